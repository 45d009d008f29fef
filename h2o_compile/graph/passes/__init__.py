"""Graph passes: each takes a GraphModule and reports how many rewrites it made."""

from .attention_sites import AttentionSite, Decline, find_attention_sites
from .h2o_attention import (LayerSpec, copy_graph_module, count_h2o_ops, fuse_decode_bookkeeping, rewrite_attention,
                            runtime_recent_graph, set_h2o_params, state_fields, state_names)
from .head_groups import split_kv_heads
from .last_logits import last_position_logits
from .rolling_positions import find_rotary, move_rotary_into_ops
from .rotary_table_cache import RotaryTables, cache_rotary_tables
from .weight_major_linear import linear_weight_major, weight_major_linears

__all__ = ["AttentionSite", "Decline", "LayerSpec", "RotaryTables", "cache_rotary_tables", "copy_graph_module",
           "count_h2o_ops", "find_attention_sites", "find_rotary", "fuse_decode_bookkeeping", "last_position_logits",
           "linear_weight_major", "move_rotary_into_ops", "rewrite_attention", "runtime_recent_graph",
           "set_h2o_params", "split_kv_heads", "state_fields", "state_names", "weight_major_linears"]
