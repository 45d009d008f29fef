"""Graph passes: each takes a GraphModule and reports how many rewrites it made."""

from .attention_sites import AttentionSite, Decline, find_attention_sites
from .h2o_attention import (LayerSpec, count_h2o_ops, decode_step_graph, rewrite_attention, set_h2o_params,
                            state_names)

__all__ = ["AttentionSite", "Decline", "LayerSpec", "count_h2o_ops", "find_attention_sites", "decode_step_graph",
           "rewrite_attention", "set_h2o_params", "state_names"]
