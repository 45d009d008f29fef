"""Budgets that follow attention: how the budget's slots are split between layers, from the model's own attention.

The uniform split gives every layer C slots. A layer whose queries put their attention on a few keys loses little
when it keeps few; a layer whose attention is spread loses mass with every key it drops. Per layer l,

    captured_l(c) = mean over queries t (and heads) of the attention mass on t's c most-attended keys

is what c slots could keep at best (the keys a query reads most, sorted: a cumulative sum). Sorted weights make
captured_l concave in c, so giving the slots one at a time to the layer whose next slot captures the most
(:func:`split_slots`) maximises the total captured mass for the same total of slots as the uniform split: the
sum over layers of ``captured_l(c_l)``.

Two sources (H2OConfig.allocation): ``calibrate`` measures it once on a calibration text and stores the split
as shares of C in the config (saved with the model); ``"prompt"`` measures it on each request's prompt before
the cache is sized (H2OModel.step, one extra forward of the prompt with the model's eager attention).
"""

from __future__ import annotations

import contextlib
import inspect
import math
from typing import Optional, Sequence, Union

import torch
from torch import Tensor, nn

from ..config import H2OConfig, resolve_config
from ..graph.support import check_supported, text_config
from .cache_plan import layer_params, least_slots


_QUERY_CHUNK = 256  # query rows whose sorted attention is held at once


@contextlib.contextmanager
def _eager_attention(model: nn.Module):
    """The model with eager attention, whose attention modules return their weights [B, Hq, T, T]."""
    before = getattr(model.config, "_attn_implementation", None)
    model.set_attn_implementation("eager")
    try:
        yield
    finally:
        if before is not None and before != "eager":
            model.set_attn_implementation(before)


def _attention_weights(output) -> Optional[Tensor]:
    """The weights [B, Hq, T, T] an attention module returned beside its output, or None."""
    if isinstance(output, tuple) and len(output) > 1 and isinstance(output[1], Tensor):
        weights = output[1]
        if weights.dim() == 4 and weights.shape[-1] == weights.shape[-2]:
            return weights
    return None


