"""benchmarks/score_rule_probes.py on the shipped small model: each probe changes what h2o measures (against the
same eval without it), and a bad probe name is a clear error. Probes patch the library for the whole process,
so each runs in its own."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from ..helpers import load_benchmark

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "score_rule_probes.py"


def eval_args(text: Path, out: Path) -> list[str]:
    return ["eval", "--model", "tiny", "--text", str(text), "--tail", "1.0", "--budgets", "0.25", "--policies",
            "h2o", "--seq-len", "96", "--num-seqs", "2", "--batch-size", "2", "--prompt-len", "8",
            "--gen-prompt-len", "16", "--gen-new-tokens", "4", "--gen-prompts", "1", "--compile", "off",
            "--out", str(out)]


def h2o_perplexity(out: Path) -> float:
    return json.loads((out / "eval.json").read_text())["perplexity"]["h2o"]["0.25"]


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("text") / "words.txt"
    words = "the cat sat on a mat while the dog ran far from home and back again".split()
    path.write_text(" ".join(words[(i * 7) % len(words)] for i in range(3000)))
    return path


@pytest.fixture(scope="module")
def plain(text, tmp_path_factory) -> float:
    out = tmp_path_factory.mktemp("plain")
    subprocess.run([sys.executable, "-m", "h2o_compile.cli", *eval_args(text, out)], check=True,
                   capture_output=True)
    return h2o_perplexity(out)


@pytest.mark.parametrize("probe", ["value-norm", "group-max", "pyramid=1.5,0.5"])
def test_a_probe_changes_what_h2o_measures(probe, text, plain, tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--probe", probe, "--", *eval_args(text, tmp_path)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    probed = h2o_perplexity(tmp_path)
    assert math.isfinite(probed) and probed != plain


def test_a_global_share_needs_sliding_layers(text, tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--probe", "global=2", "--", *eval_args(text, tmp_path)],
                          capture_output=True, text=True)
    assert done.returncode != 0 and "has no sliding-window layers" in done.stderr


@pytest.mark.parametrize("probe, message", [("norm", "allowed: value-norm, group-max"),
                                            ("pyramid=1", "pyramid takes two numbers"),
                                            ("pyramid=0,1", "both ends must be > 0"),
                                            ("global=x", "global takes one number"),
                                            ("global=0", "the share must be > 0")])
def test_a_bad_probe_is_named(probe, message, capsys):
    with pytest.raises(SystemExit):
        load_benchmark("score_rule_probes").main(["--probe", probe, "--", "eval"])
    assert message in capsys.readouterr().err
