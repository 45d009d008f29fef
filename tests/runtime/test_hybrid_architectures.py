"""Families with per-layer attention kinds (sliding-window layers, Gemma 2's soft-capping, GPT-OSS's learned
sinks), built from small random-weight configs with a 16-token window and run several windows long:
(a) a budget covering the sequence == transformers' own generate, left padding included; (b) an evicting
int budget == the independent simulation inside transformers, sliding layers as window caches and compressed;
(c) compiled == eager without graph breaks; plus the per-layer cache accounting against transformers' cache."""

from __future__ import annotations

import pytest
import torch
import transformers

import h2o_compile

from ..helpers import step_blocks
from .arch_configs import HYBRID, VOCAB, WINDOW, build
from .compile_checks import assert_compiled_decode_equals_eager
from .hf_simulation import simulate_logits

NAMES = list(HYBRID)
LENGTH = 4 * WINDOW  # every test sequence is several windows long


def padded_prompts(seed=0, length=40, pad=7):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (2, length), generator=gen)
    mask = torch.ones(2, length, dtype=torch.long)
    mask[1, :pad] = 0
    ids[1, :pad] = 0
    return ids, mask


def test_the_pass_reads_each_layers_kind():
    kinds = {name: [(s.window, s.softcap, s.sinks) for s in h2o_compile.optimize(build(name), compile=False).layers]
             for name in NAMES}
    assert kinds["gemma3"] == [(WINDOW, 0.0, False), (0, 0.0, False), (WINDOW, 0.0, False)]
    assert kinds["gemma2"] == [(WINDOW, 1.5, False), (0, 1.5, False), (WINDOW, 1.5, False)]
    assert kinds["gpt_oss"] == [(WINDOW, 0.0, True), (0, 0.0, True), (WINDOW, 0.0, True)]


@pytest.mark.parametrize("name", NAMES)
def test_full_budget_generate_equals_transformers(name):
    model = build(name)
    opt = h2o_compile.optimize(model, budget=1.0, compile=False)
    ids, mask = padded_prompts()
    ours = opt.generate(ids, attention_mask=mask, max_new_tokens=LENGTH - 40 + 8, pad_token_id=0)
    theirs = model.generate(ids, attention_mask=mask, max_new_tokens=LENGTH - 40 + 8, do_sample=False,
                            pad_token_id=0)
    assert opt.stream.slots == [WINDOW, LENGTH + 8, WINDOW]
    assert ours.shape == theirs.shape
    assert torch.equal(ours, theirs), f"first mismatch at {(ours != theirs).nonzero()[:1].tolist()}"


@pytest.mark.parametrize("compress", [False, True], ids=["window-cache", "compressed"])
@pytest.mark.parametrize("name", NAMES)
def test_evicting_budget_equals_simulation(name, compress):
    model = build(name, seed=1)
    budget, sinks = 10, 1
    opt = h2o_compile.optimize(model, budget=budget, sink_tokens=sinks, compile=False, compress_sliding=compress)
    ids = torch.randint(1, VOCAB, (2, LENGTH), generator=torch.Generator().manual_seed(3))
    blocks = [20] + [1] * (LENGTH - 20)

    def layer_args(layer, window):  # docs/design.md section 2, written out independently of H2OConfig
        if window is None:
            return dict(capacity=budget, recent=round(budget * 0.5), sinks=sinks)
        if not compress:
            return dict(capacity=window, recent=window, sinks=0)
        slots = min(budget, window)
        return dict(capacity=slots, recent=max(1, round(slots * 0.5)), sinks=sinks)

    ours = step_blocks(opt, ids, blocks)
    want = simulate_logits(model, ids, blocks, capacity=None, recent=None, sinks=None, policy="h2o",
                           layer_args=layer_args)
    torch.testing.assert_close(ours, want, rtol=1e-4, atol=1e-4)
    sliding = opt.kept_positions(0)
    assert sliding.shape[-1] == (budget if compress else WINDOW)
    assert (sliding > LENGTH - 1 - WINDOW).all(), "a sliding layer kept a key that left its window"
    assert opt.kept_positions(1).shape[-1] == budget


