"""Split the decode step at its decoder layers, so that torch.compile compiles each kind of layer once.

Why: compiled whole, the one-token step is one graph in which Dynamo traces and Inductor generates and compiles
C++ for every layer, although a model's layers repeat one or two kinds (the KV-bound Llama: 8 identical layers;
Gemma 3: sliding and global). Split at the layers, each distinct layer is compiled once and its code runs for
every layer of its kind, with that layer's weights, cache state and recent window as inputs (regional
compilation). The cold first step is shorter, every step after it slower by a compiled call per layer
(docs/results/compile_regions_cpu/compile_regions.md); hence opt-in (``regional_compile``).

Before: ``forward(input_ids, position_ids, valid, *state, *recent, query_from) -> logits``, one flat graph.
After: the same signature and result; the graph calls one submodule per region: ``region0`` (embeddings and
position tables, before the first layer), ``region1..L`` (the decoder layers) and ``region{L+1}`` (the final norm
and LM head). A region is a GraphModule whose inputs are the values it reads from outside (placeholders,
weights, other regions' results) and whose output is the tuple of its values read outside.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.fx import Graph, GraphModule, Node

from .attention_sites import module_layer

# Region input names, which the compiled step's dynamic-shape rules match (compiling.DYNAMIC_SOURCES): the
# graph's own placeholders keep their names (input_ids, valid, layer{i}_key, recent{i}, ...), a weight becomes
# weight{j} (static), a tensor made by another region act{j} (batch-dynamic). No size is an input (_read).
_WEIGHT, _ACTIVATION = "weight", "act"


class LayersInterleaved(ValueError):
    """A region reads a value that a later region computes: regions called one after another cannot run it."""


@dataclass
class Region:
    """The nodes of one decoder layer (or of what comes before or after the layers), in graph order."""

    nodes: list[Node] = field(default_factory=list)
    inputs: list[Node] = field(default_factory=list)   # outside nodes read, in first-use order
    outputs: list[Node] = field(default_factory=list)  # own nodes read outside, in graph order
    recomputed: list[Node] = field(default_factory=list)  # other regions' sizes computed again here, in order


def _assign_regions(gm: GraphModule) -> dict[Node, int]:
    """Region index of every call node: 0 before the first decoder layer, layer + 1 inside a layer, and one past
    the last layer for the model-level nodes after the first layer (final norm, LM head).

    Two kinds of node go where their inputs are, so that every layer of a kind reads the same inputs: sizes
    (ints: the first layer would otherwise compute them for all, e.g. ``batch * seq`` for a reshape) and nodes a
    pass inserted (no module path). Each goes to the latest region among its inputs' (0 if none)."""
    regions: dict[Node, int] = {}
    tail, seen_layer = 1 << 30, False
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        layer = module_layer(node)
        if _is_size(node) or not node.meta.get("nn_module_stack"):
            region = max((regions[a] for a in node.all_input_nodes if a in regions), default=0)
        elif layer is not None:
            region, seen_layer = layer + 1, True
        else:
            region = tail if seen_layer else 0
        regions[node] = region
    last_layer = max((r for r in regions.values() if r != tail), default=0)
    return {node: (last_layer + 1 if r == tail else r) for node, r in regions.items()}


def _is_size(node: Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool))


def split_regions(gm: GraphModule) -> tuple[Graph, list[Region]]:
    """The regions of ``gm``'s graph, in order, and the outer graph that calls ``region{i}`` for each in turn.

    Raises LayersInterleaved (a ValueError) when a region reads a later one (a layer reading a node of the next
    layer, a model-level node between layers feeding a layer): regions called in order cannot express it; the
    caller compiles the step whole."""
    assigned = _assign_regions(gm)
    for node, region in assigned.items():
        late = [a.name for a in node.all_input_nodes if assigned.get(a, 0) > region]
        if late:
            raise LayersInterleaved(f"{node.name} (region {region}) reads {late[0]} of a later region: the graph's "
                                    "decoder layers are not consecutive; the step compiles whole")
    by_index: dict[int, Region] = {}
    for node in gm.graph.nodes:
        if node in assigned:
            by_index.setdefault(assigned[node], Region()).nodes.append(node)
    regions = [by_index[i] for i in sorted(by_index)]
    for region in regions:
        own = set(region.nodes)
        for node in region.nodes:
            for source in node.all_input_nodes:
                _read(region, own, source, assigned)
        # Sizes stay inside: a reader recomputes them from the tensors they measure (see _read).
        region.outputs = [n for n in region.nodes if not _is_size(n) and any(user not in own for user in n.users)]

    outer = Graph()
    env: dict[Node, Node] = {}
    for node in gm.graph.nodes:  # placeholders and weights first: no region makes them
        if node not in assigned and node.op != "output":
            env[node] = outer.node_copy(node, lambda a: env[a])
    for i, region in enumerate(regions):
        call = outer.call_module(f"region{i}", tuple(env[a] for a in region.inputs))
        for j, out in enumerate(region.outputs):
            env[out] = outer.call_function(operator.getitem, (call, j))
    outer.node_copy(next(n for n in gm.graph.nodes if n.op == "output"), lambda a: env[a])
    return outer, regions


