"""The attention of a block on CPU through torch's fused flash attention, and each key's mass from its log-sum-exp.

Same contract as ``reference.attend`` (the executable spec; tests/kernels/test_cpu_prefill.py compares the two
on every attention kind), computed differently:

1. ``aten._scaled_dot_product_flash_attention_for_cpu`` gives the output and the log-sum-exp of every query,
   without materialising probabilities. Each KV head is a batch entry with one key head, so its G query
   heads read the same keys (GQA without repeating K/V) and the visibility mask, which differs between KV
   heads once they evicted different keys, is a [tc, s] bias broadcast over the group.
2. Only when the eviction rule reads scores (``need_mass``): a second pass over the same query chunks,
   mass[p] = sum_t w_t sum_g exp(q_t . k_p x scale - lse_t), in fp32 and never more than one chunk of logits.

Learned sink logits fold into the log-sum-exp: lse' = logaddexp(lse, s), and out' = out x exp(lse - lse'),
because the sink only adds to the denominator. Soft-capping has no fused form: ``supports`` declines it and
the caller keeps ``reference.attend`` for that layer (a constant of the layer, so the choice is per layer).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

_LOGITS_PER_CHUNK = 1 << 22  # fp32 logits (and bias entries) held at once: 16 MiB, as reference.attend


def supports(q: Tensor, softcap: float) -> bool:
    """Whether this path computes the layer's attention: CPU tensors, no soft-capping, a float dtype the fused
    kernel takes."""
    return q.device.type == "cpu" and softcap <= 0 and q.dtype in (torch.float32, torch.bfloat16, torch.float16)


def attend_sdpa(q: Tensor, keys: Tensor, values: Tensor, key_pos: Tensor, query_pos: Tensor, query_valid: Tensor,
                scale: float, new_from: Optional[int] = None, *, window: int = 0,
                sink_logits: Optional[Tensor] = None, query_weight: Optional[Tensor] = None,
                need_mass: bool = True) -> tuple[Tensor, Tensor]:
    """``reference.attend`` (softcap 0) with the fused kernel.

    Args:
        q: [B, Hq, T, D]; keys: [B, Hkv, S, D]; values: [B, Hkv, S, Dv]
        key_pos: [B, Hkv, S] int64 (-1 = nothing there); query_pos: [B, T]; query_valid: [B, T] bool.
        new_from: index where the block's own keys start (C): a chunk ending at block index t1 reads C + t1 keys.
        window, sink_logits [Hq]: the layer's attention kind. query_weight: [B, T] fp32 or None (rules.py).
        need_mass: False skips the second pass and returns zero mass (a rule that reads no scores).
    Returns:
        out [B, Hq, T, Dv] in q's dtype (zeros for invalid queries) and mass [B, Hkv, S] fp32.
    """
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
    sink = None if sink_logits is None else sink_logits.float().view(1, hkv, group, 1).expand(b, -1, -1, -1)
    sink = None if sink is None else sink.reshape(b * hkv, group, 1)
    weight = None if query_weight is None else query_weight.float()[:, None, :].expand(b, hkv, t).reshape(
        b * hkv, 1, t)
    mass = torch.zeros(b * hkv, s_all, dtype=torch.float32)
    out = torch.empty(b * hkv, group, t, dv, dtype=dtype)
    chunk = max(1, _LOGITS_PER_CHUNK // (b * hq * s_all))
    for t0 in range(0, t, chunk):
        t1 = min(t, t0 + chunk)
        s = s_all if new_from is None else min(s_all, new_from + t1)
        kpos, qpos = kpos_all[..., :s], qpos_all[:, :, t0:t1]
        visible = (kpos >= 0) & (kpos <= qpos) & valid_all[:, :, t0:t1]             # [B*Hkv, 1, tc, s]
        if window > 0:
            visible = visible & (kpos > qpos - window)
        bias = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, float("-inf"))
        q_chunk = qf[:, :, t0:t1]
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q_chunk, kf[:, :, :s], vf[:, :, :s], 0.0, False, attn_mask=bias, scale=scale)
        seen = visible.any(dim=-1)                                                  # [B*Hkv, 1, tc]
        lse = lse.float()                                                           # [B*Hkv, G, tc]
        if sink is not None:
            with_sink = torch.logaddexp(lse, sink)
            o = o * torch.exp(lse - with_sink).to(dtype)[..., None]
            lse = with_sink
        # A query that sees nothing (padding) has no defined output: zero, as the reference.
        out[:, :, t0:t1] = torch.where(seen[..., None], o, torch.zeros((), dtype=dtype))
        if need_mass:
            logits = torch.matmul(q_chunk.float(), kf[:, :, :s].float().transpose(2, 3)).mul_(scale)
            probs = torch.exp(logits - torch.where(seen, lse, 0.0)[..., None]).masked_fill_(~visible, 0.0)
            per_query = probs.sum(dim=1)                                            # [B*Hkv, tc, s]
            if weight is not None:
                per_query = per_query * weight[:, 0, t0:t1, None]
            mass[:, :s] += per_query.sum(dim=1)
    return out.reshape(b, hq, t, dv), mass.reshape(b, hkv, s_all)
