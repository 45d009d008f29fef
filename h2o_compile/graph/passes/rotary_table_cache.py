"""Compute the rotary tables of rolling or capped positions once per table size, not at every eager forward.

passes/rolling_positions.py makes the graph evaluate the model's rotary embedding at positions 0..S-1 on every
call. With capped distances S = max(D + 1, T): 16,385 rows per rotary base on Gemma 3 (D = 16,384), cosines
and sines an eager decode step used to pay at every token (docs/results/stream/positions_cost). The tables
depend on S and on the rotary embedding's own tensors (the inverse frequencies) only, so this pass moves their
subgraph into a :class:`RotaryTables` module that keeps its last result and computes again only when S or one of
those inputs changes (another tensor, a write into it, another device or dtype, grad or inference mode). Under
torch.compile or export the module computes every time, as the graph did: a compiled step fuses the tables into
its own code (positions_cost_compiled shows no cost there).
"""

from __future__ import annotations

import operator

import torch
from torch import nn
from torch.fx import GraphModule, Node

from .attention_sites import _is_call
from .h2o_attention import copy_graph_module
from .rolling_positions import _OP_ARGS, _h2o_ops, ancestors, descendants

aten = torch.ops.aten
_MODULE = "rotary_tables"


class RotaryTables(nn.Module):
    """The rotary tables' subgraph behind a one-entry cache.

    ``tables(*inputs)`` -> tuple of tensors (cos / sin [1, S, R] per rotary base, as the graph shaped them);
    ``inputs`` are S's graph value and the subgraph's other inputs (inverse frequencies). ``computed`` counts
    the evaluations (the tests read it)."""

    def __init__(self, tables: GraphModule):
        super().__init__()
        self.tables = tables
        self.computed = 0
        self._key = None
        self._value = None

    def forward(self, *inputs):
        if torch.compiler.is_compiling():
            return self.tables(*inputs)
        key = (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), *map(_identity, inputs))
        if key != self._key:
            self._key, self._value = None, None  # a failing evaluation must not leave the old tables keyed anew
            self._value = self.tables(*inputs)
            self._key = key
            self.computed += 1
        return self._value


def _identity(value):
    """What an input's tables depend on: a tensor by storage, version (in-place writes), shape, device and dtype."""
    if isinstance(value, torch.Tensor):
        return (value.data_ptr(), value._version, tuple(value.shape), value.device, value.dtype)
    return value


def cache_rotary_tables(gm: GraphModule) -> GraphModule:
    """A copy of ``gm`` (sharing its weights) whose rotary tables come from a :class:`RotaryTables` module, or
    ``gm`` itself when its h2o ops take no tables (true positions) or the tables do not come from one
    ``arange`` (then there is nothing this pass knows how to hold)."""
    if not _ops_with_tables(gm):
        return gm
    copy = copy_graph_module(gm)
    return copy if _hoist_tables(copy, _ops_with_tables(copy)) else gm


def _ops_with_tables(gm: GraphModule) -> list[Node]:
    return [op for op in _h2o_ops(gm) if len(op.args) > _OP_ARGS]


def _hoist_tables(gm: GraphModule, ops: list[Node]) -> bool:
    """Move the subgraph from the one ``arange`` to ``ops``' table arguments into a :class:`RotaryTables`
    module of ``gm``, in place; False (``gm`` untouched) when the tables are not that shape of subgraph."""
    graph = gm.graph
    feeding = ancestors([a for op in ops for a in op.args[_OP_ARGS:] if isinstance(a, Node)])
    ramps = [n for n in feeding if _is_call(n, aten.arange.default)]
    if len(ramps) != 1:
        return False
    inside = descendants(graph, ramps[0]) & feeding                          # the tables' own computation
    order = [n for n in graph.nodes if n in inside]
    inputs = list(dict.fromkeys(i for n in order for i in n.all_input_nodes if i not in inside))
    outputs = [n for n in order if any(u not in inside for u in n.users)]
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    use_at = min(index[u] for n in outputs for u in n.users if u not in inside)
    if any(index[i] >= use_at for i in inputs):  # an input computed after the first use: leave the graph as is
        return False

    sub = torch.fx.Graph()
    env = {node: sub.placeholder(f"input_{k}") for k, node in enumerate(inputs)}
    for node in order:
        env[node] = sub.node_copy(node, lambda n: env[n])
    sub.output(tuple(env[n] for n in outputs))
    gm.add_submodule(_MODULE, RotaryTables(GraphModule(gm, sub)))

    with graph.inserting_before(nodes[use_at]):
        call = graph.call_module(_MODULE, tuple(inputs))
        for k, node in enumerate(outputs):
            node.replace_all_uses_with(graph.call_function(operator.getitem, (call, k)),
                                       delete_user_cb=lambda u: u not in inside)
    for node in reversed(order):
        graph.erase_node(node)
    graph.lint()
    gm.recompile()
    return True

