"""Rewrite every attention site of a captured graph into ``torch.ops.h2o.attention[_]`` over explicit state.

Before: ``forward(input_ids, position_ids) -> logits`` with the model's mask-building and attention nodes.
After:  ``forward(input_ids, position_ids, valid, *state) -> logits`` (in place: the state is mutated) or
        ``-> (logits, *new_state)`` (functional, for export), where ``state`` is, per layer i, the four
        tensors key/value/score/position of kernels/reference.py, named ``layer{i}_key`` ... as placeholders.
The mask nodes become dead and are removed. The H2O parameters (recent window, sinks, policy, seed) are
constants of the op nodes; :func:`set_h2o_params` updates them when the capacity changes.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch.fx import GraphModule

from .. import ops  # registers torch.ops.h2o
from .attention_sites import AttentionSite

STATE_FIELDS = ("key", "value", "score", "position")
_INPLACE = torch.ops.h2o.attention_.default
_FUNCTIONAL = torch.ops.h2o.attention.default
# Argument index of the first H2O parameter (recent) in the op schema:
# (q, k, v, positions, valid, 4 x state, scale, recent, sinks, policy, seed)
_PARAMS_AT = 10


@dataclass(frozen=True)
class LayerSpec:
    """What one layer's cache must hold: KV heads, key and value head dims, dtype."""

    kv_heads: int
    head_dim: int
    value_dim: int
    dtype: torch.dtype


def state_names(layer: int) -> list[str]:
    return [f"layer{layer}_{field}" for field in STATE_FIELDS]


def rewrite_attention(gm: GraphModule, sites: list[AttentionSite], *, functional: bool = False,
                      recent: int = 1, sinks: int = 0, policy: str = "h2o", seed: int = 0) -> list[LayerSpec]:
    """Replace ``sites`` (from find_attention_sites) by H2O ops; returns one LayerSpec per rewritten site.

    The number of rewrites is ``len(result)``. The graph is linted and recompiled.
    """
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(placeholders) != 2:
        raise ValueError(f"expected a captured graph with inputs (input_ids, position_ids), got "
                         f"{[p.name for p in placeholders]}")
    position_ids = placeholders[1]
    with graph.inserting_after(position_ids):
        valid = graph.placeholder("valid")
    valid.meta["val"] = position_ids.meta["val"].new_empty(position_ids.meta["val"].shape, dtype=torch.bool)

    specs, new_state, last = [], [], valid
    for layer, site in enumerate(sites):
        k_val, v_val = site.key.meta["val"], site.value.meta["val"]
        spec = LayerSpec(int(k_val.shape[1]), int(k_val.shape[3]), int(v_val.shape[3]), k_val.dtype)
        specs.append(spec)
        state = []
        for name in state_names(layer):
            with graph.inserting_after(last):
                last = graph.placeholder(name)
            state.append(last)
        args = (site.query, site.key, site.value, position_ids, valid, *state, site.scale, recent, sinks, policy,
                seed)
        with graph.inserting_before(site.node):
            if functional:
                result = graph.call_function(_FUNCTIONAL, args)
                out = graph.call_function(operator.getitem, (result, 0))
                new_state.extend(graph.call_function(operator.getitem, (result, i)) for i in range(1, 5))
            else:
                out = graph.call_function(_INPLACE, args)
        out.meta["val"] = site.node.meta.get("val")
        site.node.replace_all_uses_with(out)

    output = next(n for n in graph.nodes if n.op == "output")
    if functional:
        output.args = ((output.args[0], *new_state),)
    graph.eliminate_dead_code(is_impure_node=lambda n: n.op in ("placeholder", "output") or n.target is _INPLACE)
    graph.lint()
    gm.recompile()
    return specs


def set_h2o_params(gm: GraphModule, *, recent: int, sinks: int, policy: str, seed: int) -> int:
    """Set the H2O constants of every h2o op node; returns how many nodes changed (recompiles if any)."""
    changed = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in (_INPLACE, _FUNCTIONAL):
            params = (recent, sinks, policy, seed)
            if tuple(node.args[_PARAMS_AT:]) != params:
                node.args = node.args[:_PARAMS_AT] + params
                changed += 1
    if changed:
        gm.recompile()
    return changed


def fuse_decode_bookkeeping(gm: GraphModule) -> GraphModule:
    """A copy of an in-place graph, sharing its weights, whose ``h2o.attention_`` nodes call
    ``ops.decode_fusable_`` instead: the attention stays an opaque op, the eviction bookkeeping becomes plain
    torch ops that torch.compile fuses. Only for the one-token decode step, compiled (see H2OModel)."""
    graph = torch.fx.Graph()
    output = graph.graph_copy(gm.graph, {})
    graph.output(output)
    fused = 0
    for node in graph.nodes:
        if node.op == "call_function" and node.target is _INPLACE:
            node.target = ops.decode_fusable_
            fused += 1
    if fused == 0:
        raise ValueError("fuse_decode_bookkeeping: the graph has no in-place h2o.attention_ node")
    graph.lint()
    return GraphModule(gm, graph)


def count_h2o_ops(gm: GraphModule) -> int:
    return sum(n.op == "call_function" and n.target in (_INPLACE, _FUNCTIONAL) for n in gm.graph.nodes)
