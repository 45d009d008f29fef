"""Tensor parallelism for H2O decode over torch.distributed: shard a model's attention heads and MLP across ranks
before capture, so each rank's H2O state holds its own KV heads only.

The split is gpt-fast's tp.py (and transformers' ``base_model_tp_plan``): per decoder layer

    q_proj, k_proj, v_proj  column-parallel   weight [H * D, hidden] -> rows of this rank's heads [H / N * D, hidden]
    o_proj                  row-parallel      weight [hidden, Hq * D] -> columns of this rank's query heads
    gate_proj, up_proj      column-parallel   weight [I, hidden] -> [I / N, hidden]
    down_proj               row-parallel      weight [hidden, I] -> [hidden, I / N]

and one ``torch.distributed._functional_collectives.all_reduce(out, "sum", group)`` after each row-parallel
layer, in a forward hook. torch.export captures that as ``_c10d_functional.all_reduce`` / ``wait_tensor`` nodes,
so the capture, the attention rewrite and torch.compile (fullgraph) see an ordinary per-rank model: attention
over [B, Hq / N, T, D] queries and [B, Hkv / N, T, D] keys, H2O state [B, Hkv / N, C, D] per layer.

Why no collective of our own: H2O scores, evicts and stores per (row, KV head), and rank r's query heads are
exactly the query group of its KV heads (contiguous chunks: r * Hq / N ... with Hq / N = group x Hkv / N), so
every score rule, int8 entries, sliding-window layers and rolling or capped positions run on a rank's heads
unchanged, and rank r's kept positions equal one process's for heads r * Hkv / N ... (r + 1) * Hkv / N - 1.

Embeddings, norms and the output projection stay replicated: after each all-reduce every rank holds the same
hidden state (a sum reduced in one order and sent to all), hence the same logits, so greedy decoding picks the
same token on every rank; sampling draws from torch's global generator, so give every rank the same seed
(``torch.manual_seed(s)`` before ``generate``), which then draws the same token everywhere.

Declined (ValueError naming the counts): KV heads or query heads not divisible by N, among them MQA (one KV
head; replicating it would split its query group's score over ranks, and the ranks would evict different
tokens), an MLP intermediate size not divisible by N, and attention without separate q/k/v/o projections
(fused ``qkv_proj``, GPT-2's ``c_attn``). An MLP of another layout (mixture of experts, ``fc1``/``fc2``) stays
replicated: correct, only not memory-sharded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from .support import text_config

_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
# Attention projections of layouts the plan cannot split by head: their presence names the decline.
_FUSED = ("qkv_proj", "query_key_value", "c_attn", "Wqkv", "W_pack")


@dataclass(frozen=True)
class TensorParallel:
    """How a model was sharded: ``world`` ranks, this one ``rank``; head counts per rank."""

    group: dist.ProcessGroup
    world: int
    rank: int
    heads: int         # query heads on this rank (the model's / world)
    kv_heads: int      # KV heads on this rank: the H2O state's Hkv
    mlp_sharded: bool  # False: the MLPs have no gate/up/down layout and stay replicated


def resolve_group(tp) -> Optional[dist.ProcessGroup]:
    """The process group ``optimize(tp=...)`` shards over: None for ``tp`` False/None, the default group for
    True, the group itself for a ProcessGroup. ValueError when torch.distributed is not initialized."""
    if tp is None or tp is False:
        return None
    if tp is not True and not isinstance(tp, dist.ProcessGroup):
        raise TypeError(f"tp={tp!r} must be True (the default process group), a torch.distributed ProcessGroup, "
                        "or False")
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("tp=True needs torch.distributed initialized in this process (run under torchrun and "
                         "call torch.distributed.init_process_group('gloo' or 'nccl') first)")
    return dist.group.WORLD if tp is True else tp


def shard_model(model: nn.Module, tp: Union[bool, dist.ProcessGroup], settings: str = "") -> TensorParallel:
    """Shard ``model`` in place over the ranks of ``tp`` (see the module docstring) and divide the head counts
    (and the MLP's intermediate size when it is sharded) in its config. Call it on every rank with the same
    model (same weights) and the same ``settings`` (what the caller will do with it, e.g. the H2OConfig as a
    string): every rank checks that all ranks agree before changing anything, so a mismatch raises ValueError
    on every rank instead of diverging.

    Raises ValueError for counts the plan cannot split (the message names them) or a model sharded already."""
    group = resolve_group(tp)
    if group is None:
        raise ValueError(f"tp={tp!r}: nothing to shard over")
    if getattr(model, "_h2o_tensor_parallel", None) is not None:
        raise ValueError(f"{type(model).__name__} is sharded already ({model._h2o_tensor_parallel}); optimize a "
                         "fresh copy of the model")
    if getattr(model, "_tp_size", None) not in (None, 1):  # transformers' tp_plan: DTensor weights, config whole
        raise ValueError(f"{type(model).__name__} was sharded by transformers' tp_plan (tp_size={model._tp_size}); "
                         "load it without tp_plan and let optimize(..., tp=True) shard it")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    config = text_config(model)
    attentions, mlps = _plan(model, config, world)
    _check_ranks_agree(model, config, settings, group, world)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if getattr(config, "head_dim", None) is None:  # derived as hidden / heads: pin it before dividing the heads
        config.head_dim = config.hidden_size // heads
    for attn in attentions:
        _shard_attention(attn, heads, world, rank, group)
    for mlp in mlps:
        _column(mlp.gate_proj, world, rank)
        _column(mlp.up_proj, world, rank)
        _row(mlp.down_proj, world, rank, group)
    config.num_attention_heads = heads // world
    config.num_key_value_heads = kv_heads // world
    if mlps:
        config.intermediate_size //= world
    info = TensorParallel(group, world, rank, heads // world, kv_heads // world, bool(mlps))
    model._h2o_tensor_parallel = info
    return info


def _plan(model: nn.Module, config, world: int) -> tuple[list[nn.Module], list[nn.Module]]:
    """The attention and MLP modules to shard; ValueError for counts or layouts the plan cannot split."""
    name = f"{type(model).__name__} (model_type={getattr(config, 'model_type', '?')!r})"
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if not isinstance(heads, int):
        raise ValueError(f"{name}: config has no num_attention_heads; cannot split attention by head")
    if kv_heads % world or heads % world:
        mqa = (" (MQA: its one KV head serves every query head, and replicating it would split that head's "
               "score over the ranks, which would then evict different tokens)") if kv_heads == 1 else ""
        raise ValueError(f"{name}: num_key_value_heads={kv_heads} and num_attention_heads={heads} must both be "
                         f"divisible by the tensor-parallel size {world}{mqa}")
    fused = sorted({child for _, m in model.named_modules() for child in _FUSED if hasattr(m, child)})
    attentions = [m for _, m in model.named_modules() if all(isinstance(getattr(m, p, None), nn.Linear) for p in _ATTN)]
    layers = config.num_hidden_layers
    if fused or len(attentions) != layers:
        raise ValueError(f"{name}: tensor parallelism splits attention with separate q_proj/k_proj/v_proj/o_proj "
                         f"linears; found {len(attentions)} such modules for {layers} layers"
                         + (f" and fused projections {fused}" if fused else ""))
    for attn in attentions:
        q, k = attn.q_proj.out_features, attn.k_proj.out_features
        if q % heads or k % kv_heads or q // heads != k // kv_heads or attn.o_proj.in_features != q:
            raise ValueError(f"{name}: attention projections q_proj {q} / k_proj {k} / o_proj in "
                             f"{attn.o_proj.in_features} features do not split into {heads} query and {kv_heads} "
                             "KV heads of one size")
    mlps = [m for _, m in model.named_modules() if all(isinstance(getattr(m, p, None), nn.Linear) for p in _MLP)]
    for mlp in mlps:
        inter = mlp.gate_proj.out_features
        if inter % world or mlp.up_proj.out_features != inter or mlp.down_proj.in_features != inter:
            raise ValueError(f"{name}: MLP intermediate size {inter} (up_proj {mlp.up_proj.out_features}, "
                             f"down_proj in {mlp.down_proj.in_features}) must be one size divisible by the "
                             f"tensor-parallel size {world}")
    return attentions, mlps


def _shard_attention(attn: nn.Module, heads: int, world: int, rank: int, group) -> None:
    for proj in ("q_proj", "k_proj", "v_proj"):
        _column(getattr(attn, proj), world, rank)
    _row(attn.o_proj, world, rank, group)
    sinks = getattr(attn, "sinks", None)  # learned attention sinks (GPT-OSS): one logit per query head
    if isinstance(sinks, nn.Parameter) and sinks.shape == (heads,):
        attn.sinks = nn.Parameter(_chunk(sinks.data, 0, world, rank), requires_grad=sinks.requires_grad)
    for count in ("num_heads", "num_attention_heads", "num_key_value_heads"):  # a module that keeps its own
        if isinstance(getattr(attn, count, None), int):
            setattr(attn, count, getattr(attn, count) // world)


def _chunk(t: torch.Tensor, dim: int, world: int, rank: int) -> torch.Tensor:
    return t.chunk(world, dim=dim)[rank].clone().contiguous()


def _column(linear: nn.Linear, world: int, rank: int) -> None:
    """Keep this rank's output features: weight [out, in] -> [out / N, in] (and the bias)."""
    linear.weight = nn.Parameter(_chunk(linear.weight.data, 0, world, rank), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(_chunk(linear.bias.data, 0, world, rank), requires_grad=False)
    linear.out_features //= world


def _row(linear: nn.Linear, world: int, rank: int, group) -> None:
    """Keep this rank's input features, weight [out, in] -> [out, in / N], and sum the ranks' partial outputs
    with an all-reduce after the layer. The bias is added once, on rank 0 (the sum would count it N times)."""
    linear.weight = nn.Parameter(_chunk(linear.weight.data, 1, world, rank), requires_grad=False)
    if linear.bias is not None and rank != 0:
        linear.bias = nn.Parameter(torch.zeros_like(linear.bias.data), requires_grad=False)
    linear.in_features //= world
    linear.register_forward_hook(_AllReduce(group))


class _AllReduce:
    """Forward hook: out [..., hidden] summed over the group's ranks by a functional collective, which
    torch.export records as graph nodes (a plain ``dist.all_reduce`` would run once while tracing and vanish)."""

    def __init__(self, group):
        self.group = group

    def __call__(self, module, inputs, out):
        from torch.distributed import _functional_collectives as funcol

        return funcol.all_reduce(out, "sum", self.group)


def _check_ranks_agree(model: nn.Module, config, settings: str, group, world: int) -> None:
    """Every rank must shard the same model with the same settings: gather a fingerprint from each (the class,
    head and layer counts, a checksum of the weights, ``settings``) and raise on every rank if they differ."""
    with torch.no_grad():
        checksum = float(sum(p.double().sum() for p in model.parameters()))
    mine = (type(model).__name__, config.num_hidden_layers, config.num_attention_heads,
            getattr(config, "num_key_value_heads", None), round(checksum, 6), settings)
    every = [None] * world
    dist.all_gather_object(every, mine, group=group)
    differ = [r for r, other in enumerate(every) if other != every[0]]
    if differ:
        raise ValueError(f"tensor parallelism needs the same model and settings on every rank; ranks {differ} "
                         f"differ from rank 0: {every[differ[0]]} vs {every[0]}")
