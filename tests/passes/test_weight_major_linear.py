"""The decode step's linears as weight @ x^T (passes/weight_major_linear.py): the same products as
``F.linear`` in float64, every ``aten.linear`` of a captured graph rewritten, and the compiled CPU decode step
built on the rewritten graph (but not under max-autotune, whose frozen weights Inductor prepacks)."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

import h2o_compile
from h2o_compile.runtime import model as runtime
from h2o_compile.kernels import native_cpu
from h2o_compile.graph.passes import linear_weight_major, weight_major_linears

from ..helpers import has_compiler
from ..runtime.arch_configs import VOCAB, build

_LINEAR = torch.ops.aten.linear.default


@pytest.mark.parametrize("shape", [(3, 16), (2, 1, 16), (4, 5, 16)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_equals_f_linear_in_float64(shape, with_bias):
    gen = torch.Generator().manual_seed(len(shape))
    x = torch.randn(*shape, generator=gen, dtype=torch.float64)
    w = torch.randn(24, 16, generator=gen, dtype=torch.float64)
    b = torch.randn(24, generator=gen, dtype=torch.float64) if with_bias else None
    out = linear_weight_major(x, w, b)
    assert out.shape == (*shape[:-1], 24)
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-12, atol=1e-12)


def test_bf16_with_bias_and_a_non_contiguous_input_match_f_linear():
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(16, 3, generator=gen).to(torch.bfloat16).t()                  # [3, 16], not contiguous
    w = torch.randn(24, 16, generator=gen).to(torch.bfloat16)
    b = torch.randn(24, generator=gen).to(torch.bfloat16)
    want = F.linear(x.double(), w.double(), b.double())
    # bf16 products and a bf16 bias add (two roundings of ~2^-8 relative)
    torch.testing.assert_close(linear_weight_major(x, w, b).double(), want, rtol=2e-2, atol=2e-2)


def test_a_linear_whose_weight_is_not_a_matrix_is_left_alone():
    class OneDim(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(8))
            self.m = torch.nn.Parameter(torch.randn(4, 8))

        def forward(self, x):
            return torch.ops.aten.linear.default(x, self.w) + torch.ops.aten.linear.default(x, self.m).sum(-1)

    gm = torch.fx.symbolic_trace(OneDim())
    x = torch.randn(2, 8)
    want = gm(x)
    assert weight_major_linears(gm) == 1  # the [4, 8] weight only
    assert _linears(gm) == 1
    torch.testing.assert_close(gm(x), want)


def _linears(gm) -> int:
    return sum(n.op == "call_function" and n.target is _LINEAR for n in gm.graph.nodes)


def test_every_linear_of_a_captured_graph_is_rewritten_with_the_same_outputs():
    model = build("llama", seed=3)
    opt = h2o_compile.optimize(model, budget=5, compile=False)
    graph = opt.graph
    before = _linears(graph)
    assert before == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer, and the output projection
    ids = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    opt.reset(2, 12)
    want = opt.step(ids)
    state_after = [t.clone() for t in opt.state()]

    assert weight_major_linears(graph) == before
    assert _linears(graph) == 0
    assert sum(n.target is linear_weight_major for n in graph.graph.nodes) == before
    opt.reset(2, 12)
    torch.testing.assert_close(opt.step(ids), want, rtol=1e-5, atol=1e-5)
    for a, b in zip(state_after, opt.state()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode,rewritten", [(True, True), ("max-autotune-no-cudagraphs", True),
                                            ("max-autotune", False)])
def test_the_compiled_cpu_step_gets_the_rewrite_unless_weights_are_frozen(monkeypatch, mode, rewritten):
    seen = {}

    def fake_compile_step(graph, mode, device, dynamic=False):
        seen["graph"] = graph
        return graph

    monkeypatch.setattr(runtime, "compile_step", fake_compile_step)
    model = build("llama", seed=3)
    opt = h2o_compile.optimize(model, budget=5, compile=mode)
    opt.reset(1, 8)
    opt.step(torch.tensor([[3, 4, 5]]))
    opt.step(torch.tensor([[6]]))  # the decode step: built and "compiled" here
    assert (_linears(seen["graph"]) == 0) == rewritten
    assert _linears(opt.graph) == 15  # the prompt's graph keeps aten.linear


@pytest.mark.parametrize("native", [False, pytest.param(True, marks=pytest.mark.skipif(
    not has_compiler(), reason="no C++ compiler: the native op cannot be built here"))])
def test_the_eager_cpu_step_rewrites_its_linears_and_matches_aten_linear(native):
    """Without the native ops from two rows on (a single row keeps aten.linear); with them, every row count
    through rows_linear."""
    model = build("llama", seed=3)
    opt = h2o_compile.optimize(model, budget=5, compile=False)
    ids = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    nxt = torch.randint(1, VOCAB, (2, 4), generator=torch.Generator().manual_seed(2))

    def run(batch: int):
        opt.reset(batch, 16)
        logits = [opt.step(ids[:batch])]
        logits += [opt.step(nxt[:batch, i:i + 1]) for i in range(nxt.shape[1])]
        return torch.cat(logits, dim=1), [t.clone() for t in opt.state()]

    with contextlib.nullcontext() if native else native_cpu.disabled():
        one_row, _ = run(1)
        assert (opt._eager_step_graph is not None) == native  # without them a single row keeps aten.linear
        got, got_state = run(2)
        step = opt._eager_step_graph
        assert _linears(step) == 0 and _linears(opt.graph) == 15
        target = native_cpu.rows_linear if native else linear_weight_major
        assert sum(n.target is target for n in step.graph.nodes) == 15
        # the same decode through the prompt's graph (aten.linear everywhere) is the reference
        opt._eager_step_graph = opt.graph
        want, want_state = run(2)
        want_one_row, _ = run(1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(one_row, want_one_row, rtol=1e-5, atol=1e-5)
    for a, b in zip(got_state, want_state):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
