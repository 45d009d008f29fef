"""Triton prefill (a block of T > 1 tokens) of H2O attention: flash attention plus per-key probability mass.

The block attends over ``entries`` = the C cached slots followed by the T new tokens (the same
concatenation as ``reference.h2o_attention``), without materialising the [T, C + T] probabilities:

1. ``_prefill_fwd_kernel``, grid (T / BLOCK_M, B * Hq): online-softmax attention; writes the output and the
   per-row log-sum-exp.
2. ``_prefill_mass_kernel``, grid ((C + T) / BLOCK_N, B * Hkv): each program owns a block of keys and
   recomputes its logits against every query of the group's heads, turns them into probabilities with the
   stored LSE, sums each query's over the group's heads and then sums them over the queries (column sums),
   or takes their maximum (``score="max"``), so no atomics are needed.

Visibility is by position, as in the reference: a key is seen by a query iff 0 <= key pos <= query pos and
the query is valid (and, with a sliding window W, query pos - key pos < W). Both kernels skip new-key blocks
that lie wholly after the query block, which assumes that valid positions increase along T (true for prompts
and prompt chunks). Eviction down to C is then plain torch (``reference.compress``), in triton_ops.

The attention kind is compiled in, as in triton_decode: ``WINDOW`` (0 = off), ``SOFTCAP`` (base-2 cap, 0 =
off) and ``HAS_SINKS`` (the sink logit joins the forward kernel's LSE, so the mass kernel's probabilities
leave its share out without knowing about it). On a sliding layer both kernels also skip, at run time, the
tile pairs that lie wholly outside the window (checked on the loaded positions, so no assumption on padding):
a long prompt then costs O(T x W), not O(T^2). A skipped tile would only have added exact zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_decode import LOG2E, LOG2E_K, NEG, dot_precision, is_interpreted, soft_cap

FAR = tl.constexpr(2**62)  # a position later than any: the min over a tile without valid queries


@triton.jit
def _load_queries(Q, b, hq, offs_m, offs_d, T, stride_qb, stride_qh, stride_qt, stride_qd, D: tl.constexpr):
    """One block of queries [BLOCK_M, BLOCK_D] of query head hq."""
    return tl.load(Q + b * stride_qb + hq * stride_qh + offs_m[:, None] * stride_qt + offs_d[None, :] * stride_qd,
                   mask=(offs_m < T)[:, None] & (offs_d[None, :] < D), other=0.0)


@triton.jit
def _query_rows(POSITIONS, VALID, b, offs_m, T, stride_posb, stride_post, stride_validb, stride_validt,
                HAS_VALID: tl.constexpr):
    """Positions and validity [BLOCK_M] of a block of queries (padding rows and rows past T are invalid)."""
    m_mask = offs_m < T
    qpos = tl.load(POSITIONS + b * stride_posb + offs_m * stride_post, mask=m_mask, other=-1)
    qvalid = m_mask
    if HAS_VALID:
        flag = tl.load(VALID + b * stride_validb + offs_m * stride_validt, mask=m_mask, other=0).to(tl.int32)
        qvalid = m_mask & (flag != 0)
    return qpos, qvalid


@triton.jit
def _visible(kpos, qpos, qvalid, WINDOW: tl.constexpr):
    """[BLOCK_M, BLOCK_N] bool: query (row) sees key (column), as reference.attend."""
    vis = (kpos[None, :] >= 0) & (kpos[None, :] <= qpos[:, None]) & qvalid[:, None]
    if WINDOW > 0:
        vis = vis & (kpos[None, :] > qpos[:, None] - WINDOW)
    return vis


@triton.jit
def _tiles_meet(kpos, qpos, qvalid, WINDOW):
    """Scalar bool, False when no query of the tile can see a key of the tile through the sliding window: the
    newest key is at or before the oldest valid query's t - W (invalid keys are -1, never newer)."""
    return tl.max(kpos, 0) > tl.min(tl.where(qvalid, qpos, FAR), 0) - WINDOW


