"""The decode step's linear layers as ``weight @ x^T`` on CPU: the same product, in the form CPU BLAS streams.

A one-token decode step multiplies a few rows (the batch) by every weight matrix: ``x @ W^T`` with x [B, in]
and W [out, in]. Called that way (``aten.linear`` -> ``mm(x, W.t())``), the CPU GEMM of torch 2.13 reads the
weights at a fraction of memory speed (our reading: it packs the large transposed operand on each call); the
same product as ``W @ x^T`` (the weight as the left operand) does not. ``research/linear_layout.py``
measures both forms over row counts (docs/results/linear_layout_cpu.md).

Only for the one-token step on CPU (``compiling.decode_step_graph``, ``H2OModel._eager_decode_step``): the
prompt's products have many rows, where the usual form is as fast, and GPU GEMMs have no such case. Where the
native CPU ops are built the step calls ``kernels.native_cpu.rows_linear`` instead, which streams each weight
once for the row counts where even this form does not (one row: a matrix-vector product).
"""

from __future__ import annotations

import operator
from typing import Optional

import torch
from torch import Tensor
from torch.fx import GraphModule

from ...kernels import native_cpu

_LINEAR = torch.ops.aten.linear.default


def linear_weight_major(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """``aten.linear(x, weight, bias)`` computed as ``(weight @ x^T)^T``.

    Args:
        x: [..., in]; weight: [out, in]; bias: [out] or None.
    Returns:
        [..., out], as ``torch.nn.functional.linear`` (fp32 sums in another order: equal within rounding).
    """
    rows = x.reshape(-1, x.shape[-1])                                              # [N, in]
    # A row-major copy before the view: ``reshape`` or ``contiguous`` of the transposed [N, out] would ask
    # whether N == 1 (already contiguous?), a guard that gives a batch of one a compiled step of its own.
    out = torch.mm(weight, rows.t()).t().clone(memory_format=torch.contiguous_format)  # [N, out]
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], weight.shape[0])


def _weight_is_matrix(gm: GraphModule, weight) -> bool:
    """Whether a linear's weight is a plain 2-D tensor: a 1-D weight, or a parameter that is a tensor subclass
    (a quantized weight), keeps ``aten.linear``."""
    if not isinstance(weight, torch.fx.Node):
        return False
    if weight.op == "get_attr":
        value = operator.attrgetter(weight.target)(gm)
        return type(value) in (Tensor, torch.nn.Parameter) and value.dim() == 2
    val = weight.meta.get("val")
    return isinstance(val, Tensor) and val.dim() == 2


def weight_major_linears(gm: GraphModule, native: bool = False) -> int:
    """Rewrite every ``aten.linear`` node of ``gm`` whose weight is a plain matrix (in place) to
    :func:`linear_weight_major`, or with ``native`` to the native CPU op ``kernels.native_cpu.rows_linear``
    (which streams each weight once for the row counts where BLAS does not, and calls this same BLAS form for
    the others; the caller checked that the op is built); the count."""
    target = native_cpu.rows_linear if native else linear_weight_major
    count = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is _LINEAR and _weight_is_matrix(gm, node.args[1]):
            node.target = target
            count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
    return count
