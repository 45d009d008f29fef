"""The executable specification of H2O attention, in plain PyTorch.

Every backend (the Triton kernels, the ONNX function, the compiled CPU graph) must compute what this file
computes; ../docs/design.md section 2 states it in words. The state of one layer is static-shape:

    key_cache   [B, Hkv, C, D]   keys after RoPE (before it with rolling positions), model dtype
    value_cache [B, Hkv, C, Dv]
    score_cache [B, Hkv, C]      accumulated attention A[p], fp32
    pos_cache   [B, Hkv, C]      int64 token position held by the slot, -1 = empty

With quantized entries (kv_dtype="int8", kernels/quantized.py) the key and value caches are int8 and two fp32
scales [B, Hkv, C] follow; a block's own tokens are attended at full precision and stored quantized.

One call appends a block of T >= 1 new tokens (a prompt, a prompt chunk or one decode token):
attend over (kept keys + causal block), add the probability mass every key received (summed over the
block's queries and over the query heads of its KV group; under ``score="max"`` the largest of the queries'
head-summed masses, taken with the score by a maximum) to its score, then evict down to C slots.

Slots are stable: a kept entry never moves, and kept new tokens fill the freed slots in increasing slot
order. The decode fast path (T = 1, kernels/reference_decode.py) therefore writes the new token straight into
the evicted slot, which is also what the Triton decode kernel does, so every backend produces the same layout.

Per-layer attention kinds (docs/design.md section 2), constants of a layer, each off by default:

    window W > 0     sliding window: query t sees key p only if t - p < W; a key with p <= t1 - W is dead
                     (it can never be seen again) and is evicted before any eviction choice.
    softcap c > 0    logit soft-capping: logits = c * tanh(q . k * scale / c), then the softmax.
    sink_logits      [Hq] learned attention-sink logits: one extra logit per query head in the softmax
                     denominator; its share of the probability is dropped, so no key's score gets it.

Rolling positions (``rope`` tables given, kernels/rolling.py): q, k and the cache are unrotated; the attention
rotates them by rank in the cache (or by capped distance), everything else (scores, eviction, windows) is unchanged.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .quantized import EMPTY_SCALE, dequantize
from .rolling import RopeTables, rotate_block
from .rules import POLICY_CODES, SCORES, EvictionRule, parse_rule, random_priority  # noqa: F401  (re-exported)
from .rules import accumulate, carried_scores, eviction_priority, live_entries, pool_block_scores, query_weights
from .state import (H2OState, QuantizedState, copy_state_, empty_state, make_state,  # noqa: F401  (re-exported)
                    readable, stored_entries)



def capped_logits(logits: Tensor, softcap: float) -> Tensor:
    """Gemma 2's logit soft-capping, c * tanh(x / c); ``softcap`` 0 leaves the logits as they are."""
    return logits if softcap <= 0 else torch.tanh(logits / softcap) * softcap


def softmax_with_sink(logits: Tensor, sink: Optional[Tensor]) -> Tensor:
    """softmax over the last dim, with one extra logit per row in the denominator when ``sink`` is given.

    logits [..., S] fp32; sink broadcastable to [..., 1] or None. The sink's own probability is dropped, so
    a row's probabilities sum to less than one (GPT-OSS's learned attention sinks)."""
    if sink is None:
        return torch.softmax(logits, dim=-1)
    peak = torch.maximum(logits.amax(dim=-1, keepdim=True), sink)
    weights = torch.exp(logits - peak)
    return weights / (weights.sum(dim=-1, keepdim=True) + torch.exp(sink - peak))


_LOGITS_PER_CHUNK = 1 << 22  # fp32 logits held at once by `attend` (16 MiB): query chunks stay in cache


