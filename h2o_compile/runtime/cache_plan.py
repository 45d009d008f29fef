"""CachePlan: the H2O state of every layer, planned once from the model and the H2OConfig.

One plan serves H2OModel.reset (torch buffers), export_onnx (the graph's state inputs and the metadata) and
H2OOrtModel (its OrtValues, rebuilt from that metadata), so the layout of the state is written here only.

Per layer: slots C_l (the budget on full-attention layers; a sliding-window layer keeps its window, or min(C, W)
with compress_sliding), the recent window and sink count the op protects, and the state tensors:

    key   [B, Hkv, C_l, D]   model dtype, or int8 with kv_dtype="int8"
    value [B, Hkv, C_l, Dv]
    score [B, Hkv, C_l]      fp32, 0 when empty
    position [B, Hkv, C_l]   int64, -1 when empty
    key_scale, value_scale [B, Hkv, C_l] fp32, 1 when empty (int8 only; kernels/quantized.py)
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor

from ..config import H2OConfig
from ..kernels.quantized import EMPTY_SCALE
from ..graph.passes.h2o_attention import LayerSpec, state_fields
from ..graph.support import ModelLimits, check_capped_fits, check_rolling_fits, check_sequence_fits


@dataclass(frozen=True)
class LayerPlan:
    """One layer's cache: what it holds (from its LayerSpec) and how many slots it protects."""

    spec: LayerSpec
    slots: int
    recent: int
    sinks: int

    @property
    def fields(self) -> tuple[str, ...]:
        return state_fields(self.spec.quantized)

    def tensor_specs(self, batch: int) -> list[tuple[tuple[int, ...], torch.dtype, float]]:
        """(shape, dtype, empty value) of each state tensor, in :attr:`fields` order."""
        s = self.spec
        rows = (batch, s.kv_heads, self.slots)
        entry = torch.int8 if s.quantized else s.dtype
        specs = [(rows + (s.head_dim,), entry, 0), (rows + (s.value_dim,), entry, 0), (rows, torch.float32, 0.0),
                 (rows, torch.int64, -1)]
        return specs + [(rows, torch.float32, EMPTY_SCALE)] * (2 if s.quantized else 0)

    def empty(self, batch: int, device=None) -> list[Tensor]:
        return [torch.full(shape, fill, dtype=dtype, device=device) for shape, dtype, fill in self.tensor_specs(batch)]

    def nbytes(self, batch: int) -> int:
        return sum(_numel(shape) * dtype.itemsize for shape, dtype, _ in self.tensor_specs(batch))