def _read(region: Region, own: set, source: Node, assigned: dict) -> None:
    """Make ``source``, read by a node of ``region``, available to it: an input, or, for a size another region
    computed (``batch * seq``, ``x.size(0)``), a copy of its computation read from the tensors it measures.
    Recomputed, a size stays what it is where it came from (static where the step's shapes are static, a
    symbol of the batch where they are dynamic); passed as an int input, every size would become a symbol,
    and Inductor's code for a dimension of one (the decode step's single token) would no longer be specialized
    to it."""
    if source in own or source in region.inputs or source in region.recomputed:
        return
    if _is_size(source) and source in assigned:
        for parent in source.all_input_nodes:
            _read(region, own, parent, assigned)
        region.recomputed.append(source)
    else:
        region.inputs.append(source)


def region_module(region: Region) -> GraphModule:
    """``region`` as a GraphModule ``forward(*region.inputs) -> tuple(region.outputs)``; weights are inputs."""
    graph = Graph()
    env: dict[Node, Node] = {}
    for j, source in enumerate(region.inputs):
        env[source] = graph.placeholder(_input_name(source, j))
        env[source].meta = dict(source.meta)
    for node in region.recomputed + region.nodes:
        env[node] = graph.node_copy(node, lambda a: env[a])
    graph.output(tuple(env[n] for n in region.outputs))
    return GraphModule(torch.nn.Module(), graph)


def _input_name(source: Node, j: int) -> str:
    if source.op == "placeholder":
        return source.name
    if source.op == "get_attr":
        return f"{_WEIGHT}{j}"
    return f"{_ACTIVATION}{j}"


def structure(region_gm: GraphModule) -> str:
    """A key equal for two regions exactly when one's code computes the other's from the other's inputs:
    every node's op, target and arguments, with node references as positions (names differ per layer)."""
    index = {node: i for i, node in enumerate(region_gm.graph.nodes)}

    def refs(args):
        return torch.fx.node.map_arg(args, lambda a: f"%{index[a]}")

    return repr([(n.op, None if n.op == "placeholder" else str(n.target), refs(n.args), refs(n.kwargs))
                 for n in region_gm.graph.nodes])


class RegionCall(torch.nn.Module):
    """One region of the outer graph: calls the (compiled) code shared by every region of its structure."""

    def __init__(self, run: Callable):
        super().__init__()
        object.__setattr__(self, "run", run)  # not a submodule: shared, and compiled outside this module

    def forward(self, *inputs):
        return self.run(*inputs)


def regional_graph(gm: GraphModule, compile_region: Callable[[GraphModule], Callable]) -> tuple[GraphModule, int]:
    """``gm`` split at its layers (:func:`split_regions`), each distinct region given to ``compile_region``
    once and run for every region of its structure. Returns the outer GraphModule (same signature and result
    as ``gm``, sharing its weights) and the number of distinct regions compiled."""
    outer, regions = split_regions(gm)
    shared: dict[str, Callable] = {}
    owners: dict[str, object] = {}
    for i, region in enumerate(regions):
        module = region_module(region)
        key = structure(module)
        if key not in shared:
            shared[key] = compile_region(module)
        owners[f"region{i}"] = RegionCall(shared[key])
    for node in outer.nodes:
        if node.op == "get_attr":
            owners[node.target] = _attribute(gm, node.target)
    outer.lint()
    return GraphModule(owners, outer), len(shared)


def _attribute(gm: GraphModule, target: str):
    value = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value