@torch.no_grad()
def attention_curves(model: nn.Module, input_ids: Tensor, attention_mask: Optional[Tensor] = None) -> list[Tensor]:
    """captured[l, h, c]: the attention mass the queries of layer l and KV head h put on their c most-attended
    keys (c = 0..T), averaged over the valid queries of every row and the query heads of the KV group.

    Args:
        model: a transformers causal LM (run once with eager attention; the weights are reduced layer by layer,
            never held for every layer at once).
        input_ids: [B, T]; attention_mask: [B, T], 0 for (left) padding, or None.
    Returns:
        one float64 [Hkv, T + 1] per layer, non-decreasing and concave in c, 0 at c = 0 and 1 once c >= T.
    """
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(input_ids.device)
    query_weight = mask.to(torch.float32)                                              # [B, T]
    config = text_config(model)
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    curves: list[Tensor] = []

    def reduce(module, args, output):
        weights = _attention_weights(output)                                           # [B, Hq, T, T]
        if weights is None:
            return
        b, hq, t, _ = weights.shape
        hkv = kv_heads if hq % kv_heads == 0 else hq
        total = torch.zeros(hkv, t, dtype=torch.float64, device=weights.device)
        for start in range(0, t, _QUERY_CHUNK):  # a chunk of queries at a time: the sort's copies stay small
            rows = weights[:, :, start:start + _QUERY_CHUNK].float()
            kept = rows.sort(dim=-1, descending=True).values.cumsum(dim=-1)           # [B, Hq, chunk, T]
            counted = query_weight[:, None, start:start + _QUERY_CHUNK, None] > 0
            kept = torch.where(counted, kept, 0.0)  # padding queries count nothing (their rows may be NaN)
            total += kept.reshape(b, hkv, -1, t).sum(dim=(0, 2)).double()
        per_query = total / (float(query_weight.sum()) * (hq // hkv))                # [Hkv, T]
        curves.append(torch.cat([per_query.new_zeros(hkv, 1), per_query.clamp(max=1.0)], dim=1).cpu())

    hooks = [m.register_forward_hook(reduce) for m in model.modules() if type(m).__name__.endswith("Attention")]
    extra = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    try:
        with _eager_attention(model):
            positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
            model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=False, **extra)
    finally:
        for hook in hooks:
            hook.remove()
    if len(curves) != config.num_hidden_layers:
        raise ValueError(f"{type(model).__name__}: read the attention weights of {len(curves)} attention modules "
                         f"for {config.num_hidden_layers} layers; the split needs a model whose eager attention "
                         "returns them")
    return curves


def split_slots(curves: Sequence[Tensor], uniform: Sequence[int], least: Sequence[int], most: Sequence[int],
                heads: Optional[Sequence[int]] = None) -> list[int]:
    """Slots per cache, each in [least_i, most_i], at most the uniform split's ``sum(uniform_i x heads_i)`` head
    slots in all (``heads``: KV heads per cache, all 1 by default), that maximise sum_i heads_i x curves[i][c_i]
    (``curves[i]``: float [T + 1], concave, the mean of the cache's heads; a slot past T captures nothing more).

    Greedy on the marginal gain per head slot, optimal for concave curves and equal ``heads``; slots that capture
    nothing more anywhere (every cache holds all its keys' mass) go to the caches furthest below their uniform
    share, so a short prompt gives the uniform split back."""
    heads = [1] * len(curves) if heads is None else [int(h) for h in heads]
    slots = [int(v) for v in least]
    budget = sum(u * h for u, h in zip(uniform, heads)) - sum(s * h for s, h in zip(slots, heads))
    gains, owners = [], []
    for cache, (curve, lo, hi) in enumerate(zip(curves, least, most)):
        top = min(int(hi), curve.shape[-1] - 1)
        if top > lo:
            gains.append(curve[lo + 1:top + 1] - curve[lo:top])
            owners.append(torch.full((top - lo,), cache))
    if budget > 0 and gains:
        gains, owners = torch.cat(gains), torch.cat(owners)
        order = torch.sort(gains, descending=True, stable=True).indices
        order = order[gains[order] > 1e-12]
        cost = torch.tensor(heads)[owners[order]].cumsum(0)
        order = order[cost <= budget]  # the best slots while they fit (each cache's in order: its gains fall)
        for cache, count in zip(*torch.unique(owners[order], return_counts=True)):
            slots[int(cache)] += int(count)
        budget -= int(torch.tensor(heads)[owners[order]].sum()) if len(order) else 0
    while True:
        room = [i for i in range(len(slots)) if slots[i] < most[i] and heads[i] <= budget]
        if not room:
            break
        neediest = min(room, key=lambda i: (slots[i] / max(uniform[i], 1), i))
        slots[neediest] += 1
        budget -= heads[neediest]
    return slots


def layer_split(config: H2OConfig, windows: Sequence[int], curves: Sequence[Tensor], total_len: Optional[int],
                capacity: Optional[int] = None, heads: Optional[Sequence[int]] = None) -> tuple[float, ...]:
    """Each cache's slots as a multiple of C (H2OConfig.allocation's shares) for a sequence of ``total_len``
    tokens (or a stream of ``capacity`` slots, ``total_len`` None), from ``curves``: one [T + 1] per cache, the
    mean of :func:`attention_curves` over the KV heads it holds (``heads`` per cache, all 1 by default;
    ``windows``: each cache's layer's sliding window). A sliding-window layer that keeps its window (no
    ``compress_sliding``) keeps it."""
    c = config.capacity(total_len) if total_len is not None else capacity
    return _shares(_split(config, windows, curves, total_len, capacity, heads), c)


def _split(config: H2OConfig, windows: Sequence[int], curves: Sequence[Tensor], total_len: Optional[int],
           capacity: Optional[int] = None, heads: Optional[Sequence[int]] = None) -> list[int]:
    """:func:`layer_split` in slots."""
    uniform, least, most = [], [], []
    for window, curve in zip(windows, curves):
        slots = layer_params(config, total_len, window, capacity)[0]
        fixed = window > 0 and not config.compress_sliding
        # A stream has no end: a cache may take up to what the measured text holds (past it nothing is gained).
        longest = total_len if total_len is not None else max(slots, curve.shape[-1] - 1)
        top = slots if fixed else min(window, longest) if window > 0 else longest
        uniform.append(slots)
        least.append(slots if fixed else least_slots(config, slots))
        most.append(top)
    return split_slots(curves, uniform, least, most, heads)


def _shares(slots: Sequence[int], capacity: int) -> tuple[float, ...]:
    # Rounded up at 6 decimals: floor(share x C) (cache_plan.layer_params) gives back exactly these slots.
    return tuple(math.ceil(s / capacity * 1e6) / 1e6 for s in slots)


def head_split(config: H2OConfig, windows: Sequence[int], curves: Sequence[Tensor], total_len: int,
               head_groups: int) -> tuple:
    """H2OConfig.allocation for a split per KV head: each layer's heads given at most ``head_groups`` distinct
    slot counts (each group of heads is one cache, an op of its own). ``curves``: :func:`attention_curves`.

    The heads' slots are the best split over every KV head of the model (:func:`split_slots`); then each layer's
    heads, ranked by their slots, are cut into ``head_groups`` runs of equal size, each run holding the floor of
    its mean (so the total stays within the uniform split's)."""
    per_head = [curve[h] for curve in curves for h in range(curve.shape[0])]
    head_windows = [w for w, curve in zip(windows, curves) for _ in range(curve.shape[0])]
    c = config.capacity(total_len)
    slots = _split(config, head_windows, per_head, total_len)
    allocation, at = [], 0
    for curve in curves:
        layer = slots[at:at + curve.shape[0]]
        at += curve.shape[0]
        ranked = sorted(range(len(layer)), key=lambda h: (layer[h], h))
        groups = min(head_groups, len(layer))
        kept = list(layer)
        for g in range(groups):
            members = ranked[g * len(layer) // groups:(g + 1) * len(layer) // groups]
            for h in members:
                kept[h] = sum(layer[m] for m in members) // len(members)
        allocation.append(_shares(kept, c))
    return tuple(entry if len(set(entry)) > 1 else entry[0] for entry in allocation)


@torch.no_grad()
def calibrate(model: nn.Module, input_ids: Tensor, budget: Union[float, int, None] = None, *,
              config: Union[H2OConfig, str, None] = None, attention_mask: Optional[Tensor] = None,
              head_groups: int = 1, **options) -> H2OConfig:
    """The config with ``allocation`` set to the split the model's attention on ``input_ids`` asks for.

    Args:
        model: the transformers causal LM to optimize afterwards (an H2OModel's ``.model`` works too).
        input_ids: [B, T] calibration tokens, e.g. a few windows of ordinary text of the length served;
            attention_mask: [B, T] or None.
        budget, config, **options: as :func:`h2o_compile.optimize`; the split is measured for a sequence of T
            tokens at that budget and scales with C at other lengths.
        head_groups: 1 splits between layers only; more splits each layer's KV heads too, into at most that many
            groups of their own size (each group an h2o op: more groups, more ops per decode step).
    Returns:
        an H2OConfig to pass to ``optimize(model, config=...)``; ``save_pretrained`` keeps its split.
    """
    config = resolve_config(config, budget, options)
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.shape[1] < 2:
        raise ValueError(f"input_ids must be a LongTensor [batch, T] with T >= 2 calibration tokens; got "
                         f"{tuple(input_ids.shape) if isinstance(input_ids, Tensor) else type(input_ids).__name__}")
    if isinstance(head_groups, bool) or not isinstance(head_groups, int) or head_groups < 1:
        raise ValueError(f"head_groups={head_groups!r} must be an int >= 1 (1: a split between layers only)")
    windows = check_supported(model).windows
    curves = attention_curves(model, input_ids, attention_mask)
    return config.replace(allocation=split_of(config, windows, curves, int(input_ids.shape[1]), head_groups))


def split_of(config: H2OConfig, windows: Sequence[int], curves: Sequence[Tensor], total_len: int,
             head_groups: int = 1) -> tuple:
    """The calibrated allocation of :func:`calibrate` from its ``curves`` (:func:`attention_curves`)."""
    uniform = config.replace(allocation="uniform")
    if head_groups > 1:
        return head_split(uniform, windows, curves, total_len, head_groups)
    return layer_split(uniform, windows, [curve.mean(dim=0) for curve in curves], total_len)