def attend(q: Tensor, keys: Tensor, values: Tensor, key_pos: Tensor, query_pos: Tensor,
           query_valid: Tensor, scale: float, new_from: Optional[int] = None, *, window: int = 0,
           softcap: float = 0.0, sink_logits: Optional[Tensor] = None,
           query_weight: Optional[Tensor] = None, peak: bool = False, need_mass: bool = True
           ) -> tuple[Tensor, Tensor]:
    """Masked attention that also returns the probability mass each key received (zeros without ``need_mass``).

    Queries are processed in chunks, so the [T, S] probabilities never exist at once. With ``new_from`` (the
    index where the block's own keys start, i.e. C), a chunk of queries ending at block index t1 reads only
    the first C + t1 keys: the block's later tokens are in all its queries' future (positions increase along
    a block, docs/design.md section 2), so they would receive exactly zero probability.

    Args:
        q: [B, Hq, T, D]; keys: [B, Hkv, S, D]; values: [B, Hkv, S, Dv]
        key_pos: [B, Hkv, S] int64 (-1 = nothing there); query_pos: [B, T]; query_valid: [B, T] bool.
        window, softcap, sink_logits [Hq]: the layer's attention kind (module docstring).
        query_weight: [B, T] fp32 or None, what each query's probabilities count in the mass
            (rules.query_weights); None = 1 for every valid query.
        peak: the mass is the maximum over the queries instead of their sum (``score="max"``).
    Returns:
        out [B, Hq, T, Dv] in q's dtype (zeros for invalid queries) and mass [B, Hkv, S] fp32 =
        sum (peak: max) over valid queries t of w_t sum over the group's query heads g of P_{t,g}(key).
    """
    b, hq, t, d = q.shape
    hkv, s_all = keys.shape[1], keys.shape[2]
    group = hq // hkv
    qg = q.reshape(b, hkv, group, t, d).float()                                  # [B, Hkv, G, T, D]
    keys, values = keys.float(), values.float()
    chunk = max(1, _LOGITS_PER_CHUNK // (b * hq * s_all))
    sink = None if sink_logits is None else sink_logits.float().view(1, hkv, group, 1, 1)
    mass = keys.new_zeros(b, hkv, s_all)
    outs = []
    for t0 in range(0, t, chunk):
        t1 = min(t, t0 + chunk)
        s = s_all if new_from is None else min(s_all, new_from + t1)
        kpos = key_pos[:, :, None, None, :s]                                     # [B, Hkv, 1, 1, s]
        qpos = query_pos[:, None, None, t0:t1, None]                             # [B, 1, 1, tc, 1]
        hidden = (kpos < 0) | (kpos > qpos) | ~query_valid[:, None, None, t0:t1, None]
        if window > 0:
            hidden = hidden | (kpos <= qpos - window)
        q_chunk = qg[:, :, :, t0:t1].reshape(b, hkv, group * (t1 - t0), d)      # [B, Hkv, G*tc, D]
        logits = capped_logits(torch.matmul(q_chunk, keys[:, :, :s].transpose(2, 3)).mul_(scale), softcap)
        logits = logits.view(b, hkv, group, t1 - t0, s)                          # [B, Hkv, G, tc, s]
        # A row with nothing visible (a padding query) must not produce NaN: softmax over a finite floor, then zero.
        probs = softmax_with_sink(logits.masked_fill_(hidden, torch.finfo(torch.float32).min), sink)
        probs.masked_fill_(hidden, 0.0)
        outs.append(torch.matmul(probs.view(b, hkv, group * (t1 - t0), s), values[:, :, :s])
                    .view(b, hkv, group, t1 - t0, -1))
        if not need_mass:
            continue
        per_query = probs.sum(dim=2)                                             # [B, Hkv, tc, s]
        if query_weight is not None:
            per_query = per_query * query_weight[:, None, t0:t1, None].float()
        if peak:
            mass[..., :s] = torch.maximum(mass[..., :s], per_query.amax(dim=2))
        else:
            mass[..., :s] += per_query.sum(dim=2)
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=3)                  # [B, Hkv, G, T, Dv]
    return out.reshape(b, hq, t, values.shape[-1]).to(q.dtype), mass


def _block_inputs(k, positions, valid):
    b, hkv, t, _ = k.shape
    if valid is None:
        valid = torch.ones(b, t, dtype=torch.bool, device=k.device)
    new_pos = torch.where(valid, positions, torch.full_like(positions, -1))     # [B, T]
    newest = new_pos.amax(dim=1).view(b, 1, 1)                                  # t1 per row
    return valid, new_pos[:, None, :].expand(b, hkv, t), newest


