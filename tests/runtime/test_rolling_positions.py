"""positions="rolling" on whole models: the pass moves each layer's rotary embedding into its h2o op.

(a) no eviction => rolling positions are the true ones: greedy generate equals transformers' own, left padding
included; (b) an evicting budget => step logits equal the in-transformers brute-force simulation with rolling
positions (tests/runtime/hf_simulation.py); (c) compiled == eager, no graph break, one graph across capacities;
(d) a stream runs far past max_position_embeddings at constant memory; models without rotary embeddings
decline with an error naming the layer."""

from __future__ import annotations

import warnings

import pytest
import torch

import h2o_compile
from h2o_compile.graph.support import UnsupportedModelError

from ..helpers import step_blocks
from .arch_configs import VOCAB, WINDOW, build
from .compile_checks import assert_ran_compiled, strict_compile
from .hf_simulation import simulate_logits

ROTARY = ["llama", "qwen3", "phi3", "gpt_neox", "gemma", "gemma3", "gemma2", "gpt_oss"]


def padded_prompts(length=40, pad=7, seed=0):
    ids = torch.randint(1, VOCAB, (2, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(2, length, dtype=torch.long)
    mask[1, :pad] = 0
    ids[1, :pad] = 0
    return ids, mask


@pytest.mark.parametrize("name", ROTARY)
def test_without_eviction_rolling_generate_equals_transformers(name):
    """Nothing evicted (sliding layers keep a contiguous window): ranks are true positions up to a shift."""
    model = build(name)
    opt = h2o_compile.optimize(model, budget=1.0, positions="rolling", compile=False)
    assert all(len(n.args) == 19 for n in opt.graph.graph.nodes if n.target is torch.ops.h2o.attention_.default)
    ids, mask = padded_prompts()
    ours = opt.generate(ids, attention_mask=mask, max_new_tokens=32, pad_token_id=0)
    theirs = model.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False, pad_token_id=0)
    assert torch.equal(ours, theirs), f"first mismatch at {(ours != theirs).nonzero()[:1].tolist()}"


@pytest.mark.parametrize("max_distance", [0, 5], ids=["rank", "capped"])
@pytest.mark.parametrize("name,compress", [("llama", False), ("gpt_neox", False), ("qwen3", False),
                                           ("gemma3", False), ("gemma3", True)])
def test_evicting_budget_rolling_logits_equal_simulation(name, compress, max_distance):
    """An int budget of 6 slots that evicts at every step after the first block; partial rotary (GPT-NeoX),
    two rotary bases (Gemma 3: local on sliding layers, global on the full one), sliding layers as window
    caches or compressed. Keys numbered by rank (positions="rolling") or by distance capped at 5 over 30
    tokens (positions="capped"; the 7-token prompt takes the wider cap of 6)."""
    model = build(name)
    budget, blocks = 6, [7, 1, 1, 1, 3, 1, 1, 1, 1, 5, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]
    positions = "capped" if max_distance else "rolling"
    opt = h2o_compile.optimize(model, budget=budget, positions=positions, max_distance=max_distance or None,
                               prefill=8, compress_sliding=compress, compile=False)
    total = sum(blocks)
    ids = torch.randint(1, VOCAB, (2, total), generator=torch.Generator().manual_seed(3))
    ours = step_blocks(opt, ids, blocks)
    windows = [spec.window for spec in opt.layers]

    def layer_args(layer, window):
        recent = opt.h2o_config.recent_window(budget)
        if window and not compress:  # a window cache: W slots, nothing but the window rule evicts
            return dict(capacity=window, recent=window, sinks=0)
        return dict(capacity=min(budget, window or budget), recent=min(recent, window or recent), sinks=0)

    assert windows == ([WINDOW, 0, WINDOW] if name == "gemma3" else [0, 0])
    want = simulate_logits(model, ids, blocks, capacity=budget, recent=0, sinks=0, policy="h2o",
                           layer_args=layer_args, rolling=True, max_distance=max_distance)
    torch.testing.assert_close(ours, want.float(), rtol=1e-4, atol=1e-4)
    if max_distance:
        rank = simulate_logits(model, ids, blocks, capacity=budget, recent=0, sinks=0, policy="h2o",
                               layer_args=layer_args, rolling=True)
        assert (want - rank).abs().max() > 1e-3  # the cap is not the rank numbering in disguise


def test_rolling_and_true_positions_differ_once_keys_are_evicted():
    """A negative control: with gaps in the kept positions the two position schemes give different logits."""
    model = build("llama")
    ids = torch.randint(1, VOCAB, (1, 30), generator=torch.Generator().manual_seed(1))
    logits = {}
    for positions in ("true", "rolling"):
        opt = h2o_compile.optimize(model, budget=6, prefill=4, positions=positions, compile=False)
        opt.reset(1, 30)
        logits[positions] = torch.cat([opt.step(ids[:, s:s + 4]) for s in range(0, 28, 4)], dim=1)
    torch.testing.assert_close(logits["true"][:, :6], logits["rolling"][:, :6])  # no eviction yet
    assert (logits["true"][:, 8:] - logits["rolling"][:, 8:]).abs().max() > 1e-3


def test_compiled_rolling_step_equals_eager_in_one_graph():
    model = build("gemma3")
    ids, mask = padded_prompts()
    eager = h2o_compile.optimize(model, budget=0.3, positions="rolling", compile=False)
    compiled = h2o_compile.optimize(model, budget=0.3, positions="rolling", compile=True)
    with strict_compile():
        for new_tokens in (12, 30):  # two capacities, one compiled step
            want = eager.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, pad_token_id=0)
            got = compiled.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, pad_token_id=0)
            assert torch.equal(got, want)
            assert [torch.equal(compiled.kept_positions(i), eager.kept_positions(i)) for i in range(3)] == [True] * 3
        assert_ran_compiled(graphs=1)


