"""The decode benchmark harness (h2o_compile.bench.decode): structure, fairness, synthetic fill and roofline math."""

from __future__ import annotations

import json
import math

import pytest
import torch

from h2o_compile.bench.decode import (
    BenchSettings,
    build_model,
    roofline_seconds,
    run_bench,
    run_decode,
    weight_bytes_per_step,
)
from h2o_compile.bench.contenders import H2OContender, HFContender, build_contenders
from h2o_compile.bench.report import write_bench_report

CONTENDERS = ["hf-dynamic", "hf-static-compile", "hf-static-compile@0.2", "local@0.2", "h2o@0.2"]


@pytest.fixture(scope="module")
def smoke_model():
    return build_model("smoke")


def test_weight_bytes_hand_computed(smoke_model):
    # smoke: hidden 64, 2 layers, 4 heads of 16 (2 KV heads), MLP 128, vocab 256, untied head, fp32.
    per_layer = 64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128 + 2 * 64           # q, o + k, v + MLP + 2 norms
    params = 2 * per_layer + 64 + 256 * 64                                     # + final norm + lm_head
    assert weight_bytes_per_step(smoke_model, batch=2) == 4 * params + 2 * 64 * 4  # + 2 embedding rows
    assert roofline_seconds(100, 300, 200.0) == 2.0


def test_smoke_run_structure_and_fairness(smoke_model, tmp_path):
    settings = BenchSettings(models=["smoke"], batches=[2], totals=[32], steps=4, warmup=1, repeats=2,
                             compile=False, contenders=CONTENDERS, bandwidth_mib=8, quiet_wait_s=0, retries=0)
    result = run_bench(settings, log=lambda *a: None)
    rows = {r["contender"]: r for r in result["decode"]}
    assert sorted(rows) == sorted(CONTENDERS)
    assert {r["contender"] for r in result["prefill"]} == {"hf-dynamic", "hf-static-compile", "h2o@0.2"}
    for r in rows.values():
        assert r["finite"] and r["context"] == 28 and r["context_seen"] == [28, 28] and r["context_after"] == [32, 32]
        assert len(r["blocks"]) == 2 and all(len(b) == 4 for b in r["blocks"])
        assert r["step_ms_p50"] <= r["step_ms_p95"] and r["tokens_per_s"] > 0
        assert r["compiles_during_timing"] == 0
        # The row's roofline is its own bytes over the run's bandwidth.
        bw = result["bandwidth"]["copy_gb_s"] * 1e9
        assert math.isclose(r["roofline_ms"], (r["weight_bytes"] + r["kv_read_bytes"]) / bw * 1e3, rel_tol=1e-9)
        assert math.isclose(r["roofline_ratio"], r["step_ms_p50"] / r["roofline_ms"], rel_tol=1e-9)
    assert len({r["tokens_sha"] for r in rows.values()}) == 1  # everyone decoded the same tokens
    # KV bytes: 2 layers x B 2 x 2 KV heads x 16 dims x (K + V) x fp32 = 1024 bytes per token.
    per_token = 2 * 2 * 2 * 16 * 2 * 4
    assert rows["hf-dynamic"]["cache_bytes"] == rows["hf-static-compile"]["cache_bytes"] == per_token * 32
    cap = math.ceil(0.2 * 32)
    assert rows["hf-static-compile@0.2"]["capacity"] == cap and rows["hf-static-compile@0.2"]["cache_bytes"] == (
        per_token * cap)
    assert rows["h2o@0.2"]["capacity"] == cap
    assert rows["h2o@0.2"]["cache_bytes"] == (per_token + 2 * 2 * 2 * (4 + 8)) * cap  # + fp32 score, int64 position
    dyn_read = sum(per_token * (28 + i + 1) for i in range(4)) / 4
    assert rows["hf-dynamic"]["kv_read_bytes"] == int(dyn_read)
    head = result["headline"]
    assert head["model"] == "smoke" and head["batch"] == 2 and head["total"] == 32
    assert math.isclose(head["kv_bytes_ratio_vs_full"], rows["h2o@0.2"]["cache_bytes"] / (per_token * 32))
    assert math.isclose(head["step_ratio_h2o_vs_static_same_slots"],
                        rows["h2o@0.2"]["step_ms_p50"] / rows["hf-static-compile@0.2"]["step_ms_p50"])
    paths = write_bench_report(result, str(tmp_path / "decode_cpu"), command="h2o-compile bench --smoke")
    assert json.loads(paths["json"].read_text())["command"] == "h2o-compile bench --smoke"
    text = paths["markdown"].read_text()
    assert "Headline" in text and "h2o@0.2" in text and "roofline" in text
    assert paths["png"].stat().st_size > 0