@pytest.mark.parametrize("budget, share, full_slots, sliding_slots", [
    (10, 1.6, (16, 8), (7, 4)),     # C <= W: 16 on the full layer, (3 - 1.6) / 2 x 10 = 7 on each sliding one
    (20, 1.5, (30, 15), (11, 6)),   # C > W = 16: the uniform split holds 20 + 2 x 16; 30 leave 11 each
], ids=["within-window", "past-window"])
@pytest.mark.parametrize("name", NAMES)
def test_global_share_moves_slots_and_equals_simulation(name, budget, share, full_slots, sliding_slots):
    """global_share over 1 full-attention and 2 sliding layers holds the uniform split's slots (C on the full
    layer, min(C, W) on each sliding one), moved to the full layer; (slots, recent) per kind, recent 0.5."""
    model = build(name, seed=1)
    opt = h2o_compile.optimize(model, budget=budget, sink_tokens=1, compile=False, compress_sliding=True,
                               global_share=share)
    ids = torch.randint(1, VOCAB, (2, LENGTH), generator=torch.Generator().manual_seed(3))
    blocks = [20] + [1] * (LENGTH - 20)

    def layer_args(layer, window):
        slots, recent = full_slots if window is None else sliding_slots
        return dict(capacity=slots, recent=recent, sinks=1)

    ours = step_blocks(opt, ids, blocks)
    assert opt.stream.slots == [sliding_slots[0], full_slots[0], sliding_slots[0]]
    want = simulate_logits(model, ids, blocks, capacity=None, recent=None, sinks=None, policy="h2o",
                           layer_args=layer_args)
    torch.testing.assert_close(ours, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name,score,sliding_score", [
    ("gemma3", "max", "sum"), ("gemma3", "sum", "max"), ("gemma3", "mean", "max"), ("gemma2", "max", "sum"),
    ("gpt_oss", "max", "sum")])
def test_a_score_per_kind_of_layer_equals_simulation(name, score, sliding_score):
    """sliding_score: the compressed sliding-window layers evict by their own score, the full-attention layer
    by ``score`` (decay shared, none with mean); the simulation with the scores per layer written out, which
    differs from the same rule on every layer (else the test could not tell the two apart)."""
    model = build(name, seed=1)
    decay = 1.0 if "mean" in (score, sliding_score) else 0.9
    opt = h2o_compile.optimize(model, budget=10, sink_tokens=1, compile=False, compress_sliding=True,
                               global_share=1.6, score=score, sliding_score=sliding_score, decay=decay)
    ids = torch.randint(1, VOCAB, (2, LENGTH), generator=torch.Generator().manual_seed(3))
    blocks = [20] + [1] * (LENGTH - 20)

    def simulated(sliding):
        def layer_args(layer, window):
            if window is None:
                return dict(capacity=16, recent=8, sinks=1, score=score)
            return dict(capacity=7, recent=4, sinks=1, score=sliding)

        return simulate_logits(model, ids, blocks, capacity=None, recent=None, sinks=None, policy="h2o",
                               layer_args=layer_args, decay=decay)

    want = simulated(sliding_score)
    torch.testing.assert_close(step_blocks(opt, ids, blocks), want, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(simulated(score), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("share,rule", [(1.0, {}), (1.5, {}), (1.5, dict(score="max", sliding_score="sum")),
                                        (1.0, dict(allocation=(0.5, 1.75, 0.75)))],
                         ids=["uniform", "global-share", "score-per-kind", "calibrated-split"])
def test_compiled_decode_equals_eager_without_graph_breaks(name, share, rule):
    """global_share 1.5: 12 slots on the full-attention layer, 6 on the sliding ones, one compiled step (with a
    score per kind of layer too); a calibrated split: 4, 14 and 6 slots (split by KV heads: test_head_split.py)."""
    ids = torch.randint(1, VOCAB, (2, 2 * WINDOW + 6), generator=torch.Generator().manual_seed(4))
    assert_compiled_decode_equals_eager(build(name, seed=2),
                                        dict(budget=8, compress_sliding=True, global_share=share, **rule), ids, 3)


def test_cache_bytes_per_layer_and_transformers_cache():
    model = build("gemma3")
    opt = h2o_compile.optimize(model, budget=0.25, compile=False)
    ids = torch.randint(1, VOCAB, (2, LENGTH), generator=torch.Generator().manual_seed(5))
    opt.reset(2, LENGTH)
    opt.step(ids)
    per_layer = opt.layer_cache_bytes()
    slot_bytes = 2 * 2 * (16 + 16) * 4 + 2 * 2 * (4 + 8)  # B * Hkv * (key + value fp32) + score fp32 + pos int64
    assert per_layer == [WINDOW * slot_bytes, LENGTH // 4 * slot_bytes, WINDOW * slot_bytes]
    assert opt.kv_cache_bytes() == sum(per_layer)

    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    assert opt.hf_cache_bytes(2, LENGTH) == held
    assert opt.full_cache_bytes(2, LENGTH) == 3 * 2 * 2 * LENGTH * (16 + 16) * 4


def test_global_share_on_a_model_of_one_kind_fails_at_optimize():
    with pytest.raises(ValueError, match="this model has 2 full-attention and 0 sliding-window layers"):
        h2o_compile.optimize(build("llama"), compress_sliding=True, global_share=2.0, compile=False)
