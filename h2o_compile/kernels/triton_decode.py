"""Triton decode step (T = 1) of H2O attention: split-K attention and the per-key probability mass.

The attention half of ``reference_decode.h2o_decode_`` (``reference_decode.attend_decode``: output and mass),
in two launches; the scores, the eviction choice and the slot write are ``reference_decode.evict_and_write_``,
the torch code every backend shares (kernels/rules.py), which Inductor fuses into the compiled decode step:

1. ``_decode_partial_kernel``, grid (splits, B * Hkv): the G query heads of a KV group against one split of
   the C cached slots (flash-decoding). Writes the split's running max / sum of exponentials / unnormalised
   output, and every slot's logit to a small fp32 scratch (G x C floats is far cheaper to re-read than the
   keys, which are D x 2 bytes per slot per head).
2. ``_decode_finish_kernel``, grid (B * Hkv,): merges the splits and the new token (a one-key split) into the
   global log-sum-exp and the output, turns the stored logits into probabilities with that global LSE and
   writes their sum over the group (the mass of every slot, and of the new key). No host sync, so a CUDA graph
   can capture both.

Logits are kept in base 2 (scale folded with log2(e)) so the kernels use exp2.

The layer's attention kind (reference.py's module docstring) is compiled in: ``WINDOW`` (sliding window, 0 =
off) hides the slots at or before t - W; ``SOFTCAP`` (the cap in base-2
units, c x log2 e; 0 = off) caps every logit; ``HAS_SINKS`` adds the query head's sink logit to the softmax
denominator, once, in the merge of the finish kernel (a per-split sink would be counted once per split).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

LOG2E = 1.0 / math.log(2.0)
# A finite "minus infinity" for masked logits: max/exp2 over it never produces NaN, even for a row that
# sees nothing (a padding token), which then ends with sum 0 and is zeroed explicitly.
NEG = tl.constexpr(-1.0e30)
LOG2E_K = tl.constexpr(LOG2E)  # the same constant, readable inside kernels


def is_interpreted() -> bool:
    """True when the kernels were built by Triton's interpreter (TRITON_INTERPRET=1 at import): they run on
    CPU tensors with numpy, so the wrappers pick small blocks."""
    return not isinstance(_decode_partial_kernel, triton.runtime.JITFunction)


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get IEEE dots: TF32 would put the kernels 1e-3 away from the fp32 reference."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _row_token(pid_bh, POSITIONS, VALID, stride_posb, stride_validb, HKV: tl.constexpr, HAS_VALID: tl.constexpr):
    """The program's batch row b (int64), KV head h, and the new token's position and validity flag."""
    b = (pid_bh // HKV).to(tl.int64)  # 64-bit offsets: B x Hkv x C x D passes 2^31 at long contexts
    h = pid_bh % HKV
    qpos = tl.load(POSITIONS + b * stride_posb)
    qvalid = qpos == qpos  # noqa: PLR0124  (an all-true flag with the type of a loaded one)
    if HAS_VALID:
        qvalid = tl.load(VALID + b * stride_validb) != 0
    return b, h, qpos, qvalid


@triton.jit
def _group_offsets(G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Offsets over the query heads of a KV group, the key dims and the value dims, and the group's row mask."""
    offs_g = tl.arange(0, BLOCK_G)
    return offs_g, tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV), offs_g < G


@triton.jit
def soft_cap(s, SOFTCAP: tl.constexpr):
    """Gemma 2's c * tanh(x / c) on base-2 logits: with SOFTCAP = c * log2(e) the cap commutes with the change
    of base. tanh is built from exp2(-2|x|), which cannot overflow (the interpreter has no libdevice)."""
    # Tensor first in every product: constexpr * tensor would wrap the tensor in a constexpr.
    e = tl.exp2(tl.abs(s) * (-2.0 * LOG2E_K / SOFTCAP))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(s < 0, -t, t) * SOFTCAP


@triton.jit
def _visible_slots(kpos, qpos, qvalid, n_mask, WINDOW: tl.constexpr):
    """As reference_decode.attend_decode: every filled slot is visible (it is older than the new token), except, on a
    sliding layer, those at or before qpos - W."""
    # (scalar-bool & vector-bool is mis-typed by the interpreter, so the row flag goes through where)
    vis = tl.where(qvalid, (kpos >= 0) & n_mask, False)
    if WINDOW > 0:
        vis = vis & (kpos > qpos - WINDOW)
    return vis


