"""Rolling positions: rotary embeddings applied at attention time by rank in the cache (or by capped distance),
not by text position.

With ``positions="rolling"`` (StreamingLLM's scheme, used by the paper's streaming runs) the cache holds keys
*before* RoPE. For each block, the entries a (row, KV head) holds are numbered 0..n-1 in the order of their
true positions, and the block's valid tokens continue at n, n+1, ...; queries and keys are rotated with these
numbers just before the attention. So every relative distance the model sees is below C + T, however long
the stream. Scores, eviction, the recent window and sliding windows still use true positions.

n counts the entries held (position >= 0) at the start of the block. It is the same for every KV head of a
row except on a compressed sliding-window layer, where heads may hold different numbers of keys; each
(row, KV head) then numbers its own entries and the queries of its group continue from its own n.

Capped distances (``positions="capped"``, tables with ``max_distance`` D > 0): each key keeps its true distance
to the row's newest valid token L up to D' = max(D, n - 1), n the row's valid tokens in the block, and keys
older than that sit at distance D'. Keys are numbered clamp(p - (L - D'), 0, D'), the block's tokens likewise,
so within the block every distance is exact, query t sees key p at min(t - p, D' - (L - t)), and padding
changes nothing (a padded row numbers as the same row alone). Rank numbering squeezes a heavy hitter from 60,000
tokens ago to a few hundred positions before the query, a distance at which the model expects a recent token;
capping keeps recent keys where the model expects them and puts only the old ones at one far distance
(docs/results/stream/README.md measures both). Every distance stays at most D', however long the stream.

The rotary tables come from the model's own rotary embedding, evaluated by the graph at positions 0..S-1
(passes/rolling_positions.py), so every RoPE variant the model has (base, scaling, partial rotary, per-layer
bases) is kept. Shapes:

    cos, sin   [B', S, R] or [B', 1, S, R], B' in (1, B), R <= D rotary dims (even);
               S >= C + T by rank, S >= D' + 1 with capped distances
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor


class RopeTables(NamedTuple):
    """cos and sin [B', S, R] of the model's rotary embedding at positions 0..S-1, and how keys are numbered:
    ``max_distance`` 0 = by rank in the cache, D > 0 = by true distance capped at max(D, n - 1) (module
    docstring)."""

    cos: Tensor
    sin: Tensor
    max_distance: int = 0


def as_tables(cos: Optional[Tensor], sin: Optional[Tensor], max_distance: int = 0) -> Optional[RopeTables]:
    """The op arguments as 3-D tables (the graph hands them on as the model shaped them), or None."""
    if isinstance(max_distance, bool) or not isinstance(max_distance, int) or max_distance < 0:
        raise ValueError(f"max_distance={max_distance!r} must be an int >= 0 (0 = rank numbering)")
    if cos is None and sin is None:
        if max_distance:
            raise ValueError(f"max_distance={max_distance} numbers keys for rolling positions, which need the "
                             "rotary tables rope_cos and rope_sin; got none")
        return None
    if cos is None or sin is None or cos.shape != sin.shape or cos.dim() not in (3, 4) or cos.shape[-1] % 2:
        got = [None if t is None else tuple(t.shape) for t in (cos, sin)]
        raise ValueError(f"rope_cos and rope_sin must both be given, equal shapes [B', S, R] (R even); got {got}")
    return RopeTables(cos.reshape(cos.shape[0], -1, cos.shape[-1]), sin.reshape(sin.shape[0], -1, sin.shape[-1]),
                      max_distance)


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


def capped_distances(pos_cache: Tensor, new_pos: Tensor, max_distance: int) -> tuple[Tensor, Tensor]:
    """The capped-distance positions of a block's keys (module docstring).

    Args:
        pos_cache: [B, Hkv, C] int64 true positions held at the start of the block, -1 = empty.
        new_pos: [B, Hkv, T] int64 true positions of the block's tokens, -1 = padding.
        max_distance: D >= 1; the cap is D' = max(D, n - 1) per row (n its valid tokens), so a block's own
            distances stay exact.
    Returns:
        cache_number [B, Hkv, C] and block_number [B, Hkv, T], int64 in [0, D'] <= max(D, T - 1) (empty slots
        and padding get some number in range, which no query reads).
    """
    valid = (new_pos >= 0).sum(dim=-1, keepdim=True)                             # [B, Hkv, 1] n
    cap = (valid - 1).clamp(min=max_distance)                                    # D'
    base = new_pos.amax(dim=-1, keepdim=True) - cap                              # L - D'
    return ((pos_cache - base).clamp(min=0).minimum(cap),
            (new_pos - base).clamp(min=0).minimum(cap))


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


def rotate_block(q: Tensor, k: Tensor, key_cache: Tensor, pos_cache: Tensor, new_pos: Tensor,
                 tables: RopeTables) -> tuple[Tensor, Tensor, Tensor]:
    """q [B, Hq, T, D], k [B, Hkv, T, D] and the cached keys [B, Hkv, C, D] rotated at their rolling positions
    (by rank, or by capped distance when ``tables.max_distance`` > 0), for the attention of one block; the
    cache itself keeps the unrotated keys. new_pos: [B, Hkv, T] int64 true positions, -1 = padding."""
    t = q.shape[2]
    if tables.max_distance:
        cache_number, block_number = capped_distances(pos_cache, new_pos, tables.max_distance)
        needed, what = max(tables.max_distance, t - 1) + 1, "max(max_distance, T - 1) + 1 = "
    else:
        cache_number, block_number = rolling_ranks(pos_cache, new_pos[:, 0] >= 0)
        needed, what = pos_cache.shape[-1] + t, "C + T = "
    if tables.cos.shape[1] < needed:
        raise ValueError(f"rotary tables cover {tables.cos.shape[1]} positions; rolling positions need {what}"
                         f"{needed} (C = {pos_cache.shape[-1]}, T = {t}, max_distance = {tables.max_distance})")
    return (rotate(q, tables, block_number), rotate(k, tables, block_number),
            rotate(key_cache, tables, cache_number))
