"""The Triton decode kernel (T = 1) against reference_decode.h2o_decode_: the same slots, outputs and scores.

Each test fills a cache with the reference prefill (a prompt longer than C), empties two slots far apart
(in different blocks and splits when C > 16), then runs decode steps on a copy with the kernel and on the
original with the reference: the first two steps fill the holes, lowest slot first, every later step evicts.
The attention kinds (sliding window, soft-capping, sink logits) are checked the same way, and once against the
independent float64 simulation. Without a GPU the kernel runs under the Triton interpreter (see conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from h2o_compile.kernels import reference
from h2o_compile.kernels import reference_decode

from ..helpers import sink_logits_for
from .conftest import HAS_CUDA, assert_close_out, assert_same_state, random_block
from .h2o_simulation import SimulatedCache

pytest.importorskip("triton")
from h2o_compile.kernels import triton_ops  # after conftest set TRITON_INTERPRET

POLICIES = ["h2o", "local", "sink", "random", "full"]
# (B, Hq, Hkv, D, C, split size): C is never a power of two; split 16 (one interpreter block) forces
# split-K with a ragged last split; 0 lets the wrapper choose (one split under the interpreter).
SHAPES = [(1, 8, 8, 32, 13, 0), (3, 8, 2, 64, 37, 16), (3, 8, 1, 128, 11, 0), (1, 8, 2, 32, 40, 16)]
DTYPES = [torch.float32, torch.float16]
if HAS_CUDA:  # the interpreter is too slow for these, and has no bf16
    SHAPES += [(4, 32, 8, 128, 1639, 0), (2, 32, 8, 128, 819, 64), (3, 16, 2, 64, 300, 0),
               (4, 8, 1, 64, 97, 32)]
    DTYPES += [torch.bfloat16]


def run_decode(device, shape, dtype, policy, sinks, steps=6, seed=0, left_pad=False, **kind):
    """``kind``: window / softcap / sink_logits, passed to both sides. ``left_pad``: row 1's prompt starts
    with 4 padding tokens (its cache then holds fewer, older-looking entries)."""
    b, hq, hkv, d, cap, split = shape
    recent = 3
    kw = dict(scale=d ** -0.5, recent=recent, sinks=sinks, policy=policy, seed=7, **kind)
    gen = torch.Generator().manual_seed(seed)
    # Rows at different positions, as in a batch of prompts of different lengths.
    offset = torch.arange(b, device=device)[:, None] * 5                          # [B, 1]
    prompt = cap + 2
    want = reference.empty_state(b, hkv, cap, d, dtype=dtype, device=device)
    q, k, v = random_block(gen, b, hq, hkv, prompt, d, dtype, device)
    positions = torch.arange(prompt, device=device)[None, :] + offset
    valid = torch.ones(b, prompt, dtype=torch.bool, device=device)
    if left_pad and b > 1:
        valid[1, :4] = False
    reference_decode.h2o_attention_(q, k, v, positions, valid, want, **kw)
    want.pos_cache[:, :, [cap - 2, 1]] = -1
    got = want.clone()
    for step in range(steps):
        q, k, v = random_block(gen, b, hq, hkv, 1, d, dtype, device)
        positions = prompt + step + offset
        valid = torch.ones(b, 1, dtype=torch.bool, device=device)
        if b > 1 and step == 2:
            valid[1] = False  # a padding token: no write, no mass, zero output
        out_want = reference_decode.h2o_decode_(q, k, v, positions, valid, want, **kw)
        out_got = triton_ops.h2o_attention_(q, k, v, positions, valid, got, split_size=split, **kw)
        assert_close_out(out_got, out_want)
        assert_same_state(got, want)
    return got


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}_hq{}_hkv{}_d{}_c{}_split{}".format(*s))
def test_decode_matches_reference(triton_device, shape, dtype):
    run_decode(triton_device, shape, dtype, "h2o", sinks=1)


@pytest.mark.parametrize("sinks", [0, 2])
@pytest.mark.parametrize("policy", POLICIES)
def test_decode_policies_match_reference(triton_device, policy, sinks):
    shape = (3, 8, 2, 32, 21, 16) if triton_device.type == "cpu" else (4, 32, 8, 128, 500, 64)
    run_decode(triton_device, shape, torch.float32, policy, sinks, steps=5, seed=1)


# Windows: 5 < C (the prompt leaves at most 5 live keys, so the steps fill empty slots while dead keys linger,
# hidden: visibility) and 24 > C (H2O evicts by score, and the sink and heavy hitters it kept then leave the
# window and must be overwritten first: eviction).
@pytest.mark.parametrize("with_sinks", [False, True], ids=["nosink", "sink"])
@pytest.mark.parametrize("softcap", [0.0, 3.0])
@pytest.mark.parametrize("window", [0, 5, 24])
def test_decode_attention_kinds_match_reference(triton_device, window, softcap, with_sinks):
    # G = 3 (padded to a power of two), split-K with a ragged last split, a left-padded row.
    shape = (3, 12, 4, 32, 21, 16) if triton_device.type == "cpu" else (4, 32, 8, 128, 500, 64)
    sink_logits = sink_logits_for(shape[1], triton_device) if with_sinks else None
    run_decode(triton_device, shape, torch.float32, "h2o", 1, steps=9, seed=2, left_pad=True, window=window,
               softcap=softcap, sink_logits=sink_logits)


@pytest.mark.parametrize("policy", ["h2o", "sink"])
def test_decode_kinds_match_float64_simulation(triton_device, policy):
    """Prompt (the Triton prefill) then decode steps, all through the kernels, against the brute-force
    float64 simulation of docs/design.md section 2 (not the reference): live kept positions, scores, outputs."""
    b, hq, hkv, d, cap, window, softcap, sinks = 2, 6, 2, 16, 9, 12, 2.5, 1
    group = hq // hkv
    scale = d ** -0.5
    gen = torch.Generator().manual_seed(8)
    sink_logits = sink_logits_for(hq, triton_device, seed=9)
    kw = dict(scale=scale, recent=2, sinks=sinks, policy=policy, seed=0, window=window, softcap=softcap,
              sink_logits=sink_logits)
    state = reference.empty_state(b, hkv, cap, d, device=triton_device)
    sims = [[SimulatedCache(cap, 2, sinks, policy, window=window, softcap=softcap,
                            sink_logits=sink_logits[h * group:(h + 1) * group].cpu().double())
             for h in range(hkv)] for _ in range(b)]
    start = 0
    for t in [11] + [1] * 16:  # 16 decode steps: every early key leaves the window of 12
        q, k, v = random_block(gen, b, hq, hkv, t, d, torch.float32, triton_device)
        positions = torch.arange(start, start + t, device=triton_device).expand(b, t).contiguous()
        out = triton_ops.h2o_attention_(q, k, v, positions, None, state, split_size=16, **kw).cpu().double()
        start += t
        for row in range(b):
            for h in range(hkv):
                sim = sims[row][h]
                heads = slice(h * group, (h + 1) * group)
                want = sim.block(list(range(start - t, start)), q[row, heads].cpu().double(),
                                 k[row, h].cpu().double(), v[row, h].cpu().double(), scale)
                torch.testing.assert_close(out[row, heads], want, rtol=1e-4, atol=1e-5)
                slots = {p: s for p, s in zip(state.pos_cache[row, h].tolist(), state.score_cache[row, h].tolist())
                         if p > start - 1 - window}  # live entries; a dead key may linger in its slot
                assert sorted(slots) == sorted(sim.kept), (start, row, h)
                for p, score in slots.items():
                    assert score == pytest.approx(sim.score[p], rel=1e-4, abs=1e-5)


def test_decode_keeps_the_heavy_hitter(triton_device):
    """A check of the slot choice that does not lean on the reference: a key that every query attends to
    strongly survives every eviction, and each new token is written exactly once."""
    b, hq, hkv, d, cap = 1, 8, 2, 32, 9
    gen = torch.Generator().manual_seed(3)
    direction = torch.randn(d, generator=gen)
    direction = (direction * 4.0 / direction.norm()).to(triton_device)
    kw = dict(scale=d ** -0.5, recent=2, sinks=0, policy="h2o", seed=0)
    state = reference.empty_state(b, hkv, cap, d, device=triton_device)
    q, k, v = random_block(gen, b, hq, hkv, cap, d, torch.float32, triton_device)
    k[:, :, 4] = direction
    triton_ops.h2o_attention_(q + direction, k, v, torch.arange(cap, device=triton_device)[None], None, state,
                              **kw)
    for step in range(cap, cap + 6):
        q, k, v = random_block(gen, b, hq, hkv, 1, d, torch.float32, triton_device)
        positions = torch.tensor([[step]], device=triton_device)
        triton_ops.h2o_attention_(q + direction, k, v, positions, None, state, **kw)
        assert (state.pos_cache == 4).sum(-1).eq(1).all(), state.pos_cache
        assert (state.pos_cache == step).sum(-1).eq(1).all(), state.pos_cache


@pytest.mark.skipif(not HAS_CUDA, reason="CUDA graphs need a GPU")
def test_decode_step_replays_in_cuda_graph():
    """No host sync in the decode step: captured once, replayed with new inputs, it tracks the reference."""
    device = torch.device("cuda")
    b, hq, hkv, d, cap = 2, 32, 8, 128, 300
    kw = dict(scale=d ** -0.5, recent=20, sinks=4, policy="h2o", seed=0)
    gen = torch.Generator().manual_seed(5)
    want = reference.empty_state(b, hkv, cap, d, dtype=torch.float16, device=device)
    q, k, v = random_block(gen, b, hq, hkv, cap + 50, d, torch.float16, device)
    reference_decode.h2o_attention_(q, k, v, torch.arange(cap + 50, device=device).expand(b, -1), None, want, **kw)
    got = want.clone()
    static = random_block(gen, b, hq, hkv, 1, d, torch.float16, device)
    static_pos = torch.zeros(b, 1, dtype=torch.int64, device=device)
    scratch = want.clone()  # warm-up (compilation) must not touch `got`
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        triton_ops.h2o_attention_(*static, static_pos, None, scratch, **kw)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            static_out = triton_ops.h2o_attention_(*static, static_pos, None, got, **kw)
    torch.cuda.current_stream().wait_stream(stream)
    for step in range(cap + 50, cap + 58):
        q, k, v = random_block(gen, b, hq, hkv, 1, d, torch.float16, device)
        for buf, new in zip(static, (q, k, v)):
            buf.copy_(new)
        static_pos.fill_(step)
        graph.replay()
        out_want = reference_decode.h2o_decode_(q, k, v, static_pos.clone(), None, want, **kw)
        assert_close_out(static_out, out_want)
        assert_same_state(got, want)


@pytest.mark.skipif(not HAS_CUDA, reason="Inductor emits Triton only for CUDA")
def test_decode_op_compiles_without_graph_breaks():
    """torch.compile(fullgraph=True) keeps the triton_op and the torch bookkeeping in one graph, with the same
    result."""
    device = torch.device("cuda")
    b, hq, hkv, d, cap = 2, 16, 4, 64, 100
    gen = torch.Generator().manual_seed(6)
    want = reference.empty_state(b, hkv, cap, d, dtype=torch.bfloat16, device=device)
    got = reference.empty_state(b, hkv, cap, d, dtype=torch.bfloat16, device=device)

    def step(q, k, v, positions, kc, vc, sc, pc):
        state = reference.H2OState(kc, vc, sc, pc)
        return triton_ops.h2o_attention_(q, k, v, positions, None, state, scale=d ** -0.5, recent=10, sinks=2,
                                         policy="h2o")

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    for t in range(cap + 10):
        q, k, v = random_block(gen, b, hq, hkv, 1, d, torch.bfloat16, device)
        positions = torch.full((b, 1), t, device=device)
        out_want = reference_decode.h2o_decode_(q, k, v, positions, None, want, scale=d ** -0.5, recent=10, sinks=2,
                                         policy="h2o")
        assert_close_out(compiled(q, k, v, positions, *got[:4]), out_want)
    assert_same_state(got, want)
