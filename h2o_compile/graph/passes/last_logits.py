"""A copy of a rewritten graph that computes the logits of the last position of the block only.

``generate`` needs one row of logits after a prompt, but the captured graph projects every position through the
output embeddings: [B, P, V] floats, 25 GB for 8 prompts of 3000 tokens with Gemma 3's 262k vocabulary. The
copy slices the hidden states to the last position just before that projection (what transformers'
``logits_to_keep=1`` does), so everything after it (a final soft-cap) sees [B, 1, H].
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule

from .h2o_attention import copy_graph_module

_LINEAR = torch.ops.aten.linear.default


def output_projection(gm: GraphModule, head_path: str) -> torch.fx.Node:
    """The ``aten.linear`` node traced inside the module at ``head_path`` (e.g. ``model.lm_head``)."""
    found = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is _LINEAR
             and list(n.meta.get("nn_module_stack", {}).values())[-1:] and
             list(n.meta["nn_module_stack"].values())[-1][0] == head_path]
    if len(found) != 1:
        raise ValueError(f"expected one aten.linear traced in {head_path!r}, found {len(found)}")
    return found[0]


def last_position_logits(gm: GraphModule, head_path: str) -> GraphModule:
    """A copy of ``gm`` (sharing its weights) whose logits output is [B, 1, V]: the block's last position."""
    copy = copy_graph_module(gm)
    graph = copy.graph
    head = output_projection(copy, head_path)
    hidden = head.args[0]
    with graph.inserting_before(head):
        last = graph.call_function(torch.ops.aten.slice.Tensor, (hidden, 1, -1, torch.iinfo(torch.int64).max))
    head.args = (last,) + head.args[1:]
    graph.lint()
    copy.recompile()
    return copy