@dataclass(frozen=True)
class CachePlan:
    """Every cache's :class:`LayerPlan` for one request shape (a bounded sequence or a stream): one per layer, or
    per group of KV heads of a layer split by heads (passes/head_groups.py), in graph order."""

    layers: tuple[LayerPlan, ...]
    capacity: int                   # C, the budget's slots per layer (full-attention layers: global_share x C)
    max_seq_len: Optional[int]      # None for a stream of ``capacity`` slots
    whole_slots: Optional[int] = None  # a tensor-parallel rank: the largest cache of the whole model (for_rank)

    @classmethod
    def build(cls, config: H2OConfig, specs: Sequence[LayerSpec], limits: ModelLimits, *,
              max_seq_len: Optional[int] = None, capacity: Optional[int] = None,
              rolling_block: Optional[int] = None, shares: Optional[Sequence[float]] = None) -> CachePlan:
        """Plan for a sequence of at most ``max_seq_len`` tokens, or a stream of ``capacity`` slots (one of
        the two); ``shares``: each layer's slots as a multiple of C for this request (a prompt's split,
        runtime/allocation.py), else the config's (:func:`layer_shares`). Checks that the sequence fits the
        model's positions (ValueError): with true positions its length; with rolling positions and
        ``rolling_block`` given, the last block of that many tokens (capped distances: the longest block)."""
        if (max_seq_len is None) == (capacity is None):
            raise ValueError(f"plan either a bounded sequence (max_seq_len) or a stream (capacity), "
                             f"not {'both' if capacity is not None else 'neither'}")
        if max_seq_len is not None:
            cls.check_lengths(config, limits, max_seq_len, rolling_block)
            capacity = config.capacity(max_seq_len)
        if shares is None:
            shares = layer_shares(config, [spec.window for spec in specs], capacity, max_seq_len, specs=specs)
        params = [layer_params(config, max_seq_len, spec.window, capacity, share) for spec, share in zip(specs, shares)]
        if config.allocation != "uniform":
            params = _within_uniform(config, params, [layer_params(config, max_seq_len, spec.window, capacity)[0]
                                                      for spec in specs], [spec.kv_heads for spec in specs])
        return cls(tuple(LayerPlan(spec, *p) for spec, p in zip(specs, params)), capacity, max_seq_len)

    @classmethod
    def for_rank(cls, config: H2OConfig, specs: Sequence[LayerSpec], limits: ModelLimits, first_head: int,
                 world: int, **request) -> CachePlan:
        """:meth:`build` for a tensor-parallel rank holding KV heads ``first_head``... of every layer (``specs``: its
        caches): the plan of the whole model over all ``world`` ranks' heads, of which the rank keeps its heads'
        caches, so a split by KV heads gives each head the slots one process gives it."""
        layers = [next(s for s in specs if s.layer == layer) for layer in sorted({s.layer for s in specs})]
        whole_layers = [dataclasses.replace(s, kv_heads=world * sum(t.kv_heads for t in specs if t.layer == s.layer),
                                            heads=()) for s in layers]
        whole = []
        for spec, groups in zip(whole_layers, head_groups(config, whole_layers)):
            whole += [spec] if groups is None else [dataclasses.replace(spec, kv_heads=len(g), heads=g) for g in groups]
        plan = cls.build(config, whole, limits, **request)
        mine = []
        for spec in specs:
            head = first_head + (spec.heads[0] if spec.heads else 0)
            held = next(p for p in plan.layers
                        if p.spec.layer == spec.layer and (not p.spec.heads or head in p.spec.heads))
            mine.append(LayerPlan(spec, held.slots, held.recent, held.sinks))
        return cls(tuple(mine), plan.capacity, plan.max_seq_len, whole_slots=max(plan.slots))

    @staticmethod
    def check_lengths(config: H2OConfig, limits: ModelLimits, max_seq_len: int,
                      rolling_block: Optional[int] = None) -> None:
        """The checks of :meth:`build` for a bounded sequence, from the config alone (before a slow capture)."""
        if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < 1:
            raise ValueError(f"max_seq_len={max_seq_len!r} must be an int >= 1")
        if config.positions == "true":  # rolling positions stay below C + block whatever the length
            check_sequence_fits(limits, max_seq_len)
        elif rolling_block is not None and config.positions == "capped":  # the longest block decides
            config.position_cap(limits.max_positions)
            check_capped_fits(limits, min(rolling_block, max_seq_len),
                              context=f"max_seq_len={max_seq_len} with prefill={config.prefill!r}: ")
        elif rolling_block is not None:  # rolling: the last block of the sequence decides
            block = min(rolling_block, max_seq_len)
            shares = layer_shares(config, limits.windows, config.capacity(max_seq_len), max_seq_len)
            slots = max(layer_params(config, max_seq_len, window, share=share)[0]
                        for window, share in zip(limits.windows, shares))
            check_rolling_fits(limits, slots, max_seq_len - block, block,
                               context=f"max_seq_len={max_seq_len} with prefill={config.prefill!r}: ")

    @property
    def slots(self) -> list[int]:
        return [p.slots for p in self.layers]

    @property
    def largest_slots(self) -> int:
        """The largest cache's slots in the whole model (every rank's, under tensor parallelism)."""
        return self.whole_slots if self.whole_slots is not None else max(self.slots)

    @property
    def recent(self) -> list[int]:
        return [p.recent for p in self.layers]

    @property
    def sinks(self) -> list[int]:
        return [p.sinks for p in self.layers]

    def empty_state(self, batch: int, device=None) -> list[list[Tensor]]:
        """Fresh state tensors, one list per layer."""
        return [p.empty(batch, device) for p in self.layers]

    def nbytes(self, batch: int) -> int:
        return sum(p.nbytes(batch) for p in self.layers)

    # -- the exported form (h2o_config.json), which H2OOrtModel reads back -----------------------------------

    def layer_meta(self) -> list[dict]:
        return [{"kv_heads": p.spec.kv_heads, "head_dim": p.spec.head_dim, "value_dim": p.spec.value_dim,
                 "capacity": p.slots, "recent": p.recent, "window": p.spec.window, "softcap": p.spec.softcap,
                 "sinks": p.spec.sinks, "quantized": p.spec.quantized, "layer": p.spec.layer,
                 "heads": list(p.spec.heads)} for p in self.layers]

    @classmethod
    def from_meta(cls, meta: dict, dtype: torch.dtype) -> CachePlan:
        """The plan of an export (its metadata's ``layers``); ``dtype``: the model's float dtype."""
        layers = []
        for i, layer in enumerate(meta["layers"]):
            spec = LayerSpec(int(layer["kv_heads"]), int(layer["head_dim"]), int(layer["value_dim"]), dtype,
                             window=int(layer.get("window", 0)), softcap=float(layer.get("softcap", 0.0)),
                             sinks=bool(layer.get("sinks", False)), quantized=bool(layer.get("quantized", False)),
                             layer=int(layer.get("layer", i)), heads=tuple(layer.get("heads", ())))
            # Exports before per-layer attention kinds had one capacity for every layer.
            slots = int(layer.get("capacity", meta["capacity"]))
            layers.append(LayerPlan(spec, slots, int(layer.get("recent", meta.get("recent", 1))), 0))
        return cls(tuple(layers), int(meta["capacity"]), meta.get("max_seq_len"))


