"""Capture a Hugging Face causal LM as an FX graph: torch.export (non-strict), use_cache=False, dynamic shapes;
``build_graph`` then rewrites its attention into H2O ops (the graph every backend runs or exports).

The captured graph computes ``logits = model(input_ids, position_ids)`` for a whole block of tokens with the
model's own attention (SDPA or eager). The attention pass then turns it into H2O attention over explicit
per-layer state. Weights are shared with the user's model, not copied.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import nn

from ..config import H2OConfig
from .passes import find_attention_sites, find_rotary, move_rotary_into_ops, rewrite_attention
from .support import ModelLimits, UnsupportedModelError, attention_implementation, check_supported

class _LogitsOnly(nn.Module):
    """forward(input_ids, position_ids) -> logits [B, T, V], without a KV cache."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits


def capture(model: nn.Module, example_len: int = 8, example_batch: int = 2) -> torch.fx.GraphModule:
    """Export ``model`` to an FX GraphModule ``(input_ids [B, T], position_ids [B, T]) -> logits [B, T, V]``.

    Batch and sequence length are dynamic. The returned module uses plain (non-pytree) calling conventions so
    passes can add inputs and outputs.
    """
    if not hasattr(model, "config") or not hasattr(model.config, "vocab_size"):
        raise TypeError(f"expected a transformers causal LM (with .config), got {type(model).__name__}")
    model.eval()
    max_pos = getattr(model.config, "max_position_embeddings", None) or 4096
    device = next(model.parameters()).device
    input_ids = torch.zeros(example_batch, example_len, dtype=torch.long, device=device)
    position_ids = torch.arange(example_len, device=device).expand(example_batch, example_len).contiguous()
    batch = torch.export.Dim("batch", min=1, max=4096)
    seq = torch.export.Dim("seq", min=1, max=max(example_len + 1, max_pos))
    dynamic = {"input_ids": {0: batch, 1: seq}, "position_ids": {0: batch, 1: seq}}
    with attention_implementation(model), torch.no_grad():
        exported = torch.export.export(_LogitsOnly(model), (input_ids, position_ids), dynamic_shapes=dynamic,
                                       strict=False)
    gm = exported.module()
    _flatten_calling_convention(gm)
    return gm


def _flatten_calling_convention(gm: torch.fx.GraphModule) -> None:
    """Replace the pytree in/out spec of an exported module by plain positional inputs and one output."""
    graph = gm.graph
    # The unlifted module checks its inputs against the exported spec; the passes change the inputs.
    gm._forward_pre_hooks.clear()
    graph._codegen = torch.fx.graph.CodeGen()
    output = next(n for n in graph.nodes if n.op == "output")
    (result,) = torch.utils._pytree.tree_leaves(output.args)
    output.args = (result,)
    gm.recompile()


def build_graph(model: nn.Module, *, functional: bool = False, positions: str = "true", quantized: bool = False,
                max_distance: Optional[int] = None):
    """Capture ``model`` and rewrite its attention; returns (graph, layer specs, limits).
    ``quantized``: int8 kept entries (H2OConfig.kv_dtype), two scale tensors more per layer in the state.

    ``positions="rolling"`` or ``"capped"`` also moves every layer's rotary embedding into its h2o op
    (passes.move_rotary_into_ops; ``max_distance`` as H2OConfig's); a model without rotary embeddings raises
    UnsupportedModelError."""
    limits = check_supported(model)
    capped = H2OConfig(positions=positions, max_distance=max_distance)
    if limits.max_positions is not None:
        capped.position_cap(limits.max_positions)  # a cap beyond the model's positions fails before the capture
    graph = capture(model)
    sites, declines = find_attention_sites(graph.graph)
    name = type(model).__name__
    if declines:
        raise UnsupportedModelError(f"{name}: cannot serve these attention sites: " + "; ".join(map(str, declines)))
    if len(sites) != limits.num_layers:
        raise UnsupportedModelError(
            f"{name}: found {len(sites)} attention sites for {limits.num_layers} layers; supported patterns are "
            "aten.scaled_dot_product_attention (with or without repeat_kv / enable_gqa) and eager "
            "matmul -> softmax -> matmul")
    check_layer_kinds(name, sites, limits)
    layers = rewrite_attention(graph, sites, functional=functional, windows=limits.windows, quantized=quantized)
    _, not_rotary = find_rotary(graph)
    limits = dataclasses.replace(limits, rotary=not not_rotary)
    if positions != "true":
        if not_rotary:
            raise UnsupportedModelError(f"{name}: positions={positions!r} needs rotary position embeddings on every "
                                        "layer, to rotate keys at attention time; " + "; ".join(not_rotary))
        move_rotary_into_ops(graph, capped.position_cap(limits.max_positions))
    return graph, layers, limits


def check_layer_kinds(name: str, sites, limits: ModelLimits) -> None:
    """The config's per-layer settings apply to the site of that layer: sites must come in layer order (where
    the graph records the module path), and the soft-cap the graph shows must be the config's."""
    for i, site in enumerate(sites):
        if site.layer is not None and site.layer != i:
            raise UnsupportedModelError(f"{name}: attention site {i} ({site.node.name}) was traced in layer "
                                        f"{site.layer}; cannot match the config's per-layer attention kinds")
        if abs(site.softcap - limits.softcap) > 1e-6 * max(1.0, limits.softcap):
            raise UnsupportedModelError(
                f"{name}: layer {i} ({site.node.name}) soft-caps its logits at {site.softcap or 'none'} but the "
                f"config says attn_logit_softcapping={limits.softcap or None}")
