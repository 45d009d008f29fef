"""Find the attention sites of a captured graph: where q, k, v meet, with the KV heads un-repeated.

Patterns (small documented variants, no per-architecture code):
  1. ``aten.scaled_dot_product_attention(q, k, v, mask?, scale=?, enable_gqa=?)``;
  2. the same fed by transformers' ``repeat_kv`` (unsqueeze(2) -> expand -> reshape), peeled off so only the
     KV heads reach the cache;
  3. eager: ``matmul(q, k^T) -> mul/div scale -> [soft-cap] -> add mask? -> softmax -> to? -> dropout? ->
     matmul(., v)``, where the soft-cap is Gemma 2's ``mul(tanh(div(x, cap)), cap)``;
  4. eager with learned attention sinks (GPT-OSS): the masked logits are concatenated with one sink logit per
     query head (a parameter [Hq] reshaped and expanded), shifted by their max, soft-maxed, and the sink
     column sliced off before the product with v.

A node that looks like attention but cannot be served (additive float masks that may carry a position bias,
other score transforms, cross-attention) yields a :class:`Decline` that names the node and the reason; the
caller decides whether that is an error. Each site also records which decoder layer it belongs to (from
the module path torch.export keeps in ``node.meta["nn_module_stack"]``), so per-layer settings from the
config are matched to sites by layer, not by graph order alone.
"""

from __future__ import annotations

import math
import operator
import re
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
    softcap: float = 0.0            # logit soft-capping c (0 = none)
    sink: Optional[Node] = None     # learned sink logits [Hq], None = none
    layer: Optional[int] = None     # decoder layer index from the module path, None if the graph does not say


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


def _is_call(node, *targets) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target in targets


def _last_dim(node: Node, dim) -> bool:
    val = _val(node)
    return dim == -1 or (val is not None and dim == val.dim() - 1)


_LAYER_INDEX = re.compile(r"\.(\d+)(?:\.|$)")


