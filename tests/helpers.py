"""Small test doubles shared by several test files."""

from __future__ import annotations

import torch


def sink_logits_for(hq, device, seed=11):
    """[Hq] learned sink logits, large enough to take a real share of the softmax."""
    return (torch.randn(hq, generator=torch.Generator().manual_seed(seed)) * 2.0).to(device)


class CollectStreamer:
    """A transformers-style streamer: put() per chunk of tokens, end() once."""

    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.clone())

    def end(self):
        self.ended = True
