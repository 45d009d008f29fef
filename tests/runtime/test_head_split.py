"""Budgets split between the KV heads of a layer (H2OConfig.allocation per head, passes/head_groups.py): each
group of heads keeps a cache of its own size. Checked against the brute-force simulation inside transformers,
given each KV head its own capacity, and against the best split found by trying every one."""

from __future__ import annotations


import pytest
import torch

import h2o_compile
from h2o_compile.config import H2OConfig

from ..helpers import step_blocks
from .arch_configs import VOCAB, WINDOW, build
from .compile_checks import assert_compiled_decode_equals_eager
from .hf_simulation import simulate_logits
from .test_allocation import best_split, reference_curves, uneven

LENGTH = 3 * WINDOW

# Per layer a share, or one per KV head (2 KV heads per layer in each family), at 8 slots: 4 and 12 slots, ...;
# each within the uniform split's total (a plan takes any excess back, tests/runtime/test_allocation.py).
SPLITS = {
    "llama": ((0.5, 1.5), (1.25, 0.75)),
    "gemma3": ((0.5, 1.0), 1.5, (1.0, 0.5)),      # compress_sliding: the sliding layers' groups too
    "gpt_oss": ((1.5, 0.5), (0.75, 1.25), 1.0),   # learned sink logits sliced with their query heads
}


def per_head_slots(split, budget):
    return [[int(s * budget)] * 2 if not isinstance(s, tuple) else [int(v * budget) for v in s] for s in split]


def simulate(model, ids, blocks, slots, sinks):
    def layer_args(layer, window, head):
        c = slots[layer][head]
        return dict(capacity=c, recent=max(1, round(c * 0.5)), sinks=sinks)

    return simulate_logits(model, ids, blocks, capacity=None, recent=None, sinks=None, policy="h2o",
                           layer_args=layer_args)


@pytest.mark.parametrize("name", sorted(SPLITS))
def test_a_layer_split_by_heads_equals_simulation(name):
    """Each group of KV heads its own cache: logits == the simulation with each KV head at its own capacity, the
    state no larger than the uniform split's, kept positions per layer in head order (-1 past a group's slots)."""
    model = build(name, seed=2)
    budget, sinks = 8, 1
    ids = torch.randint(1, VOCAB, (2, LENGTH), generator=torch.Generator().manual_seed(4))
    blocks = [12] + [1] * (LENGTH - 12)
    opt = h2o_compile.optimize(model, budget=budget, sink_tokens=sinks, compress_sliding=True,
                               allocation=SPLITS[name], compile=False)
    ours = step_blocks(opt, ids, blocks)
    slots = per_head_slots(SPLITS[name], budget)
    torch.testing.assert_close(ours, simulate(model, ids, blocks, slots, sinks), rtol=1e-4, atol=1e-4)

    uniform = h2o_compile.optimize(model, budget=budget, sink_tokens=sinks, compress_sliding=True, compile=False)
    uniform.reset(2, LENGTH)
    assert opt.kv_cache_bytes() <= uniform.kv_cache_bytes()
    assert len(opt.layer_cache_bytes()) == len(slots) and sum(opt.layer_cache_bytes()) == opt.kv_cache_bytes()
    for layer, heads in enumerate(slots):
        kept = opt.kept_positions(layer)
        assert kept.shape == (2, 2, max(heads))
        for head, c in enumerate(heads):
            assert (kept[:, head, :c] >= 0).all() and (kept[:, head, c:] == -1).all()


def test_a_head_split_with_int8_entries_rolling_positions_and_chunked_prefill_equals_simulation():
    """The groups' ops keep the layer's other settings: int8 entries (the scales sliced with their heads), keys
    rotated by rank at attention time (the rotary tables shared), a prompt fed in chunks of 8."""
    model = build("gemma3", seed=3)
    split, budget = SPLITS["gemma3"], 8
    opt = h2o_compile.optimize(model, budget=budget, sink_tokens=1, compress_sliding=True, allocation=split,
                               kv_dtype="int8", positions="rolling", prefill=8, compile=False)
    ids = torch.randint(1, VOCAB, (2, LENGTH), generator=torch.Generator().manual_seed(5))
    slots = per_head_slots(split, budget)

    def layer_args(layer, window, head):
        c = slots[layer][head]
        return dict(capacity=c, recent=max(1, round(c * 0.5)), sinks=1)

    ours = step_blocks(opt, ids, [20] + [1] * (LENGTH - 20))
    want = simulate_logits(model, ids, [8, 8, 4] + [1] * (LENGTH - 20), capacity=None, recent=None, sinks=None,
                           policy="h2o", layer_args=layer_args, rolling=True, quantized=True)
    torch.testing.assert_close(ours, want, rtol=1e-4, atol=1e-4)


def test_a_compiled_head_split_decodes_as_eager_in_one_graph():
    """The compiled CPU step of layers split by KV heads (4 / 8, 12 and 8 / 4 slots): one graph, no break, the
    eager step's logits and kept positions."""
    ids = torch.randint(1, VOCAB, (2, 2 * WINDOW + 6), generator=torch.Generator().manual_seed(4))
    assert_compiled_decode_equals_eager(build("gemma3", seed=2),
                                        dict(budget=8, compress_sliding=True, allocation=SPLITS["gemma3"]), ids, 3)


