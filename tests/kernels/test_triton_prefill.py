"""The Triton prefill kernels (blocks of T > 1 tokens) against the reference op: same slots, outputs, scores.

Blocks go through ``triton_ops.h2o_attention_`` (prefill kernels + reference.compress) and through
``reference_decode.h2o_attention_`` from the same start; a schedule mixes a prompt longer than C, chunks that are
not multiples of the tile, and a decode step; the attention kinds (sliding window, soft-capping, sink logits)
run the same schedule. Without a GPU the kernels run under the Triton interpreter.
"""

from __future__ import annotations

import pytest
import torch

from h2o_compile.kernels import reference
from h2o_compile.kernels import reference_decode

from ..helpers import sink_logits_for
from .conftest import HAS_CUDA, assert_close_out, assert_same_state, random_block

pytest.importorskip("triton")
from h2o_compile.kernels import triton_ops, triton_prefill  # after conftest set TRITON_INTERPRET

POLICIES = ["h2o", "local", "sink", "random", "full"]
# (B, Hq, Hkv, D, C); C is never a power of two.
SHAPES = [(1, 8, 8, 32, 13), (3, 8, 2, 64, 11), (3, 8, 1, 128, 7)]
DTYPES = [torch.float32, torch.float16]
SCHEDULE = [19, 5, 1, 18]  # block sizes: prompt > C, ragged chunks (tile 16 under the interpreter), decode
if HAS_CUDA:
    SHAPES += [(4, 32, 8, 128, 410), (2, 16, 2, 64, 1000), (3, 8, 1, 80, 97)]
    DTYPES += [torch.bfloat16]


def block_validity(b, t, start, device):
    """Row 1 is left-padded (its first 3 tokens are padding), row 2 right-padded in the first block."""
    valid = torch.ones(b, t, dtype=torch.bool, device=device)
    if start == 0 and b > 2 and t > 6:
        valid[1, :3] = False
        valid[2, -2:] = False
    return valid


def run_schedule(device, shape, dtype, policy, sinks, schedule, seed=0, **kind):
    """``kind``: window / softcap / sink_logits, passed to both sides."""
    b, hq, hkv, d, cap = shape
    kw = dict(scale=d ** -0.5, recent=3, sinks=sinks, policy=policy, seed=5, **kind)
    gen = torch.Generator().manual_seed(seed)
    want = reference.empty_state(b, hkv, cap, d, dtype=dtype, device=device)
    got = reference.empty_state(b, hkv, cap, d, dtype=dtype, device=device)
    start = 0
    for t in schedule:
        q, k, v = random_block(gen, b, hq, hkv, t, d, dtype, device)
        positions = torch.arange(start, start + t, device=device).expand(b, t).contiguous()
        valid = block_validity(b, t, start, device)
        out_want = reference_decode.h2o_attention_(q, k, v, positions, valid, want, **kw)
        out_got = triton_ops.h2o_attention_(q, k, v, positions, valid, got, **kw)
        assert_close_out(out_got, out_want)
        assert_same_state(got, want)
        start += t


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}_hq{}_hkv{}_d{}_c{}".format(*s))
def test_prefill_matches_reference(triton_device, shape, dtype):
    schedule = SCHEDULE if triton_device.type == "cpu" else [3 * shape[4] + 5, 77, 1, 1, 130]
    run_schedule(triton_device, shape, dtype, "h2o", 1, schedule)


@pytest.mark.parametrize("sinks", [0, 2])
@pytest.mark.parametrize("policy", POLICIES)
def test_prefill_policies_match_reference(triton_device, policy, sinks):
    run_schedule(triton_device, (3, 8, 2, 32, 9), torch.float32, policy, sinks, [17, 6, 20], seed=1)


