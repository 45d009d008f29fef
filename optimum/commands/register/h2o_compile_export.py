"""``optimum-cli export h2o``: h2o_compile's ONNX export under optimum's command line, registered through optimum's
own ``optimum.commands.register`` namespace (no fork of optimum). The flags and the folder written are those of
``h2o-compile export`` (h2o_compile/cli/__init__.py); building the parser imports h2o_compile, and with it torch,
when optimum-cli starts."""

from optimum.commands.base import BaseOptimumCLICommand, CommandInfo
from optimum.commands.export.base import ExportCommand


class H2OExportCommand(BaseOptimumCLICommand):
    COMMAND = CommandInfo(name="h2o", help="Export a causal LM with an H2O KV cache to ONNX (h2o_compile).")

    @staticmethod
    def parse_args(parser):
        from h2o_compile.cli import add_export_args

        add_export_args(parser)

    def run(self):
        from h2o_compile.cli import cmd_export, run_command

        code = run_command(cmd_export, self.args)
        if code:
            raise SystemExit(code)


REGISTER_COMMANDS = [(H2OExportCommand, ExportCommand)]