@triton.jit
def _prefill_fwd_kernel(
    Q, KEYS, VALUES, KPOS, POSITIONS, VALID, SINK_LOGITS, OUT, LSE,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_pb, stride_ph, stride_pn,
    stride_posb, stride_post, stride_validb, stride_validt, stride_sink,
    stride_ob, stride_oh, stride_ot, stride_od,
    C, T, qk_scale,
    HQ: tl.constexpr, G: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_VALID: tl.constexpr, DOT_PRECISION: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16, "tl.dot needs 16 x 16 tiles at least")
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // HQ).to(tl.int64)  # 64-bit offsets: B x H x T x D can pass 2^31
    hq = pid_bh % HQ
    h = hq // G
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = _load_queries(Q, b, hq, offs_m, offs_d, T, stride_qb, stride_qh, stride_qt, stride_qd, D)
    q = q.to(KEYS.dtype.element_ty)
    qpos, qvalid = _query_rows(POSITIONS, VALID, b, offs_m, T, stride_posb, stride_post, stride_validb,
                               stride_validt, HAS_VALID)

    m_i = tl.full([BLOCK_M], NEG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    n_total = C + T
    end = tl.minimum(n_total, C + (pid_m + 1) * BLOCK_M)  # causal: later new tokens are never visible
    for n0 in range(0, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < n_total
        kpos = tl.load(KPOS + b * stride_pb + h * stride_ph + offs_n * stride_pn, mask=n_mask, other=-1)
        meet = True  # a static True keeps the loop branch-free (and pipelined) without a window
        if WINDOW > 0:
            meet = _tiles_meet(kpos, qpos, qvalid, WINDOW)
        if meet:
            k = tl.load(KEYS + b * stride_kb + h * stride_kh + offs_n[:, None] * stride_kn
                        + offs_d[None, :] * stride_kd,
                        mask=n_mask[:, None] & (offs_d[None, :] < D), other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale    # [BLOCK_M, BLOCK_N]
            if SOFTCAP > 0:
                s = soft_cap(s, SOFTCAP)
            vis = _visible(kpos, qpos, qvalid, WINDOW)
            s = tl.where(vis, s, NEG)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.where(vis, tl.exp2(s - m_new[:, None]), 0.0)
            v = tl.load(VALUES + b * stride_vb + h * stride_vh + offs_n[:, None] * stride_vn
                        + offs_dv[None, :] * stride_vd, mask=n_mask[:, None] & (offs_dv[None, :] < DV),
                        other=0.0)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

    if HAS_SINKS:
        # One more logit in the denominator, none in the numerator (reference.softmax_with_sink).
        sink = tl.load(SINK_LOGITS + hq * stride_sink).to(tl.float32) * LOG2E_K
        m_new = tl.maximum(m_i, sink)
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.exp2(sink - m_new)
        acc = acc * alpha[:, None]
        m_i = m_new
    seen = l_i > 0  # (without sinks) false only for padding rows: their output is zero, as in the reference
    out = tl.where(seen[:, None], acc / tl.where(seen, l_i, 1.0)[:, None], 0.0)
    m_mask = offs_m < T
    tl.store(OUT + b * stride_ob + hq * stride_oh + offs_m[:, None] * stride_ot
             + offs_dv[None, :] * stride_od,
             out.to(OUT.dtype.element_ty), mask=m_mask[:, None] & (offs_dv[None, :] < DV))
    tl.store(LSE + pid_bh * T + offs_m, m_i + tl.log2(tl.where(seen, l_i, 1.0)), mask=m_mask)


@triton.jit
def _prefill_mass_kernel(
    Q, KEYS, KPOS, POSITIONS, VALID, LSE, MASS,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_pb, stride_ph, stride_pn,
    stride_posb, stride_post, stride_validb, stride_validt,
    C, T, qk_scale,
    HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_VALID: tl.constexpr, DOT_PRECISION: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    PEAK: tl.constexpr,
):
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16, "tl.dot needs 16 x 16 tiles at least")
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // HKV).to(tl.int64)  # 64-bit offsets: B x Hkv x C x D passes 2^31 at long contexts
    h = pid_bh % HKV
    n_total = C + T
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    n_mask = offs_n < n_total
    kpos = tl.load(KPOS + b * stride_pb + h * stride_ph + offs_n * stride_pn, mask=n_mask, other=-1)
    k = tl.load(KEYS + b * stride_kb + h * stride_kh + offs_n[:, None] * stride_kn
                + offs_d[None, :] * stride_kd,
                mask=n_mask[:, None] & (offs_d[None, :] < D), other=0.0)
    # New token j is seen by queries i >= j only; cached slots by every query.
    first_query = tl.maximum(pid_n * BLOCK_N - C, 0) // BLOCK_M * BLOCK_M
    col = tl.zeros([BLOCK_N], tl.float32)
    for m0 in range(first_query, T, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        qpos, qvalid = _query_rows(POSITIONS, VALID, b, offs_m, T, stride_posb, stride_post, stride_validb,
                                   stride_validt, HAS_VALID)
        meet = True  # as in the forward kernel; the queries are loaded only for a tile pair that meets
        if WINDOW > 0:
            meet = _tiles_meet(kpos, qpos, qvalid, WINDOW)
        if meet:
            vis = _visible(kpos, qpos, qvalid, WINDOW)
            # Each query's mass summed over the group's heads first: a peak (score="max") is taken per query.
            tile = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for g in range(G):
                hq = h * G + g
                q = _load_queries(Q, b, hq, offs_m, offs_d, T, stride_qb, stride_qh, stride_qt, stride_qd, D)
                lse = tl.load(LSE + (b * HKV * G + hq) * T + offs_m, mask=offs_m < T, other=0.0)
                # Recomputed exactly as in the forward kernel, so each row's probabilities sum to one (less
                # the sink's share, which is in the LSE).
                s = tl.dot(q.to(KEYS.dtype.element_ty), tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
                if SOFTCAP > 0:
                    s = soft_cap(s, SOFTCAP)
                tile += tl.exp2(tl.where(vis, s - lse[:, None], NEG))
            if PEAK:
                col = tl.maximum(col, tl.max(tile, 0))
            else:
                col += tl.sum(tile, 0)
    tl.store(MASS + pid_bh * n_total + offs_n, col, mask=n_mask)


def prefill_attend(q, keys, values, key_pos, positions, valid, *, scale: float, cache_len: int, window: int = 0,
                   softcap: float = 0.0, sink_logits=None, query_weight=None, peak: bool = False):
    """Attention of a block over (cache + block) and the probability mass every key received.

    Args:
        q: [B, Hq, T, D]; keys: [B, Hkv, C+T, D]; values: [B, Hkv, C+T, Dv] (the C slots, then the block).
        key_pos: [B, Hkv, C+T] int64, -1 = nothing there (empty slot or padding token).
        positions: [B, T] int64 query positions; valid: [B, T] bool or None. cache_len: C.
        window (0 = none), softcap (0 = none), sink_logits [Hq] or None: the layer's attention kind.
        query_weight: [B, T] fp32 or None, what each query's probabilities count in the mass
            (kernels/rules.py); None = 1 for every valid query.
        peak: the mass is the maximum over the queries, not the sum (``score="max"``).
    Returns:
        out [B, Hq, T, Dv] in q's dtype (zeros for invalid queries) and mass [B, Hkv, C+T] fp32 = sum (peak:
        max) over valid queries of each key's weighted probability summed over the group's query heads
        (``reference.attend``).
    """
    from torch.library import wrap_triton

    b, hq, t, d = q.shape
    hkv, n_total = keys.shape[1], keys.shape[2]
    dv = values.shape[3]
    group = hq // hkv
    # One config (no autotune): 16 keeps the interpreter fast; fp32 tiles are halved to bound shared memory.
    block = 16 if is_interpreted() else (32 if keys.dtype == torch.float32 else 64)
    out = torch.empty(b, hq, t, dv, device=q.device, dtype=q.dtype)
    lse = torch.empty(b * hq, t, device=q.device, dtype=torch.float32)               # base 2
    mass = torch.empty(b, hkv, n_total, device=q.device, dtype=torch.float32)
    has_valid = valid is not None
    valid_t = valid if has_valid else positions  # never read when has_valid is False
    has_sinks = sink_logits is not None
    sinks_t = sink_logits if has_sinks else q  # never read when has_sinks is False
    # 8 warps for wide heads, as flash attention does: 4 would need ~250 registers per thread at D = 128.
    common = dict(G=group, D=d, BLOCK_M=block, BLOCK_N=block, BLOCK_D=triton.next_power_of_2(d),
                  HAS_VALID=has_valid, DOT_PRECISION=dot_precision(keys.dtype), WINDOW=window,
                  SOFTCAP=softcap * LOG2E if softcap > 0 else 0.0,
                  num_warps=8 if d >= 128 else 4)
    qk_scale = scale * LOG2E
    wrap_triton(_prefill_fwd_kernel)[(triton.cdiv(t, block), b * hq)](
        q, keys, values, key_pos, positions, valid_t, sinks_t, out, lse,
        *q.stride(), *keys.stride(), *values.stride(), *key_pos.stride(),
        *positions.stride(), *valid_t.stride(), sinks_t.stride(0), *out.stride(),
        cache_len, t, qk_scale,
        HQ=hq, DV=dv, BLOCK_DV=triton.next_power_of_2(dv), HAS_SINKS=has_sinks, **common,
    )
    if query_weight is not None:
        # w x exp2(s - lse) = exp2(s - (lse - log2 w)): the weights fold into the LSE the mass kernel reads,
        # and a weight of 0 becomes an LSE of +inf, whose probabilities are exactly 0.
        lse = (lse.view(b, hq, t) - torch.log2(query_weight.float())[:, None, :]).view(b * hq, t)
    wrap_triton(_prefill_mass_kernel)[(triton.cdiv(n_total, block), b * hkv)](
        q, keys, key_pos, positions, valid_t, lse, mass,
        *q.stride(), *keys.stride(), *key_pos.stride(),
        *positions.stride(), *valid_t.stride(),
        cache_len, t, qk_scale,
        HKV=hkv, PEAK=peak, **common,
    )
    return out, mass
