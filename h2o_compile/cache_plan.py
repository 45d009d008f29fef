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

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor

from .config import H2OConfig
from .kernels.quantized import EMPTY_SCALE
from .passes.h2o_attention import LayerSpec, state_fields
from .support import ModelLimits, check_capped_fits, check_rolling_fits, check_sequence_fits


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
    """Every layer's :class:`LayerPlan` for one request shape (a bounded sequence or a stream)."""

    layers: tuple[LayerPlan, ...]
    capacity: int                   # C, the budget's slots per layer (full-attention layers: global_share x C)
    max_seq_len: Optional[int]      # None for a stream of ``capacity`` slots

    @classmethod
    def build(cls, config: H2OConfig, specs: Sequence[LayerSpec], limits: ModelLimits, *,
              max_seq_len: Optional[int] = None, capacity: Optional[int] = None,
              rolling_block: Optional[int] = None) -> CachePlan:
        """Plan for a sequence of at most ``max_seq_len`` tokens, or a stream of ``capacity`` slots (one of
        the two). Checks that the sequence fits the model's positions (ValueError): with true positions its
        length; with rolling positions and ``rolling_block`` given, the last block of that many tokens (capped
        distances: the longest block)."""
        if (max_seq_len is None) == (capacity is None):
            raise ValueError(f"plan either a bounded sequence (max_seq_len) or a stream (capacity), "
                             f"not {'both' if capacity is not None else 'neither'}")
        if max_seq_len is not None:
            cls.check_lengths(config, limits, max_seq_len, rolling_block)
            capacity = config.capacity(max_seq_len)
        shares = config.layer_shares([spec.window for spec in specs], capacity, max_seq_len)
        layers = tuple(LayerPlan(spec, *config.layer_params(max_seq_len, spec.window, capacity, share))
                       for spec, share in zip(specs, shares))
        return cls(layers, capacity, max_seq_len)

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
            shares = config.layer_shares(limits.windows, config.capacity(max_seq_len), max_seq_len)
            slots = max(config.layer_params(max_seq_len, window, share=share)[0]
                        for window, share in zip(limits.windows, shares))
            check_rolling_fits(limits, slots, max_seq_len - block, block,
                               context=f"max_seq_len={max_seq_len} with prefill={config.prefill!r}: ")

    @property
    def slots(self) -> list[int]:
        return [p.slots for p in self.layers]

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
                 "sinks": p.spec.sinks, "quantized": p.spec.quantized} for p in self.layers]

    @classmethod
    def from_meta(cls, meta: dict, dtype: torch.dtype) -> CachePlan:
        """The plan of an export (its metadata's ``layers``); ``dtype``: the model's float dtype."""
        layers = []
        for layer in meta["layers"]:
            spec = LayerSpec(int(layer["kv_heads"]), int(layer["head_dim"]), int(layer["value_dim"]), dtype,
                             window=int(layer.get("window", 0)), softcap=float(layer.get("softcap", 0.0)),
                             sinks=bool(layer.get("sinks", False)), quantized=bool(layer.get("quantized", False)))
            # Exports before per-layer attention kinds had one capacity for every layer.
            slots = int(layer.get("capacity", meta["capacity"]))
            layers.append(LayerPlan(spec, slots, int(layer.get("recent", meta.get("recent", 1))), 0))
        return cls(tuple(layers), int(meta["capacity"]), meta.get("max_seq_len"))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
