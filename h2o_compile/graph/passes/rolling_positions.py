"""Move each layer's rotary embedding from the captured graph into its h2o op (``positions="rolling"`` or
``"capped"``).

Before: ``h2o.attention_(rope(q), rope(k), ...)`` with ``rope(x) = x * cos + rotate_half(x) * sin`` on the first
R dims of x (R < D: partial rotary, GPT-NeoX / Phi style), cos and sin [B, 1, T, R] computed by the model's
rotary embedding from ``position_ids``; or its chunked form ``cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin])``
with half-width tables (GPT-OSS), the same rotation.
After:  ``h2o.attention_(q, k, ..., rope_cos, rope_sin)``: the op caches unrotated keys and rotates q and k at
attention time by their rank in the cache, or by capped distance (kernels/rolling.py). The tables are the
model's own rotary subgraph, copied once, evaluated at positions 0..S-1 with S = (largest cache of any layer) + T
by rank, S = max(D + 1, T) with distances capped at D, so the model's base, scaling and per-layer bases
(Gemma 3's local and global) carry over unchanged.

A model without that pattern (learned absolute positions, ALiBi, interleaved rotary) cannot move its
positions: :func:`find_rotary` names the layer and what it found instead.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch.fx import GraphModule, Node

from .attention_sites import _is_call, _last_dim, _val
from ...ops import H2O_ATTENTION
from .h2o_attention import _FUNCTIONAL, _INPLACE

aten = torch.ops.aten
_CASTS = (aten.to.dtype, aten._to_copy.default, aten.alias.default, aten.clone.default, aten.contiguous.default)
_POS_CACHE = H2O_ATTENTION.index("pos_cache")
_OP_ARGS = H2O_ATTENTION.index("rope_cos")  # arguments of an h2o op before the rotary tables


@dataclass(frozen=True)
class Rotary:
    """``rope(source)`` in the graph: ``source`` [B, H, T, D] unrotated; cos, sin [B, 1, T, R] as multiplied,
    or [B, 1, T, R/2] when ``half`` (the chunked form, GPT-OSS: each frequency once)."""

    source: Node
    cos: Node
    sin: Node
    half: bool = False


def _strip(node):
    while _is_call(node, *_CASTS):
        node = node.args[0]
    return node


def _slice_of(node, start, end=None) -> Optional[Node]:
    """x for ``x[..., start:end]`` (end None = to the end), else None."""
    if not (_is_call(node, aten.slice.Tensor) and len(node.args) >= 4 and _last_dim(node.args[0], node.args[1])):
        return None
    stop = node.args[3]
    if node.args[2] != start or (stop != end if end is not None else stop < (1 << 62)):
        return None
    return node.args[0]


def _rotate_half_of(node) -> Optional[Node]:
    """x for ``cat([-x[..., h:], x[..., :h]], -1)`` with 2h = x's last dim, else None."""
    if not (_is_call(node, aten.cat.default) and len(node.args[0]) == 2 and
            _last_dim(node, node.args[1] if len(node.args) > 1 else 0)):
        return None
    neg, first = node.args[0]
    if not _is_call(neg, aten.neg.default):
        return None
    width = _val(node).shape[-1]
    x = _slice_of(neg.args[0], width // 2)
    return x if x is not None and _slice_of(first, 0, width // 2) is x else None


def _products(node) -> Optional[tuple]:
    if not (_is_call(node, aten.add.Tensor) and all(_is_call(a, aten.mul.Tensor) for a in node.args[:2])):
        return None
    return tuple(tuple(m.args[:2]) for m in node.args[:2])


def _full_rotary(node) -> Optional[Rotary]:
    """``x * cos + rotate_half(x) * sin`` (either order of the sum and of each product)."""
    products = _products(_strip(node))
    if products is None:
        return None
    for plain, turned in (products, products[::-1]):
        for x, cos in (plain, plain[::-1]):
            for half, sin in (turned, turned[::-1]):
                if isinstance(x, Node) and _rotate_half_of(half) is x and isinstance(cos, Node) and \
                        isinstance(sin, Node):
                    return Rotary(x, cos, sin)
    return None


def _mul_pair(node, x) -> Optional[Node]:
    """t for ``x * t`` or ``t * x``, else None."""
    if _is_call(node, aten.mul.Tensor):
        a, b = node.args[:2]
        if a is x and isinstance(b, Node):
            return b
        if b is x and isinstance(a, Node):
            return a
    return None


def _chunked_rotary(node) -> Optional[Rotary]:
    """``cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)`` with ``x1, x2 = x.chunk(2, -1)``."""
    if not (_is_call(node, aten.cat.default) and len(node.args[0]) == 2 and
            _last_dim(node, node.args[1] if len(node.args) > 1 else 0)):
        return None
    first, second = node.args[0]
    if not (_is_call(first, aten.sub.Tensor) and _is_call(second, aten.add.Tensor)):
        return None
    halves = [a for a in first.args[0].args[:2] if _is_call(a, operator.getitem)] if \
        _is_call(first.args[0], aten.mul.Tensor) else []
    chunk = halves[0].args[0] if halves else None
    if not (_is_call(chunk, aten.chunk.default) and chunk.args[1] == 2 and _last_dim(chunk.args[0], chunk.args[2])):
        return None
    x1, x2 = (next((u for u in chunk.users if u.target is operator.getitem and u.args[1] == i), None)
              for i in (0, 1))
    cos, sin = _mul_pair(first.args[0], x1), _mul_pair(first.args[1], x2)
    a, b = second.args[:2]
    rotated = any(_mul_pair(u, x2) is cos and _mul_pair(w, x1) is sin for u, w in ((a, b), (b, a)))
    if cos is None or sin is None or not rotated:  # the second half must be x2 * cos + x1 * sin
        return None
    return Rotary(chunk.args[0], cos, sin, half=True)


def match_rotary(node) -> Union[Rotary, str]:
    """The rotary application that produced ``node`` (q or k of an h2o op), or why there is none."""
    node = _strip(node)
    full = _full_rotary(node) or _chunked_rotary(node)
    if full is not None:
        return full
    if _is_call(node, aten.cat.default) and len(node.args[0]) == 2:  # partial: cat([rope(x[:R]), x[R:]])
        rotated, passed = node.args[0]
        part = _full_rotary(rotated)
        if part is not None:
            width = _val(part.source).shape[-1]
            source = _slice_of(part.source, 0, width)
            if source is None and _is_call(part.source, aten.alias.default):  # x[..., :R] with R = D (Phi-3)
                source = part.source.args[0]
            if source is not None and _slice_of(passed, width) is source:
                return Rotary(source, part.cos, part.sin)
    found = node.target if isinstance(node, Node) else node
    return f"its input is {found}, not x * cos + rotate_half(x) * sin (rotary embedding on the last dim)"


def find_rotary(gm: GraphModule) -> tuple[list[tuple[Rotary, Rotary]], list[str]]:
    """(q, k) rotary applications of every h2o op in graph order, and the reasons of the layers without one."""
    pairs, declines = [], []
    for layer, node in enumerate(_h2o_ops(gm)):
        q, k = match_rotary(node.args[0]), match_rotary(node.args[1])
        if isinstance(q, str) or isinstance(k, str):
            declines.append(f"layer {layer}: {'query' if isinstance(q, str) else 'key'} " + (q if isinstance(q, str)
                                                                                                 else k))
        elif (q.cos, q.sin) != (k.cos, k.sin):
            declines.append(f"layer {layer}: queries and keys are rotated with different tables")
        else:
            pairs.append((q, k))
    return pairs, declines


def _h2o_ops(gm: GraphModule) -> list[Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in (_INPLACE, _FUNCTIONAL)]


def move_rotary_into_ops(gm: GraphModule, max_distance: int = 0) -> int:
    """Rewrite every h2o op to take unrotated q, k and the rotary tables; returns the number of ops rewritten.
    ``max_distance`` 0 numbers keys by rank, D > 0 by true distance capped at D (kernels/rolling.py).

    Raises ValueError naming the layers whose positions cannot move (see :func:`find_rotary`)."""
    graph = gm.graph
    ops = _h2o_ops(gm)
    pairs, declines = find_rotary(gm)
    if declines:
        raise ValueError("rolling or capped positions need every layer's rotary embedding in the graph; "
                         + "; ".join(declines))
    if any(len(op.args) != _OP_ARGS for op in ops):
        raise ValueError("the h2o ops already take rotary tables (the graph was rewritten before)")
    position_ids = [n for n in graph.nodes if n.op == "placeholder"][1]
    wanted = list(dict.fromkeys(n for q, _ in pairs for n in (q.cos, q.sin)))
    with graph.inserting_before(ops[0]):
        # One copy of the rotary subgraph for the whole model: HF multiplies a per-layer unsqueeze of one
        # cos/sin per rotary embedding, and the copy shares everything up to those unsqueezes.
        env = _copy_from(graph, wanted, position_ids, _table_positions(graph, position_ids, ops, max_distance))
        half_tables = {}
        for op, (q, k) in zip(ops, pairs):
            tables = [env[q.cos], env[q.sin]]
            if q.half:  # the op's tables repeat each frequency (rotate-half layout)
                if (q.cos, q.sin) not in half_tables:
                    half_tables[q.cos, q.sin] = [graph.call_function(aten.cat.default, ([t, t], -1)) for t in tables]
                tables = half_tables[q.cos, q.sin]
            op.args = (q.source, k.source, *op.args[2:], *tables)
            if max_distance:
                op.kwargs = {**op.kwargs, "max_distance": max_distance}
    graph.eliminate_dead_code(is_impure_node=lambda n: n.op in ("placeholder", "output") or n.target is _INPLACE)
    graph.lint()
    gm.recompile()
    return len(ops)


def _table_positions(graph: torch.fx.Graph, position_ids: Node, users: list[Node], max_distance: int) -> Node:
    """``arange(S)`` as [1, S]: S = the largest cache among ``users`` (every layer) + the block's T, or
    max(D + 1, T) with distances capped at D > 0. One row, not B: the tables are the same for every row of the
    batch (the ops broadcast B' = 1), and at D = 16,384 each row would cost 16,385 x R cosines and sines."""
    block = graph.call_function(aten.sym_size.int, (position_ids, 1))
    if max_distance:
        total = graph.call_function(torch.sym_max, (max_distance + 1, block))
    else:
        size = graph.call_function(aten.sym_size.int, (users[0].args[_POS_CACHE], 2))
        for op in users[1:]:
            size = graph.call_function(torch.sym_max, (size, graph.call_function(aten.sym_size.int,
                                                                                  (op.args[_POS_CACHE], 2))))
        total = graph.call_function(operator.add, (size, block))
    device = _val(position_ids).device
    ramp = graph.call_function(aten.arange.default, (total,), {"dtype": torch.int64, "device": device})
    return graph.call_function(aten.unsqueeze.default, (ramp, 0))


def _copy_from(graph: torch.fx.Graph, outputs: list[Node], source: Node, replacement: Node) -> dict[Node, Node]:
    """Copy the nodes between ``source`` and ``outputs`` (their ancestors that depend on ``source``) at the
    insertion point, reading ``replacement`` instead; returns the map old node -> copy (other inputs are
    shared, e.g. the inverse frequencies)."""
    needed = (ancestors(outputs) & descendants(graph, source)) - {source}
    env = {source: replacement}
    for node in [n for n in graph.nodes if n in needed]:
        env[node] = graph.node_copy(node, lambda n: env.get(n, n))
        env[node].meta = {}  # the traced shapes say T positions; the copy computes S
    return env


def ancestors(nodes: list[Node]) -> set[Node]:
    """``nodes`` and every node they read, directly or not."""
    seen, stack = set(), list(nodes)
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(node.all_input_nodes)
    return seen


def descendants(graph: torch.fx.Graph, root: Node) -> set[Node]:
    """``root`` and every node of ``graph`` that reads it, directly or not."""
    found = {root}
    for node in graph.nodes:  # graph order is a topological order
        if any(i in found for i in node.all_input_nodes):
            found.add(node)
    return found
