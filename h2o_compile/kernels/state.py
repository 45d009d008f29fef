"""One layer's H2O state: the cache tensors (reference.py's module docstring gives their shapes), plain or with
int8 entries and their scales, and what reads and writes them as a whole."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from .quantized import EMPTY_SCALE, dequantize, quantize


class H2OState(NamedTuple):
    """One layer's cache in the model's dtype; shapes in reference.py's module docstring."""

    key_cache: Tensor
    value_cache: Tensor
    score_cache: Tensor
    pos_cache: Tensor

    key_scale = property(lambda self: None)    # the interface of QuantizedState: no scales here
    value_scale = property(lambda self: None)
    quantized = False

    def tensors(self) -> tuple[Tensor, ...]:
        """The state's tensors in the order of the op's arguments."""
        return tuple(self)

    def clone(self) -> "H2OState":
        return H2OState(*(t.clone() for t in self))


class QuantizedState(NamedTuple):
    """One layer's cache with int8 entries and their fp32 scales (kernels/quantized.py). A scale of None marks
    a cache that attention reads already dequantized (rotated keys under rolling positions)."""

    key_cache: Tensor
    value_cache: Tensor
    score_cache: Tensor
    pos_cache: Tensor
    key_scale: Optional[Tensor]
    value_scale: Optional[Tensor]

    quantized = True

    def tensors(self) -> tuple[Tensor, ...]:
        return tuple(self)

    def clone(self) -> "QuantizedState":
        return QuantizedState(*(None if t is None else t.clone() for t in self))


def make_state(key_cache: Tensor, value_cache: Tensor, score_cache: Tensor, pos_cache: Tensor,
               key_scale: Optional[Tensor] = None, value_scale: Optional[Tensor] = None):
    """An H2OState, or a QuantizedState when a scale is given."""
    if key_scale is None and value_scale is None:
        return H2OState(key_cache, value_cache, score_cache, pos_cache)
    return QuantizedState(key_cache, value_cache, score_cache, pos_cache, key_scale, value_scale)


def empty_state(batch, kv_heads, capacity, head_dim, *, value_dim=None, dtype=torch.float32, device=None,
                quantized: bool = False):
    """An empty cache: zeros, scores 0, every position -1 (quantized: int8 zeros, scales 1)."""
    value_dim = head_dim if value_dim is None else value_dim
    shape = (batch, kv_heads, capacity)
    entry_dtype = torch.int8 if quantized else dtype
    scales = (torch.full(shape, EMPTY_SCALE, device=device), torch.full(shape, EMPTY_SCALE, device=device))
    return make_state(
        torch.zeros(*shape, head_dim, dtype=entry_dtype, device=device),
        torch.zeros(*shape, value_dim, dtype=entry_dtype, device=device),
        torch.zeros(shape, dtype=torch.float32, device=device),
        torch.full(shape, -1, dtype=torch.int64, device=device),
        *(scales if quantized else ()),
    )


def readable(state: H2OState, dtype: torch.dtype) -> H2OState:
    """The state as attention reads it: quantized keys and values dequantized to ``dtype`` (a copy; the block
    path only, the decode step dequantizes slot chunks inside ``reference_decode.attend_decode``)."""
    if not state.quantized:
        return state
    return H2OState(dequantize(state.key_cache, state.key_scale, dtype),
                    dequantize(state.value_cache, state.value_scale, dtype), state.score_cache, state.pos_cache)


def stored_entries(k: Tensor, v: Tensor, state: H2OState) -> tuple[Tensor, Tensor, Optional[Tensor], Optional[Tensor]]:
    """What the cache holds of new tokens k [B, Hkv, T, D], v [B, Hkv, T, Dv]: (keys, values, key scales,
    value scales) in the cache's dtype, the scales [B, Hkv, T] fp32 when quantized, else None."""
    if not state.quantized:
        return k.to(state.key_cache.dtype), v.to(state.value_cache.dtype), None, None
    (kq, ks), (vq, vs) = quantize(k), quantize(v)
    return kq, vq, ks, vs


def copy_state_(state: H2OState, new_state: H2OState) -> None:
    """Write ``new_state`` into ``state``'s buffers (the in-place ops' result)."""
    for buf, new in zip(state.tensors(), new_state.tensors()):
        buf.copy_(new)
