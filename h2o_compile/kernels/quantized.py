"""Quantized kept entries (``kv_dtype="int8"``): symmetric absmax int8, one fp32 scale per vector.

docs/design.md section 2, "Quantized entries": when an entry is written to the cache, each key vector and each value
vector (one position, one KV head) becomes q = clamp(round(x / s), -127, 127) with s = max|x| / 127 (s = 1 for a
zero vector), stored as int8 plus its scale; attention reads s * q. A block's own new tokens are used unquantized
by the block's queries and stored quantized. Scores, positions and eviction do not change.

A quantized layer state carries two more tensors than kernels/reference.py's four:

    key_cache   [B, Hkv, C, D]  int8       key_scale   [B, Hkv, C]  fp32 (1 in an empty slot)
    value_cache [B, Hkv, C, Dv] int8       value_scale [B, Hkv, C]  fp32

Why one scale per vector and not per channel: a vector is what a slot holds and what eviction moves, so its
scale travels with it through the same gathers and writes as its position; per-channel scales would need
re-quantizing every kept entry whenever the set of kept entries changes.
"""

from __future__ import annotations

import torch
from torch import Tensor

KV_DTYPES = ("model", "int8")
QMAX = 127.0
EMPTY_SCALE = 1.0  # the scale of a zero vector, and of an empty slot


def quantize(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [..., D] (any float dtype) -> (q [..., D] int8, scale [...] fp32), the rule above, computed in fp32."""
    x = x.float()
    scale = x.abs().amax(dim=-1) / QMAX
    scale = torch.where(scale > 0, scale, torch.full_like(scale, EMPTY_SCALE))
    q = torch.clamp(torch.round(x / scale[..., None]), -QMAX, QMAX).to(torch.int8)
    return q, scale


def dequantize(q: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """q [..., D] int8, scale [...] fp32 -> s * q [..., D] in ``dtype`` (product in fp32)."""
    return (q.float() * scale[..., None]).to(dtype)


def check_kv_dtype(kv_dtype: str) -> str:
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype={kv_dtype!r}; allowed: {', '.join(map(repr, KV_DTYPES))}")
    return kv_dtype
