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


def split_slots(curves: Sequence[Tensor], uniform: Sequence[int], least: Sequence[int],
                most: Sequence[int]) -> list[int]:
    """Slots per layer, at most ``sum(uniform)`` in all, each in [least_l, most_l], that maximise
    sum_l curves[l][c_l] (``curves[l]``: float [T + 1], concave; a slot past T captures nothing more).

    Greedy on the marginal gains, optimal for concave curves; slots that capture nothing more anywhere (every
    layer holds all its keys' mass) go to the layers furthest below their uniform share, so a short prompt
    gives the uniform split back."""
    slots = [int(v) for v in least]
    budget = sum(uniform) - sum(slots)
    gains, owners = [], []
    for layer, (curve, lo, hi) in enumerate(zip(curves, least, most)):
        top = min(int(hi), curve.shape[-1] - 1)
        if top > lo:
            gains.append(curve[lo + 1:top + 1] - curve[lo:top])
            owners.append(torch.full((top - lo,), layer))
    if budget > 0 and gains:
        gains, owners = torch.cat(gains), torch.cat(owners)
        order = torch.sort(gains, descending=True, stable=True).indices[:budget]
        order = order[gains[order] > 1e-12]
        for layer, count in zip(*torch.unique(owners[order], return_counts=True)):
            slots[int(layer)] += int(count)
        budget -= len(order)
    while budget > 0:
        room = [i for i in range(len(slots)) if slots[i] < most[i]]
        if not room:
            break
        neediest = min(room, key=lambda i: (slots[i] / max(uniform[i], 1), i))
        slots[neediest] += 1
        budget -= 1
    return slots


def layer_split(config: H2OConfig, windows: Sequence[int], curves: Sequence[Tensor],
                total_len: Optional[int], capacity: Optional[int] = None) -> tuple[float, ...]:
    """Each layer's slots as a multiple of C (H2OConfig.allocation's shares) for a sequence of ``total_len``
    tokens (or a stream of ``capacity`` slots, ``total_len`` None), from ``curves`` (one [Hkv, T + 1] per
    layer, :func:`attention_curves`): every layer's heads share its slots, so a layer's curve
    is its heads' mean. A sliding-window layer that keeps its window (no ``compress_sliding``) keeps it."""
    c = config.capacity(total_len) if total_len is not None else capacity
    uniform, least, most, per_layer = [], [], [], []
    for window, curve in zip(windows, curves):
        slots = layer_params(config, total_len, window, capacity)[0]
        fixed = window > 0 and not config.compress_sliding
        # A stream has no end: a layer may take up to what the measured text holds (past it nothing is gained).
        longest = total_len if total_len is not None else max(slots, curve.shape[-1] - 1)
        top = slots if fixed else min(window, longest) if window > 0 else longest
        uniform.append(slots)
        least.append(slots if fixed else least_slots(config, slots))
        most.append(top)
        per_layer.append(curve.mean(dim=0))
    slots = split_slots(per_layer, uniform, least, most)
    # Rounded up at 6 decimals: floor(share x C) (cache_plan.layer_params) gives back exactly these slots.
    return tuple(math.ceil(s / c * 1e6) / 1e6 for s in slots)


@torch.no_grad()
def calibrate(model: nn.Module, input_ids: Tensor, budget: Union[float, int, None] = None, *,
              config: Union[H2OConfig, str, None] = None, attention_mask: Optional[Tensor] = None,
              **options) -> H2OConfig:
    """The config with ``allocation`` set to the split the model's attention on ``input_ids`` asks for.

    Args:
        model: the transformers causal LM to optimize afterwards (an H2OModel's ``.model`` works too).
        input_ids: [B, T] calibration tokens, e.g. a few windows of ordinary text of the length served;
            attention_mask: [B, T] or None.
        budget, config, **options: as :func:`h2o_compile.optimize`; the split is measured for a sequence of T
            tokens at that budget and scales with C at other lengths.
    Returns:
        an H2OConfig to pass to ``optimize(model, config=...)``; ``save_pretrained`` keeps its split.
    """
    config = resolve_config(config, budget, options)
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.shape[1] < 2:
        raise ValueError(f"input_ids must be a LongTensor [batch, T] with T >= 2 calibration tokens; got "
                         f"{tuple(input_ids.shape) if isinstance(input_ids, Tensor) else type(input_ids).__name__}")
    windows = check_supported(model).windows
    curves = attention_curves(model, input_ids, attention_mask)
    shares = layer_split(config.replace(allocation="uniform"), windows, curves, int(input_ids.shape[1]))
    return config.replace(allocation=shares)
