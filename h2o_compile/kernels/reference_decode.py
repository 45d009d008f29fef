"""The reference's decode fast path (T = 1) and its in-place entry point, in plain PyTorch.

One new token per row: the same result as kernels/reference.py's block path (``h2o_attention`` with T = 1)
without rebuilding the cache: attention over the cache plus the new key (:func:`attend_decode`), then the
bookkeeping that writes the new token into the freed slot (:func:`evict_and_write_`). :func:`h2o_attention_`
is ``torch.ops.h2o.attention_``'s reference computation: this path for T = 1, else the block path copied back.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .reference import _block_inputs, capped_logits, h2o_attention, rolled_inputs, softmax_with_sink
from .rolling import RopeTables
from .rules import SCORES, accumulate, carried_scores, eviction_priority, parse_rule, query_weights
from .state import H2OState, copy_state_, stored_entries


def attend_decode(q: Tensor, k: Tensor, v: Tensor, valid: Tensor, state: H2OState, scale: float,
                  new_pos: Optional[Tensor] = None, *, window: int = 0, softcap: float = 0.0,
                  sink_logits: Optional[Tensor] = None, fused_dequant: bool = False
                  ) -> tuple[Tensor, Tensor, Tensor]:
    """One query token per row against the C cached keys and its own key, without concatenating the cache.

    The cache is read once (keys for the logits, values for the output); only the [.., C + 1] logits are
    concatenated. Every cached entry with position >= 0 is visible (it is older than the new token), except,
    on a sliding-window layer, those at or before new_pos - W.

    Args:
        q: [B, Hq, 1, D]; k: [B, Hkv, 1, D]; v: [B, Hkv, 1, Dv]; valid: [B, 1] bool.
        state: its scales given, the int8 keys / values are read in slot chunks and never copied whole.
        new_pos: [B, Hkv, 1] int64, the new token's position (needed only with a window).
        window, softcap, sink_logits [Hq]: the layer's attention kind (module docstring).
        fused_dequant: quantized entries as products and sums over the int8 tensors themselves, for a compiler
            to fuse the int8 -> fp32 conversion into its reduction loops (the compiled CPU decode); eager, it
            would materialise [B, Hkv, G, C, D]. The chunked matrix products otherwise.
    Returns:
        out [B, Hq, 1, Dv] (q's dtype), mass over the cache [B, Hkv, C] and on the new key [B, Hkv, 1] (fp32).
    """
    key_cache, value_cache, pos_cache = state.key_cache, state.value_cache, state.pos_cache
    b, hq, _, d = q.shape
    hkv = key_cache.shape[1]
    qg = q.reshape(b, hkv, hq // hkv, d).float()                                 # [B, Hkv, G, D]
    cached = capped_logits(_cache_logits(qg, key_cache, state.key_scale, fused_dequant) * scale, softcap)
    hidden = pos_cache < 0                                                       # [B, Hkv, C]
    if window > 0:
        hidden = hidden | (pos_cache <= new_pos - window)
    cached.masked_fill_(hidden[:, :, None, :], torch.finfo(torch.float32).min)  # [B, Hkv, G, C]
    own = capped_logits((qg * k.float()).sum(-1, keepdim=True) * scale, softcap)  # [B, Hkv, G, 1], always visible
    sink = None if sink_logits is None else sink_logits.float().view(1, hkv, hq // hkv, 1)
    probs = softmax_with_sink(torch.cat([cached, own], dim=-1), sink)            # [B, Hkv, G, C+1]
    out = (_cache_values(probs[..., :-1], value_cache, state.value_scale, fused_dequant)
           + probs[..., -1:] * v.float().reshape(b, hkv, 1, -1))
    # A padding token (valid False) attends nowhere: zero output, zero mass (x 1 leaves the others exact).
    keep = valid.view(b, 1, 1).float()
    mass = probs.sum(dim=2) * keep                                               # [B, Hkv, C+1]
    out = out * keep[..., None]
    return out.reshape(b, hq, 1, -1).to(q.dtype), mass[..., :-1], mass[..., -1:]


_DEQUANT_SLOTS = 256  # int8 slots converted to fp32 at a time by the decode step: the copy stays in cache


def _cache_logits(qg: Tensor, key_cache: Tensor, key_scale: Optional[Tensor], fused: bool = False) -> Tensor:
    """q . k for every cached key: qg [B, Hkv, G, D] fp32 -> [B, Hkv, G, C] fp32. Quantized keys are read
    ``_DEQUANT_SLOTS`` at a time, their scale applied to the dot products (q . (s k) = s (q . k)); ``fused``:
    one product-and-sum over the int8 keys (attend_decode's fused_dequant)."""
    if key_scale is None:
        return torch.matmul(qg, key_cache.float().transpose(2, 3))
    if fused:
        return (qg[:, :, :, None, :] * key_cache[:, :, None].float()).sum(-1) * key_scale[:, :, None, :]
    cap = key_cache.shape[2]
    parts = [torch.matmul(qg, key_cache[:, :, c0:c0 + _DEQUANT_SLOTS].float().transpose(2, 3))
             * key_scale[:, :, None, c0:c0 + _DEQUANT_SLOTS] for c0 in range(0, cap, _DEQUANT_SLOTS)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def _cache_values(probs: Tensor, value_cache: Tensor, value_scale: Optional[Tensor], fused: bool = False) -> Tensor:
    """sum_c probs[c] v[c]: probs [B, Hkv, G, C] fp32 -> [B, Hkv, G, Dv] fp32; a quantized value's scale
    multiplies its probability instead of the vector, chunk by chunk as in :func:`_cache_logits`."""
    if value_scale is None:
        return torch.matmul(probs, value_cache.float())
    weighted = probs * value_scale[:, :, None, :]
    if fused:
        return (weighted[..., None] * value_cache[:, :, None].float()).sum(-2)
    out = None
    for c0 in range(0, value_cache.shape[2], _DEQUANT_SLOTS):
        part = torch.matmul(weighted[..., c0:c0 + _DEQUANT_SLOTS], value_cache[:, :, c0:c0 + _DEQUANT_SLOTS].float())
        out = part if out is None else out + part
    return out


def h2o_decode_(q: Tensor, k: Tensor, v: Tensor, positions: Tensor, valid: Optional[Tensor],
                state: H2OState, *, scale: float, recent: int, sinks: int, policy: str,
                seed: int = 0, window: int = 0, softcap: float = 0.0,
                sink_logits: Optional[Tensor] = None, rope: Optional[RopeTables] = None,
                query_from: Optional[Tensor] = None, attend_decode_fn=None) -> Tensor:
    """In-place H2O attention for one new token (T = 1): the decode step.

    Same result as :func:`h2o_attention` with T = 1, without rebuilding the cache: the new token is written
    into the first empty slot, else into the slot of the entry with the lowest (priority, position). No
    ``.item()`` and no data-dependent branching, so a CUDA graph can capture it.

    Args: as :func:`h2o_attention` with T = 1; ``attend_decode_fn``: :func:`attend_decode`'s signature (None = it;
    h2o_compile/ops/dispatch.py passes the native CPU op). Returns out [B, Hq, 1, Dv]; ``state`` is updated in place.
    """
    valid, new_pos, newest = _block_inputs(k, positions, valid)                 # new_pos [B, Hkv, 1]
    q_seen, k_seen, state_seen = rolled_inputs(q, k, new_pos, state, rope)
    out, mass_cache, mass_new = (attend_decode_fn or attend_decode)(q_seen, k_seen, v, valid, state_seen, scale,
                                                                    new_pos, window=window, softcap=softcap,
                                                                    sink_logits=sink_logits)
    evict_and_write_(state, k, v, new_pos, newest, valid, mass_cache, mass_new, recent=recent, sinks=sinks,
                     policy=policy, seed=seed, window=window, positions=positions, query_from=query_from)
    return out


def evict_and_write_(state: H2OState, k: Tensor, v: Tensor, new_pos: Tensor, newest: Tensor, valid: Tensor,
                     mass_cache: Tensor, mass_new: Tensor, *, recent: int, sinks: int, policy: str,
                     seed: int = 0, window: int = 0, positions: Optional[Tensor] = None,
                     query_from: Optional[Tensor] = None) -> None:
    """The decode step after attention: add the step's mass to the scores, pick the slot to overwrite and write
    the new token there. Only elementwise ops, reductions and indexing, so that a compiler can fuse it all
    (the compiled CPU decode step runs this as one generated loop nest per layer).

    Args:
        k: [B, Hkv, 1, D]; v: [B, Hkv, 1, Dv]; new_pos: [B, Hkv, 1] int64 (-1 for padding); newest: [B, 1, 1];
        valid: [B, 1] bool; mass_cache: [B, Hkv, C] and mass_new: [B, Hkv, 1] fp32, from :func:`attend_decode`.
        window: the layer's sliding window (0 = none). With C <= W (how the runtime sizes a sliding layer) at
        most one key leaves the window per step, and it is the one overwritten.
        positions: [B, 1] int64 and query_from: [B] int64, needed only when a prompt token arrives through
            this path (a one-token prompt or chunk) under a prompt window (kernels/rules.py).
    """
    score_cache, pos_cache = state.score_cache, state.pos_cache
    rule = parse_rule(policy)
    weight = None if query_from is None else query_weights(rule, positions, valid, query_from)
    if weight is not None:                                                       # [B, 1]
        mass_cache, mass_new = mass_cache * weight[:, :, None], mass_new * weight[:, :, None]
    if rule.reads_mass:
        scores = accumulate(rule, carried_scores(rule, score_cache, valid), mass_cache)  # [B, Hkv, C]
    elif rule.keyed:
        scores, mass_new = score_cache, SCORES[rule.score].key_score(k)          # [B, Hkv, 1]
    else:  # nothing reads a score: they stay 0 (a constant branch, as the rule is a constant of the graph)
        scores, mass_new = score_cache, torch.zeros_like(mass_new)
    priority = eviction_priority(rule, scores, pos_cache, newest, recent, sinks, seed, window)
    lowest = priority == priority.amin(dim=-1, keepdim=True)
    tie_pos = torch.where(lowest, pos_cache, torch.full_like(pos_cache, torch.iinfo(torch.int64).max))
    slot = tie_pos.argmin(dim=-1).reshape(-1)                                    # [B * Hkv]
    b, hkv, cap = pos_cache.shape
    entry = torch.arange(b * hkv, device=slot.device)                            # (row, head) pairs, flat
    write = valid.reshape(b, 1).expand(b, hkv).reshape(-1)                       # padding leaves the cache as is

    def put(buf: Tensor, new: Tensor) -> None:
        # Indexed reads/writes of one entry per (row, head): a compiler keeps them in place (a scatter over a
        # gathered index would make Inductor copy the whole cache). Flat (row, head) indices of one shape:
        # broadcasting [B, 1] against [1, Hkv] would make dynamo specialise a batch of one.
        flat = buf.view(b * hkv, cap, *buf.shape[3:])
        old = flat[entry, slot]                                                  # [B*Hkv] or [B*Hkv, D]
        mask = write if old.dim() == 1 else write[:, None]
        flat.index_put_((entry, slot), torch.where(mask, new.reshape(old.shape).to(buf.dtype), old))

    score_cache.copy_(scores)
    new_k, new_v, new_ks, new_vs = stored_entries(k, v, state)  # quantized at write time when the state is
    put(state.key_cache, new_k)
    put(state.value_cache, new_v)
    put(score_cache, mass_new)
    put(pos_cache, new_pos)
    if state.quantized:
        put(state.key_scale, new_ks)
        put(state.value_scale, new_vs)


def h2o_attention_(q, k, v, positions, valid, state: H2OState, *, scale, recent, sinks, policy, seed=0,
                   window=0, softcap=0.0, sink_logits=None, rope=None, query_from=None, attend_fn=None,
                   attend_decode_fn=None):
    """In-place H2O attention: the decode fast path for T = 1, else the general path copied back."""
    kind = dict(window=window, softcap=softcap, sink_logits=sink_logits, rope=rope, query_from=query_from)
    if q.shape[2] == 1:
        return h2o_decode_(q, k, v, positions, valid, state, scale=scale, recent=recent, sinks=sinks,
                           policy=policy, seed=seed, attend_decode_fn=attend_decode_fn, **kind)
    out, new_state = h2o_attention(q, k, v, positions, valid, state, scale=scale, recent=recent,
                                   sinks=sinks, policy=policy, seed=seed, attend_fn=attend_fn, **kind)
    copy_state_(state, new_state)
    return out
