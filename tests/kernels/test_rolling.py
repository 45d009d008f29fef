"""Rolling positions (kernels/rolling.py), by rank and by capped distance, in every backend: the reference op
against the float64 brute-force simulation, the Triton kernels (interpreter on CPU) and the compiled CPU decode
step against the reference."""

from __future__ import annotations

import pytest
import torch

import h2o_compile  # noqa: F401  (registers torch.ops.h2o)
from h2o_compile import ops
from h2o_compile.kernels import reference
from h2o_compile.kernels import reference_decode
from h2o_compile.kernels.rolling import RopeTables, as_tables, capped_distances, rolling_ranks

from .conftest import assert_close_out, assert_same_state, random_block
from .h2o_simulation import SimulatedCache
from .test_reference import kept_sets, make_block

SCHEDULE = [7, 1, 1, 1, 3, 1, 1, 2, 1, 1, 1, 1]


def tables(inv_freq: torch.Tensor, length: int, dtype=torch.float32, max_distance: int = 0) -> RopeTables:
    """cos / sin [1, length, R] as a model's rotary embedding builds them (rotate-half layout)."""
    angles = torch.arange(length, dtype=torch.float64)[:, None] * inv_freq[None, :]
    both = torch.cat([angles, angles], dim=-1)[None]
    return RopeTables(both.cos().to(dtype), both.sin().to(dtype), max_distance)


def op_block(state, q, k, v, positions, valid, rope, *, inplace, recent, sinks, policy, window=0, scale=0.25):
    args = (q.float(), k.float(), v.float(), positions, valid, *state[:4], scale, recent, sinks, policy, 3, window,
            0.0, None, rope.cos, rope.sin)
    if inplace:
        return torch.ops.h2o.attention_(*args, max_distance=rope.max_distance), state
    out, *new = torch.ops.h2o.attention(*args, max_distance=rope.max_distance)
    return out, reference.H2OState(*new[:4])  # no scales: not quantized


@pytest.mark.parametrize("max_distance", [0, 4], ids=["rank", "capped"])
@pytest.mark.parametrize("inplace", [True, False], ids=["inplace", "functional"])
@pytest.mark.parametrize("window", [0, 6])
@pytest.mark.parametrize("rotary", [16, 8], ids=["full-rotary", "partial-rotary"])
@pytest.mark.parametrize("policy", ["h2o", "sink", "random"])
def test_rolling_positions_match_bruteforce_simulation(policy, rotary, window, inplace, max_distance):
    """Capped at 4 over 21 positions: most kept keys sit at the cap, and the 7-token block (T - 1 = 6 > 4)
    takes the wider cap."""
    b, hq, hkv, d, cap, recent, sinks = 2, 4, 2, 16, 5, 2, 1
    inv_freq = 1.0 / (30.0 ** (torch.arange(0, rotary, 2, dtype=torch.float64) / rotary))
    # Longer than needed: only rows < C + T (rank) or max(D, T - 1) + 1 (capped) are read.
    rope = tables(inv_freq, cap + max(SCHEDULE) + 3, max_distance=max_distance)
    gen = torch.Generator().manual_seed(11)
    state = reference.empty_state(b, hkv, cap, d)
    sims = [[SimulatedCache(cap, recent, sinks, policy, seed=3, window=window or None, inv_freq=inv_freq,
                            max_distance=max_distance) for _ in range(hkv)] for _ in range(b)]
    group, start = hq // hkv, 0
    for t in SCHEDULE:
        q, k, v = make_block(gen, b, hq, hkv, t, d)
        positions = torch.arange(start, start + t).expand(b, t).contiguous()
        out, state = op_block(state, q, k, v, positions, None, rope, inplace=inplace, recent=recent, sinks=sinks,
                              policy=policy, window=window)
        for row in range(b):
            for h in range(hkv):
                heads = slice(h * group, (h + 1) * group)
                want = sims[row][h].block(list(range(start, start + t)), q[row, heads], k[row, h], v[row, h], 0.25)
                torch.testing.assert_close(out[row, heads].double(), want, rtol=1e-4, atol=1e-5)
                assert kept_sets(state)[row][h] == sorted(sims[row][h].kept)
                # The cache holds the keys as they came, unrotated.
                for slot, p in enumerate(state.pos_cache[row, h].tolist()):
                    if p >= 0:
                        torch.testing.assert_close(state.key_cache[row, h, slot].double(), sims[row][h].keys[p],
                                                   rtol=1e-6, atol=1e-6)
        start += t


