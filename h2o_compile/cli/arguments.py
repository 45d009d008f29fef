"""The one flag vocabulary of ``h2o-compile``, shared by the command modules (cli/__init__.py,
cli/quality_commands.py, and through them optimum-cli's ``export h2o``), which import this one and not each other,
and by the scripts under benchmarks/.

Every subcommand says a model with ``--model`` (a shipped name, a Hub id, a local folder or a .gguf file), a
budget with ``--budget`` (a fraction of the sequence or a number of slots; a list where the command sweeps), a
configuration with ``--preset`` / ``--rule`` in the rule syntax of :meth:`H2OConfig.parse`, the decode step's
compilation with ``--compile`` (the same choices and default everywhere), ``--policy``, ``--sink-tokens``,
``--recent-ratio`` and ``--kv-dtype`` (lists where the command sweeps; the plural names are aliases) and where
results go with ``--out`` (default: a new folder under ./runs/ of the current directory, never inside the
package). tests/test_cli_vocabulary.py reads every parser and keeps it so.
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from pathlib import Path

from ..config import PRESET_OPTIONS, H2OConfig, parse_options

MODEL_HELP = "a shipped model (tiny, gemma3-270m), a Hub id, a local model folder, or a .gguf file"
COMPILE_CHOICES = ("auto", "on", "off", "default", "reduce-overhead", "max-autotune")
COMPILE_HELP = ("the decode step under torch.compile: auto = on CUDA only, on, off, or a torch.compile mode; "
                "max-autotune on CPU also freezes and prepacks the weights")


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's defaults formatter, for options without a help text too, and silent where there is no default
    to show (None, False) or the help text already says it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if any(action.default is x for x in (None, False, argparse.SUPPRESS)) or "default" in text \
                or not action.option_strings:
            return text
        shown = ",".join(map(str, action.default)) if isinstance(action.default, (list, tuple)) else "%(default)s"
        return f"{text} (default: {shown})" if text else f"default: {shown}"


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose --help shows every option's default."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(*args, **kwargs)

    def add_argument(self, *args, **kwargs):
        # argparse prints no help line for an option without a help text, so it would not show its default.
        default = kwargs.get("default")
        if kwargs.get("help") is None and default is not None and default is not False and args[0].startswith("-"):
            kwargs["help"] = "default: %(default)s"
        return super().add_argument(*args, **kwargs)


def csv_of(kind):
    """An argparse ``type`` for a comma-separated list: ``csv_of(float)("0.1,0.2")`` -> [0.1, 0.2]."""
    def parse(text):
        try:
            return [kind(x) for x in text.split(",") if x]
        except (ValueError, argparse.ArgumentTypeError):
            raise argparse.ArgumentTypeError(f"{text!r} must be a comma-separated list of {kind.__name__}") from None
    return parse


def parse_budget(text: str):
    """'0.2' -> 0.2 (fraction of the sequence), '256' -> 256 (slots)."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"budget {text!r} must be a fraction like 0.2 or a slot count like 256") from None


parse_budget.__name__ = "budget"


def compile_choice(value: str):
    """A --compile flag as ``optimize(compile=...)`` takes it: on/off -> True/False, auto and modes as they are."""
    return {"on": True, "off": False}.get(value, value)


def add_config_args(p: argparse.ArgumentParser) -> None:
    """--preset and --rule: the H2O configuration in the one rule syntax (H2OConfig.parse)."""
    p.add_argument("--preset", choices=list(PRESET_OPTIONS), default="paper",
                   help="a named configuration (h2o_compile.PRESETS); recommended is the best measured")
    p.add_argument("--rule", default=None,
                   help="options on top of the preset, in the rule syntax: presets, score names and name=value "
                        "joined by '+', e.g. max+decay=0.99+prompt_window=64 (H2OConfig.parse)")


def config_from_args(args, **flags):
    """The H2OConfig of --preset / --rule, with the explicit flags (those not None) applied on top."""
    config = H2OConfig.parse(args.preset)
    if args.rule:
        config = config.replace(**parse_options(args.rule))
    given = {k: v for k, v in flags.items() if v is not None}
    return config.replace(**given) if given else config


def default_out(command: str) -> Path:
    """A new folder for a command's results under ./runs/ of the current directory (runs/ is gitignored in a
    checkout): runs/<command>-<date>-<time>[-n]."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = Path.cwd() / "runs" / f"{command}-{stamp}"
    out, n = base, 1
    while out.exists():
        n += 1
        out = base.with_name(f"{base.name}-{n}")
    return out


# The optional dependencies of a command: module -> the extra that installs it.
EXTRAS = {"matplotlib": "eval", "onnx": "onnx", "onnxscript": "onnx", "onnxruntime": "onnx", "fastapi": "serve",
          "uvicorn": "serve", "openai": "serve"}


def require(command: str, *modules: str) -> None:
    """ImportError naming the extra to install when ``command`` needs a module that is not installed."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        extras = sorted({EXTRAS.get(m, m) for m in missing})
        hint = " or ".join(f"pip install 'h2o-compile[{e}]'" for e in extras)
        if "onnx" in extras:
            hint += " (on a CUDA machine: h2o-compile[onnx-gpu])"
        raise ImportError(f"h2o-compile {command} needs {', '.join(missing)}: {hint}")