def module_layer(node: Node) -> Optional[int]:
    """The decoder layer a node was traced in: the first integer component of its innermost module path
    (``model.layers.3.self_attn`` -> 3, ``transformer.h.0.attn`` -> 0), None if the graph does not say."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    path = list(stack.values())[-1][0]
    found = _LAYER_INDEX.search("." + str(path))
    return int(found.group(1)) if found else None


_SHAPE_ONLY = (aten.expand.default, aten.slice.Tensor, aten.unsqueeze.default, aten.select.int, *_VIEWS,
               *_PASSTHROUGH)
_WHERE = (aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar)
_MASKED_FILL = (aten.masked_fill.Scalar, aten.masked_fill.Tensor)
_CONSTANT_FILLS = (aten.zeros.default, aten.full.default, aten.zeros_like.default, aten.full_like.default,
                   aten.new_zeros.default, aten.new_full.default, aten.scalar_tensor.default)


def _is_scalar(x) -> bool:
    if isinstance(x, (int, float)):
        return True
    val = _val(x)
    return val is not None and val.numel() == 1


def _is_bool(x) -> bool:
    val = _val(x)
    return val is not None and val.dtype == torch.bool


def is_visibility_mask(node) -> bool:
    """True when an additive attention term can only say "visible" or "hidden": a choice between two
    constants under a bool condition (``where(cond, 0, min)``, ``masked_fill(zeros, cond, min)``), reshaped
    or sliced. Such a term carries no graded position bias (ALiBi, a learned bias), so the H2O op, which
    masks by position, may drop it."""
    while _is_call(node, *_SHAPE_ONLY):
        node = node.args[0]
    if _is_call(node, *_WHERE):
        cond, a, b = node.args[:3]
        return _is_bool(cond) and _is_scalar(a) and _is_scalar(b)
    if _is_call(node, *_MASKED_FILL):
        base, cond, value = node.args[:3]
        return _is_bool(cond) and _is_scalar(value) and (_is_call(base, *_CONSTANT_FILLS) or
                                                         is_visibility_mask(base))
    return False


def _strip_max_shift(node):
    """``sub(x, max(x, -1, keepdim).values)`` -> x: the shift a softmax does not see."""
    if not _is_call(node, aten.sub.Tensor):
        return node
    x, peak = node.args
    if _is_call(peak, operator.getitem):
        peak = peak.args[0]
    if _is_call(peak, aten.max.dim, aten.amax.default) and peak.args[0] is x:
        return x
    return node


def _sink_parameter(node) -> Optional[Node]:
    """The [Hq] tensor behind ``param.reshape(1, -1, 1, 1).expand(B, -1, T, 1)``, None if it is not that."""
    while _is_call(node, aten.expand.default, *_VIEWS, *_PASSTHROUGH):
        node = node.args[0]
    val = _val(node)
    return node if val is not None and val.dim() == 1 else None


def _strip_softcap(logits) -> tuple[object, float]:
    """``mul(tanh(div(x, c)), c)`` -> (x, c); anything else -> (logits, 0.0)."""
    if _is_call(logits, aten.mul.Tensor) and isinstance(logits.args[1], (int, float)):
        tanh = logits.args[0]
        if _is_call(tanh, aten.tanh.default):
            inner = tanh.args[0]
            cap = float(logits.args[1])
            if _is_call(inner, aten.div.Tensor) and inner.args[1] == cap:
                return inner.args[0], cap
            if _is_call(inner, aten.mul.Tensor) and isinstance(inner.args[1], (int, float)) and \
                    math.isclose(inner.args[1] * cap, 1.0, rel_tol=1e-6):
                return inner.args[0], cap
    return logits, 0.0


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
    if mask is None and not _arg(node, 5, "is_causal", False):
        # No mask and not causal: every query sees every key, later ones included (an encoder), which a
        # cache of past keys cannot serve.
        return Decline(node, "SDPA without a mask and with is_causal=False is bidirectional attention")
    scale = node.kwargs.get("scale")  # keyword-only in aten's schema
    if scale is None:
        scale = 1.0 / math.sqrt(_val(q).shape[-1])
    return AttentionSite(node, q, k, v, float(scale), "sdpa", layer=module_layer(node))


def match_eager(node: Node) -> Union[AttentionSite, Decline, None]:
    """Match backwards from ``matmul(probs, v)`` whose ``probs`` come from a softmax."""
    if node.op != "call_function" or node.target is not aten.matmul.default:
        return None
    probs, v = node.args
    softmax = _skip_passthrough(probs)
    sliced = _is_call(softmax, aten.slice.Tensor) and _last_dim(softmax.args[0], softmax.args[1]) and \
        tuple(softmax.args[2:4]) == (0, -1)
    if sliced:  # probs[..., :-1]: a sink column is dropped
        softmax = _skip_passthrough(softmax.args[0])
    if not (isinstance(softmax, Node) and softmax.target in _SOFTMAX):
        return None
    if softmax.args[1] not in (-1, 3):
        return Decline(node, f"softmax over dim {softmax.args[1]}, expected the last dim")
    logits, sink = softmax.args[0], None
    if sliced:
        concat = _skip_passthrough(_strip_max_shift(logits))
        if not (_is_call(concat, aten.cat.default) and len(concat.args[0]) == 2 and
                _last_dim(concat, concat.args[1] if len(concat.args) > 1 else 0)):
            return Decline(node, "the softmax's last column is dropped but its input is not cat([logits, sinks])")
        logits, sink = concat.args[0][0], _sink_parameter(concat.args[0][1])
        if sink is None:
            return Decline(node, "the extra softmax column is not a per-head parameter (learned sinks [Hq])")
    if isinstance(logits, Node) and logits.target is aten.add.Tensor:
        if not is_visibility_mask(logits.args[1]):
            return Decline(node, f"the term {logits.args[1]} added to the logits is not a causal/padding mask "
                                 "(a position bias or learned bias cannot follow evicted keys)")
        logits = logits.args[0]  # the additive causal/padding mask: our op masks by position instead
    logits, softcap = _strip_softcap(logits)
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
    if declined is None and sink is not None and _val(sink).shape[0] != _val(q).shape[1]:
        declined = Decline(node, f"sink logits of shape {tuple(_val(sink).shape)} for {_val(q).shape[1]} query heads")
    pattern = "eager+sinks" if sink is not None else "eager"
    return declined or AttentionSite(node, q, k, v, float(scale), pattern, softcap=softcap, sink=sink,
                                     layer=module_layer(node))


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