@triton.jit
def _decode_partial_kernel(
    Q, K_CACHE, V_CACHE, POS_CACHE, POSITIONS, VALID, K_SCALE, V_SCALE,
    LOGITS, PART_M, PART_L, PART_ACC,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_kc, stride_kd,
    stride_vb, stride_vh, stride_vc, stride_vd,
    stride_pb, stride_ph, stride_pc,
    stride_posb, stride_validb,
    C, NUM_SPLITS, split_n, qk_scale,
    HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_VALID: tl.constexpr, DOT_PRECISION: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    QUANT_K: tl.constexpr, QUANT_V: tl.constexpr,
):
    tl.static_assert(BLOCK_G >= 16, "tl.dot needs at least 16 rows; pad the query group")
    tl.static_assert(BLOCK_N >= 16)
    pid_s = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b, h, qpos, qvalid = _row_token(pid_bh, POSITIONS, VALID, stride_posb, stride_validb, HKV, HAS_VALID)
    offs_g, offs_d, offs_dv, g_mask = _group_offsets(G, BLOCK_G, BLOCK_D, BLOCK_DV)
    q = tl.load(Q + b * stride_qb + (h * G + offs_g)[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=g_mask[:, None] & (offs_d[None, :] < D), other=0.0)
    if not QUANT_K:  # int8 entries are converted to q's dtype instead (exact: |q| <= 127)
        q = q.to(K_CACHE.dtype.element_ty)

    m_i = tl.full([BLOCK_G], NEG, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    k_base = K_CACHE + b * stride_kb + h * stride_kh
    v_base = V_CACHE + b * stride_vb + h * stride_vh
    row = (pid_bh * G + offs_g).to(tl.int64) * C  # LOGITS is [B * Hkv * G, C], contiguous
    # split_n is a multiple of BLOCK_N (the wrapper asserts it), so no block straddles two splits. It is a
    # runtime argument: a constexpr would compile one kernel per cache size.
    start = pid_s * split_n
    end = tl.minimum(start + split_n, C)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < C
        kpos = tl.load(POS_CACHE + b * stride_pb + h * stride_ph + offs_n * stride_pc, mask=n_mask, other=-1)
        k = tl.load(k_base + offs_n[:, None] * stride_kc + offs_d[None, :] * stride_kd,
                    mask=n_mask[:, None] & (offs_d[None, :] < D), other=0)
        if QUANT_K:  # q . (s k) = s (q . k): one scale per slot, shared layout with POS_CACHE
            k_scale = tl.load(K_SCALE + b * stride_pb + h * stride_ph + offs_n * stride_pc, mask=n_mask, other=1.0)
            s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * k_scale[None, :] * qk_scale
        else:
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale    # [BLOCK_G, BLOCK_N]
        if SOFTCAP > 0:
            s = soft_cap(s, SOFTCAP)
        vis = _visible_slots(kpos, qpos, qvalid, n_mask, WINDOW)
        s = tl.where(vis[None, :], s, NEG)
        tl.store(LOGITS + row[:, None] + offs_n[None, :], s, mask=g_mask[:, None] & n_mask[None, :])
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.where(vis[None, :], tl.exp2(s - m_new[:, None]), 0.0)
        v = tl.load(v_base + offs_n[:, None] * stride_vc + offs_dv[None, :] * stride_vd,
                    mask=n_mask[:, None] & (offs_dv[None, :] < DV), other=0)
        l_i = l_i * alpha + tl.sum(p, 1)
        if QUANT_V:  # sum_n p_n (s_n v_n): the scale weights the probability
            v_scale = tl.load(V_SCALE + b * stride_pb + h * stride_ph + offs_n * stride_pc, mask=n_mask, other=1.0)
            pv = tl.dot((p * v_scale[None, :]).to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
        else:
            pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    part = (pid_bh * NUM_SPLITS + pid_s) * G + offs_g  # PART_* are [B*Hkv, S, G(, DV)]
    tl.store(PART_M + part, m_i, mask=g_mask)
    tl.store(PART_L + part, l_i, mask=g_mask)
    tl.store(PART_ACC + part[:, None] * DV + offs_dv[None, :], acc,
             mask=g_mask[:, None] & (offs_dv[None, :] < DV))


@triton.jit
def _decode_finish_kernel(
    Q, K_NEW, V_NEW, POSITIONS, VALID, SINK_LOGITS,
    LOGITS, PART_M, PART_L, PART_ACC, OUT, MASS, MASS_NEW,
    K_CACHE, V_CACHE, POS_CACHE,
    stride_qb, stride_qh, stride_qd,
    stride_knb, stride_knh, stride_knd,
    stride_vnb, stride_vnh, stride_vnd,
    stride_ob, stride_oh, stride_od,
    stride_pb, stride_ph, stride_pc,
    stride_posb, stride_validb, stride_sink,
    C, NUM_SPLITS, qk_scale,
    HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_VALID: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
    QUANT_K: tl.constexpr, QUANT_V: tl.constexpr,
):
    tl.static_assert(BLOCK_G >= G)
    tl.static_assert(BLOCK_N >= 16)
    pid_bh = tl.program_id(0)
    b, h, qpos, qvalid = _row_token(pid_bh, POSITIONS, VALID, stride_posb, stride_validb, HKV, HAS_VALID)
    offs_g, offs_d, offs_dv, g_mask = _group_offsets(G, BLOCK_G, BLOCK_D, BLOCK_DV)
    d_mask = offs_d < D
    dv_mask = offs_dv < DV

    # The new token is a split of one key: its logit seeds the merge of the partial results.
    q = tl.load(Q + b * stride_qb + (h * G + offs_g)[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    k_new = tl.load(K_NEW + b * stride_knb + h * stride_knh + offs_d * stride_knd, mask=d_mask, other=0.0)
    v_new = tl.load(V_NEW + b * stride_vnb + h * stride_vnh + offs_dv * stride_vnd, mask=dv_mask, other=0.0)
    # Round the new token to the cache dtype first: the reference attends over the cached copy of it. An int8
    # cache stores it later; the block attends to it unquantized (and q stays as the partial kernel saw it).
    if not QUANT_K:
        k_new = k_new.to(K_CACHE.dtype.element_ty)
        q = q.to(K_CACHE.dtype.element_ty)
    if not QUANT_V:
        v_new = v_new.to(V_CACHE.dtype.element_ty)
    q = q.to(tl.float32)
    s_new = tl.sum(q * k_new.to(tl.float32)[None, :], 1) * qk_scale
    if SOFTCAP > 0:
        s_new = soft_cap(s_new, SOFTCAP)
    vis_new = qvalid  # a token always sees itself (t - t = 0 < W)
    m_i = tl.where(vis_new, s_new, NEG)
    l_i = tl.where(vis_new, 1.0, 0.0) + tl.zeros([BLOCK_G], tl.float32)
    acc = tl.where(vis_new, v_new.to(tl.float32)[None, :], 0.0) + tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    for split in range(NUM_SPLITS):
        part = (pid_bh * NUM_SPLITS + split) * G + offs_g
        m_s = tl.load(PART_M + part, mask=g_mask, other=NEG)
        l_s = tl.load(PART_L + part, mask=g_mask, other=0.0)
        a_s = tl.load(PART_ACC + part[:, None] * DV + offs_dv[None, :],
                      mask=g_mask[:, None] & dv_mask[None, :], other=0.0)
        m_new = tl.maximum(m_i, m_s)
        alpha = tl.exp2(m_i - m_new)
        beta = tl.exp2(m_s - m_new)
        l_i = l_i * alpha + l_s * beta
        acc = acc * alpha[:, None] + a_s * beta[:, None]
        m_i = m_new
    if HAS_SINKS:
        # One more logit in the denominator and nothing in the numerator: the sink's share goes to no value
        # and no score. A padding row (m_i = NEG) ends with l = 1, acc = 0: still a zero output.
        sink = tl.load(SINK_LOGITS + (h * G + offs_g) * stride_sink, mask=g_mask, other=0.0)
        sink = sink.to(tl.float32) * LOG2E_K
        m_new = tl.maximum(m_i, sink)
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.exp2(sink - m_new)
        acc = acc * alpha[:, None]
        m_i = m_new
    seen = l_i > 0
    out = tl.where(seen[:, None], acc / tl.where(seen, l_i, 1.0)[:, None], 0.0)
    tl.store(OUT + b * stride_ob + (h * G + offs_g)[:, None] * stride_oh + offs_dv[None, :] * stride_od,
             out.to(OUT.dtype.element_ty), mask=g_mask[:, None] & dv_mask[None, :])
    lse = m_i + tl.log2(tl.where(seen, l_i, 1.0))                                  # [BLOCK_G], base 2
    # A padding row has lse = NEG: mask before exp2 so nothing overflows.
    mass_new = tl.sum(tl.exp2(tl.where(tl.where(vis_new, g_mask, False), s_new - lse, NEG)), 0)
    tl.store(MASS_NEW + pid_bh, mass_new)

    # The mass of every cached slot: the stored logits against the global LSE, summed over the group.
    row = (pid_bh * G + offs_g).to(tl.int64) * C
    for n0 in range(0, C, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < C
        pos = tl.load(POS_CACHE + b * stride_pb + h * stride_ph + offs_n * stride_pc, mask=n_mask, other=-1)
        lg = tl.load(LOGITS + row[:, None] + offs_n[None, :], mask=g_mask[:, None] & n_mask[None, :],
                     other=NEG)
        vis = _visible_slots(pos, qpos, qvalid, n_mask, WINDOW)
        p = tl.where(vis[None, :] & g_mask[:, None], tl.exp2(lg - lse[:, None]), 0.0)
        tl.store(MASS + pid_bh.to(tl.int64) * C + offs_n, tl.sum(p, 0), mask=n_mask)


def decode_config(cap: int, batch_heads: int, dtype: torch.dtype, device: torch.device,
                  split_size: int = 0) -> dict:
    """Block sizes and split size for one decode call; a function of shapes only, so CUDA graphs can capture.

    One config under the interpreter (small blocks keep it fast); no autotuning on GPU either: decode is
    memory-bound and the split count, not the tile, decides how many SMs stream the cache.
    """
    if is_interpreted():
        block_n, finish_n = 16, 16
    else:
        # fp32 tiles are twice as large; 32 keeps shared memory well under 100 KB on any recent GPU. The
        # finish kernel runs one program per (row, KV head) over all C slots: wide blocks, few iterations.
        block_n = 32 if dtype == torch.float32 else 64
        finish_n = min(1024, max(64, triton.next_power_of_2(cap)))
    if split_size > 0:
        split = triton.cdiv(split_size, block_n) * block_n
    elif device.type == "cuda":
        # About two programs per SM, each streaming at least two blocks (one split costs one merge step).
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        want = max(1, triton.cdiv(2 * sms, batch_heads))
        split = max(2 * block_n, triton.cdiv(triton.cdiv(cap, want), block_n) * block_n)
    else:
        split = triton.cdiv(cap, block_n) * block_n
    return dict(BLOCK_N=block_n, FINISH_BLOCK_N=finish_n, SPLIT_N=split, num_splits=triton.cdiv(cap, split))


def decode_attend(q, k, v, positions, valid, key_cache, value_cache, pos_cache, *, scale: float,
                  split_size: int = 0, window: int = 0, softcap: float = 0.0, sink_logits=None,
                  key_scale=None, value_scale=None):
    """The attention of one new token per row, and the mass every key received: ``reference_decode.attend_decode``.

    Args:
        q: [B, Hq, 1, D]; k: [B, Hkv, 1, D]; v: [B, Hkv, 1, Dv] (fp32 / fp16 / bf16).
        positions: [B, 1] int64; valid: [B, 1] bool or None (False: zero output and zero mass).
        key_cache: [B, Hkv, C, D]; value_cache: [B, Hkv, C, Dv]; pos_cache: [B, Hkv, C] int64 (read only).
        key_scale, value_scale: [B, Hkv, C] fp32 with an int8 key / value cache (kernels/quantized.py: each
            slot's vector is scale * q), laid out like pos_cache; None for a cache in a float dtype (rolling
            positions hand the kernel dequantized, rotated keys with int8 values).
        split_size: slots per split, 0 = chosen from the shapes.
        window (0 = none), softcap (0 = none), sink_logits [Hq] or None: the layer's attention kind.
    Returns:
        out [B, Hq, 1, Dv] in q's dtype, mass over the cache [B, Hkv, C] and on the new key [B, Hkv, 1] (fp32).
    """
    from torch.library import wrap_triton

    b, hq, _, d = q.shape
    hkv, cap = key_cache.shape[1], key_cache.shape[2]
    dv = value_cache.shape[3]
    group = hq // hkv
    for name, scales in (("key_scale", key_scale), ("value_scale", value_scale)):
        if scales is not None and scales.stride() != pos_cache.stride():
            raise ValueError(f"{name} strides {scales.stride()} must equal pos_cache's {pos_cache.stride()}: the "
                             "kernel reads them at the same offsets")
    compute_dtype = q.dtype if key_scale is not None else key_cache.dtype  # int8 keys are converted to q's dtype
    cfg = decode_config(cap, b * hkv, compute_dtype, q.device, split_size)
    splits = cfg["num_splits"]
    assert cfg["SPLIT_N"] % cfg["BLOCK_N"] == 0
    f32 = dict(device=q.device, dtype=torch.float32)
    logits = torch.empty(b * hkv * group, cap, **f32)                              # [B*Hkv*G, C], base-2
    part_m = torch.empty(b * hkv, splits, group, **f32)
    part_l = torch.empty(b * hkv, splits, group, **f32)
    part_acc = torch.empty(b * hkv, splits, group, dv, **f32)
    out = torch.empty(b, hq, 1, dv, device=q.device, dtype=q.dtype)
    mass = torch.empty(b, hkv, cap, **f32)
    mass_new = torch.empty(b, hkv, 1, **f32)
    has_valid = valid is not None
    valid_t = valid if has_valid else positions  # never read when has_valid is False
    has_sinks = sink_logits is not None
    sinks_t = sink_logits if has_sinks else q  # never read when has_sinks is False
    qk_scale = scale * LOG2E
    blocks = dict(HKV=hkv, G=group, D=d, DV=dv, BLOCK_D=triton.next_power_of_2(d),
                  BLOCK_DV=triton.next_power_of_2(dv), HAS_VALID=has_valid, WINDOW=window,
                  SOFTCAP=softcap * LOG2E if softcap > 0 else 0.0, QUANT_K=key_scale is not None,
                  QUANT_V=value_scale is not None)
    scales = [pos_cache if x is None else x for x in (key_scale, value_scale)]  # pos_cache: never read
    wrap_triton(_decode_partial_kernel)[(splits, b * hkv)](
        q, key_cache, value_cache, pos_cache, positions, valid_t, *scales,
        logits, part_m, part_l, part_acc,
        q.stride(0), q.stride(1), q.stride(3),
        *key_cache.stride(), *value_cache.stride(), *pos_cache.stride(),
        positions.stride(0), valid_t.stride(0),
        cap, splits, cfg["SPLIT_N"], qk_scale,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=cfg["BLOCK_N"],
        DOT_PRECISION=dot_precision(compute_dtype), num_warps=4, **blocks,
    )
    wrap_triton(_decode_finish_kernel)[(b * hkv,)](
        q, k, v, positions, valid_t, sinks_t,
        logits, part_m, part_l, part_acc, out, mass, mass_new,
        key_cache, value_cache, pos_cache,
        q.stride(0), q.stride(1), q.stride(3),
        k.stride(0), k.stride(1), k.stride(3),
        v.stride(0), v.stride(1), v.stride(3),
        out.stride(0), out.stride(1), out.stride(3),
        *pos_cache.stride(),
        positions.stride(0), valid_t.stride(0), sinks_t.stride(0),
        cap, splits, qk_scale,
        BLOCK_G=triton.next_power_of_2(group), BLOCK_N=cfg["FINISH_BLOCK_N"], HAS_SINKS=has_sinks,
        num_warps=8 if cfg["FINISH_BLOCK_N"] >= 512 else 4, **blocks,
    )
    return out, mass, mass_new