@pytest.mark.parametrize("max_distance", [0, 3], ids=["rank", "capped"])
def test_left_padding_takes_no_rolling_position(max_distance):
    """A left-padded row computes what the same row alone computes: padding is not counted among the ranks,
    nor taken for the newest token the capped distances count from."""
    hq, hkv, d, cap, pad = 4, 2, 16, 5, 3
    inv_freq = 1.0 / (30.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    rope = tables(inv_freq, cap + 12, max_distance=max_distance)
    gen = torch.Generator().manual_seed(2)
    kw = dict(recent=2, sinks=0, policy="h2o")
    padded, alone = reference.empty_state(2, hkv, cap, d), reference.empty_state(1, hkv, cap, d)
    q, k, v = make_block(gen, 2, hq, hkv, 9, d)
    valid = torch.ones(2, 9, dtype=torch.bool)
    valid[0, :pad] = False
    positions = torch.stack([torch.arange(9) - pad, torch.arange(9)]).clamp(min=0)
    out_padded, _ = op_block(padded, q, k, v, positions, valid, rope, inplace=True, **kw)
    out_alone, _ = op_block(alone, q[:1, :, pad:], k[:1, :, pad:], v[:1, :, pad:], positions[:1, pad:], None, rope,
                            inplace=True, **kw)
    torch.testing.assert_close(out_padded[:1, :, pad:], out_alone)
    for step in range(6):
        q, k, v = make_block(gen, 2, hq, hkv, 1, d)
        positions = torch.tensor([[9 - pad + step], [9 + step]])
        out_padded, _ = op_block(padded, q, k, v, positions, None, rope, inplace=True, **kw)
        out_alone, _ = op_block(alone, q[:1], k[:1], v[:1], positions[:1], None, rope, inplace=True, **kw)
        torch.testing.assert_close(out_padded[:1], out_alone)
    # A padded block over a full cache: 5 tokens, 2 of them padding in row 0 (with a cap of 3, T - 1 = 4 would
    # number the row's held keys differently from its 3 valid tokens alone).
    q, k, v = make_block(gen, 2, hq, hkv, 5, d)
    valid = torch.ones(2, 5, dtype=torch.bool)
    valid[0, :2] = False
    positions = torch.stack([torch.arange(12, 17) - 2, torch.arange(15, 20)]).clamp(min=0)
    out_padded, _ = op_block(padded, q, k, v, positions, valid, rope, inplace=True, **kw)
    out_alone, _ = op_block(alone, q[:1, :, 2:], k[:1, :, 2:], v[:1, :, 2:], positions[:1, 2:], None, rope,
                            inplace=True, **kw)
    torch.testing.assert_close(out_padded[:1, :, 2:], out_alone)


def test_ranks_number_held_entries_in_position_order():
    pos = torch.tensor([[[7, -1, 2, 40, -1, 3]]])
    valid = torch.tensor([[False, True, True]])
    cache_rank, block_rank = rolling_ranks(pos, valid)
    held = cache_rank[pos >= 0].tolist()
    assert held == [2, 0, 3, 1]                       # 7 -> 2, 2 -> 0, 40 -> 3, 3 -> 1
    assert block_rank[0, 0, 1:].tolist() == [4, 5]    # the valid tokens continue after the 4 held


def test_capped_distances_count_from_the_newest_valid_token():
    pos = torch.tensor([[[7, -1, 2, 40, -1, 38]]])
    new_pos = torch.tensor([[[-1, 41, 42]]])          # padding first, then positions 41 and 42
    cache_number, block_number = capped_distances(pos, new_pos, max_distance=4)
    held = cache_number[pos >= 0].tolist()
    assert held == [0, 0, 2, 0]                       # 40 is 2 before 42 (at 4); 7, 2 and 38 sit at the cap
    assert block_number[0, 0, 1:].tolist() == [3, 4]
    _, wide = capped_distances(pos, torch.tensor([[[30, 31, 32, 33, 34, 35, 36]]]), max_distance=4)
    assert wide[0, 0].tolist() == list(range(7))      # a block longer than the cap keeps its own distances
    _, padded = capped_distances(pos, torch.tensor([[[-1, -1, -1, 41, 42]]]), max_distance=1)
    assert padded[0, 0, 3:].tolist() == [0, 1]        # the cap widens to the 2 valid tokens, not to T = 5


@pytest.mark.parametrize("max_distance, rows, needed", [(0, 6, "C \\+ T = 7"),
                                                        (9, 9, "max\\(max_distance, T - 1\\) \\+ 1 = 10")])
def test_tables_too_short_are_an_error(max_distance, rows, needed):
    rope = tables(torch.ones(8, dtype=torch.float64), rows, max_distance=max_distance)
    state = reference.empty_state(1, 1, 5, 16)
    q, k, v = make_block(torch.Generator().manual_seed(0), 1, 1, 1, 2, 16)
    with pytest.raises(ValueError, match=f"rotary tables cover {rows} positions; rolling positions need {needed}"):
        op_block(state, q, k, v, torch.arange(2)[None], None, rope, inplace=True, recent=1, sinks=0, policy="h2o")


def test_max_distance_without_tables_or_negative_is_an_error():
    with pytest.raises(ValueError, match="max_distance=5 numbers keys for rolling positions"):
        as_tables(None, None, 5)
    with pytest.raises(ValueError, match="max_distance=-1 must be an int >= 0"):
        as_tables(torch.ones(1, 4, 2), torch.ones(1, 4, 2), -1)


def _filled(gen, b, hq, hkv, d, cap, rope, dtype, device, kw):
    """A cache after a prompt longer than C, through the reference with rolling positions."""
    state = reference.empty_state(b, hkv, cap, d, dtype=dtype, device=device)
    q, k, v = random_block(gen, b, hq, hkv, cap + 4, d, dtype, device)
    positions = torch.arange(cap + 4, device=device).expand(b, -1).contiguous()
    reference_decode.h2o_attention_(q, k, v, positions, None, state, rope=rope, **kw)
    return state, cap + 4


@pytest.mark.parametrize("max_distance", [0, 10], ids=["rank", "capped"])
@pytest.mark.parametrize("window", [0, 8])
@pytest.mark.parametrize("policy", ["h2o", "sink"])
def test_triton_rolling_positions_equal_reference(triton_device, policy, window, max_distance):
    from h2o_compile.kernels import triton_ops

    b, hq, hkv, d, cap, dtype = 2, 8, 2, 32, 13, torch.float32
    gen = torch.Generator().manual_seed(4)
    inv_freq = 1.0 / (100.0 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16))   # partial rotary: R = 16
    rope = RopeTables(*(t.to(triton_device) for t in tables(inv_freq, 2 * cap + 4)[:2]), max_distance)
    kw = dict(scale=d ** -0.5, recent=3, sinks=1, policy=policy, seed=7, window=window)
    want, start = _filled(gen, b, hq, hkv, d, cap, rope, dtype, triton_device, kw)
    got = want.clone()
    for t in [1, 1, 5, 1, 1]:  # decode steps and a chunk: the decode kernel and the prefill kernel
        q, k, v = random_block(gen, b, hq, hkv, t, d, dtype, triton_device)
        positions = torch.arange(start, start + t, device=triton_device).expand(b, -1).contiguous()
        out_want = reference_decode.h2o_attention_(q, k, v, positions, None, want, rope=rope, **kw)
        out_got = triton_ops.h2o_attention_(q, k, v, positions, None, got, rope=rope, **kw)
        assert_close_out(out_got, out_want)
        assert_same_state(got, want)
        start += t


