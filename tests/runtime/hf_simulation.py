"""Teacher-forced H2O simulation inside transformers itself: the model keeps its full DynamicCache and a
custom attention function masks every key the brute-force simulation (tests/kernels/h2o_simulation.py) has
evicted. Independent of the capture, the graph pass and the h2o ops.

Each layer's attention kind comes from transformers' own attention module: ``module.sliding_window`` (None on
full-attention layers), the ``softcap`` the model passes to its attention function, ``module.sinks``.

Rolling positions: transformers hands the attention q and k rotated at their true positions; the simulation
turns them back (the inverse rotation, float64, from the model's own inverse frequencies of that layer) and
lets the brute-force cache rotate them by rank."""

from __future__ import annotations

import inspect

import torch
import transformers

from tests.kernels.h2o_simulation import SimulatedCache

_SIMS: dict = {}


def _h2o_sim_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """query [B, Hq, T, D]; key/value [B, Hkv, S, D] (the whole history). Returns ([B, T, Hq, Dv], None)."""
    sims = _SIMS["by_layer"].setdefault(module.layer_idx, {})
    window = getattr(module, "sliding_window", None) or None
    sink_logits = getattr(module, "sinks", None)
    kind = dict(window=window, softcap=kwargs.get("softcap"))
    inv_freq = _SIMS["inv_freq"](module.layer_idx)
    b, hq, t, _ = query.shape
    hkv, total = key.shape[1], key.shape[2]
    group = hq // hkv
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = torch.zeros(b, hq, t, value.shape[-1], dtype=torch.float64)
    positions = list(range(total - t, total))
    dtype = query.dtype
    if inv_freq is not None:
        new_keys = _unrotate(key[:, :, total - t:], inv_freq, positions)
        key = torch.cat([key[:, :, :total - t].double(), new_keys], dim=2)  # only the new keys are read below
        query = _unrotate(query, inv_freq, positions)
    # The prompt (the first block) under a prompt window / pooling: which of its queries add to the scores.
    prompt = total == t and _SIMS["prompt_rule"]
    window = _SIMS["prompt_window"]
    counted = set(positions[-window:]) if prompt and window is not None else None
    for row in range(b):
        for h in range(hkv):
            sinks = None if sink_logits is None else sink_logits[h * group:(h + 1) * group].double()
            if (row, h) not in sims:
                sims[row, h] = SimulatedCache(**_SIMS["cache_args"](module.layer_idx, kind["window"], h), **kind,
                                              sink_logits=sinks, inv_freq=inv_freq)
            sim = sims[row, h]
            out[row, h * group:(h + 1) * group] = sim.block(
                positions, query[row, h * group:(h + 1) * group].double(), key[row, h, total - t:].double(),
                value[row, h, total - t:].double(), scale, counted=counted, prompt=prompt)
    return out.to(dtype).transpose(1, 2).contiguous(), None


def _unrotate(x, inv_freq, positions):
    """x [B, H, T, D] rotated (rotate-half layout, first 2 * len(inv_freq) dims) at ``positions`` -> unrotated."""
    x = x.double()
    angles = torch.tensor(positions, dtype=torch.float64)[:, None] * inv_freq.double()[None, :]   # [T, R/2]
    cos, sin = angles.cos(), angles.sin()
    half = inv_freq.shape[0]
    a, b, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    return torch.cat([a * cos + b * sin, b * cos - a * sin, rest], dim=-1)


def layer_inv_freq(model, layer):
    """The inverse frequencies of ``layer``'s rotary embedding (per layer type where the model has several)."""
    rotary = model.base_model.rotary_emb
    layer_types = getattr(model.config, "layer_types", None)
    if layer_types is not None and hasattr(rotary, f"{layer_types[layer]}_inv_freq"):
        return getattr(rotary, f"{layer_types[layer]}_inv_freq")
    return rotary.inv_freq


transformers.AttentionInterface.register("h2o_sim", _h2o_sim_attention)


@torch.no_grad()
def simulate_logits(model, input_ids, blocks, *, capacity, recent, sinks, policy, seed=0, layer_args=None,
                    rolling=False, score="sum", decay=1.0, pool=1, prompt_window=None, quantized=False,
                    max_distance=0):
    """Feed ``input_ids`` [B, S] in blocks of the given sizes; returns logits [B, S, V] under simulated H2O.

    ``score``, ``decay``, ``pool``, ``prompt_window``: the score rule (docs/design.md section 2); the first block is
    the prompt. ``quantized``: kept keys and values are stored int8-rounded (kv_dtype="int8").

    ``layer_args(layer, window) -> dict(capacity=, recent=, sinks=)`` gives a layer its own cache size (for
    sliding-window layers), and with ``score=`` its own score; by default every layer gets ``capacity``,
    ``recent``, ``sinks`` and ``score``. ``layer_args(layer, window, head)`` (three parameters): each KV head
    its own.
    ``rolling``: rolling positions (keys rotated by their rank in the cache, module docstring), or with
    ``max_distance`` D > 0 by their true distance to the block's newest token capped at max(D, T - 1)."""
    _SIMS.clear()
    shared = dict(capacity=capacity, recent=recent, sinks=sinks)

    per_head = layer_args is not None and len(inspect.signature(layer_args).parameters) == 3

    def cache_args(layer, window, head):  # layer_args may also give the layer its own score
        given = shared if layer_args is None else layer_args(layer, window, head) if per_head else \
            layer_args(layer, window)
        return dict(dict(policy=policy, seed=seed, score=score, decay=decay, pool=pool, quantized=quantized,
                         max_distance=max_distance), **given)

    _SIMS.update(by_layer={}, cache_args=cache_args, prompt_window=prompt_window,
                 prompt_rule=prompt_window is not None or pool > 1,
                 inv_freq=lambda layer: layer_inv_freq(model, layer).double() if rolling else None)
    before = model.config._attn_implementation
    model.set_attn_implementation("h2o_sim")
    try:
        cache = transformers.DynamicCache()  # every key of every layer: the simulation decides what is seen
        logits, start = [], 0
        for size in blocks:
            block = input_ids[:, start:start + size]
            positions = torch.arange(start, start + size).expand_as(block)
            out = model(input_ids=block, position_ids=positions, past_key_values=cache, use_cache=True)
            logits.append(out.logits)
            start += size
        return torch.cat(logits, dim=1)
    finally:
        model.set_attn_implementation(before)