def h2o_attention(q: Tensor, k: Tensor, v: Tensor, positions: Tensor, valid: Optional[Tensor],
                  state: H2OState, *, scale: float, recent: int, sinks: int, policy: str,
                  seed: int = 0, window: int = 0, softcap: float = 0.0,
                  sink_logits: Optional[Tensor] = None, rope: Optional[RopeTables] = None,
                  query_from: Optional[Tensor] = None, attend_fn=None) -> tuple[Tensor, H2OState]:
    """Functional H2O attention over one block of T >= 1 new tokens (the general path).

    Args:
        q: [B, Hq, T, D]; k: [B, Hkv, T, D]; v: [B, Hkv, T, Dv]
        positions: [B, T] int64 true positions of the new tokens.
        valid: [B, T] bool or None; False marks a padding token, which is never attended nor cached.
        state: the layer's cache (C slots), quantized or not.
        policy: the eviction rule, a policy name or an ``EvictionRule.spec`` (kernels/rules.py).
        window, softcap, sink_logits [Hq] or None: the layer's attention kind (module docstring).
        rope: rotary tables for rolling positions (kernels/rolling.py): q, k and the cache hold unrotated
            vectors, rotated by their rank in the cache (or capped distance, ``rope.max_distance``) for the
            attention only. None = true positions.
        query_from: [B] int64 or None; given with the prompt block only: queries before it add no mass, and
            the rule's prompt pooling applies (kernels/rules.py).
        attend_fn: the attention of the block, :func:`attend`'s signature plus ``need_mass``; None = :func:`attend`
            (h2o_compile/ops/dispatch.py passes torch's fused CPU attention or the Triton prefill).
    Returns:
        out [B, Hq, T, Dv] and the new state. The block attends over C + T keys; ``attend`` takes the queries
        in chunks, so a whole prompt (prefill "full") never holds all [B, Hq, T, C + T] probabilities.
    """
    cap = state.pos_cache.shape[-1]
    rule = parse_rule(policy)
    valid, new_pos, newest = _block_inputs(k, positions, valid)
    seen = readable(state, k.dtype)
    q_seen, k_seen, state_seen = rolled_inputs(q, k, new_pos, seen, rope)
    keys_seen = torch.cat([state_seen.key_cache, k_seen.to(seen.key_cache.dtype)], dim=2)  # [B, Hkv, C+T, D]
    values_seen = torch.cat([seen.value_cache, v.to(seen.value_cache.dtype)], dim=2)
    all_pos = torch.cat([state.pos_cache, new_pos], dim=2)                                 # [B, Hkv, C+T]
    weight = query_weights(rule, positions, valid, query_from)
    out, mass = (attend_fn or attend)(q_seen, keys_seen, values_seen, all_pos, positions, valid, scale, new_from=cap,
                          window=window, softcap=softcap, sink_logits=sink_logits, query_weight=weight,
                          need_mass=rule.reads_mass, peak=rule.peak)
    all_scores = block_scores(rule, state.score_cache, mass, valid, query_from, k)
    if not state.quantized and rope is None:  # what was attended is what is stored
        entries = H2OState(keys_seen, values_seen, all_scores, all_pos)
    else:
        new_k, new_v, new_ks, new_vs = stored_entries(k, v, state)
        entries = make_state(torch.cat([state.key_cache, new_k], dim=2), torch.cat([state.value_cache, new_v], dim=2),
                             all_scores, all_pos,
                             *((torch.cat([state.key_scale, new_ks], dim=2),
                                torch.cat([state.value_scale, new_vs], dim=2)) if state.quantized else ()))
    new_state = compress(entries, newest, cap, recent=recent, sinks=sinks, policy=policy, seed=seed, window=window)
    return out, new_state


def block_scores(rule: EvictionRule, score_cache: Tensor, mass: Tensor, valid: Tensor,
                 query_from: Optional[Tensor], new_keys: Tensor) -> Tensor:
    """The scores of the C cached entries and the T new ones after a block (step 3 of docs/design.md section 2,
    with the rule's decay and prompt pooling); shared by every path that attends over a whole block.

    Args:
        score_cache: [B, Hkv, C] fp32; mass: [B, Hkv, C+T] fp32, already weighted by rules.query_weights;
        valid: [B, T] bool; query_from: [B] int64 or None (None: not the prompt, no pooling);
        new_keys: [B, Hkv, T, D], the block's keys as the model produced them (a query-free score reads them).
    Returns:
        [B, Hkv, C+T] fp32.
    """
    if rule.keyed:  # the entries keep the score they were written with
        return torch.cat([score_cache, SCORES[rule.score].key_score(new_keys)], dim=2)
    if not rule.reads_mass:  # local, sink, random, full: nothing reads a score, so none is kept
        return torch.zeros_like(mass)
    cap = score_cache.shape[-1]
    old = accumulate(rule, carried_scores(rule, score_cache, valid), mass[..., :cap])
    new = mass[..., cap:]
    if query_from is not None:
        new = pool_block_scores(rule, new, valid)
    return torch.cat([old, new], dim=2)