@pytest.mark.parametrize("max_distance", [0, 6], ids=["rank", "capped"])
def test_compiled_cpu_decode_step_rolling_equals_reference(max_distance):
    """ops.decode_fusable_ (the compiled CPU decode step's form of the op) under torch.compile."""
    b, hq, hkv, d, cap = 2, 4, 2, 16, 9
    gen = torch.Generator().manual_seed(8)
    inv_freq = 1.0 / (30.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    rope = tables(inv_freq, 2 * cap + 4, max_distance=max_distance)  # the prompt reads C + (C + 4) rows
    kw = dict(scale=0.25, recent=2, sinks=1, policy="h2o", seed=0)
    want, start = _filled(gen, b, hq, hkv, d, cap, rope, torch.float32, "cpu", kw)
    got = want.clone()

    def step(q, k, v, positions, state):
        return ops.decode_fusable_(q, k, v, positions, None, *state[:4], kw["scale"], kw["recent"], kw["sinks"],
                                   kw["policy"], kw["seed"], 0, 0.0, None, rope.cos, rope.sin,
                                   max_distance=max_distance)

    compiled = torch.compile(step, fullgraph=True)
    for _ in range(4):
        q, k, v = random_block(gen, b, hq, hkv, 1, d, torch.float32, "cpu")
        positions = torch.full((b, 1), start)
        out_want = reference_decode.h2o_attention_(q, k, v, positions, None, want, rope=rope, **kw)
        out_got = compiled(q, k, v, positions, got)
        assert_close_out(out_got, out_want)
        assert_same_state(got, want)
        start += 1
