"""Rewrite every attention site of a captured graph into ``torch.ops.h2o.attention[_]`` over explicit state.

Before: ``forward(input_ids, position_ids) -> logits`` with the model's mask-building and attention nodes.
After:  ``forward(input_ids, position_ids, valid, *state) -> logits`` (in place: the state is mutated) or
        ``-> (logits, *new_state)`` (functional, for export), where ``state`` is, per layer i, the four
        tensors key/value/score/position of kernels/reference.py, named ``layer{i}_key`` ... as placeholders
        (six with quantized entries: the key and value scales follow, kernels/quantized.py).
The mask nodes become dead and are removed. The H2O parameters (recent window, sinks, policy, seed) are
constants of the op nodes (:func:`set_h2o_params`); :func:`runtime_recent_graph` turns the recent windows, which
follow from each request's capacity, into inputs (what H2OModel runs). Each layer's
attention kind (sliding window from the config; soft-cap and learned sink logits from the graph) follows them
as the op's last three arguments.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch.fx import GraphModule

from ... import ops  # registers torch.ops.h2o
from ...ops import H2O_ATTENTION, PARAMS, PARAMS_AT
from .attention_sites import AttentionSite

STATE_FIELDS = ("key", "value", "score", "position")
SCALE_FIELDS = ("key_scale", "value_scale")  # quantized entries only
_INPLACE = torch.ops.h2o.attention_.default
_FUNCTIONAL = torch.ops.h2o.attention.default
_PARAMS_END = PARAMS_AT + len(PARAMS)


@dataclass(frozen=True)
class LayerSpec:
    """What one layer's cache must hold (KV heads, key and value head dims, dtype) and how it attends; a layer
    split by KV heads (passes/head_groups.py) has one per group of heads, ``heads`` naming them."""

    kv_heads: int
    head_dim: int
    value_dim: int
    dtype: torch.dtype
    window: int = 0         # sliding window W, 0 = full attention
    softcap: float = 0.0    # logit soft-capping, 0 = none
    sinks: bool = False     # learned attention-sink logits
    quantized: bool = False  # int8 entries plus one scale per vector (kernels/quantized.py)
    layer: int = 0          # the model's layer
    heads: tuple[int, ...] = ()  # the layer's KV heads this cache holds, () = all of them


def state_fields(quantized: bool = False) -> tuple[str, ...]:
    """A layer's state tensors, in graph order."""
    return STATE_FIELDS + SCALE_FIELDS if quantized else STATE_FIELDS


def state_names(layer: int, quantized: bool = False) -> list[str]:
    return [f"layer{layer}_{field}" for field in state_fields(quantized)]


def rewrite_attention(gm: GraphModule, sites: list[AttentionSite], *, functional: bool = False,
                      windows=None, recent: int = 1, sinks: int = 0, policy: str = "h2o",
                      seed: int = 0, quantized: bool = False) -> list[LayerSpec]:
    """Replace ``sites`` (from find_attention_sites) by H2O ops; returns one LayerSpec per rewritten site.

    ``windows``: per site, the sliding window W of its layer (0 = full attention); None = all full.
    ``quantized``: every layer's state holds int8 entries and their scales (two more placeholders each).
    The number of rewrites is ``len(result)``. The graph is linted and recompiled.
    """
    windows = [0] * len(sites) if windows is None else list(windows)
    if len(windows) != len(sites):
        raise ValueError(f"{len(windows)} windows for {len(sites)} attention sites")
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
        spec = LayerSpec(int(k_val.shape[1]), int(k_val.shape[3]), int(v_val.shape[3]), k_val.dtype,
                         window=int(windows[layer]), softcap=site.softcap, sinks=site.sink is not None,
                         quantized=quantized, layer=layer)
        specs.append(spec)
        state = []
        for name in state_names(layer, quantized):
            with graph.inserting_after(last):
                last = graph.placeholder(name)
            state.append(last)
        values = dict(q=site.query, k=site.key, v=site.value, positions=position_ids, valid=valid,
                      **dict(zip(H2O_ATTENTION.state, state)), scale=site.scale, recent=recent, sinks=sinks,
                      policy=policy, seed=seed, window=spec.window, softcap=spec.softcap, sink_logits=site.sink)
        last_positional = H2O_ATTENTION.index("sink_logits") + 1  # the passes after this one append rotary tables
        args = tuple(values.pop(name) for name in H2O_ATTENTION.names[:last_positional])
        scales = values  # key_scale / value_scale, given for int8 entries only
        with graph.inserting_before(site.node):
            if functional:
                result = graph.call_function(_FUNCTIONAL, args, scales)
                out = graph.call_function(operator.getitem, (result, 0))
                new_state.extend(graph.call_function(operator.getitem, (result, i)) for i in range(1, 1 + len(state)))
            else:
                out = graph.call_function(_INPLACE, args, scales)
        out.meta["val"] = site.node.meta.get("val")
        site.node.replace_all_uses_with(out)

    output = next(n for n in graph.nodes if n.op == "output")
    if functional:
        output.args = ((output.args[0], *new_state),)
    graph.eliminate_dead_code(is_impure_node=lambda n: n.op in ("placeholder", "output") or n.target is _INPLACE)
    graph.lint()
    gm.recompile()
    return specs


