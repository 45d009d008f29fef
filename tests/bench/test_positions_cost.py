"""benchmarks/positions_cost.py on the shipped small model: one row per scheme and block, the default cap."""

from __future__ import annotations

import json
import sys

import pytest

from ..helpers import load_benchmark


def run(monkeypatch, *args):
    monkeypatch.setattr(sys, "argv", ["positions_cost.py", "--model", "tiny", "--budget-slots", "16", *args])
    load_benchmark("positions_cost").main()


def test_every_scheme_is_timed_against_rank_numbering(tmp_path, monkeypatch):
    run(monkeypatch, "--tokens", "1,4", "--repeats", "2", "--out", str(tmp_path))
    report = json.loads((tmp_path / "positions_cost.json").read_text())
    assert report["max_distance"] == 512 and report["compiled"] is False  # half the model's 1024 positions
    rows = {(r["positions"], r["tokens"]): r for r in report["results"]}
    assert set(rows) == {(s, t) for s in ("rolling", "capped", "true") for t in (1, 4)}
    assert all(rows["rolling", t]["vs_rolling"] == 1.0 for t in (1, 4))
    assert all(r["median_s"] > 0 for r in rows.values())
    assert "| capped | 4 |" in (tmp_path / "positions_cost.md").read_text()


def test_compiled_timing_takes_the_decode_step_only(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="--compile times the decode step: give --tokens 1, not 1,4"):
        run(monkeypatch, "--tokens", "1,4", "--compile", "--out", str(tmp_path))
