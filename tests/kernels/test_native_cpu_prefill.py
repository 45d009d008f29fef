"""The native one-pass causal prefill (kernels/native/prefill_mass.cc) against a float64 softmax written out in
full, its build and its fallback; and the op's prefill takes it exactly where a rule reads the mass."""

from __future__ import annotations

import pytest
import torch

from h2o_compile.ops import dispatch
from h2o_compile.kernels import native_cpu, reference
from h2o_compile.kernels.native_build import NativeBuildError

from ..helpers import has_compiler

needs_compiler = pytest.mark.skipif(not has_compiler(), reason="no C++ compiler: the op cannot be built here")

# (N, G, T, C, D): one tile and several (T not a multiple of the 64-query tile), MHA / GQA, an empty cache,
# one query, a 256-wide head (Gemma 3).
SHAPES = [(3, 2, 150, 40, 32), (2, 4, 70, 0, 16), (1, 1, 1, 5, 8), (2, 3, 129, 3, 64), (1, 4, 65, 20, 256)]


def _brute_force(q, k, v, cache_pos, query_pos, window, scale, sink, weight, peak=False):
    """Every logit in float64, the visibility written out from positions, softmax with the sink as one more
    column; the mass sums (``peak``: takes the maximum of) each query's weighted sum over the group's heads."""
    n, g, t, _ = q.shape
    logits = torch.einsum("ngtd,nsd->ngts", q.double(), k.double()) * scale
    key_pos = torch.cat([cache_pos, query_pos], dim=1)[:, None, :]                  # [N, 1, S]
    newest = query_pos[:, :, None]                                                   # [N, T, 1]
    visible = (key_pos >= 0) & (key_pos <= newest)
    if window:
        visible &= key_pos > newest - window
    logits = logits.masked_fill(~visible[:, None], float("-inf"))
    sink_col = (torch.full((n, g, t, 1), float("-inf"), dtype=torch.float64) if sink is None
                else sink.double()[:, :, None, None].expand(n, g, t, 1))
    probs = torch.softmax(torch.cat([logits, sink_col], dim=-1), dim=-1)[..., :-1]
    w = torch.ones(n, t, dtype=torch.float64) if weight is None else weight.double()
    per_query = probs.sum(dim=1) * w[:, :, None]                                    # [N, T, S]
    mass = per_query.amax(dim=1) if peak else per_query.sum(dim=1)
    return torch.einsum("ngts,nsd->ngtd", probs, v.double()), mass


def _positions(n, t, cap, gen, *, in_block=False):
    """Query positions increasing by 1 or 2 (gaps test the window's search), after the cache's; cache slots
    at distinct older positions, a fifth empty. ``in_block``: some cached positions inside the block's range
    (a key a query must not see before its position)."""
    query_pos = cap + 5 + torch.randint(1, 3, (n, t), generator=gen).cumsum(dim=1)
    span = cap + 5 + (t if in_block else 0)
    cache_pos = torch.stack([torch.randperm(span, generator=gen)[:cap] for _ in range(n)])
    return torch.where(torch.rand(n, cap, generator=gen) < 0.2, -1, cache_pos), query_pos


@needs_compiler
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "n{}_g{}_t{}_c{}_d{}".format(*s))
@pytest.mark.parametrize("window", [0, 6, 40])
@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("weights", [None, "random", "last 5"])
@pytest.mark.parametrize("peak", [False, True], ids=["sum", "peak"])
def test_one_pass_equals_the_float64_softmax(shape, window, sinks, weights, peak):
    n, g, t, cap, d = shape
    gen = torch.Generator().manual_seed(sum(shape) + window)
    q, k, v = (torch.randn(n, g, t, d, generator=gen), torch.randn(n, cap + t, d, generator=gen),
               torch.randn(n, cap + t, d, generator=gen))
    cache_pos, query_pos = _positions(n, t, cap, gen, in_block=window == 40)
    sink = torch.randn(n, g, generator=gen) if sinks else None
    weight = {None: None, "random": torch.rand(n, t, generator=gen),
              "last 5": (torch.arange(t) >= t - 5).float().expand(n, t)}[weights]
    args = (cache_pos, query_pos, window, d ** -0.5, sink, weight)
    out, mass = native_cpu.causal_attend_with_mass(q, k, v, *args, peak=peak)
    want_out, want_mass = _brute_force(q, k, v, *args, peak=peak)
    torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mass.double(), want_mass, rtol=1e-5, atol=1e-5)
    assert not mass[:, :cap][cache_pos < 0].any()  # an empty slot gets exactly nothing


@needs_compiler
@pytest.mark.parametrize("peak", [False, True], ids=["sum", "peak"])
def test_threads_split_one_heads_tiles_and_combine(peak):
    """Three threads over one KV head's 3 tiles (and 2 query heads for the sum): each thread's range holds part of
    the same head's mass, combined by a sum (or a max) afterwards; the float64 result either way. (The test
    session runs one thread per worker, where every call has a single range.)"""
    gen = torch.Generator().manual_seed(7)
    q, k, v = torch.randn(1, 2, 150, 16, generator=gen), torch.randn(1, 160, 16, generator=gen), torch.randn(1, 160, 16)
    cache_pos, query_pos = _positions(1, 150, 10, gen)
    weight = torch.rand(1, 150, generator=gen)
    args = (cache_pos, query_pos, 0, 0.25, None, weight)
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        out, mass = native_cpu.causal_attend_with_mass(q, k, v, *args, peak=peak)
    finally:
        torch.set_num_threads(threads)
    want_out, want_mass = _brute_force(q, k, v, *args, peak=peak)
    torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mass.double(), want_mass, rtol=1e-5, atol=1e-5)


