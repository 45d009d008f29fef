"""The budget's slots split between layers by the model's own attention (runtime/allocation.py), against an
independent reference: the attention weights transformers itself returns (``output_attentions``), reduced in
float64 with plain loops, and the best split found by trying every one. The models have one layer's attention
sharpened and another's flattened (their softmax scale), so the split they ask for is far from uniform."""

from __future__ import annotations

import itertools

import pytest
import torch

import h2o_compile
from h2o_compile.runtime.allocation import attention_curves, split_slots

from ..helpers import step_blocks
from .arch_configs import VOCAB, WINDOW, build
from .hf_simulation import simulate_logits

LENGTH = 4 * WINDOW
PROMPT = 40


def uneven(name, seed=1):
    """A random model whose layers attend unlike each other: layer 0 sharply, layer 1 almost evenly."""
    model = build(name, seed=seed)
    layers = model.model.layers
    layers[0].self_attn.scaling *= 8.0
    layers[1].self_attn.scaling *= 0.05
    return model


def reference_curves(model, ids):
    """[L] of float64 [Hkv, T + 1]: per KV head, the mean over queries and the group's query heads of the mass
    on the c most-attended keys, from transformers' own output_attentions, row by row."""
    model.set_attn_implementation("eager")
    with torch.no_grad():
        attentions = model(ids, output_attentions=True).attentions
    model.set_attn_implementation("sdpa")
    hkv = model.config.num_key_value_heads
    curves = []
    for weights in attentions:
        b, hq, t, _ = weights.shape
        curve = torch.zeros(hkv, t + 1, dtype=torch.float64)
        for h in range(hkv):
            for row in range(b):
                for q in range(h * hq // hkv, (h + 1) * hq // hkv):
                    for query in range(t):
                        kept = sorted(weights[row, q, query].double().tolist(), reverse=True)
                        curve[h, 1:] += torch.tensor(kept, dtype=torch.float64).cumsum(0)
        curves.append(curve / (b * t * hq // hkv))
    return curves


def best_split(curves, uniform, least, most):
    """Every split with at most sum(uniform) slots, each layer in [least, most]: the one that keeps most."""
    best, chosen = -1.0, None
    for slots in itertools.product(*(range(lo, hi + 1) for lo, hi in zip(least, most))):
        if sum(slots) <= sum(uniform):
            kept = sum(float(curve[c]) for curve, c in zip(curves, slots))
            if kept > best + 1e-12:
                best, chosen = kept, list(slots)
    return chosen, best


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_attention_curves_equal_transformers_weights_reduced_in_float64(name):
    model = uneven(name)
    ids = torch.randint(1, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    ours, want = attention_curves(model, ids), reference_curves(model, ids)
    assert len(ours) == len(want) == model.config.num_hidden_layers
    for got, ref in zip(ours, want):
        torch.testing.assert_close(got, ref, rtol=0, atol=2e-6)
    assert ours[0][:, 2].mean() > ours[1][:, 2].mean() + 0.2, "the sharpened layer keeps more with two keys"


def test_split_slots_keeps_as_much_as_the_best_split():
    model = uneven("gemma3")
    ids = torch.randint(1, VOCAB, (1, 32), generator=torch.Generator().manual_seed(1))
    curves = [c.mean(dim=0) for c in reference_curves(model, ids)]
    for uniform, least, most in [([6, 6, 6], [2, 2, 2], [16, 32, 16]), ([10, 10, 10], [1, 1, 1], [16, 32, 16]),
                                 ([4, 9, 4], [4, 1, 4], [4, 32, 4])]:
        slots = split_slots(curves, uniform, least, most)
        want, best = best_split(curves, uniform, least, most)
        kept = sum(float(c[s]) for c, s in zip(curves, slots))
        assert sum(slots) == sum(uniform) and all(lo <= s <= hi for s, lo, hi in zip(slots, least, most))
        assert kept == pytest.approx(best, abs=1e-12) and slots == want
    assert split_slots(curves, [6, 6, 6], [2, 2, 2], [16, 32, 16])[0] < 6, "the sharp layer gives slots away"


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_prompt_split_equals_simulation_at_the_best_split(name):
    """allocation="prompt": the split of the prompt's attention (found here by trying every split on the float64
    reference), then H2O at those per-layer slots == the brute-force simulation inside transformers."""
    model = uneven(name)
    budget, sinks = 10, 1
    ids = torch.randint(1, VOCAB, (2, LENGTH), generator=torch.Generator().manual_seed(3))
    windows = [WINDOW, 0, WINDOW] if name == "gemma3" else [0, 0]
    curves = [c.mean(dim=0) for c in reference_curves(model, ids[:, :PROMPT])]
    least = [2] * len(windows)  # sink + a recent window of round(c / 2) fits from 2 slots on
    most = [w or LENGTH for w in windows]
    slots, _ = best_split(curves, [budget] * len(windows), least, most)
    assert slots != [budget] * len(windows)

    opt = h2o_compile.optimize(model, budget=budget, sink_tokens=sinks, compress_sliding=True,
                               allocation="prompt", compile=False)
    blocks = [PROMPT] + [1] * (LENGTH - PROMPT)
    ours = step_blocks(opt, ids, blocks)
    assert opt.stream.slots == slots
    uniform = h2o_compile.optimize(model, budget=budget, sink_tokens=sinks, compress_sliding=True, compile=False)
    uniform.reset(2, LENGTH)
    assert opt.kv_cache_bytes() <= uniform.kv_cache_bytes()

    def layer_args(layer, window):
        return dict(capacity=slots[layer], recent=max(1, round(slots[layer] * 0.5)), sinks=sinks)

    want = simulate_logits(model, ids, blocks, capacity=None, recent=None, sinks=None, policy="h2o",
                           layer_args=layer_args)
    torch.testing.assert_close(ours, want, rtol=1e-4, atol=1e-4)


def test_calibrated_split_is_the_prompt_split_saved():
    """calibrate() on a text gives the config whose fixed split the prompt mode finds for that text; generate
    with either gives the same tokens, and save_pretrained / from_pretrained keep the split."""
    model = uneven("gemma3")
    ids = torch.randint(1, VOCAB, (1, 48), generator=torch.Generator().manual_seed(5))
    config = h2o_compile.calibrate(model, ids, budget=0.25, config="recommended", compress_sliding=True)
    assert isinstance(config.allocation, tuple) and len(config.allocation) == 3
    assert config.replace(allocation="uniform") == h2o_compile.H2OConfig.parse("recommended").replace(
        budget=0.25, compress_sliding=True)
    fixed = h2o_compile.optimize(model, config=config, compile=False)
    prompt = h2o_compile.optimize(model, config=config.replace(allocation="prompt"), compile=False)
    assert torch.equal(fixed.generate(ids[:, :40], max_new_tokens=8), prompt.generate(ids[:, :40], max_new_tokens=8))
    assert fixed.stream.slots == prompt.stream.slots != [12, 12, 12]
    assert h2o_compile.H2OConfig.parse(config.to_string()) == config


def test_bad_splits_are_named():
    model = build("llama")
    with pytest.raises(ValueError, match=r"allocation holds 3 shares, one per layer .* this model has 2 layers"):
        h2o_compile.optimize(model, allocation=(1.0, 1.0, 1.0), compile=False)
    with pytest.raises(ValueError, match=r"allocation='prompt' with tp"):
        h2o_compile.optimize(model, allocation="prompt", tp=True, compile=False)
    with pytest.raises(ValueError, match=r"allocation='auto'; allowed: 'uniform', 'prompt'"):
        h2o_compile.H2OConfig(allocation="auto")
    with pytest.raises(ValueError, match=r"allocation=\(1.0, -1.0\)"):
        h2o_compile.H2OConfig(allocation=(1.0, -1.0))
    with pytest.raises(ValueError, match=r"input_ids must be a LongTensor \[batch, T\]"):
        h2o_compile.calibrate(model, torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="continuous batching keeps every row in one state"):
        h2o_compile.optimize(model, allocation="prompt", compile=False).init_continuous_batching()


def test_export_refuses_a_prompt_split_by_name(tmp_path):
    with pytest.raises(ValueError, match="allocation='prompt' is not served by the ONNX function"):
        h2o_compile.export_onnx(build("llama"), tmp_path / "never", allocation="prompt")


def test_a_split_never_holds_more_than_the_uniform_split():
    """Shares measured at one length, planned at another: past the 16-token window the sliding layers stop paying
    for what they gave (0.5 x 40 = 20 is capped at 16), so the full layer's 2 x 40 = 80 would hold 112 slots where
    the uniform split holds 16 + 40 + 16; the plan takes the excess back from the layer above its share."""
    opt = h2o_compile.optimize(build("gemma3"), budget=40, compress_sliding=True, allocation=(0.5, 2.0, 0.5),
                               compile=False)
    opt.reset(1, 100)
    assert opt.stream.slots == [16, 40, 16]
    opt.reset(1, capacity=12)  # below the window: 6, 24 and 6 slots, the uniform split's 36
    assert opt.stream.slots == [6, 24, 6]


def test_a_prompt_split_on_a_stream_follows_the_prompt():
    """reset(B, capacity=C): the stream's split comes from its first block too, within the uniform total."""
    model = uneven("gemma3")
    ids = torch.randint(1, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(3))
    opt = h2o_compile.optimize(model, sink_tokens=1, compress_sliding=True, allocation="prompt", compile=False)
    opt.reset(1, capacity=10)
    opt.step(ids)
    assert opt.stream.slots != [10, 10, 10] and sum(opt.stream.slots) <= 30

