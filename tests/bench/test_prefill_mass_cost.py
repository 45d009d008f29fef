"""benchmarks/prefill_mass_cost.py on small shapes: it times the fused attention with and without the mass pass
and finds the pass's own operators in its profile."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "prefill_mass_cost.py"


def _run(monkeypatch, *args):
    spec = importlib.util.spec_from_file_location("prefill_mass_cost", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(sys, "argv", ["prefill_mass_cost.py", *args])
    module.main()


def test_the_mass_pass_is_timed_and_its_operators_found(monkeypatch, tmp_path, capsys):
    out = tmp_path / "mass.json"
    _run(monkeypatch, "--length", "96", "--heads", "2", "--head-dim", "16", "--repeats", "1", "--out", str(out))
    figures = json.loads(out.read_text())
    assert figures["args"]["length"] == 96
    assert min(figures["flash_causal_s"], figures["attend_without_mass_s"], figures["attend_with_mass_s"]) > 0
    ops = figures["operators_s"]
    assert ops["aten::_scaled_dot_product_flash_attention_for_cpu"] > 0
    assert ops["aten::bmm"] > 0 and ops["aten::exp_"] > 0  # the second pass: q.k - lse, then exp
    assert "the mass pass costs" in capsys.readouterr().out


def test_bad_sizes_are_refused_by_name(monkeypatch):
    with pytest.raises(SystemExit, match="--length"):
        _run(monkeypatch, "--length", "0")