def test_heads_with_equal_slots_in_two_caches_equal_one_cache():
    """Two groups of one head each, at the same slots: the same tokens and kept positions as the layer's one op."""
    model = build("llama")
    ids = torch.randint(1, VOCAB, (2, 30), generator=torch.Generator().manual_seed(0))
    one = h2o_compile.optimize(model, budget=8, sink_tokens=1, compile=False)
    two = h2o_compile.optimize(model, budget=8, sink_tokens=1, allocation=((1.0, 1.0 + 1e-9), 1.0), compile=False)
    assert len(two.layers) == 3 and two.graph.code.count("h2o.attention_") == 3
    assert torch.equal(one.generate(ids, max_new_tokens=12), two.generate(ids, max_new_tokens=12))
    assert two.stream.slots == [8, 8, 8] and two.kv_cache_bytes() == one.kv_cache_bytes()
    for layer in range(2):
        assert torch.equal(one.kept_positions(layer), two.kept_positions(layer))


def uneven_heads(seed=1):
    """A random Llama whose KV heads attend unlike each other: in layer 0 the first KV head's query heads sharply,
    in layer 1 the second's almost evenly (their query projections scaled)."""
    model = build("llama", seed=seed)
    per_kv = model.config.num_attention_heads // model.config.num_key_value_heads * model.config.head_dim
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight[:per_kv] *= 8.0
        model.model.layers[1].self_attn.q_proj.weight[per_kv:] *= 0.05
    return model


def test_prompt_heads_split_equals_simulation_at_the_best_split():
    """allocation="prompt-heads": every KV head its own cache, sized by the prompt's attention (the best of every
    split of the four heads' slots, on transformers' own attention weights), then H2O == the simulation."""
    model = uneven("llama")
    budget, sinks, prompt = 6, 1, 12
    ids = torch.randint(1, VOCAB, (2, LENGTH), generator=torch.Generator().manual_seed(3))
    curves = [c[h] for c in reference_curves(model, ids[:, :prompt]) for h in range(2)]
    slots, _ = best_split(curves, [budget] * 4, [2] * 4, [prompt] * 4)
    assert len(set(slots)) > 1

    opt = h2o_compile.optimize(model, budget=budget, sink_tokens=sinks, allocation="prompt-heads", compile=False)
    blocks = [prompt] + [1] * (LENGTH - prompt)
    ours = step_blocks(opt, ids, blocks)
    assert opt.stream.slots == slots and len(opt.layers) == 4
    per_layer = [slots[0:2], slots[2:4]]
    torch.testing.assert_close(ours, simulate(model, ids, blocks, per_layer, sinks), rtol=1e-4, atol=1e-4)


def test_calibrated_heads_are_the_prompt_heads_split_saved():
    """calibrate(head_groups=2) with two KV heads per layer: the split prompt-heads finds on that text (the same
    logits for it), saved in
    the config (rule string and JSON round trips); head_groups=1 splits the layers only."""
    model = uneven_heads()
    ids = torch.randint(1, VOCAB, (1, 48), generator=torch.Generator().manual_seed(5))
    config = h2o_compile.calibrate(model, ids, budget=0.25, sink_tokens=1, head_groups=2)
    assert all(isinstance(entry, tuple) and len(entry) == 2 for entry in config.allocation)
    fixed = h2o_compile.optimize(model, config=config, compile=False)
    prompt = h2o_compile.optimize(model, config=config.replace(allocation="prompt-heads"), compile=False)
    for opt in (fixed, prompt):  # the calibration text as the prompt of a 48-token sequence: the same split
        opt.reset(1, 48)
    torch.testing.assert_close(fixed.step(ids), prompt.step(ids), rtol=0, atol=0)
    assert fixed.stream.slots == prompt.stream.slots != [12] * 4
    assert H2OConfig.parse(config.to_string()) == config
    assert H2OConfig.from_dict(config.to_dict()) == config
    layers = h2o_compile.calibrate(model, ids, budget=0.25, sink_tokens=1)
    assert all(isinstance(entry, float) for entry in layers.allocation)


def test_fewer_head_groups_than_heads_share_one_cache_size():
    """head_groups=2 over 4 KV heads: each layer's heads hold at most two slot counts, within the uniform total."""
    model = build("llama", seed=3)
    model.config.num_key_value_heads = 4  # rebuilt below with four KV heads of two query heads each
    model = type(model)(model.config).eval()
    ids = torch.randint(1, VOCAB, (1, 48), generator=torch.Generator().manual_seed(6))
    config = h2o_compile.calibrate(model, ids, budget=12, sink_tokens=1, head_groups=2)
    opt = h2o_compile.optimize(model, config=config, compile=False)
    opt.reset(1, 48)
    for entry in config.allocation:
        assert len(set(entry if isinstance(entry, tuple) else (entry,))) <= 2
    assert sum(s * spec.kv_heads for s, spec in zip(opt.stream.slots, opt.layers)) <= 12 * 4 * 2


def test_bad_head_splits_are_named():
    model = build("llama")
    with pytest.raises(ValueError, match=r"allocation gives layer 0 3 KV head shares; this model's layer has 2"):
        h2o_compile.optimize(model, allocation=((1.0, 0.5, 1.5), 1.0), compile=False)
    with pytest.raises(ValueError, match=r"allocation=\(\(1.0, 0.0\), 1.0\)"):
        H2OConfig(allocation=((1.0, 0.0), 1.0))
    with pytest.raises(ValueError, match=r"head_groups=0 must be an int >= 1"):
        h2o_compile.calibrate(model, torch.ones(1, 8, dtype=torch.long), head_groups=0)
    with pytest.raises(ValueError, match=r"allocation='prompt-heads' with tp"):
        h2o_compile.optimize(model, allocation="prompt-heads", tp=True, compile=False)
    assert H2OConfig.parse("allocation=0.5/1.5:1.0").allocation == ((0.5, 1.5), 1.0)
    assert H2OConfig(allocation=((1.0, 1.0), 2.0)).allocation == (1.0, 2.0), "a layer of equal shares is not split"