def test_synthetic_fill_gives_every_contender_the_same_context(smoke_model):
    """With the same synthetic keys/values, the full-cache contenders compute the same next-token logits."""
    batch, total, context = 2, 48, 40
    tokens = torch.randint(0, 256, (batch, 1), generator=torch.Generator().manual_seed(3))
    logits = {}
    for c in (HFContender(smoke_model, static=False), HFContender(smoke_model, static=True, compile=False),
              H2OContender(smoke_model, "full", 1.0, compile=False), H2OContender(smoke_model, "h2o", 0.25, False)):
        c.prepare(batch, total, context, seed=5)
        assert c.cached_tokens() == context
        logits[c.name] = c.step(tokens, context)
        assert logits[c.name].shape == (batch, 256) and torch.isfinite(logits[c.name]).all()
        c.restore()
        assert c.cached_tokens() == context
        again = c.step(tokens, context)
        if c.policy == "full":  # restore() rewinds to the same state; evicting policies reuse freed slots
            torch.testing.assert_close(again, logits[c.name], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits["hf-static-compile"], logits["hf-dynamic"], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits["h2o-full"], logits["hf-dynamic"], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(logits["h2o@0.25"], logits["hf-dynamic"], atol=1e-3)  # it really dropped tokens


def test_h2o_state_fill_matches_policy(smoke_model):
    c = H2OContender(smoke_model, "h2o", 0.25, compile=False)
    c.prepare(1, 64, 60, seed=0)
    pos = c.h2o.kept_positions(0)                                              # [1, Hkv, C]
    recent = c.h2o.h2o_config.recent_window(c.capacity)
    assert c.capacity == 16 and (pos >= 0).all()
    assert (pos[..., -recent:] == torch.arange(60 - recent, 60)).all()          # the recent window is kept
    assert (pos[..., :-recent] < 60 - recent).all()                             # heavy hitters are older
    assert all(len(set(row.tolist())) == c.capacity for row in pos.view(-1, c.capacity))


def test_settings_validation():
    with pytest.raises(ValueError, match="models"):
        BenchSettings(models=["gpt5"])
    with pytest.raises(ValueError, match="steps"):
        BenchSettings(totals=[16], steps=16)


@pytest.mark.slow
def test_compiled_decode_has_no_recompiles_while_timed(smoke_model):
    settings = BenchSettings(models=["smoke"], batches=[2], totals=[32], steps=3, warmup=2, repeats=2,
                             prefill=False)
    contenders = build_contenders(smoke_model, [0.2], 0.2, compile=True, only={"hf-static-compile", "h2o@0.2"})
    with torch._dynamo.config.patch(recompile_limit=64):
        rows = run_decode(contenders, smoke_model, 2, 32, settings, bandwidth=1e10, log=lambda *a: None)
    assert all(r["finite"] and r["compiles_during_timing"] == 0 for r in rows)


def test_static_cache_without_crop_is_rewound_through_its_write_index(smoke_model):
    """transformers < 5.24 has no StaticLayer.crop (the GPU machine's 5.17): restore() rewinds the write index
    each layer keeps instead, so the next block starts from the filled context again."""
    class Layer:
        def __init__(self):
            self.cumulative_length = torch.tensor(44)

    class OldStaticCache:
        layers = [Layer(), Layer()]

        def get_seq_length(self):
            return int(self.layers[0].cumulative_length)

        def crop(self, n):
            raise AttributeError("'StaticLayer' object has no attribute 'crop'")

    c = HFContender(smoke_model, static=True, compile=False)
    c.cache, c.context = OldStaticCache(), 40
    c.restore()
    assert [int(layer.cumulative_length) for layer in c.cache.layers] == [40, 40] and c.cached_tokens() == 40
