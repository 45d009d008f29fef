"""The attention of a block on CPU through torch's fused flash attention, and each key's mass from its log-sum-exp.

Same contract as ``reference.attend`` (the executable spec; tests/kernels/test_cpu_prefill.py compares the two
on every attention kind), computed differently:

1. ``aten._scaled_dot_product_flash_attention_for_cpu`` gives the output and the log-sum-exp of every query,
   without materialising probabilities. Each KV head is a batch entry with one key head, so its G query
   heads read the same keys (GQA without repeating K/V) and the visibility mask, which differs between KV
   heads once they evicted different keys, is a [tc, s] bias broadcast over the group.
2. Only when the eviction rule reads scores (``need_mass``): a block without padding (a prompt, a chunk of one,
   each row of a left-padded batch; any window) takes the one-pass op of native_cpu.py, which keeps each
   query tile's probabilities in cache for both the output and the column sums, or the column maxima of the
   group's per-query sums for the peak of ``score="max"`` (no second q.k product); so does a window layer's
   block whose rule reads no scores. Where that op cannot be built, the fused kernel and then a second pass
   over the same query chunks, mass[p] = sum over t (the max over t for a peak) of
   w_t sum_g exp(q_t . k_p x scale - lse_t), in fp32 and never more than one chunk of logits.

Learned sink logits fold into the log-sum-exp: lse' = logaddexp(lse, s), and out' = out x exp(lse - lse'),
because the sink only adds to the denominator. Soft-capping has no fused form: ``supports`` declines it and
the caller keeps ``reference.attend`` for that layer (a constant of the layer, so the choice is per layer).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import native_cpu

_LOGITS_PER_CHUNK = 1 << 22  # fp32 logits (and bias entries) held at once: 16 MiB, as reference.attend


def supports(q: Tensor, softcap: float) -> bool:
    """Whether this path computes the layer's attention: CPU tensors, no soft-capping, a float dtype the fused
    kernel takes."""
    return q.device.type == "cpu" and softcap <= 0 and q.dtype in (torch.float32, torch.bfloat16, torch.float16)


def attend_sdpa(q: Tensor, keys: Tensor, values: Tensor, key_pos: Tensor, query_pos: Tensor, query_valid: Tensor,
                scale: float, new_from: Optional[int] = None, *, window: int = 0,
                sink_logits: Optional[Tensor] = None, query_weight: Optional[Tensor] = None,
                need_mass: bool = True, peak: bool = False) -> tuple[Tensor, Tensor]:
    """``reference.attend`` (softcap 0) with the fused kernel.

    Args:
        q: [B, Hq, T, D]; keys: [B, Hkv, S, D]; values: [B, Hkv, S, Dv]
        key_pos: [B, Hkv, S] int64 (-1 = nothing there); query_pos: [B, T]; query_valid: [B, T] bool.
        new_from: index where the block's own keys start (C): a chunk ending at block index t1 reads C + t1 keys.
        window, sink_logits [Hq]: the layer's attention kind. query_weight: [B, T] fp32 or None (rules.py).
        need_mass: False skips the second pass and returns zero mass (a rule that reads no scores).
        peak: the mass is the maximum over the queries, not the sum (``score="max"``).
    Returns:
        out [B, Hq, T, Dv] in q's dtype (zeros for invalid queries) and mass [B, Hkv, S] fp32.
    """
    pads = _left_padding(query_valid) if new_from is not None else None
    if pads is not None:
        return _row_by_row(pads, q, keys, values, key_pos, query_pos, scale, new_from, window=window,
                           sink_logits=sink_logits, query_weight=query_weight, need_mass=need_mass, peak=peak)
    b, hq, t, d = q.shape
    hkv, s_all, dv = keys.shape[1], keys.shape[2], values.shape[3]
    group = hq // hkv
    dtype = q.dtype
    qf = q.reshape(b * hkv, group, t, d)                                          # [B*Hkv, G, T, D]
    kf = keys.to(dtype).reshape(b * hkv, 1, s_all, d)
    vf = values.to(dtype).reshape(b * hkv, 1, s_all, dv)
    kpos_all = key_pos.reshape(b * hkv, 1, 1, s_all)
    qpos_all = query_pos[:, None, :].expand(b, hkv, t).reshape(b * hkv, 1, t, 1)
    valid_all = query_valid[:, None, :].expand(b, hkv, t).reshape(b * hkv, 1, t, 1)
    chunk = max(1, _LOGITS_PER_CHUNK // (b * hq * s_all))

    # A sliding-window layer over a block whose cache holds nothing (a prompt's first block): a query chunk sees
    # only the block keys within W of its queries, so each chunk attends over that span, not the whole prefix.
    # (Host checks, fine in an eager prefill.)
    span_cut = window > 0 and new_from is not None and not bool((kpos_all[..., :new_from] >= 0).any())

    def first_key(t0: int, t1: int) -> int:
        """The lowest key index any query of the chunk [t0, t1) can see (0 unless ``span_cut``)."""
        if not span_cut:
            return 0
        newest_seen = torch.where(query_valid[:, t0:t1], query_pos[:, t0:t1], query_pos.new_tensor(2**62))
        oldest = newest_seen.amin(dim=1).view(b, 1, 1) - window                     # [B, 1, 1]
        block = key_pos[:, :, new_from:new_from + t1]                               # [B, Hkv, t1]
        needed = ((block >= 0) & (block > oldest)).flatten(0, 1).any(dim=0)        # [t1]
        return new_from + (int(needed.float().argmax()) if bool(needed.any()) else t1)

    def visible_keys(t0: int, t1: int) -> tuple[Tensor, int, int]:
        """The chunk's visibility mask [B*Hkv, 1, tc, s - lo] over keys lo..s-1, with lo and s."""
        s = s_all if new_from is None else min(s_all, new_from + t1)
        lo = min(first_key(t0, t1), s - 1)  # a chunk of padding keeps one (hidden) key: no empty kernel call
        kpos, qpos = kpos_all[..., lo:s], qpos_all[:, :, t0:t1]
        visible = (kpos >= 0) & (kpos <= qpos) & valid_all[:, :, t0:t1]
        if window > 0:
            visible = visible & (kpos > qpos - window)
        return visible, lo, s

    unpadded = new_from is not None and bool(query_valid.all())  # (a host check, fine in an eager prefill)
    # The one-pass op where a rule reads the mass, and on a window layer whatever the rule: it computes only the
    # window's columns per query tile, which beats the masked fused kernel in chunks even without the mass
    # (benchmarks/prefill.py). Zero weights then skip the column sums.
    if unpadded and (need_mass or window > 0) and native_cpu.available():
        weight = query_weight if need_mass else torch.zeros(b, t)
        # The cache as stored (the op computes in fp32): no rounding of an fp32 cache to the queries' dtype.
        out, mass = _one_pass(qf, keys.reshape(b * hkv, s_all, d), values.reshape(b * hkv, s_all, dv),
                              kpos_all[:, 0, 0, :new_from], qpos_all.view(b * hkv, t), window, scale, sink_logits,
                              weight, peak)
        return out.reshape(b, hq, t, dv), mass.reshape(b, hkv, s_all)
    # Otherwise a block without padding or window (a prompt, a chunk of one): the causal kernel over its own keys
    # plus one masked call over the cache, merged by their LSEs. The causal kernel skips the future half, which a
    # mask cannot tell it to.
    causal = unpadded and window == 0
    if causal:
        out, lse = _causal_and_cache(qf, kf, vf, kpos_all[..., :new_from], new_from, scale)
    else:
        out = torch.empty(b * hkv, group, t, dv, dtype=dtype)
        lse = torch.empty(b * hkv, group, t, dtype=torch.float32)
        for t0 in range(0, t, chunk):
            t1 = min(t, t0 + chunk)
            visible, lo, s = visible_keys(t0, t1)
            bias = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, float("-inf"))
            o, l_c = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                qf[:, :, t0:t1], kf[:, :, lo:s], vf[:, :, lo:s], 0.0, False, attn_mask=bias, scale=scale)
            seen = visible.any(dim=-1)                                              # [B*Hkv, 1, tc]
            # A query that sees nothing (padding) has no defined output: zero, as the reference.
            out[:, :, t0:t1] = torch.where(seen[..., None], o, torch.zeros((), dtype=dtype))
            lse[:, :, t0:t1] = torch.where(seen, l_c.float(), float("-inf"))
    if sink_logits is not None:
        sink = sink_logits.float().view(1, hkv, group, 1).expand(b, -1, -1, -1).reshape(b * hkv, group, 1)
        with_sink = torch.logaddexp(lse, sink)
        out = out * torch.exp(lse - with_sink).nan_to_num(0.0).to(dtype)[..., None]
        lse = with_sink
    if need_mass:
        mass = _key_mass(qf, kf, lse, kpos_all, query_weight, scale, chunk, new_from, causal, visible_keys, peak)
    else:
        mass = torch.zeros(b * hkv, s_all, dtype=torch.float32)
    return out.reshape(b, hq, t, dv), mass.reshape(b, hkv, s_all)