def compress(entries: H2OState, newest: Tensor, cap: int, *, recent: int, sinks: int, policy: str,
             seed: int = 0, window: int = 0) -> H2OState:
    """Evict down to ``cap`` slots (step 4 of docs/design.md section 2); shared by every path that attends
    over a whole block first (this file's general path, the Triton prefill).

    Args:
        entries: the C old slots followed by the T new tokens, scores already including this block's mass:
            [B, Hkv, C+T, D], [B, Hkv, C+T, Dv], [B, Hkv, C+T] fp32, [B, Hkv, C+T] int64 (-1 = nothing),
            and with quantized entries the two [B, Hkv, C+T] scales (they move with their vectors).
        newest: [B, 1, 1] int64, t1 per row. cap: C. window: the layer's sliding window (0 = none).
    Returns:
        The new state (C slots): kept old entries stay in their slots, kept new tokens fill the freed ones.
    """
    all_scores, all_pos = entries.score_cache, entries.pos_cache
    new_pos = all_pos[:, :, cap:]
    # Rank entries by (priority desc, position desc): two stable sorts, position first.
    priority = eviction_priority(parse_rule(policy), all_scores, all_pos, newest, recent, sinks, seed, window)
    by_pos = torch.sort(all_pos, dim=-1, descending=True, stable=True).indices
    order = torch.sort(priority.gather(-1, by_pos), dim=-1, descending=True, stable=True).indices
    ranked = by_pos.gather(-1, order)                                            # entries, best first
    keep = torch.zeros_like(all_pos, dtype=torch.bool).scatter(
        -1, ranked[..., :cap], True) & live_entries(all_pos, newest, window)     # [B, Hkv, C+T]

    kept_old, kept_new = keep[..., :cap], keep[..., cap:]
    freed = ~kept_old                                                            # [B, Hkv, C]
    # The r-th freed slot receives the r-th kept new token (both counted in increasing order).
    t = new_pos.shape[2]
    new_rank = torch.where(kept_new, kept_new.long().cumsum(-1) - 1, torch.full_like(new_pos, t))
    source_by_rank = torch.full(new_pos.shape[:2] + (t + 1,), -1, dtype=torch.long, device=new_pos.device)
    source_by_rank.scatter_(-1, new_rank, torch.arange(t, device=new_pos.device).expand_as(new_rank))
    source_by_rank[..., t] = -1  # the overflow column collected the tokens that were not kept
    free_rank = (freed.long().cumsum(-1) - 1).clamp(0, t)
    source = torch.where(freed, source_by_rank.gather(-1, free_rank), torch.full_like(free_rank, -1))
    filled = source >= 0                                                         # [B, Hkv, C]
    src = cap + source.clamp(min=0)                                              # index into C+T entries

    def take(entries: Tensor, empty_value) -> Tensor:
        idx = src if entries.dim() == 3 else src[..., None].expand(-1, -1, -1, entries.shape[-1])
        picked = entries.gather(2, idx)
        old = entries[:, :, :cap]
        mask = filled if entries.dim() == 3 else filled[..., None]
        fresh = torch.where(mask, picked, torch.full_like(picked, empty_value))
        keep_mask = kept_old if entries.dim() == 3 else kept_old[..., None]
        return torch.where(keep_mask, old, fresh)

    empty = (0, 0, 0.0, -1, EMPTY_SCALE, EMPTY_SCALE)  # what an empty slot holds, field by field
    return make_state(*(take(x, e) for x, e in zip(entries.tensors(), empty)))


def rolled_inputs(q: Tensor, k: Tensor, new_pos: Tensor, state: H2OState,
                  rope: Optional[RopeTables]) -> tuple[Tensor, Tensor, H2OState]:
    """(q, k, state) as the attention of a block reads them. With rolling positions (``rope`` given): q, k and
    a copy of the cached keys rotated at their rolling positions (dequantized first when quantized); the cache
    itself keeps unrotated keys. new_pos: [B, Hkv, T] int64 true positions of the block, -1 = padding."""
    if rope is None:
        return q, k, state
    keys = state.key_cache if state.key_scale is None else dequantize(state.key_cache, state.key_scale, q.dtype)
    q_rot, k_rot, cache_rot = rotate_block(q, k, keys, state.pos_cache, new_pos, rope)
    return q_rot, k_rot, make_state(cache_rot, state.value_cache, state.score_cache, state.pos_cache, None,
                                    state.value_scale)
