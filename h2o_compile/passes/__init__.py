"""Graph passes: each takes a GraphModule and reports how many rewrites it made."""

from .attention_sites import AttentionSite, Decline, find_attention_sites
from .h2o_attention import (LayerSpec, count_h2o_ops, decode_step_graph, rewrite_attention, set_h2o_params,
                            state_names)
from .last_logits import last_position_logits

__all__ = ["AttentionSite", "Decline", "LayerSpec", "count_h2o_ops", "find_attention_sites", "decode_step_graph",
           "last_position_logits", "rewrite_attention", "set_h2o_params", "state_names"]
