"""The Triton kernels as ``torch.library.triton_op``s, and the Triton backend of ``torch.ops.h2o.attention_``.

``triton_op`` (not ``custom_op``) so that Inductor sees the kernels (``wrap_triton``) and keeps them inside a
compiled graph, and CUDA graphs capture them with the rest of the decode step:

- ``torch.ops.h2o.triton_decode_attend``: one new token per row against the cache: output and per-key mass
  (kernels/triton_decode.py); scores, eviction and the slot write are then ``reference_decode.evict_and_write_``.
- ``torch.ops.h2o.triton_prefill``: attention of a block over (cache + block) and the per-key mass
  (kernels/triton_prefill.py); eviction down to C is then ``reference.compress`` in torch ops.

Both take the layer's attention kind last, as the h2o ops do: ``window`` (sliding window, 0 = none),
``softcap`` (0 = none) and ``sink_logits`` ([Hq] or None); see reference.py's module docstring.

On CPU tensors the kernels run only under ``TRITON_INTERPRET=1`` (set before this module is imported), which
is how the tests check them against the reference without a GPU.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor
from torch.library import triton_op

from . import reference
from . import reference_decode
from .rolling import RopeTables
from .triton_decode import decode_attend
from .triton_prefill import prefill_attend


@triton_op("h2o::triton_decode_attend", mutates_args=())
def triton_decode_attend(q: Tensor, k: Tensor, v: Tensor, positions: Tensor, valid: Optional[Tensor],
                         key_cache: Tensor, value_cache: Tensor, pos_cache: Tensor, scale: float, split_size: int = 0,
                         window: int = 0, softcap: float = 0.0, sink_logits: Optional[Tensor] = None,
                         key_scale: Optional[Tensor] = None, value_scale: Optional[Tensor] = None
                         ) -> tuple[Tensor, Tensor, Tensor]:
    """(out [B, Hq, 1, Dv], mass over the cache [B, Hkv, C], mass on the new key [B, Hkv, 1]); shapes as
    ``triton_decode.decode_attend``. split_size 0 = chosen from the shapes; the scales with int8 caches."""
    return decode_attend(q, k, v, positions, valid, key_cache, value_cache, pos_cache, scale=scale,
                         split_size=split_size, window=window, softcap=softcap, sink_logits=sink_logits,
                         key_scale=key_scale, value_scale=value_scale)


@triton_op("h2o::triton_prefill", mutates_args=())
def triton_prefill(q: Tensor, keys: Tensor, values: Tensor, key_pos: Tensor, positions: Tensor,
                   valid: Optional[Tensor], scale: float, cache_len: int, window: int = 0, softcap: float = 0.0,
                   sink_logits: Optional[Tensor] = None, query_weight: Optional[Tensor] = None, peak: bool = False
                   ) -> tuple[Tensor, Tensor]:
    """(out [B, Hq, T, Dv], mass [B, Hkv, C+T] fp32); shapes as ``triton_prefill.prefill_attend``."""
    return prefill_attend(q, keys, values, key_pos, positions, valid, scale=scale, cache_len=cache_len,
                          window=window, softcap=softcap, sink_logits=sink_logits, query_weight=query_weight,
                          peak=peak)


def h2o_attention_(q: Tensor, k: Tensor, v: Tensor, positions: Tensor, valid: Optional[Tensor],
                   state: reference.H2OState, *, scale: float, recent: int, sinks: int, policy: str,
                   seed: int = 0, window: int = 0, softcap: float = 0.0, sink_logits: Optional[Tensor] = None,
                   rope: Optional[RopeTables] = None, query_from: Optional[Tensor] = None,
                   split_size: int = 0) -> Tensor:
    """In-place H2O attention with the Triton kernels; the contract of ``reference_decode.h2o_attention_``.

    ``reference_decode.h2o_attention_`` with the Triton kernels as its attention: they compute the attention and each
    key's mass; the scores, the eviction and the writes are the reference's torch code (``evict_and_write_``
    for a decode step, ``block_scores`` + ``compress`` for a block), so every rule is written once
    (kernels/rules.py). A quantized state's int8 entries are read by the decode kernel directly.

    Args:
        q: [B, Hq, T, D]; k: [B, Hkv, T, D]; v: [B, Hkv, T, Dv]; positions: [B, T] int64;
        valid: [B, T] bool or None; state: the layer's cache (C slots), updated in place.
        policy: the eviction rule (kernels/rules.py); query_from: [B] int64 or None (the prompt block only).
        window, softcap, sink_logits [Hq] or None: the layer's attention kind (reference.py).
        rope: rotary tables for rolling positions (kernels/rolling.py), None = true positions. The kernels
            read rotated copies of q, k and the cached keys; the cache keeps the unrotated keys.
        split_size: decode only, slots per split-K program (0 = chosen from the shapes); tests force it.
    Returns:
        out [B, Hq, T, Dv] in q's dtype.
    """
    decode = functools.partial(_triton_decode_attend, split_size=split_size)
    return reference_decode.h2o_attention_(q, k, v, positions, valid, state, scale=scale, recent=recent, sinks=sinks,
                                    policy=policy, seed=seed, window=window, softcap=softcap,
                                    sink_logits=sink_logits, rope=rope, query_from=query_from,
                                    attend_fn=_triton_attend_block, attend_decode_fn=decode)


def _triton_decode_attend(q, k, v, valid, state, scale, new_pos, *, window, softcap, sink_logits, split_size=0):
    """reference_decode.attend_decode's contract with the Triton decode kernel; the kernel takes the new token's
    position per row [B, 1] (-1 on a padding row, whose output and mass it zeroes without reading it)."""
    return torch.ops.h2o.triton_decode_attend(q, k, v, new_pos[:, 0, :], valid, state.key_cache, state.value_cache,
                                              state.pos_cache, scale, split_size, window, softcap, sink_logits,
                                              state.key_scale, state.value_scale)


def _triton_attend_block(q, keys, values, key_pos, positions, valid, scale, *, new_from, window, softcap,
                         sink_logits, query_weight, need_mass, peak=False):
    """reference.attend's contract (plus need_mass) with the Triton prefill kernel, which always returns the mass."""
    return torch.ops.h2o.triton_prefill(q, keys, values, key_pos, positions, valid, scale, new_from, window,
                                        softcap, sink_logits, query_weight, peak)