def set_h2o_params(gm: GraphModule, *, recent=None, sinks, policy, seed: int) -> int:
    """Set the H2O constants of every h2o op node; returns how many nodes changed (recompiles if any).

    ``recent``, ``sinks`` and ``policy`` (an ``EvictionRule.spec``): one value for every layer, or a sequence
    with one per layer (graph order); ``recent=None`` leaves the recent windows as they are (graph inputs, see
    :func:`runtime_recent_graph`)."""
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in (_INPLACE, _FUNCTIONAL)]
    if recent is None:
        recent = [n.args[PARAMS_AT] for n in nodes]
    recent = [recent] * len(nodes) if isinstance(recent, int) else list(recent)
    sinks = [sinks] * len(nodes) if isinstance(sinks, int) else list(sinks)
    policy = [policy] * len(nodes) if isinstance(policy, str) else list(policy)
    if not len(recent) == len(sinks) == len(policy) == len(nodes):
        raise ValueError(f"{len(recent)} recent windows, {len(sinks)} sink counts and {len(policy)} policies for "
                         f"{len(nodes)} h2o ops")
    changed = 0
    for node, layer_recent, layer_sinks, layer_policy in zip(nodes, recent, sinks, policy):
        params = (layer_recent, layer_sinks, layer_policy, seed)
        if tuple(node.args[PARAMS_AT:_PARAMS_END]) != params:
            node.args = node.args[:PARAMS_AT] + params + node.args[_PARAMS_END:]
            changed += 1
    if changed:
        gm.recompile()
    return changed


def copy_graph_module(gm: GraphModule) -> GraphModule:
    """A copy of ``gm`` with its own graph and the same weights: a pass edits ``copy.graph``, then recompiles."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return GraphModule(gm, graph)


def _inplace_ops(gm: GraphModule) -> list[torch.fx.Node]:
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is _INPLACE]
    if not nodes:
        raise ValueError("the graph has no in-place h2o.attention_ node")
    return nodes


def runtime_recent_graph(gm: GraphModule) -> GraphModule:
    """A copy of an in-place graph, sharing its weights, whose h2o ops read their recent window from int inputs
    ``recent{i}`` (one per layer, after the state) instead of graph constants: the window follows from each
    request's capacity, and as an input it changes neither the graph code nor a compiled step. A last input,
    ``query_from`` ([B] int64 or None), reaches every op: the runtime passes it with the prompt block when the
    score rule treats the prompt specially (kernels/rules.py), None otherwise.

    Before: ``forward(input_ids, position_ids, valid, *state)``;
    after: ``forward(..., *state, *recent, query_from)``."""
    copy = copy_graph_module(gm)
    last = [n for n in copy.graph.nodes if n.op == "placeholder"][-1]
    nodes = _inplace_ops(copy)
    for i, node in enumerate(nodes):
        with copy.graph.inserting_after(last):
            last = copy.graph.placeholder(f"recent{i}")
        node.args = node.args[:PARAMS_AT] + (last,) + node.args[PARAMS_AT + 1:]
    with copy.graph.inserting_after(last):
        query_from = copy.graph.placeholder("query_from", default_value=None)
    for node in nodes:
        node.kwargs = {**node.kwargs, "query_from": query_from}
    copy.graph.lint()
    copy.recompile()
    return copy


def fuse_decode_bookkeeping(gm: GraphModule, native: bool = False) -> GraphModule:
    """A copy of an in-place graph, sharing its weights, whose ``h2o.attention_`` nodes call
    ``ops.decode_fusable_`` instead: the attention stays an opaque op, the eviction bookkeeping becomes plain
    torch ops that torch.compile fuses. Only for the one-token decode step compiled on CPU (see H2OModel; the
    Triton decode kernel already fuses it on GPU). ``native``: the attention of a float cache through the
    native CPU op (kernels/native_cpu.py)."""
    copy = copy_graph_module(gm)
    for node in _inplace_ops(copy):
        node.target = ops.decode_fusable_
        if native:
            node.kwargs = {**node.kwargs, "native": True}
    copy.graph.lint()
    copy.recompile()
    return copy


def count_h2o_ops(gm: GraphModule) -> int:
    return sum(n.op == "call_function" and n.target in (_INPLACE, _FUNCTIONAL) for n in gm.graph.nodes)
