"""benchmarks/compile_regions.py: its table puts each model's cold compiles (median and every run) beside the
step times of the one-process comparison, and bad arguments stop it with the values named."""

from __future__ import annotations

import sys

import pytest

from ..helpers import load_benchmark


def _module():
    return load_benchmark("compile_regions")


def test_the_table_shows_the_median_cold_compile_every_run_and_the_step_times():
    cold = [{"model": "kvbound", "variant": "whole", "first_step_s": s, "graphs": 1} for s in (40.0, 44.0, 90.0)]
    cold += [{"model": "kvbound", "variant": "by-layer", "first_step_s": 20.0, "graphs": 3}]
    steps = [{"model": "kvbound", "step_ms": {"whole": {"1": 12.0, "4": 10.0}, "by-layer": {"1": 13.5, "4": 11.25}}}]
    text = _module().markdown(cold, steps, "cmd", "a CPU", threads=2)
    assert "| kvbound | whole | 44.0 (40.0, 44.0, 90.0) | 1 | 12.00 | 10.00 |" in text
    assert "| kvbound | by-layer | 20.0 (20.0) | 3 | 13.50 | 11.25 |" in text
    assert "step ms, batch 1 | step ms, batch 4 |" in text and "(2 threads in the measured processes)" in text


@pytest.mark.parametrize("args,named", [(["--models", "gpt5"], "gpt5"), (["--batches", "1,x"], "'1,x'"),
                                        (["--steps", "0"], "--steps")])
def test_bad_arguments_stop_with_the_value_named(monkeypatch, args, named):
    module = _module()
    monkeypatch.setattr(sys, "argv", ["compile_regions.py", *args])
    with pytest.raises(SystemExit, match=named):
        module.main()