@needs_compiler
def test_bf16_in_bf16_out_fp32_inside():
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 2, 90, 32, generator=gen), torch.randn(2, 100, 32), torch.randn(2, 100, 32)
    cache_pos, query_pos = torch.arange(10).expand(2, 10), torch.arange(10, 100).expand(2, 90)
    low = [x.bfloat16() for x in (q, k, v)]
    out, mass = native_cpu.causal_attend_with_mass(*low, cache_pos, query_pos, 0, 0.2, None, None)
    want_out, want_mass = _brute_force(*[x.float() for x in low], cache_pos, query_pos, 0, 0.2, None, None)
    assert out.dtype == torch.bfloat16 and mass.dtype == torch.float32
    torch.testing.assert_close(out.double(), want_out, rtol=1e-2, atol=1e-2)  # one bf16 rounding of the output
    torch.testing.assert_close(mass.double(), want_mass, rtol=1e-5, atol=1e-5)


@needs_compiler
def test_bad_shapes_and_dtypes_are_named():
    native_cpu.available()
    q, k, cache = torch.randn(1, 1, 4, 8), torch.randn(1, 4, 8), torch.ones(1, 0, dtype=torch.long)
    op = torch.ops.h2o_cpu.causal_attend_with_mass
    with pytest.raises(RuntimeError, match="keys/values must hold the C cached and T block keys"):
        op(q, k[:, :3], k, cache, torch.arange(4)[None], 0, 1.0, None, None, 64)
    with pytest.raises(RuntimeError, match="fp32 q/keys/values and int64 positions"):
        op(q.double(), k, k, cache, torch.arange(4)[None], 0, 1.0, None, None, 64)
    with pytest.raises(RuntimeError, match="query positions must increase along the block"):
        op(q, k, k, cache, torch.tensor([[0, 1, 1, 2]]), 0, 1.0, None, None, 64)
    with pytest.raises(RuntimeError, match="query_tile must be >= 1, got 0"):
        op(q, k, k, cache, torch.arange(4)[None], 0, 1.0, None, None, 0)


def test_a_failed_build_names_the_command_and_the_prefill_falls_back(monkeypatch, tmp_path):
    monkeypatch.setenv("H2O_COMPILE_CACHE", str(tmp_path))
    fake = tmp_path / "bad-cxx"
    fake.write_text("#!/bin/sh\necho 'fatal: no' >&2\nexit 3\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CXX", str(fake))
    with pytest.raises(NativeBuildError, match=r"(?s)native CPU ops failed \(exit 3\).*bad-cxx.*"
                                               r"prefill_mass.cc.*fatal: no"):
        native_cpu.library_path()
    monkeypatch.setattr(native_cpu, "_state", {})
    with pytest.warns(RuntimeWarning, match="(?s)two-pass path and the decode step torch's operators.*fatal: no"):
        assert native_cpu.available() is False
    assert native_cpu.available() is False  # decided once per process
    monkeypatch.setattr(native_cpu, "_state", {})
    monkeypatch.setenv(native_cpu.OFF_SWITCH, "0")
    assert native_cpu.available() is False and native_cpu._state["why"] == f"{native_cpu.OFF_SWITCH}=0"


@needs_compiler
def test_the_library_is_built_once_per_torch_and_source():
    path = native_cpu.library_path()
    assert f"torch-{torch.__version__}-" in str(path) and path == native_cpu.library_path()


@needs_compiler
@pytest.mark.parametrize("policy,window,taken", [("h2o", 0, True), ("h2o+score=max", 0, True), ("sink", 0, False),
                                                  ("h2o+score=knorm", 0, False),
                                                  ("local", 0, False), ("h2o", 8, True), ("sink", 8, True)])
def test_the_op_prefill_takes_the_one_pass_where_a_rule_reads_the_mass(monkeypatch, policy, window, taken):
    """A first prompt through the whole H2O op: the paper's rule and the peak (scores read) through the one-pass
    op, the rules that read none through torch's causal kernel alone, except on a window layer (the one-pass op
    is faster there either way)."""
    calls = []
    real = native_cpu.causal_attend_with_mass
    monkeypatch.setattr(native_cpu, "causal_attend_with_mass", lambda *a, **k: calls.append(1) or real(*a, **k))
    gen = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(1, 4, 40, 16, generator=gen), torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16)
    positions, valid = torch.arange(40)[None], torch.ones(1, 40, dtype=torch.bool)
    state = reference.empty_state(1, 2, 8, 16)
    dispatch.h2o_attention(q, k, v, positions, valid, state, scale=0.25, recent=4, sinks=0, policy=policy,
                           window=window)
    assert bool(calls) is taken