def _one_pass(qf: Tensor, kf: Tensor, vf: Tensor, cache_pos: Tensor, positions: Tensor, window: int, scale: float,
              sink_logits: Optional[Tensor], query_weight: Optional[Tensor], peak: bool
              ) -> tuple[Tensor, Tensor]:
    """An unpadded block's output and mass (its peak with ``peak``) through native_cpu (one q.k product).

    qf: [N, G, T, D]; kf: [N, C + T, D]; vf: [N, C + T, Dv]; cache_pos: [N, C] (-1 = empty); positions: [N, T]
    (each KV head's row of the block's positions); sink_logits: [Hq]; query_weight: [B, T].
    Returns out [N, G, T, Dv] and mass [N, C + T] fp32."""
    n, group, t, _ = qf.shape
    cap = cache_pos.shape[1]
    sink = weight = None
    if sink_logits is not None:  # [Hq] -> [N, G]: the same G logits for every batch row of a KV head
        hkv = sink_logits.numel() // group
        sink = sink_logits.float().view(1, hkv, group).expand(n // hkv, -1, -1).reshape(n, group)
    if query_weight is not None:  # [B, T] -> [N, T]: every KV head of a row weighs its queries alike
        weight = query_weight.float()[:, None, :].expand(-1, n // query_weight.shape[0], -1).reshape(n, t)
    if cap and not bool((cache_pos >= 0).any()):  # a first prompt: nothing cached, so no cache columns at all
        out, mass = native_cpu.causal_attend_with_mass(qf, kf[:, cap:], vf[:, cap:], cache_pos[:, :0], positions,
                                                           window, scale, sink, weight, peak=peak)
        return out, torch.cat([mass.new_zeros(n, cap), mass], dim=1)
    return native_cpu.causal_attend_with_mass(qf, kf, vf, cache_pos, positions, window, scale, sink, weight,
                                              peak=peak)


def _left_padding(query_valid: Tensor) -> Optional[list[int]]:
    """Each row's count of leading padding tokens when the block is left-padded (some padding, every row's
    valid tokens one suffix), else None. (A host read: eager prefill.)"""
    if bool(query_valid.all()):
        return None
    pads = (~query_valid).sum(dim=1)                                                # [B]
    suffix = torch.arange(query_valid.shape[1]) >= pads[:, None]
    return pads.tolist() if bool((suffix == query_valid).all()) else None


def _row_by_row(pads: list[int], q: Tensor, keys: Tensor, values: Tensor, key_pos: Tensor, query_pos: Tensor,
                scale: float, new_from: int, **kind) -> tuple[Tensor, Tensor]:
    """A left-padded batch (a serving batch of prompts of different lengths) one row at a time over its valid
    suffix: each row is then a block without padding, which takes the causal kernel (or, on a window layer, the
    window's span), where one masked call over the padded batch would attend over every key of the prefix.
    Padding queries output zeros and add no mass, padding keys get none: the spec's result."""
    b, hq, t, _ = q.shape
    out = q.new_zeros(b, hq, t, values.shape[3])
    mass = torch.zeros(key_pos.shape, dtype=torch.float32)
    weight = kind.pop("query_weight")
    for row, pad in enumerate(pads):
        if pad == t:
            continue
        keep = torch.cat([torch.arange(new_from), torch.arange(new_from + pad, new_from + t)])  # cache + suffix
        o, m = attend_sdpa(q[row:row + 1, :, pad:], keys[row:row + 1, :, keep], values[row:row + 1, :, keep],
                           key_pos[row:row + 1, :, keep], query_pos[row:row + 1, pad:],
                           torch.ones(1, t - pad, dtype=torch.bool), scale, new_from=new_from,
                           query_weight=None if weight is None else weight[row:row + 1, pad:], **kind)
        out[row, :, pad:] = o[0]
        mass[row, :, keep] = m[0]
    return out, mass


def _key_mass(qf: Tensor, kf: Tensor, lse: Tensor, kpos_all: Tensor, query_weight: Optional[Tensor], scale: float,
              chunk: int, new_from: Optional[int], causal: bool, visible_keys, peak: bool = False) -> Tensor:
    """mass[p] = sum_t w_t sum_g exp(q_t . k_p x scale - lse_t): [N, S] fp32 (N = B x Hkv), chunk by chunk;
    with ``peak`` the maximum over t instead of the sum (``score="max"``).

    qf: [N, G, T, D]; kf: [N, 1, S, D]; lse: [N, G, T] fp32 (with any sink folded in); kpos_all: [N, 1, 1, S];
    query_weight: [B, T] or None. ``visible_keys(t0, t1)`` gives the general path's mask over keys lo..s-1.
    """
    n, group, t, d = qf.shape
    s_all = kf.shape[2]
    mass = torch.zeros(n, 1, s_all, dtype=torch.float32)
    first = 0
    weight = None
    if query_weight is not None:
        # Queries of zero weight add exactly nothing: with a prompt window (or a steep decay) the pass starts
        # at the first query that counts, which is most of the prefill's saving. (A host read: eager prefill.)
        counts = (query_weight != 0).any(dim=0)
        first = int(counts.float().argmax()) if bool(counts.any()) else t
        weight = query_weight.float()[:, None, :].expand(-1, n // query_weight.shape[0], t).reshape(n, 1, t)
    # The keys with a column of ones, the queries with a column of -lse: one product gives q.k x scale - lse
    # (a broadcast add would cost a pass over the logits). One fp32 copy of the keys, [N, D + 1, S].
    keys_t = torch.cat([kf[:, 0].float(), torch.ones(n, s_all, 1)], dim=2).transpose(1, 2)
    for t0 in range(first, t, chunk):
        t1 = min(t, t0 + chunk)
        if causal:
            lo, s = 0, min(s_all, new_from + t1)
        else:
            visible, lo, s = visible_keys(t0, t1)
        tc = t1 - t0
        # One [G*tc, D] x [D, s] product per KV head (a broadcast over G would copy the keys G times), with the
        # scale folded into the queries and -lse added by the product itself: logits are written once, then
        # exponentiated in place.
        neg_lse = lse[:, :, t0:t1, None].clamp(min=-3e38).neg()
        rows = torch.cat([qf[:, :, t0:t1].float() * scale, neg_lse], dim=3).reshape(n, group * tc, d + 1)
        probs = torch.bmm(rows, keys_t[:, :, lo:s]).exp_()                          # [N, G*tc, s - lo]
        if causal:
            # Without padding or window the only per-query mask is the chunk's own future (a triangle of its
            # last tc keys); empty cache slots are per key and dropped after the sum.
            future = torch.ones(tc, tc, dtype=torch.bool).triu_(1)
            probs.view(n, group, tc, s)[..., new_from + t0:new_from + t1].masked_fill_(future, 0.0)
        else:
            probs.view(n, group, tc, s - lo).masked_fill_(~visible, 0.0)
        if peak:
            per_query = probs.view(n, group, tc, s - lo).sum(dim=1)                  # [N, tc, s - lo]
            if weight is not None:
                per_query = per_query * weight[:, 0, t0:t1, None]
            mass[..., lo:s] = torch.maximum(mass[..., lo:s], per_query.amax(dim=1, keepdim=True))
        elif weight is None:
            mass[..., lo:s] += probs.sum(dim=1, keepdim=True)
        else:
            mass[..., lo:s] += torch.bmm(weight[..., t0:t1].repeat(1, 1, group), probs)
    if causal:  # an empty slot's key may have any logit (even an overflow): where, not a product
        held = kpos_all[:, 0, 0, :new_from] >= 0                                     # [N, C]
        mass[:, 0, :new_from] = torch.where(held, mass[:, 0, :new_from], 0.0)
    return mass[:, 0]


def _causal_and_cache(qf: Tensor, kf: Tensor, vf: Tensor, cache_pos: Tensor, cap: int, scale: float
                      ) -> tuple[Tensor, Tensor]:
    """Every query valid, no window: the block's causal attention over its own keys and a masked one over the C
    cached keys (all older than the block; empty slots hidden), merged by LSE.

    qf: [N, G, T, D]; kf / vf: [N, 1, C+T, D]; cache_pos: [N, 1, 1, C]. Returns out [N, G, T, Dv] and the
    natural-log LSE [N, G, T] fp32."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    out, lse = flash(qf, kf[:, :, cap:], vf[:, :, cap:], 0.0, True, scale=scale)
    lse = lse.float()
    held = cache_pos >= 0                                                            # [N, 1, 1, C]
    if cap == 0 or not bool(held.any()):  # a first prompt: nothing cached yet
        return out, lse
    bias = torch.zeros(held.shape, dtype=qf.dtype).masked_fill_(~held, float("-inf"))
    bias = bias.expand(-1, -1, qf.shape[2], -1)
    out_c, lse_c = flash(qf, kf[:, :, :cap], vf[:, :, :cap], 0.0, False, attn_mask=bias, scale=scale)
    lse_c = torch.where(held.any(dim=-1), lse_c.float(), float("-inf"))            # rows with an empty cache
    total = torch.logaddexp(lse, lse_c)
    out = (out.float() * torch.exp(lse - total)[..., None]
           + torch.nan_to_num(out_c.float()) * torch.exp(lse_c - total)[..., None]).to(qf.dtype)
    return out, total
