"""Find the attention sites of a captured graph: where q, k, v meet, with the KV heads un-repeated.

Patterns (small documented variants, no per-architecture code):
  1. ``aten.scaled_dot_product_attention(q, k, v, mask?, scale=?, enable_gqa=?)``;
  2. the same fed by transformers' ``repeat_kv`` (unsqueeze(2) -> expand -> reshape), peeled off so only the
     KV heads reach the cache;
  3. eager: ``matmul(q, k^T) -> mul/div scale -> add mask? -> softmax -> to? -> dropout? -> matmul(., v)``.

A node that looks like attention but cannot be served (additive float masks that may carry a position bias,
logit soft-capping, cross-attention) yields a :class:`Decline` that names the node and the reason; the
caller decides whether that is an error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch.fx import Node

aten = torch.ops.aten

_VIEWS = (aten.reshape.default, aten.view.default, aten._unsafe_view.default)
_PASSTHROUGH = (aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.dropout.default,
                aten.alias.default, aten.clone.default, aten.contiguous.default)
_SOFTMAX = (aten.softmax.int, aten._softmax.default)


@dataclass
class AttentionSite:
    """One attention computation: ``node`` outputs [B, Hq, T, Dv] from q [B, Hq, T, D], k/v [B, Hkv, T, *]."""

    node: Node
    query: Node
    key: Node
    value: Node
    scale: float
    pattern: str


@dataclass
class Decline:
    node: Node
    reason: str

    def __str__(self) -> str:
        return f"{self.node.name}: {self.reason}"


def _val(node) -> Optional[torch.Tensor]:
    return node.meta.get("val") if isinstance(node, Node) else None


def _arg(node: Node, index: int, name: str, default=None):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def peel_repeat_kv(node: Node) -> Node:
    """``reshape(expand(unsqueeze(x, 2), [B, Hkv, G, S, D]), [B, Hkv*G, S, D])`` -> x; anything else as is."""
    if not (isinstance(node, Node) and node.target in _VIEWS):
        return node
    expand = node.args[0]
    while isinstance(expand, Node) and expand.target in (aten.clone.default, aten.contiguous.default):
        expand = expand.args[0]
    if not (isinstance(expand, Node) and expand.target is aten.expand.default):
        return node
    unsqueeze = expand.args[0]
    if not (isinstance(unsqueeze, Node) and unsqueeze.target is aten.unsqueeze.default and unsqueeze.args[1] == 2):
        return node
    source = unsqueeze.args[0]
    if _val(source) is None or _val(source).dim() != 4:
        return node
    return source


def _skip_passthrough(node):
    while isinstance(node, Node) and node.target in _PASSTHROUGH:
        node = node.args[0]
    return node


def _check_self_attention(node: Node, q: Node, k: Node, v: Node) -> Optional[Decline]:
    qv, kv, vv = _val(q), _val(k), _val(v)
    if qv is None or kv is None or vv is None:
        return Decline(node, "shapes unknown (no meta['val']); capture with torch.export")
    if qv.dim() != 4 or kv.dim() != 4:
        return Decline(node, f"expected 4-D q/k, got {tuple(qv.shape)} and {tuple(kv.shape)}")
    if qv.shape[2] is not kv.shape[2] and str(qv.shape[2]) != str(kv.shape[2]):
        return Decline(node, "keys come from another sequence than the queries (cross-attention)")
    if kv.shape[1] == 0 or qv.shape[1] % kv.shape[1]:
        return Decline(node, f"{qv.shape[1]} query heads are not a multiple of {kv.shape[1]} KV heads")
    return None


def match_sdpa(node: Node) -> Union[AttentionSite, Decline, None]:
    if node.op != "call_function" or node.target is not aten.scaled_dot_product_attention.default:
        return None
    q, k, v = node.args[:3]
    mask = _arg(node, 3, "attn_mask")
    if isinstance(mask, Node) and _val(mask) is not None and _val(mask).dtype != torch.bool:
        return Decline(node, "SDPA with an additive float mask, which may carry a position bias (ALiBi); "
                             "only causal/padding masks are supported")
    if _arg(node, 4, "dropout_p", 0.0):
        return Decline(node, "attention dropout is active (call model.eval())")
    k, v = peel_repeat_kv(k), peel_repeat_kv(v)
    declined = _check_self_attention(node, q, k, v)
    if declined:
        return declined
    scale = node.kwargs.get("scale")
    if scale is None:
        scale = 1.0 / math.sqrt(_val(q).shape[-1])
    return AttentionSite(node, q, k, v, float(scale), "sdpa")


def match_eager(node: Node) -> Union[AttentionSite, Decline, None]:
    """Match backwards from ``matmul(probs, v)`` whose ``probs`` come from a softmax."""
    if node.op != "call_function" or node.target is not aten.matmul.default:
        return None
    probs, v = node.args
    softmax = _skip_passthrough(probs)
    if not (isinstance(softmax, Node) and softmax.target in _SOFTMAX):
        return None
    if softmax.args[1] not in (-1, 3):
        return Decline(node, f"softmax over dim {softmax.args[1]}, expected the last dim")
    logits = softmax.args[0]
    if isinstance(logits, Node) and logits.target is aten.add.Tensor:
        logits = logits.args[0]  # the additive causal/padding mask: our op masks by position instead
    scale = 1.0
    if isinstance(logits, Node) and logits.target in (aten.mul.Tensor, aten.div.Tensor) and \
            isinstance(logits.args[1], (int, float)):
        scale = logits.args[1] if logits.target is aten.mul.Tensor else 1.0 / logits.args[1]
        logits = logits.args[0]
    if not (isinstance(logits, Node) and logits.target is aten.matmul.default):
        found = logits.target if isinstance(logits, Node) else logits
        return Decline(node, f"softmax input is {found}, expected matmul(q, k^T) [* scale] [+ mask]; logit "
                             "soft-capping and other score transforms are not supported")
    q, kt = logits.args
    if not (isinstance(kt, Node) and kt.target is aten.transpose.int and sorted(kt.args[1:]) in ([2, 3], [-2, -1])):
        return Decline(node, "keys are not transposed as k.transpose(2, 3)")
    k, v = peel_repeat_kv(kt.args[0]), peel_repeat_kv(v)
    declined = _check_self_attention(node, q, k, v)
    return declined or AttentionSite(node, q, k, v, float(scale), "eager")


def find_attention_sites(graph: torch.fx.Graph) -> tuple[list[AttentionSite], list[Decline]]:
    """All attention sites in graph order, and the nodes that looked like attention but were declined."""
    sites, declines = [], []
    for node in graph.nodes:
        for matcher in (match_sdpa, match_eager):
            found = matcher(node)
            if isinstance(found, AttentionSite):
                sites.append(found)
            elif isinstance(found, Decline):
                declines.append(found)
    return sites, declines
