"""Split a layer's h2o op by KV heads, so that groups of heads keep caches of their own sizes (H2OConfig.allocation
split per KV head, runtime/allocation.py).

H2O scores, evicts and stores per (row, KV head): a KV head's keys never compete with another's for a slot. So an
op over heads h in a group, with its own state [B, |group|, C_group, ...], computes for those heads exactly what
the layer's op computes at C_group slots, and a layer served as one op per group holds each group at its own size,
at static shapes, every backend unchanged.

Before: ``out = h2o.attention_(q, k, v, ..., layer{l}_key, layer{l}_value, ...)`` with q [B, Hq, T, D],
        k, v [B, Hkv, T, D], out [B, Hq, T, Dv] (or the functional op and its new state in the graph's output).
After:  per group g of KV heads (in the order given), the op on q's query heads of those KV heads, k's and v's
        heads, the learned sink logits of those query heads, and placeholders ``layer{l}_group{g}_key`` ...
        [B, |group|, C_g, ...]; the outputs concatenated and put back in head order. A layer that is not split
        keeps its op. Run it last: the other passes find one op per layer.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Optional, Sequence

import torch
from torch.fx import GraphModule, Node

from ...ops import H2O_ATTENTION
from .h2o_attention import _FUNCTIONAL, _INPLACE, LayerSpec

aten = torch.ops.aten
_STATE = [H2O_ATTENTION.index(name) for name in H2O_ATTENTION.state[:4]]  # positional: key .. position
_SCALES = H2O_ATTENTION.state[4:]                                          # keyword: int8 entries' scales
_SINK_LOGITS = H2O_ATTENTION.index("sink_logits")


def check_groups(groups: Sequence[Sequence[int]], kv_heads: int, layer: int) -> list[tuple[int, ...]]:
    """``groups`` as tuples, checked to cover KV heads 0..kv_heads-1 once each (ValueError naming the layer)."""
    groups = [tuple(int(h) for h in group) for group in groups]
    if sorted(h for group in groups for h in group) != list(range(kv_heads)) or not all(groups):
        raise ValueError(f"layer {layer}: head groups {groups} must hold each of its {kv_heads} KV heads once")
    return groups


def split_kv_heads(gm: GraphModule, specs: Sequence[LayerSpec],
                   groups: Sequence[Optional[Sequence[Sequence[int]]]]) -> list[LayerSpec]:
    """Rewrite each layer ``l`` with ``groups[l]`` (lists of its KV heads; None or one group = not split) into one
    op per group; returns the spec of every op in graph order (``LayerSpec.heads``: the layer's KV heads it holds).
    The graph is linted and recompiled."""
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in (_INPLACE, _FUNCTIONAL)]
    if not len(nodes) == len(specs) == len(groups):
        raise ValueError(f"{len(groups)} head groupings for {len(specs)} layers and {len(nodes)} h2o ops")
    out_specs: list[LayerSpec] = []
    for layer, (node, spec, layer_groups) in enumerate(zip(nodes, specs, groups)):
        if layer_groups is None or len(layer_groups) < 2:
            out_specs.append(spec)
            continue
        layer_groups = check_groups(layer_groups, spec.kv_heads, layer)
        _split_op(gm, node, spec, layer, layer_groups)
        out_specs.extend(dataclasses.replace(spec, kv_heads=len(g), heads=g) for g in layer_groups)
    gm.graph.eliminate_dead_code(is_impure_node=lambda n: n.op in ("placeholder", "output") or n.target is _INPLACE)
    gm.graph.lint()
    gm.recompile()
    return out_specs


def _split_op(gm: GraphModule, node: Node, spec: LayerSpec, layer: int, groups: list[tuple[int, ...]]) -> None:
    """Replace ``node``, layer ``layer``'s op, by one op per group: new state placeholders after the layer's, the
    inputs sliced by head, the outputs joined back in head order (functional: the new state in the graph's output
    where the layer's was)."""
    graph = gm.graph
    q, k, v = node.args[:3]
    per_kv = _val(q).shape[1] // spec.kv_heads  # query heads per KV head
    old_state = [node.args[i] for i in _STATE] + [node.kwargs[name] for name in _SCALES
                                                        if node.kwargs.get(name) is not None]
    functional = node.target is _FUNCTIONAL
    outs, new_state, group_state, last = [], [], [], old_state[-1]
    for g, heads in enumerate(groups):
        query_heads = [h * per_kv + i for h in heads for i in range(per_kv)]
        placeholders = []
        for old in old_state:
            with graph.inserting_after(last):
                last = graph.placeholder(f"layer{layer}_group{g}_{old.name.split('_', 1)[1]}")
            if "val" in old.meta:
                last.meta["val"] = _take_val(old.meta["val"], 1, heads)
            placeholders.append(last)
        group_state.append(placeholders)
        with graph.inserting_before(node):
            args = list(node.args)
            args[0], args[1], args[2] = _take(graph, q, 1, query_heads), _take(graph, k, 1, heads), \
                _take(graph, v, 1, heads)
            for i, placeholder in zip(_STATE, placeholders):
                args[i] = placeholder
            if isinstance(args[_SINK_LOGITS], Node):  # learned sink logits, one per query head
                args[_SINK_LOGITS] = _take(graph, args[_SINK_LOGITS], 0, query_heads)
            kwargs = dict(node.kwargs, **dict(zip(_SCALES, placeholders[4:])))
            call = graph.call_function(node.target, tuple(args), kwargs)
            call.meta = {**node.meta}
            if functional:
                out = graph.call_function(operator.getitem, (call, 0))
                new_state.append([graph.call_function(operator.getitem, (call, 1 + i)) for i in range(len(old_state))])
            else:
                out = call
            out.meta["val"] = _take_val(_output_val(node), 1, query_heads)
            outs.append(out)
    order = [h * per_kv + i for heads in groups for h in heads for i in range(per_kv)]
    with graph.inserting_before(node):
        joined = graph.call_function(aten.cat.default, (outs, 1))
        joined.meta["val"] = _take_val(_output_val(node), 1, order)
        back = sorted(range(len(order)), key=order.__getitem__)  # position in ``joined`` of each query head
        result = _take(graph, joined, 1, back)
    if functional:
        old_outputs = {user.args[1]: user for user in node.users if user.target is operator.getitem}
        old_outputs[0].replace_all_uses_with(result)
        output = next(n for n in graph.nodes if n.op == "output")
        flat = list(output.args[0])
        at = flat.index(old_outputs[1])
        flat[at:at + len(old_state)] = [n for group in new_state for n in group]
        output.args = (tuple(flat),)
        for user in list(node.users):
            graph.erase_node(user)
    else:
        node.replace_all_uses_with(result)
    graph.erase_node(node)
    for old, per_group in zip(old_state, zip(*group_state)):
        _reread_sizes(graph, old, per_group)
        graph.erase_node(old)


def _reread_sizes(graph, old: Node, per_group: Sequence[Node]) -> None:
    """Point the size reads of a layer's state tensor ``old`` at its groups' (rolling positions size their rotary
    tables by the largest cache): the batch from the first group, the slots as the largest group's."""
    for user in list(old.users):
        dim = user.args[1] if user.target is aten.sym_size.int else None
        if dim not in (0, 2):
            raise ValueError(f"cannot split {old.name} by KV heads: {user.format_node()} reads it")
        with graph.inserting_before(user):
            size = graph.call_function(aten.sym_size.int, (per_group[0], dim))
            for other in per_group[1:] if dim == 2 else ():
                size = graph.call_function(torch.sym_max, (size, graph.call_function(aten.sym_size.int,
                                                                                      (other, dim))))
        user.replace_all_uses_with(size)
        graph.erase_node(user)


def _take(graph, x: Node, dim: int, index: list[int]) -> Node:
    """``x`` indexed by ``index`` along ``dim``: slices of its contiguous runs, concatenated (no index tensor, so
    every backend and the ONNX export see plain slices); ``x`` itself for the identity."""
    size = _val(x).shape[dim]
    if index == list(range(size)):
        return x
    runs, start = [], 0
    for i in range(1, len(index) + 1):
        if i == len(index) or index[i] != index[i - 1] + 1:
            runs.append((index[start], index[i - 1] + 1))
            start = i
    parts = []
    for lo, hi in runs:
        part = graph.call_function(aten.slice.Tensor, (x, dim, lo, hi))
        part.meta["val"] = _take_val(_val(x), dim, list(range(lo, hi)))
        parts.append(part)
    if len(parts) == 1:
        return parts[0]
    joined = graph.call_function(aten.cat.default, (parts, dim))
    joined.meta["val"] = _take_val(_val(x), dim, index)
    return joined


def _val(node: Node):
    return node.meta["val"]


def _output_val(node: Node):
    val = node.meta.get("val")
    if node.target is _FUNCTIONAL:
        getitem = next(u for u in node.users if u.target is operator.getitem and u.args[1] == 0)
        val = getitem.meta.get("val")
    return val


def _take_val(val, dim: int, index: list[int]):
    """The fake value of ``val`` indexed along ``dim`` (shapes only)."""
    if val is None:
        return None
    return torch.cat([val.narrow(dim, i, 1) for i in index], dim=dim)