def layer_positions(specs: Sequence[LayerSpec], positions: Sequence[Tensor], layer: int) -> Tensor:
    """The kept positions [B, Hkv, C_layer] of model layer ``layer`` from every cache's ``positions``
    [B, heads, C_i] (``specs``: the caches, graph order): a layer split by KV heads gets its groups' rows back in
    head order, C_layer its largest group's slots, the smaller groups' padded with -1 (empty)."""
    layers = 1 + max(spec.layer for spec in specs)
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < layers:
        raise ValueError(f"layer={layer!r} out of range; the model has {layers} layers")
    caches = [(spec, pos) for spec, pos in zip(specs, positions) if spec.layer == layer]
    if len(caches) == 1:
        return caches[0][1].clone()
    rows, slots = caches[0][1].shape[0], max(pos.shape[2] for _, pos in caches)
    kept = caches[0][1].new_full((rows, sum(spec.kv_heads for spec, _ in caches), slots), -1)
    for spec, pos in caches:
        kept[:, list(spec.heads), :pos.shape[2]] = pos
    return kept


def _within_uniform(config: H2OConfig, params: list[tuple[int, int, int]], uniform: list[int],
                    heads: list[int]) -> list[tuple[int, int, int]]:
    """A split's (slots, recent, sinks) per cache with at most the uniform split's slots in all (each cache's slots
    times its KV ``heads``). Shares measured at one length can hold more at another (a sliding layer that gave
    slots away stops paying once C passes its window; the floor of the fewest slots a cache may hold): the excess
    comes back from the caches furthest above their uniform slots, about 1% of a cache at a time."""
    slots = [p[0] for p in params]
    excess = sum(n * h for n, h in zip(slots, heads)) - sum(n * h for n, h in zip(uniform, heads))
    while excess > 0:
        cache = max(range(len(slots)), key=lambda i: (slots[i] / uniform[i], slots[i]))
        if slots[cache] <= uniform[cache]:
            break
        # About 1% of the cache at a time (a split planned far from its calibration length can be thousands over).
        take = max(1, min(-(-excess // heads[cache]), slots[cache] - max(uniform[cache], round(slots[cache] * 0.99))))
        slots[cache] -= take
        excess -= take * heads[cache]
    return [p if n == p[0] else (n, config.recent_window(n), p[2]) for n, p in zip(slots, params)]


def head_groups(config: H2OConfig, specs: Sequence[LayerSpec]) -> list[Optional[list[tuple[int, ...]]]]:
    """Per layer (``specs``: one per layer, from the capture), its KV heads grouped by the cache each group keeps
    (passes/head_groups.py), or None where the layer keeps one cache: a calibrated split's heads with equal
    shares share one; ``"prompt-heads"`` gives every KV head its own (but on sliding-window layers that keep
    their window: nothing to split there)."""
    allocation = config.allocation
    if isinstance(allocation, tuple):
        _check_layer_count(allocation, len(specs))
    groups: list[Optional[list[tuple[int, ...]]]] = []
    for spec in specs:
        entry = allocation[spec.layer] if isinstance(allocation, tuple) else None
        keeps_window = spec.window > 0 and not config.compress_sliding  # every head keeps the window: no split
        if isinstance(entry, tuple):
            if len(entry) != spec.kv_heads:
                raise ValueError(f"allocation gives layer {spec.layer} {len(entry)} KV head shares; this model's "
                                 f"layer has {spec.kv_heads} KV heads (h2o_compile.calibrate it)")
            by_share: dict[float, list[int]] = {}
            for head, share in enumerate(entry):
                by_share.setdefault(share, []).append(head)
            groups.append(None if keeps_window else [tuple(g) for g in by_share.values()])
        elif allocation == "prompt-heads" and spec.kv_heads > 1 and not keeps_window:
            groups.append([(h,) for h in range(spec.kv_heads)])
        else:
            groups.append(None)
    return groups


def _check_layer_count(allocation: tuple, layers: int) -> None:
    if len(allocation) != layers:
        raise ValueError(f"allocation holds {len(allocation)} shares, one per layer of the model it was "
                         f"calibrated on; this model has {layers} layers (h2o_compile.calibrate it)")


def layer_shares(config: H2OConfig, windows: Sequence[int], capacity: Optional[int] = None,
                 total_len: Optional[int] = None, specs: Optional[Sequence[LayerSpec]] = None) -> list[float]:
    """Each cache's slots as a multiple of C (``global_share``, or a calibrated ``allocation``'s own shares),
    given every cache's sliding window (0 = full attention); all 1.0 by default. ``specs``: the caches (a layer
    split by KV heads has one per group, :func:`head_groups`), else one per layer, a layer split by heads
    taking its largest share (what rolling positions' checks need). With ``capacity`` C (and
    ``total_len``, None for a stream) the global_share of that plan, which holds the uniform split's slots:
    C per full-attention layer plus min(C, W) per sliding one. Without it, the shares while C <= every
    window, which any length's plan is checked against first. ValueError when the model lacks one kind of
    layer or the full-attention layers would take every slot."""
    windows, share = list(windows), float(config.global_share)
    if isinstance(config.allocation, tuple):  # a calibrated split (runtime/allocation.py)
        if specs is None:
            _check_layer_count(config.allocation, len(windows))
            return [max(e) if isinstance(e, tuple) else e for e in config.allocation]
        _check_layer_count(config.allocation, len({spec.layer for spec in specs}))
        entries = [config.allocation[spec.layer] for spec in specs]
        return [(e[spec.heads[0]] if spec.heads else max(e)) if isinstance(e, tuple) else e
                for e, spec in zip(entries, specs)]
    if share == 1.0:
        return [1.0] * len(windows)
    full = sum(1 for w in windows if w <= 0)
    sliding = len(windows) - full
    if not full or not sliding:
        raise ValueError(f"global_share={config.global_share!r} moves slots between full-attention and "
                         f"sliding-window layers; this model has {full} full-attention and {sliding} "
                         "sliding-window layers (use global_share=1.0)")
    rest = (len(windows) - share * full) / sliding
    if rest <= 0:
        raise ValueError(f"global_share={config.global_share!r}: {full} full-attention layers of "
                         f"{len(windows)} would hold every slot; allowed: below {len(windows) / full:g}")
    if capacity is not None:
        rest = _sliding_share(config, windows, capacity, total_len, full, sliding, share)
    return [rest if w > 0 else share for w in windows]


def _sliding_share(config: H2OConfig, windows: list[int], capacity: int, total_len: Optional[int], full: int,
                   sliding: int, share: float) -> float:
    """A sliding-window layer's slots as a multiple of C: the uniform split's slots less the full layers'
    global_share x C (at most the sequence), shared equally (rounded: within half a slot per layer)."""
    full_slots = layer_params(config, total_len, 0, capacity, share)[0]
    uniform = sum(layer_params(config, total_len, w, capacity)[0] for w in windows)
    left = uniform - full * full_slots
    each = round(left / sliding)
    if each < 1 or config.sink_tokens + config.recent_window(each) > each:
        least = least_slots(config, capacity + 1)
        length = "a stream" if total_len is None else f"{total_len} tokens"
        raise ValueError(f"global_share={config.global_share!r} at C={capacity} slots ({length}): the {full} "
                         f"full-attention layers' {full_slots} slots each leave {left} of the uniform split's "
                         f"{uniform} for {sliding} sliding-window layers, {each} each, fewer than the {least} "
                         f"that sink_tokens ({config.sink_tokens}) and a recent window need; global_share <= "
                         f"{(uniform - sliding * least) // full / capacity:.4f} leaves them {least}")
    return left / (sliding * capacity)  # layer_params rounds it x C back to ``each``


def layer_params(config: H2OConfig, total_len: Optional[int], window: int, capacity: Optional[int] = None,
                 share: float = 1.0) -> tuple[int, int, int]:
    """(capacity, recent window, sink tokens) of one layer for a sequence of ``total_len`` tokens, or,
    for a stream of unknown length (``total_len`` None), for the fixed ``capacity`` C.

    A full-attention layer (``window`` 0) gets C = capacity(total_len). A sliding-window layer keeps
    min(W, total_len) slots, all protected (only keys that left the window are evicted: no choice to
    make), or with ``compress_sliding`` min(C, W) slots under the policy. ``share`` (the layer's entry of
    :func:`layer_shares`) scales C first: round(share x C), at most total_len (a split's ``allocation``:
    rounded down, at least the slots its sinks and recent window need).
    """
    if total_len is None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity={capacity!r} must be an int >= 1 for a stream without max_seq_len")
        config.check_split(capacity)
        cap, total_len = capacity, None
    else:
        cap = config.capacity(total_len)
    if share != 1.0 and config.allocation != "uniform":  # rounded down, so a split never holds more in all
        cap = max(least_slots(config, cap), math.floor(cap * share + 1e-6))
        cap = cap if total_len is None else min(cap, total_len)
    elif share != 1.0:
        cap = max(1, round(cap * share))
        cap = cap if total_len is None else min(cap, total_len)
    if total_len is None:
        total_len = window if window > 0 else cap
    if window <= 0:
        config.check_split(cap)
        return cap, config.recent_window(cap), layer_sinks(config, window)
    if not config.compress_sliding:
        slots = min(window, total_len)
        return slots, slots, layer_sinks(config, window)
    slots = min(cap, window)
    config.check_split(slots)
    return slots, config.recent_window(slots), layer_sinks(config, window)


def least_slots(config: H2OConfig, upto: int) -> int:
    """The fewest slots a layer may hold under ``config``: its sinks and recent window fit (at most ``upto``)."""
    for n in range(1, upto + 1):
        if config.sink_tokens + config.recent_window(n) <= n:
            return n
    return upto


def layer_sinks(config: H2OConfig, window: int) -> int:
    """Sink tokens of a layer: none on a sliding-window layer that keeps its window (it never chooses)."""
    return 0 if window > 0 and not config.compress_sliding else config.sink_tokens


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
