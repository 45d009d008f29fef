"""Stream: the H2O state of one run of requests, what ``H2OModel.reset`` builds and ``step`` advances.

The role of gpt-fast's KVCache: an nn.Module owning static buffers (each layer's state tensors, cache_plan.py's
layout, updated in place by the h2o ops) plus the counters ``step`` keeps. ``forward``'s fresh stream,
continuous batching's rows and the benchmarks work through its methods.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from ..graph.passes import state_names
from .cache_plan import CachePlan


class Stream(nn.Module):
    """``batch_size`` rows of the caches ``plan`` lays out, on ``device``, empty.

    Attributes:
        plan: the CachePlan (slots, recent window and sinks per layer).
        seen: [B] int64, the tokens each row holds so far (its next position).
        fed: columns fed since the reset (prompt and decode blocks, padding included): the longest row.
        warned_positions: whether this stream already warned that it passed the model's positions.
    """

    def __init__(self, plan: CachePlan, batch_size: int, device: torch.device):
        super().__init__()
        self.plan = plan
        self._names = [state_names(i, layer.spec.quantized) for i, layer in enumerate(plan.layers)]
        for names, tensors in zip(self._names, plan.empty_state(batch_size, device)):
            for name, tensor in zip(names, tensors):
                self.register_buffer(name, tensor, persistent=False)
                if device.type == "cuda":
                    torch._dynamo.mark_static_address(tensor)  # CUDA graphs replay on fixed addresses
        self.register_buffer("seen", torch.zeros(batch_size, dtype=torch.long, device=device), persistent=False)
        self.fed = 0
        self.warned_positions = False

    @property
    def capacity(self) -> int:
        """C, the budget's slots per layer (full-attention layers: global_share x C)."""
        return self.plan.capacity

    @property
    def max_seq_len(self) -> Optional[int]:
        """The longest sequence it was sized for; None for a stream of ``capacity`` slots with no end."""
        return self.plan.max_seq_len

    @property
    def slots(self) -> list[int]:
        """Slots of each layer (sliding-window layers may differ from C)."""
        return self.plan.slots

    @property
    def recent(self) -> list[int]:
        """The recent window of each layer, an input of every graph call."""
        return self.plan.recent

    def layer_states(self) -> list[list[Tensor]]:
        """The state tensors of each layer (cache_plan.py's order), in layer order."""
        return [[getattr(self, name) for name in names] for names in self._names]

    def tensors(self) -> list[Tensor]:
        """The flat state, as the graph takes it: per layer key, value, score, position (and int8 scales)."""
        return [t for layer in self.layer_states() for t in layer]

    def layer_nbytes(self) -> list[int]:
        """Bytes of each layer's state (keys, values, scores, positions, and int8 scales), in layer order."""
        return [sum(t.numel() * t.element_size() for t in layer) for layer in self.layer_states()]

    def reset_row(self, row: int) -> None:
        """Empty one row (every layer: slots empty, scores 0, positions -1, int8 scales 1) and its token count,
        leaving every other row as it is."""
        for plan, tensors in zip(self.plan.layers, self.layer_states()):
            for (_, _, fill), tensor in zip(plan.tensor_specs(1), tensors):
                tensor[row].fill_(fill)
        self.seen[row] = 0

    def copy_row(self, src: "Stream", src_row: int, row: int) -> None:
        """Copy row ``src_row`` of ``src`` (every layer's tensors and its token count) into ``row``; both streams
        follow the same plan."""
        for src_layer, layer in zip(src.layer_states(), self.layer_states()):
            for s, d in zip(src_layer, layer):
                d[row].copy_(s[src_row])
        self.seen[row] = src.seen[src_row]

    def set_length(self, tokens: int) -> None:
        """Mark every row as holding ``tokens`` tokens, for a state written from outside (the decode benchmark
        fills it with a synthetic context)."""
        self.seen.fill_(tokens)
        self.fed = tokens
