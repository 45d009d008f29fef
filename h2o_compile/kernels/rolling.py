"""Rolling positions: rotary embeddings applied at attention time by rank in the cache, not by text position.

With ``positions="rolling"`` (StreamingLLM's scheme, used by the paper's streaming runs) the cache holds keys
*before* RoPE. For each block, the entries a (row, KV head) holds are numbered 0..n-1 in the order of their
true positions, and the block's valid tokens continue at n, n+1, ...; queries and keys are rotated with these
numbers just before the attention. So every relative distance the model sees is below C + T, however long
the stream. Scores, eviction, the recent window and sliding windows still use true positions.

n counts the entries held (position >= 0) at the start of the block. It is the same for every KV head of a
row except on a compressed sliding-window layer, where heads may hold different numbers of keys; each
(row, KV head) then numbers its own entries and the queries of its group continue from its own n.

The rotary tables come from the model's own rotary embedding, evaluated by the graph at positions 0..S-1
(passes/rolling_positions.py), so every RoPE variant the model has (base, scaling, partial rotary, per-layer
bases) is kept. Shapes:

    cos, sin   [B', S, R] or [B', 1, S, R], B' in (1, B), S >= C + T, R <= D rotary dims (even)
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor


class RopeTables(NamedTuple):
    """cos and sin [B', S, R] of the model's rotary embedding at positions 0..S-1."""

    cos: Tensor
    sin: Tensor


def as_tables(cos: Optional[Tensor], sin: Optional[Tensor]) -> Optional[RopeTables]:
    """The op arguments as 3-D tables (the graph hands them on as the model shaped them), or None."""
    if cos is None and sin is None:
        return None
    if cos is None or sin is None or cos.shape != sin.shape or cos.dim() not in (3, 4) or cos.shape[-1] % 2:
        got = [None if t is None else tuple(t.shape) for t in (cos, sin)]
        raise ValueError(f"rope_cos and rope_sin must both be given, equal shapes [B', S, R] (R even); got {got}")
    return RopeTables(cos.reshape(cos.shape[0], -1, cos.shape[-1]), sin.reshape(sin.shape[0], -1, sin.shape[-1]))


def rolling_ranks(pos_cache: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
    """The rolling positions of a block's keys.

    Args:
        pos_cache: [B, Hkv, C] int64 true positions held at the start of the block, -1 = empty.
        valid: [B, T] bool, False for padding (which takes no position).
    Returns:
        cache_rank [B, Hkv, C] (rank among the held entries by true position; 0 for empty slots, which no
        query sees) and block_rank [B, Hkv, T] (n + index among the block's valid tokens), both int64.
    """
    held = pos_cache >= 0
    # Rank = number of held entries with a smaller position: sort once, then scatter each sorted index back.
    order = torch.argsort(pos_cache, dim=-1, stable=True)                       # empty slots (-1) first
    empty = (~held).sum(-1, keepdim=True)                                        # [B, Hkv, 1]
    sorted_rank = torch.arange(pos_cache.shape[-1], device=pos_cache.device).expand_as(pos_cache) - empty
    cache_rank = torch.zeros_like(pos_cache).scatter(-1, order, sorted_rank).clamp(min=0)
    n = pos_cache.shape[-1] - empty                                              # [B, Hkv, 1] entries held
    block_rank = n + (valid.long().cumsum(-1) - 1).clamp(min=0)[:, None, :]      # [B, Hkv, T]
    return cache_rank, block_rank


def rotate(x: Tensor, tables: RopeTables, rank: Tensor) -> Tensor:
    """x rotated as the model's ``x * cos + rotate_half(x) * sin`` on its first R dims, at positions ``rank``.

    Args:
        x: [B, H, T, D], H a multiple of Hkv (query heads of a KV group share their KV head's positions).
        rank: [B, Hkv, T] int64 rolling positions (< S).
    Returns:
        [B, H, T, D] in x's dtype (the rotation runs in the tables' dtype, as the model's own does).
    """
    b, h, t, d = x.shape
    hkv = rank.shape[1]
    width = tables.cos.shape[-1]
    index = rank.reshape(b, hkv * t, 1).expand(b, hkv * t, width)

    def rows(table: Tensor) -> Tensor:  # [B', S, R] -> [B, H, T, R]
        picked = table.expand(b, -1, -1).gather(1, index).view(b, hkv, 1, t, width)
        return picked.expand(b, hkv, h // hkv, t, width).reshape(b, h, t, width)

    cos, sin = rows(tables.cos), rows(tables.sin)
    part = x[..., :width].to(cos.dtype)
    half = width // 2
    turned = torch.cat([-part[..., half:], part[..., :half]], dim=-1)
    rotated = (part * cos + turned * sin).to(x.dtype)
    return rotated if width == d else torch.cat([rotated, x[..., width:]], dim=-1)


def rotate_block(q: Tensor, k: Tensor, key_cache: Tensor, pos_cache: Tensor, valid: Tensor,
                 tables: RopeTables) -> tuple[Tensor, Tensor, Tensor]:
    """q [B, Hq, T, D], k [B, Hkv, T, D] and the cached keys [B, Hkv, C, D] rotated at their rolling positions,
    for the attention of one block; the cache itself keeps the unrotated keys."""
    cache_rank, block_rank = rolling_ranks(pos_cache, valid)
    needed = pos_cache.shape[-1] + q.shape[2]
    if tables.cos.shape[1] < needed:
        raise ValueError(f"rotary tables cover {tables.cos.shape[1]} positions; rolling positions need C + T = "
                         f"{needed}")
    return rotate(q, tables, block_rank), rotate(k, tables, block_rank), rotate(key_cache, tables, cache_rank)