def test_a_rolling_stream_runs_far_past_the_models_positions_at_constant_memory():
    """128 trained positions; 2,000 tokens in chunks of 8 through 24 slots: state sizes never change, the
    logits stay finite, and the cache's positions are true positions far beyond 128."""
    model = build("llama")  # max_position_embeddings=128
    opt = h2o_compile.optimize(model, budget=24, prefill=8, positions="rolling", compile=False)
    opt.reset(1, capacity=24)
    shapes = [tuple(t.shape) for t in opt.state()]
    ids = torch.randint(1, VOCAB, (1, 2000), generator=torch.Generator().manual_seed(2))
    for start in range(0, 2000, 8):
        logits = opt.step(ids[:, start:start + 8])
        assert torch.isfinite(logits).all()
    assert [tuple(t.shape) for t in opt.state()] == shapes
    assert opt.kept_positions(0).max().item() == 1999
    with pytest.raises(ValueError, match="rolling positions reach 24 held keys \\+ a block of 120 = 144"):
        whole = h2o_compile.optimize(model, budget=24, positions="rolling", compile=False)  # prefill "full"
        whole.reset(1, capacity=24)
        whole.step(ids[:, :30])
        whole.step(ids[:, :120])  # one block of 120 after 24 held keys: distances up to 143
    assert whole.stream.seen.tolist() == [30]  # the refused block left the stream where it was


def test_true_positions_past_the_models_positions_warn_on_rotary_models_and_fail_on_learned_ones():
    opt = h2o_compile.optimize(build("llama"), budget=16, prefill=8, compile=False)
    opt.reset(1, capacity=16)
    ids = torch.randint(1, VOCAB, (1, 8))
    for _ in range(16):
        opt.step(ids)
    with pytest.warns(UserWarning, match="passes the model's max_position_embeddings=128 with true positions"):
        opt.step(ids)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step(ids)  # once per stream
    gpt2 = h2o_compile.optimize(build("gpt2"), budget=16, prefill=8, compile=False)
    gpt2.reset(1, capacity=16)
    for _ in range(16):
        gpt2.step(ids)
    with pytest.raises(ValueError, match="shows no rotary embedding"):
        gpt2.step(ids)


@pytest.mark.parametrize("name,tables", [("llama", 1), ("gpt_oss", 1), ("gemma3", 2)])
def test_the_rotary_tables_are_computed_once_per_rotary_embedding(name, tables):
    """One copy of the model's rotary subgraph serves every layer (Gemma 3: a local and a global base)."""
    opt = h2o_compile.optimize(build(name), budget=8, positions="rolling", compile=False)
    cosines = [n for n in opt.graph.graph.nodes if n.target is torch.ops.aten.cos.default]
    assert len(cosines) == tables


@pytest.mark.parametrize("name", ["gpt2", "opt"])
def test_models_without_rotary_embeddings_decline_rolling_positions(name):
    with pytest.raises(UnsupportedModelError, match="positions='rolling' needs rotary position embeddings.*layer 0"):
        h2o_compile.optimize(build(name), positions="rolling", compile=False)


def test_bad_positions_value_is_named():
    with pytest.raises(ValueError, match="positions=.absolute.; allowed: .true., .rolling., .capped."):
        h2o_compile.optimize(build("llama"), positions="absolute")
