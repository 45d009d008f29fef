"""The attention pass: it fires (counted), the rewritten graph equals eager transformers, and it declines
what it cannot serve."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
import transformers

import h2o_compile
from h2o_compile.graph.capture import capture
from h2o_compile.kernels.reference import empty_state
from h2o_compile.graph.passes import count_h2o_ops, find_attention_sites, rewrite_attention, set_h2o_params

aten = torch.ops.aten


def tiny_llama(attn="sdpa", layers=2):
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      attn_implementation=attn)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def run_rewritten(gm, layers, ids, capacity):
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    valid = torch.ones_like(ids, dtype=torch.bool)
    state = [t for s in layers for t in empty_state(ids.shape[0], s.kv_heads, capacity, s.head_dim,
                                                    value_dim=s.value_dim, dtype=s.dtype)]
    return gm(ids, positions, valid, *state), state


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_pass_fires_once_per_layer_and_equals_eager(attn):
    model = tiny_llama(attn, layers=3)
    gm = capture(model)
    sites, declines = find_attention_sites(gm.graph)
    assert declines == []
    assert [s.pattern for s in sites] == [attn] * 3
    assert all(s.key.meta["val"].shape[1] == 2 for s in sites), "repeat_kv must be peeled: 2 KV heads stored"
    assert all(math.isclose(s.scale, 8 ** -0.5) for s in sites)
    layers = rewrite_attention(gm, sites, recent=4, sinks=0, policy="h2o", seed=0)
    assert count_h2o_ops(gm) == len(layers) == 3
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert aten.scaled_dot_product_attention.default not in targets and aten.softmax.int not in targets
    # The model's mask building (position_ids -> diff -> cumsum -> comparisons) is dead and gone.
    assert aten.diff.default not in targets and aten.cumsum.default not in targets
    ids = torch.randint(0, 64, (2, 11))
    logits, _ = run_rewritten(gm, layers, ids, capacity=11)
    torch.testing.assert_close(logits, model(ids).logits, rtol=1e-4, atol=1e-5)


def test_functional_rewrite_returns_new_state_and_leaves_inputs():
    model = tiny_llama()
    gm = capture(model)
    sites, _ = find_attention_sites(gm.graph)
    layers = rewrite_attention(gm, sites, functional=True, recent=2, sinks=0, policy="h2o", seed=0)
    ids = torch.randint(0, 64, (1, 9))
    (logits, *new_state), state = run_rewritten(gm, layers, ids, capacity=4)
    assert len(new_state) == 4 * len(layers)
    assert all(torch.all(p == -1) for p in state[3::4]), "the functional graph must not mutate its inputs"
    assert all((p >= 0).sum() == 2 * 4 for p in new_state[3::4])
    torch.testing.assert_close(logits[:, :4], model(ids[:, :4]).logits, rtol=1e-4, atol=1e-5)


def test_set_h2o_params_updates_every_op():
    model = tiny_llama()
    gm = capture(model)
    sites, _ = find_attention_sites(gm.graph)
    rewrite_attention(gm, sites)
    assert set_h2o_params(gm, recent=3, sinks=1, policy="random", seed=9) == 2
    assert set_h2o_params(gm, recent=3, sinks=1, policy="random", seed=9) == 0
    assert all(n.args[10:14] == (3, 1, "random", 9) for n in gm.graph.nodes if "h2o" in str(n.target))
    # per-layer values (sliding-window layers get their own recent window and no sinks)
    assert set_h2o_params(gm, recent=[2, 4], sinks=[0, 1], policy="random", seed=9) == 2
    ops = [n for n in gm.graph.nodes if "h2o" in str(n.target)]
    assert [n.args[10:14] for n in ops] == [(2, 0, "random", 9), (4, 1, "random", 9)]
    assert all(n.args[14:] == (0, 0.0, None) for n in ops)  # the layer kinds are untouched


class _Toy(torch.nn.Module):
    """q/k/v projections + one attention variant, exported the way capture() exports models."""

    def __init__(self, variant):
        super().__init__()
        self.variant = variant
        self.proj = torch.nn.Linear(16, 16 + 8 + 8)
        self.head_bias = torch.nn.Parameter(torch.randn(1, 4, 1, 1))

    def forward(self, x, y):
        b, t, _ = x.shape
        q, k, v = self.proj(x).split([16, 8, 8], dim=-1)
        q = q.view(b, t, 4, 4).transpose(1, 2)
        k = k.view(b, t, 2, 4).transpose(1, 2)
        v = v.view(b, t, 2, 4).transpose(1, 2)
        if self.variant == "gqa":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        if self.variant == "bidirectional":
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        if self.variant == "scale_arg":  # a non-default scale (keyword-only in aten's schema), own bool mask
            causal = torch.ones(t, t, dtype=torch.bool).tril()
            return F.scaled_dot_product_attention(q, k, v, causal, 0.0, False, scale=0.125, enable_gqa=True)
        k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
        if self.variant == "alibi":
            bias = -torch.arange(t, dtype=x.dtype).view(1, 1, 1, t) * torch.ones(1, 4, t, 1)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        if self.variant == "softcap":
            logits = torch.tanh(q @ k.transpose(2, 3) / 30.0) * 30.0
            return torch.softmax(logits, dim=-1) @ v
        if self.variant.startswith("eager_"):
            logits = q @ k.transpose(2, 3) * 0.5
            pos = torch.arange(t)
            causal = pos[None, :] <= pos[:, None]                                  # [T, T] bool
            if self.variant == "eager_mask":        # transformers' eager mask: where(visible, 0, min)
                added = torch.where(causal, 0.0, torch.finfo(x.dtype).min)
            elif self.variant == "eager_alibi":     # a graded distance bias, masked where future
                added = (pos[None, :] - pos[:, None]).to(x.dtype).masked_fill(~causal, float("-inf"))
            else:                                   # eager_learned: a learned per-head bias
                added = self.head_bias + torch.where(causal, 0.0, float("-inf"))
            return torch.softmax(logits + added, dim=-1) @ v
        if self.variant == "tanh":  # tanh with a different cap outside than inside: not Gemma 2's soft-cap
            logits = torch.tanh(q @ k.transpose(2, 3) / 30.0) * 20.0
            return torch.softmax(logits, dim=-1) @ v
        if self.variant == "cross":
            kv = self.proj(y)[..., 16:]
            k = kv[..., :8].reshape(b, y.shape[1], 2, 4).transpose(1, 2).repeat_interleave(2, 1)
            v = kv[..., 8:].reshape(b, y.shape[1], 2, 4).transpose(1, 2).repeat_interleave(2, 1)
            return F.scaled_dot_product_attention(q, k, v)
        raise AssertionError(self.variant)


def _toy_graph(variant):
    seq, other = torch.export.Dim("seq", min=2, max=32), torch.export.Dim("other", min=2, max=32)
    ep = torch.export.export(_Toy(variant), (torch.randn(1, 5, 16), torch.randn(1, 7, 16)),
                             dynamic_shapes={"x": {1: seq}, "y": {1: other}}, strict=False)
    return ep.module().graph


def test_sdpa_with_enable_gqa_is_matched_with_kv_heads():
    sites, declines = find_attention_sites(_toy_graph("gqa"))
    assert declines == [] and len(sites) == 1
    assert sites[0].key.meta["val"].shape[1] == 2


@pytest.mark.parametrize("variant,reason", [
    ("alibi", "additive float mask"),
    ("tanh", "score transforms"),
    ("cross", "cross-attention"),
    ("bidirectional", "bidirectional"),
    ("eager_alibi", "not a causal/padding mask"),
    ("eager_learned", "not a causal/padding mask"),
])
def test_unsupported_variants_are_declined_with_a_reason(variant, reason):
    sites, declines = find_attention_sites(_toy_graph(variant))
    assert sites == []
    assert len(declines) == 1 and reason in declines[0].reason


def test_sdpa_non_default_scale_with_the_models_own_bool_mask_is_read():
    (site,), declines = find_attention_sites(_toy_graph("scale_arg"))
    assert declines == [] and site.scale == 0.125 and site.pattern == "sdpa"


def test_eager_causal_mask_is_dropped_for_the_h2o_op():
    (site,), declines = find_attention_sites(_toy_graph("eager_mask"))
    assert declines == [] and site.scale == 0.5 and site.pattern == "eager"


def test_soft_capping_is_read_from_the_graph():
    (site,), declines = find_attention_sites(_toy_graph("softcap"))
    assert declines == [] and site.softcap == 30.0 and site.scale == 1.0 and site.pattern == "eager"


def test_a_layer_kind_the_pass_cannot_serve_is_declined_naming_the_layer():
    from types import SimpleNamespace

    from h2o_compile.graph.support import layer_windows

    config = SimpleNamespace(num_hidden_layers=3, sliding_window=8,
                             layer_types=["sliding_attention", "full_attention", "chunked_attention"])
    with pytest.raises(h2o_compile.UnsupportedModelError, match="layer 2 has attention kind 'chunked_attention'"):
        layer_windows(config)
    config.layer_types = config.layer_types[:2] + ["sliding_attention"]
    assert layer_windows(config) == (8, 0, 8)


@pytest.mark.parametrize("config,match", [
    (transformers.BloomConfig(vocab_size=64, hidden_size=32, n_layer=2, n_head=4), "ALiBi"),
    (transformers.MptConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=64), "ALiBi"),
    (transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4), "encoder-decoder"),
    (transformers.BartConfig(vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                             decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64), "encoder-decoder"),
])
def test_optimize_rejects_unsupported_models(config, match):
    if config.is_encoder_decoder:
        model = transformers.AutoModelForSeq2SeqLM.from_config(config).eval()
    else:
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(h2o_compile.UnsupportedModelError, match=match):
        h2o_compile.optimize(model)
