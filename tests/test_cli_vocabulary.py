"""One flag vocabulary: every subcommand's parser, read here, names a concept by one flag (older names are aliases
of it, never the primary name), with the same choices and default; --help shows each default once; a bad
configuration fails before any model loads; kvpress's compression_ratio gets the budget it means."""

from __future__ import annotations

import argparse
import re

import pytest

from h2o_compile.cli import build_parser, main
from h2o_compile.cli.arguments import COMPILE_CHOICES

ALIASES = {"--budgets": "--budget", "--budget-slots": "--budget", "--models": "--model", "--policies": "--policy",
           "--kv-dtypes": "--kv-dtype", "--h2o-sinks": "--sink-tokens", "--recent-ratios": "--recent-ratio",
           "--rules": "--rule", "--h2o-rules": "--rule", "--output": "--out"}
# the commands that build H2O configurations
CONFIGURING = ("generate", "export", "eval", "stream", "tasks", "calibrate", "serve")


def _commands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _actions(parser) -> dict[str, argparse.Action]:
    """Primary flag -> action."""
    return {a.option_strings[0]: a for a in parser._actions if a.option_strings and a.dest != "help"}


def _flat(value):
    return value if isinstance(value, list) else [value]


def test_older_names_are_aliases_of_the_one_name():
    for name, parser in _commands().items():
        for primary, action in _actions(parser).items():
            assert primary not in ALIASES, f"{name}: {primary} is the primary name; use {ALIASES[primary]}"
            for alias in action.option_strings[1:]:
                if alias in ALIASES:
                    assert ALIASES[alias] == primary, f"{name}: {alias} aliases {primary}, not {ALIASES[alias]}"


def test_every_command_takes_model_and_out_where_it_loads_or_writes():
    for name, parser in _commands().items():
        actions = _actions(parser)
        if name not in ("eval-merge", "tasks-merge"):
            assert "--model" in actions, name
        if name not in ("generate", "serve"):  # generate prints, serve serves; the others write files
            assert "--out" in actions and actions["--out"].default is None, name  # None: a new folder in ./runs


def test_every_configuring_command_takes_preset_and_rule():
    for name in CONFIGURING:  # a sweep's --rule takes a list of rule strings; a preset name is one of them
        flags = {flag for action in _actions(_commands()[name]).values() for flag in action.option_strings}
        assert {"--preset", "--rule"} <= flags, name


def test_compile_has_the_same_choices_and_default_everywhere():
    found = 0
    for name, parser in _commands().items():
        action = _actions(parser).get("--compile")
        if action is not None:
            found += 1
            assert tuple(action.choices) == COMPILE_CHOICES and action.default == "auto", name
    assert found >= 3  # generate, eval, bench


@pytest.mark.parametrize("flag, single_default, listed_default", [("--kv-dtype", None, ["model"]),
                                                                  ("--policy", None, None)])
def test_a_configuration_flag_means_the_same_everywhere(flag, single_default, listed_default):
    for name in CONFIGURING:
        action = _actions(_commands()[name]).get(flag)
        if action is None:
            continue
        if action.type is None:  # one value: unset keeps the preset's (model entries, policy h2o)
            assert action.default == single_default, name
        elif listed_default is not None:
            assert action.default == listed_default, name


@pytest.mark.parametrize("name", ["generate", "export", "eval", "stream", "tasks", "bench", "demo"])
def test_budget_takes_a_fraction_or_slots(name):
    action = _actions(_commands()[name])["--budget"]
    assert _flat(action.type("256")) == [256] and isinstance(_flat(action.type("256"))[0], int), name
    assert _flat(action.type("0.2")) == [0.2], name


def test_help_shows_each_default_once():
    for name, parser in _commands().items():
        text = " ".join(parser.format_help().split())
        repeated = re.findall(r"\(([^()]+)\) \(default: \1\)", text)
        assert not repeated, f"{name} --help says a default twice: {repeated}"
        assert "(default: [" not in text, f"{name} --help prints a Python list"


@pytest.mark.parametrize("argv", [
    ["generate", "--prompt", "w1", "--rule", "max+decay=2"],
    ["export", "--rule", "max+decay=2"],
    ["eval", "--text", "x.txt", "--rule", "max+decay=2"],
    ["stream", "--text", "x.txt", "--tokens", "64", "--budget", "16", "--rule", "max+decay=2"],
    ["tasks", "--text", "x.txt", "--rule", "max+decay=2"],
])
def test_a_bad_configuration_fails_before_the_model_loads(argv, capsys, tmp_path):
    pytest.importorskip("matplotlib")
    out = [] if argv[0] == "generate" else ["--out", str(tmp_path / "out")]
    code = main([*argv, "--model", str(tmp_path / "no-model-here"), *out])
    err = capsys.readouterr().err
    assert code == 2 and "decay=2" in err and "no-model-here" not in err, err


def test_compression_ratio_is_refused_with_the_budget_it_means(capsys, tmp_path):
    code = main(["generate", "--model", str(tmp_path / "none"), "--prompt", "w1", "--rule", "compression_ratio=0.8"])
    assert code == 2 and "budget = 1 - compression_ratio = 0.2" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"budget = 1 - compression_ratio = 0.25"):
        import h2o_compile
        h2o_compile.H2OConfig.parse("compression_ratio=0.75")
