"""benchmarks/stream_positions_probe.py: its numbering gives every kept key its true distance to the query, capped
at D, checked against rotary embeddings written out here in float64 (the attention logit of a rotated q and k
depends on their distance only)."""

from __future__ import annotations

import torch

from h2o_compile.kernels.rolling import RopeTables

from ..helpers import load_benchmark

WIDTH, BASE = 16, 10000.0


def _frequencies() -> torch.Tensor:
    return BASE ** (-torch.arange(0, WIDTH, 2, dtype=torch.float64) / WIDTH)


def _tables(length: int, amplitude: float = 1.0) -> RopeTables:
    """The model-side tables [1, S, R] at positions 0..S-1, fp32, cat(freqs, freqs) as transformers builds them."""
    angle = torch.arange(length, dtype=torch.float64)[:, None] * _frequencies()
    angle = torch.cat([angle, angle], dim=-1)
    return RopeTables((angle.cos() * amplitude).float()[None], (angle.sin() * amplitude).float()[None])


def _rotated(x: torch.Tensor, position: float) -> torch.Tensor:
    """x [..., R] rotated at one position, float64, the rotate-half convention."""
    angle = position * torch.cat([_frequencies(), _frequencies()])
    half = WIDTH // 2
    turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x.double() * angle.cos() + turned.double() * angle.sin()


def test_frequencies_and_amplitude_are_read_back_from_the_tables():
    probe = load_benchmark("stream_positions_probe")
    frequency, amplitude = probe.table_frequencies(_tables(1152, amplitude=0.75))
    expected = torch.cat([_frequencies(), _frequencies()])
    torch.testing.assert_close(frequency, expected, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(amplitude, torch.full((WIDTH,), 0.75, dtype=torch.float64), rtol=1e-6, atol=0)


def test_logits_see_true_distances_capped_at_the_limit():
    probe = load_benchmark("stream_positions_probe")
    torch.manual_seed(0)
    limit = 300
    held = torch.tensor([[[0, 17, 5000, 5290, -1, 5301]]])         # [B=1, Hkv=1, C=6]; -1 = empty slot
    q = torch.randn(1, 2, 3, WIDTH)                                   # two query heads share the KV head
    k = torch.randn(1, 1, 3, WIDTH)
    cache = torch.randn(1, 1, 6, WIDTH)
    valid = torch.ones(1, 3, dtype=torch.bool)
    q_rot, k_rot, cache_rot = probe.capped_rotate_block(limit)(q, k, cache, held, valid, _tables(64))
    block = [5302, 5303, 5304]                                        # the block continues after the newest key
    for head in range(2):
        for t, query_position in enumerate(block):
            query = _rotated(q[0, head, t], 0.0)
            for slot, key_position in enumerate(held[0, 0].tolist()):
                if key_position < 0:
                    continue
                distance = min(query_position - key_position, limit + (query_position - block[-1]))
                expected = query @ _rotated(cache[0, 0, slot], -distance)
                got = q_rot[0, head, t].double() @ cache_rot[0, 0, slot].double()
                torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
            for s, key_position in enumerate(block[:t + 1]):
                expected = query @ _rotated(k[0, 0, s], -(query_position - key_position))
                torch.testing.assert_close(q_rot[0, head, t].double() @ k_rot[0, 0, s].double(), expected,
                                           rtol=1e-4, atol=1e-4)
