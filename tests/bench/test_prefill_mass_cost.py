"""benchmarks/prefill_mass_cost.py on small shapes: it times the fused attention without the mass and with it in
one pass and in two, and finds the second pass's own operators in its profile."""

from __future__ import annotations

import json
import sys

import pytest

from ..helpers import has_compiler, load_benchmark


def _run(monkeypatch, *args):
    module = load_benchmark("prefill_mass_cost")
    monkeypatch.setattr(sys, "argv", ["prefill_mass_cost.py", *args])
    module.main()


@pytest.mark.skipif(not has_compiler(), reason="the one-pass op needs a C++ compiler")
def test_the_mass_pass_is_timed_and_its_operators_found(monkeypatch, tmp_path, capsys):
    out = tmp_path / "mass.json"
    _run(monkeypatch, "--length", "96", "--heads", "2", "--head-dim", "16", "--repeats", "1", "--out", str(out))
    figures = json.loads(out.read_text())
    assert figures["args"]["length"] == 96
    assert min(figures[name] for name in ("flash_causal_s", "attend_without_mass_s", "attend_with_mass_one_pass_s",
                                          "attend_with_mass_two_pass_s")) > 0
    ops = figures["operators_s"]
    assert ops["aten::_scaled_dot_product_flash_attention_for_cpu"] > 0
    assert ops["aten::bmm"] > 0 and ops["aten::exp_"] > 0  # the second pass: q.k - lse, then exp
    assert "in one pass" in capsys.readouterr().out


def test_bad_sizes_are_refused_by_name(monkeypatch):
    with pytest.raises(SystemExit, match="--length"):
        _run(monkeypatch, "--length", "0")
