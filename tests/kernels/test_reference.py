"""The reference op (in-place and functional) against the brute-force simulation, plus invariants."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import h2o_compile  # noqa: F401  (registers torch.ops.h2o)
from h2o_compile.kernels import reference

from .h2o_simulation import SimulatedCache

POLICIES = ["h2o", "local", "sink", "random", "full"]
# A prompt block bigger than the cache, decode steps, a mid-sequence chunk, more decode steps.
SCHEDULE = [7, 1, 1, 1, 3, 1, 1, 2, 1, 1]


def make_block(gen, b, hq, hkv, t, d, dtype=torch.float32):
    q = torch.randn(b, hq, t, d, generator=gen, dtype=torch.float64)
    k = torch.randn(b, hkv, t, d, generator=gen, dtype=torch.float64)
    v = torch.randn(b, hkv, t, d, generator=gen, dtype=torch.float64)
    return q, k, v


def run_op(state, q, k, v, positions, valid, *, inplace, **kw):
    """One block through torch.ops.h2o; returns (out, state)."""
    args = (q.float(), k.float(), v.float(), positions, valid)
    if inplace:
        out = torch.ops.h2o.attention_(*args, *state[:4], kw["scale"], kw["recent"], kw["sinks"], kw["policy"],
                                       kw["seed"])
        return out, state
    out, *new = torch.ops.h2o.attention(*args, *state[:4], kw["scale"], kw["recent"], kw["sinks"], kw["policy"],
                                        kw["seed"])
    return out, reference.H2OState(*new[:4])  # no scales: not quantized


def kept_sets(state):
    pos = state.pos_cache
    return [[sorted(p for p in pos[b, h].tolist() if p >= 0) for h in range(pos.shape[1])]
            for b in range(pos.shape[0])]


@pytest.mark.parametrize("inplace", [True, False], ids=["inplace", "functional"])
@pytest.mark.parametrize("sinks", [0, 2])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("b,hq,hkv,d", [(1, 4, 4, 16), (3, 8, 2, 64), (3, 8, 1, 16), (1, 8, 2, 64)])
def test_matches_bruteforce_simulation(b, hq, hkv, d, policy, sinks, inplace):
    total = sum(SCHEDULE)
    cap = total if policy == "full" else 5
    recent = 2
    seed = 3
    scale = d ** -0.5
    gen = torch.Generator().manual_seed(hash((b, hq, hkv, d, policy, sinks)) % 2**31)
    state = reference.empty_state(b, hkv, cap, d)
    sims = [[SimulatedCache(cap, recent, sinks, policy, seed) for _ in range(hkv)] for _ in range(b)]
    group = hq // hkv
    start = 0
    for t in SCHEDULE:
        q, k, v = make_block(gen, b, hq, hkv, t, d)
        positions = torch.arange(start, start + t).expand(b, t).contiguous()
        out, state = run_op(state, q, k, v, positions, None, inplace=inplace, scale=scale, recent=recent,
                            sinks=sinks, policy=policy, seed=seed)
        for row in range(b):
            for h in range(hkv):
                want = sims[row][h].block(list(range(start, start + t)), q[row, h * group:(h + 1) * group],
                                          k[row, h], v[row, h], scale)
                got = out[row, h * group:(h + 1) * group].double()
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
                assert kept_sets(state)[row][h] == sorted(sims[row][h].kept)
                scores = {p: s for p, s in zip(state.pos_cache[row, h].tolist(),
                                               state.score_cache[row, h].tolist()) if p >= 0}
                for p, s in scores.items():
                    assert s == pytest.approx(sims[row][h].score[p], rel=1e-4, abs=1e-5)
        start += t


@pytest.mark.parametrize("policy", ["h2o", "random", "sink"])
def test_kept_are_protected_plus_top_scoring(policy):
    """After each block: kept = sinks ∪ recent window ∪ the best of the rest by (priority, position)."""
    b, hq, hkv, d, cap, recent, sinks = 2, 8, 2, 16, 6, 2, 1
    gen = torch.Generator().manual_seed(7)
    state = reference.empty_state(b, hkv, cap, d)
    start = 0
    kw = dict(scale=0.25, recent=recent, sinks=sinks, policy=policy, seed=11)
    for t in [9, 1, 1, 4, 1, 1, 1, 5, 1]:
        q, k, v = make_block(gen, b, hq, hkv, t, d)
        positions = torch.arange(start, start + t).expand(b, t).contiguous()
        # The same block on a cache with room for everything shows the scores before eviction.
        roomy = reference.H2OState(*(torch.cat([x, y], dim=2) for x, y in
                                     zip(state.tensors(), reference.empty_state(b, hkv, t, d).tensors())))
        _, before = run_op(roomy, q, k, v, positions, None, inplace=False, **kw)
        _, state = run_op(state, q, k, v, positions, None, inplace=True, **kw)
        newest = start + t - 1
        for row in range(b):
            for h in range(hkv):
                entries = [(p, s) for p, s in zip(before.pos_cache[row, h].tolist(),
                                                  before.score_cache[row, h].tolist()) if p >= 0]
                protected = {p for p, _ in entries if p < sinks or p > newest - recent}
                if policy == "h2o":
                    rank = {p: (s, p) for p, s in entries}
                elif policy == "random":
                    rank = {p: (reference.random_priority(torch.tensor(p), 11).item(), p) for p, _ in entries}
                else:
                    rank = {p: (p, p) for p, _ in entries}
                rest = sorted((p for p, _ in entries if p not in protected), key=rank.get, reverse=True)
                expected = protected | set(rest[: max(0, cap - len(protected))])
                assert set(kept_sets(state)[row][h]) == expected
        start += t


@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (8, 1)])
def test_budget_covering_sequence_is_causal_sdpa(hq, hkv):
    b, d, total = 2, 32, 20
    gen = torch.Generator().manual_seed(0)
    q, k, v = (x.float() for x in make_block(gen, b, hq, hkv, total, d))
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1),
                                          is_causal=True)
    state = reference.empty_state(b, hkv, total, d)
    outs, start = [], 0
    for t in [12, 1, 1, 3, 1, 1, 1]:
        positions = torch.arange(start, start + t).expand(b, t).contiguous()
        sl = slice(start, start + t)
        outs.append(torch.ops.h2o.attention_(q[:, :, sl], k[:, :, sl], v[:, :, sl], positions, None, *state[:4],
                                             d ** -0.5, 10, 0, "h2o", 0))
        start += t
    torch.testing.assert_close(torch.cat(outs, dim=2), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("policy", ["h2o", "local"])
def test_left_padded_row_equals_unpadded(policy):
    hq, hkv, d, cap, pad = 8, 2, 16, 5, 3
    gen = torch.Generator().manual_seed(1)
    kw = dict(scale=0.25, recent=2, sinks=0, policy=policy, seed=0)
    padded = reference.empty_state(2, hkv, cap, d)
    alone = reference.empty_state(1, hkv, cap, d)
    # Row 0 carries `pad` padding tokens in front of its prompt; row 1 is a full-length distractor.
    q, k, v = make_block(gen, 2, hq, hkv, 9, d)
    valid = torch.ones(2, 9, dtype=torch.bool)
    valid[0, :pad] = False
    positions = torch.stack([torch.arange(9) - pad, torch.arange(9)]).clamp(min=0)
    out_padded, _ = run_op(padded, q, k, v, positions, valid, inplace=True, **kw)
    out_alone, _ = run_op(alone, q[:1, :, pad:], k[:1, :, pad:], v[:1, :, pad:], positions[:1, pad:], None,
                          inplace=True, **kw)
    torch.testing.assert_close(out_padded[:1, :, pad:], out_alone)
    assert torch.all(out_padded[0, :, :pad] == 0)
    for step in range(6):
        q, k, v = make_block(gen, 2, hq, hkv, 1, d)
        positions = torch.tensor([[9 - pad + step], [9 + step]])
        out_padded, _ = run_op(padded, q, k, v, positions, None, inplace=True, **kw)
        out_alone, _ = run_op(alone, q[:1], k[:1], v[:1], positions[:1], None, inplace=True, **kw)
        torch.testing.assert_close(out_padded[:1], out_alone)
        assert kept_sets(padded)[0] == kept_sets(alone)[0]


@pytest.mark.parametrize("policy", ["h2o", "random"])
def test_one_query_per_chunk_matches_bruteforce_simulation(monkeypatch, policy):
    """attend() in query chunks (here one query each, reading only the keys up to it) is the same attention."""
    monkeypatch.setattr(reference, "_LOGITS_PER_CHUNK", 1)
    test_matches_bruteforce_simulation(3, 8, 2, 16, policy, 2, True)
    test_left_padded_row_equals_unpadded(policy)


def test_decode_fast_path_equals_general_path():
    """T = 1 in place (slot write) and functional (rebuild) give the same slots, not just the same sets."""
    b, hq, hkv, d, cap = 3, 8, 2, 16, 4
    gen = torch.Generator().manual_seed(5)
    kw = dict(scale=0.25, recent=1, sinks=1, policy="h2o", seed=0)
    fast = reference.empty_state(b, hkv, cap, d)
    general = reference.empty_state(b, hkv, cap, d)
    for t in range(12):
        q, k, v = make_block(gen, b, hq, hkv, 1, d)
        positions = torch.full((b, 1), t)
        out_fast, _ = run_op(fast, q, k, v, positions, None, inplace=True, **kw)
        out_general, general = run_op(general, q, k, v, positions, None, inplace=False, **kw)
        torch.testing.assert_close(out_fast, out_general)
        for x, y in zip(fast, general):
            torch.testing.assert_close(x, y)
