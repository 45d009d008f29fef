"""The GPU decode benchmark's harness (h2o_compile.bench.cuda): the batch search and a CPU smoke run."""

from __future__ import annotations

import json

import pytest
import torch

from h2o_compile.bench.cuda import CudaBenchSettings, find_max_batch, fit_batch_limit, run_cuda_bench
from h2o_compile.bench.report import write_cuda_report


def test_fit_batch_limit_is_the_line_through_two_probes():
    # 100 bytes fixed + 10 per row: under 1000 bytes fit floor(900 / 10) = 90 rows.
    assert fit_batch_limit({1: 110, 8: 180}, 1000, max_batch=4096) == 90
    assert fit_batch_limit({1: 110, 8: 180}, 1000, max_batch=50) == 50
    assert fit_batch_limit({1: 110, 8: 180}, 105, max_batch=50) == 0


def test_find_max_batch_lowers_an_optimistic_prediction_until_it_fits():
    """Probes see 10 bytes per row, the verified (compiled) runs 12: the search must land on the true largest
    batch under the cap, found by brute force over the verified cost."""
    def need(batch, verify):
        return 100 + (12 if verify else 10) * batch

    cap = 1000
    truth = max(b for b in range(1, 200) if need(b, True) <= cap)
    found = find_max_batch(need, cap, [1, 8], max_batch=4096)
    assert found["predicted"] == 90
    assert found["batch"] == truth == 75 and found["need_bytes"] == need(truth, True) <= cap
    assert [b for b, _ in found["tries"]][0] == 90 and len(found["tries"]) == 2


def test_find_max_batch_reports_nothing_fits():
    found = find_max_batch(lambda b, verify: 10_000 + b, 1000, [1, 2], max_batch=64)
    assert found["batch"] == 0 and found["need_bytes"] is None


@pytest.mark.parametrize("kwargs,match", [(dict(dtype="int8"), "dtype='int8'"),
                                          (dict(probe_batches=[8, 1]), "probe_batches"),
                                          (dict(memory_cap_gib=0), "memory_cap_gib=0")])
def test_settings_reject_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CudaBenchSettings(**kwargs)


def test_unknown_part_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown \\['graph'\\]"):
        run_cuda_bench(CudaBenchSettings(device="cpu", model="smoke"), parts=("graph",))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without a GPU")
def test_cuda_requested_without_a_gpu_is_a_clear_error():
    with pytest.raises(RuntimeError, match="cuda"):
        run_cuda_bench(CudaBenchSettings(device="cuda", model="smoke"))


def test_cpu_smoke_run_and_report(tmp_path):
    s = CudaBenchSettings(device="cpu", model="smoke", dtype="float32", batch=2, total=32, steps=4, warmup=2,
                          repeats=2, memory_cap_gib=0.5, probe_batches=[1, 2], max_batch=4)
    result = run_cuda_bench(s, log=lambda *a: None)
    names = [r["contender"] for r in result["graphs"]]
    assert names == ["hf-dynamic", "hf-static-compile", "hf-static-compile+graphs", "h2o@0.2 eager",
                     "h2o@0.2 compiled", "h2o@0.2+graphs"]
    for r in result["graphs"]:
        assert r["finite"] and r["context_after"] == [32, 32] and r["tokens_per_s"] > 0
    caps = {r["contender"]: r for r in result["memory_cap"]}
    assert list(caps) == ["hf-static", "h2o-full", "h2o@0.2"]
    for r in caps.values():
        # 0.5 GiB holds far more than 4 rows of the smoke model: the search stops at max_batch, verified.
        assert r["predicted"] == r["batch"] == 4 and r["need_bytes"] <= r["cap_bytes"] and r["tokens_per_s"] > 0
    assert caps["h2o@0.2"]["cache_bytes"] < caps["h2o-full"]["cache_bytes"]
    paths = write_cuda_report(result, str(tmp_path / "decode_cuda"), command="decode_cuda.py --smoke")
    assert json.loads(paths["json"].read_text())["memory_cap"][0]["batch"] == 4
    text = paths["markdown"].read_text()
    assert "CUDA graphs on and off" in text and "Largest batch under 0.5 GiB" in text
    assert paths["png"].stat().st_size > 0
