"""The native linear layer over a decode step's few rows (kernels/native/rows_linear.cc) against F.linear in
float64, on both of its paths (its own weight-streaming loop: 1 and 3-8 fp32 rows of a contiguous weight; torch's
BLAS otherwise), and the decode graphs that take it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from h2o_compile.kernels import native_cpu
from h2o_compile.graph.passes import weight_major_linears

from ..helpers import has_compiler

pytestmark = pytest.mark.skipif(not has_compiler(), reason="no C++ compiler: the op cannot be built here")


@pytest.fixture(autouse=True)
def _built():
    assert native_cpu.available()  # with a compiler, a failed build is a failure (the wrapper does not load)


@pytest.mark.parametrize("rows", range(1, 11))
@pytest.mark.parametrize("features", [64, 100])  # whole vectors, and a tail the loop finishes one by one
@pytest.mark.parametrize("with_bias", [False, True])
def test_equals_f_linear_in_float64(rows, features, with_bias):
    gen = torch.Generator().manual_seed(rows * features)
    x, w = torch.randn(rows, features, generator=gen), torch.randn(37, features, generator=gen)
    b = torch.randn(37, generator=gen) if with_bias else None
    out = native_cpu.rows_linear(x, w, b)
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert out.shape == (rows, 37) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


def test_leading_dims_a_strided_input_and_the_blas_cases():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 2, 48, generator=gen)[:, :, 0]                          # [2, 3, 48], not contiguous
    w = torch.randn(48, 20, generator=gen).t()                                     # [20, 48], not contiguous
    out = native_cpu.rows_linear(x, w)
    assert out.shape == (2, 3, 20)
    torch.testing.assert_close(out.double(), F.linear(x.double(), w.double()), rtol=1e-5, atol=1e-5)
    xb, wb = x[0].bfloat16(), w.contiguous().bfloat16()                            # bf16: torch's BLAS
    torch.testing.assert_close(native_cpu.rows_linear(xb, wb).double(), F.linear(xb.double(), wb.double()),
                               rtol=2e-2, atol=2e-2)


def test_bad_shapes_are_named():
    op = torch.ops.h2o_cpu.rows_linear
    with pytest.raises(RuntimeError, match=r"x \[N, in\] and weight \[out, in\]"):
        op(torch.randn(2, 5), torch.randn(3, 4), None)
    with pytest.raises(RuntimeError, match=r"bias must be \[out\] = \[3\]"):
        op(torch.randn(2, 4), torch.randn(3, 4), torch.randn(4))


def test_a_graph_rewritten_with_native_calls_the_op_and_keeps_its_result():
    class TwoLinears(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(40, 24), torch.nn.Linear(24, 8, bias=False)

        def forward(self, x):
            hidden = torch.ops.aten.linear.default(x, self.a.weight, self.a.bias).relu()
            return torch.ops.aten.linear.default(hidden, self.b.weight)

    gm = torch.fx.symbolic_trace(TwoLinears())
    x = torch.randn(3, 40)
    want = gm(x)
    assert weight_major_linears(gm, native=True) == 2
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(native_cpu.rows_linear) == 2
    torch.testing.assert_close(gm(x), want, rtol=1e-5, atol=1e-5)
