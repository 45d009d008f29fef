"""Teacher-forced H2O simulation inside transformers itself: the model keeps its full DynamicCache and a
custom attention function masks every key the brute-force simulation (tests/kernels/h2o_simulation.py) has
evicted. Independent of the capture, the graph pass and the h2o ops.

Each layer's attention kind comes from transformers' own attention module: ``module.sliding_window`` (None on
full-attention layers), the ``softcap`` the model passes to its attention function, ``module.sinks``."""

from __future__ import annotations

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
    cache_args = _SIMS["cache_args"](module.layer_idx, window)
    b, hq, t, _ = query.shape
    hkv, total = key.shape[1], key.shape[2]
    group = hq // hkv
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = torch.zeros(b, hq, t, value.shape[-1], dtype=torch.float64)
    positions = list(range(total - t, total))
    for row in range(b):
        for h in range(hkv):
            sinks = None if sink_logits is None else sink_logits[h * group:(h + 1) * group].double()
            sim = sims.setdefault((row, h), SimulatedCache(**cache_args, **kind, sink_logits=sinks))
            out[row, h * group:(h + 1) * group] = sim.block(
                positions, query[row, h * group:(h + 1) * group].double(), key[row, h, total - t:].double(),
                value[row, h, total - t:].double(), scale)
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


transformers.AttentionInterface.register("h2o_sim", _h2o_sim_attention)


@torch.no_grad()
def simulate_logits(model, input_ids, blocks, *, capacity, recent, sinks, policy, seed=0, layer_args=None):
    """Feed ``input_ids`` [B, S] in blocks of the given sizes; returns logits [B, S, V] under simulated H2O.

    ``layer_args(layer, window) -> dict(capacity=, recent=, sinks=)`` gives a layer its own cache size (for
    sliding-window layers); by default every layer gets ``capacity``, ``recent`` and ``sinks``."""
    _SIMS.clear()
    shared = dict(capacity=capacity, recent=recent, sinks=sinks)

    def cache_args(layer, window):
        return dict(**(layer_args(layer, window) if layer_args else shared), policy=policy, seed=seed)

    _SIMS.update(by_layer={}, cache_args=cache_args)
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