# Window 5: most tile pairs lie wholly outside it (the kernels skip them); 24: larger than C and a chunk.
@pytest.mark.parametrize("with_sinks", [False, True], ids=["nosink", "sink"])
@pytest.mark.parametrize("softcap", [0.0, 3.0])
@pytest.mark.parametrize("window", [0, 5, 24])
def test_prefill_attention_kinds_match_reference(triton_device, window, softcap, with_sinks):
    # G = 3, rows with left and right padding in the prompt, a decode step inside the schedule.
    shape = (3, 6, 2, 32, 11) if triton_device.type == "cpu" else (3, 32, 8, 128, 410)
    schedule = SCHEDULE if triton_device.type == "cpu" else [3 * shape[4] + 5, 77, 1, 1, 130]
    sink_logits = sink_logits_for(shape[1], triton_device) if with_sinks else None
    run_schedule(triton_device, shape, torch.float32, "h2o", 1, schedule, seed=3, window=window,
                 softcap=softcap, sink_logits=sink_logits)


KINDS = {"plain": {}, "window": dict(window=7), "softcap": dict(softcap=2.0), "sinks": dict(sinks=True),
         "all": dict(window=7, softcap=2.0, sinks=True),
         # score="max": each key's largest head-summed probability over the queries instead of their sum
         "peak": dict(peak=True), "peak all": dict(window=7, softcap=2.0, sinks=True, peak=True)}


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_attend_kernel_matches_reference_attend(triton_device, dtype, kind):
    """The kernels alone on a cache with holes (pos -1) and slots newer than some queries."""
    b, hq, hkv, d, cap, t = 2, 8, 2, 32, 21, 35
    gen = torch.Generator().manual_seed(2)
    q, k_all, v_all = random_block(gen, b, hq, hkv, cap + t, d, dtype, triton_device)
    q = q[:, :, :t]
    key_pos = torch.randint(0, 40, (b, hkv, cap), generator=gen).to(triton_device)
    key_pos[:, :, ::4] = -1
    positions = torch.arange(30, 30 + t, device=triton_device).expand(b, t).contiguous()
    valid = torch.rand(b, t, generator=gen).to(triton_device) > 0.2
    new_pos = torch.where(valid, positions, -1)[:, None].expand(b, hkv, t)
    all_pos = torch.cat([key_pos, new_pos], dim=2)
    kw = dict(KINDS[kind])
    if kw.pop("sinks", False):
        kw["sink_logits"] = sink_logits_for(hq, triton_device)
    out, mass = triton_prefill.prefill_attend(q, k_all, v_all, all_pos, positions, valid, scale=d ** -0.5,
                                              cache_len=cap, **kw)
    out_want, mass_want = reference.attend(q, k_all, v_all, all_pos, positions, valid, d ** -0.5, **kw)
    assert_close_out(out, out_want)
    torch.testing.assert_close(mass, mass_want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", ["plain", "all"])
def test_h2o_op_dispatches_to_triton(triton_device, monkeypatch, kind):
    """torch.ops.h2o.attention_ with H2O_COMPILE_BACKEND=triton equals the reference backend."""
    b, hq, hkv, d, cap = 2, 8, 2, 32, 10
    gen = torch.Generator().manual_seed(4)
    extra = (7, 2.0, sink_logits_for(hq, triton_device)) if kind == "all" else ()  # window, softcap, sinks
    states = {name: reference.empty_state(b, hkv, cap, d, device=triton_device)
              for name in ("reference", "triton")}
    start = 0
    for t in [14, 1, 1, 3, 1]:
        q, k, v = random_block(gen, b, hq, hkv, t, d, torch.float32, triton_device)
        positions = torch.arange(start, start + t, device=triton_device).expand(b, t).contiguous()
        outs = {}
        for name, state in states.items():
            monkeypatch.setenv("H2O_COMPILE_BACKEND", name)
            outs[name] = torch.ops.h2o.attention_(q, k, v, positions, None, *state[:4], d ** -0.5, 3, 1, "h2o", 0,
                                                  *extra)
        assert_close_out(outs["triton"], outs["reference"])
        assert_same_state(states["triton"], states["reference"])
        start += t
