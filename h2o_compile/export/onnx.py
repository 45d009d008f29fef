"""Export an H2O model to ONNX: ``export_onnx(model, out_dir, budget=0.2, max_seq_len=2048)``.

The exported graph is the functional H2O graph of passes/h2o_attention.py, one ``model.onnx``:

    inputs   input_ids [B, T] int64, position_ids [B, T] int64, valid [B, T] bool,
             past_key_values.{i}.key [B, Hkv, C, D], .value [B, Hkv, C, Dv], .score [B, Hkv, C] f32,
             .position [B, Hkv, C] int64 (-1 = empty slot); with kv_dtype="int8" the key and value are int8
             and .key_scale / .value_scale [B, Hkv, C] f32 follow (cache_plan.py)
    outputs  logits [B, T, V], present.{i}.key / .value / .score / .position (/ .key_scale / .value_scale),
             the same shapes as the inputs

B and T are dynamic, C (the cache capacity, = H2OConfig.capacity(max_seq_len)) is static: it is the shape of
the state, and the recent window and sink count baked into the graph are derived from it.

Why one graph for prefill and decode: T is dynamic and the H2O function is the general block path of
kernels/reference.py, which for T = 1 computes the same cache layout as the in-place decode fast path. A
second graph would duplicate the weights (or need shared external data) for a decode step that costs the same
apart from two TopK passes over C + 1 entries, which are small next to reading the C cached keys and values.

Why ``position_ids`` + ``valid`` and not Optimum's ``attention_mask`` [B, past + T]: an evicting cache has
no "past length" — slot j holds an arbitrary kept position — so the graph cannot derive positions from a
mask over the past. The caller (ort.H2OOrtModel, like runtime.H2OModel) counts the valid tokens of each row
and passes the true positions; ``valid`` is the block's own attention mask (False = left padding), which
is all the graph needs to never attend to nor cache a padding token.

Each attention site is one ``ai.h2o_compile::H2OAttention`` node, a model-local function of standard ops
(export/onnx_function.py), so any ONNX Runtime provider runs the model without a custom-op library.
Next to the model: ``h2o_config.json`` (everything ort.H2OOrtModel needs), the transformers config, the
generation config and, when given or found, the tokenizer files.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import warnings
from pathlib import Path

import torch
from torch import nn

from ..graph.capture import build_graph
from ..config import H2OConfig, check_served, resolve_config
from ..runtime import H2OModel
from ..runtime.cache_plan import CachePlan, head_groups
from ..kernels.rules import POLICY_CODES, SCORES, parse_rule
from ..ops import H2O_ATTENTION
from ..graph.passes import set_h2o_params, split_kv_heads
from ..graph.passes.h2o_attention import state_fields
from ..graph.support import check_supported

MODEL_FILE = "model.onnx"
CONFIG_FILE = "h2o_config.json"
FORMAT = "h2o_compile.onnx"
FORMAT_VERSION = 5  # 2: the H2OAttention function takes rotary tables (rolling positions); 3: kv_dtype;
#                    4: its max_distance attribute (capped distances); 5: the H2OConfig as config.to_dict()
# The scores the ONNX function and export/native/h2o_rule.h compute, by their registry entry's code; the
# capability table (config/capabilities.py) refuses the others before an export.
ONNX_SCORE_CODES = {name: s.onnx_code for name, s in SCORES.items() if s.onnx_code is not None}
SUPPORTED_OPSETS = range(18, 24)  # the function body is written with opset 18 ops, unchanged up to 23
_DTYPES = {torch.float32: "float32", torch.float16: "float16"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "vocab.txt", "added_tokens.json", "chat_template.jinja")


def state_input_names(num_layers: int, quantized: bool = False) -> list[str]:
    return [f"past_key_values.{i}.{f}" for i in range(num_layers) for f in state_fields(quantized)]


def state_output_names(num_layers: int, quantized: bool = False) -> list[str]:
    return [f"present.{i}.{f}" for i in range(num_layers) for f in state_fields(quantized)]


def _h2o_translation(*args, **kwargs):
    """torch.ops.h2o.attention (its arguments: ops/schema.py) -> one call of the H2OAttention function
    (attributes carry the constants).

    A layer without learned sinks passes all -inf (no sink for any head): the function's input is always
    there, and the constant lets ONNX Runtime fold the sink branch away (export/onnx_function.py).
    Quantized entries (key_scale given): the function runs on the dequantized caches and its caches are
    quantized again (export/onnx_function.py, ``dequantized`` / ``quantized``)."""
    from onnxscript import opset18 as op

    from .onnx_function import H2OAttentionNode, dequantized, quantized

    a = H2O_ATTENTION.bind(args, kwargs)
    q, sink_logits, rope_cos, rope_sin = a["q"], a["sink_logits"], a["rope_cos"], a["rope_sin"]
    key_cache, value_cache, key_scale, value_scale = a["key_cache"], a["value_cache"], a["key_scale"], a["value_scale"]
    rule = parse_rule(a["policy"])

    if sink_logits is None:
        # [Hq] from q's static head count; the optimizer folds Shape + Expand into a constant.
        sink_logits = op.Expand(op.Constant(value_float=float("-inf")), op.Shape(q, start=1, end=2))
    rolling = rope_cos is not None
    if not rolling:  # true positions: a placeholder table, never read (the function's If folds away)
        rope_cos = rope_sin = op.ConstantOfShape(op.Constant(value_ints=[1, 1, 2]))
    if key_scale is not None:
        key_cache, value_cache = dequantized(key_cache, key_scale), dequantized(value_cache, value_scale)
    out, keys, values, scores, slots = H2OAttentionNode(
        q, a["k"], a["v"], a["positions"], a["valid"], key_cache, value_cache, a["score_cache"], a["pos_cache"],
        sink_logits, rope_cos, rope_sin, scale=float(a["scale"]), recent=int(a["recent"]), sinks=int(a["sinks"]),
        policy=POLICY_CODES[rule.policy], seed=int(a["seed"]), window=int(a["window"]), softcap=float(a["softcap"]),
        rolling=int(rolling), score=ONNX_SCORE_CODES[rule.score], decay=float(rule.decay),
        max_distance=int(a["max_distance"]))
    if key_scale is None:  # the op's two scale outputs are empty and unused
        none = op.Constant(value_floats=[])
        return out, keys, values, scores, slots, none, none
    (keys, new_key_scale), (values, new_value_scale) = quantized(keys), quantized(values)
    return out, keys, values, scores, slots, new_key_scale, new_value_scale


def _resolve_config(model, config, options: dict) -> tuple[nn.Module, H2OConfig]:
    """An H2OModel lends its H2OConfig (``config`` / ``options`` win); a transformers model gets ``config``
    (default: the paper's) with ``options``."""
    if isinstance(model, H2OModel):
        return model.model, resolve_config(model.h2o_config if config is None else config, None, options)
    if not isinstance(model, nn.Module) or not hasattr(model, "config"):
        raise TypeError(f"export_onnx expects a transformers causal LM or an H2OModel, "
                        f"got {type(model).__name__}")
    return model, resolve_config(config, None, options)


def export_onnx(model, out_dir: str | os.PathLike, *, config=None, max_seq_len: int | None = None,
                batch_size: int | None = None, opset: int = 18, tokenizer=None, op: str = "function",
                **options) -> Path:
    """Export ``model`` (a transformers causal LM or an :class:`H2OModel`) with its H2O cache to ``out_dir``.

    Args:
        config: an H2OConfig, preset name or rule string (as :func:`optimize`); default: the H2OModel's own
            config, else the paper's. ``**options``: H2OConfig / ScoreRule fields applied on top. What the ONNX
            backends do not serve (a prompt window: the exported graph has no input marking the prompt block;
            a score outside the ONNX function's) is refused by name (h2o_compile/config/capabilities.py). ``prefill`` is
            recorded for the ORT model.
        max_seq_len: the longest prompt + new tokens the export serves (default: the model's
            max_position_embeddings, at most 2048). Fixes the capacity C = capacity(max_seq_len) (and each
            sliding-window layer's own slot count, H2OConfig.layer_params).
        batch_size: None (default) exports a dynamic batch axis; an int fixes it.
        opset: ONNX opset of the model, 18..23.
        tokenizer: saved next to the model when given; otherwise tokenizer files found in the model's
            ``name_or_path`` directory are copied.
        op: "function" (default) attaches the H2OAttention function body, so the file runs in any ONNX
            Runtime, and runs the native custom op instead when H2OOrtModel registers it (a registered kernel
            wins over a model-local function of the same name, measured in tests/export/test_native_op.py);
            "native" writes the nodes without the body: a smaller graph that needs the library
            (export/native) to load.
    Returns:
        ``out_dir`` as a Path. Raises ValueError for bad arguments, before anything is written.
    """

    hf_model, config = _resolve_config(model, config, options)
    _check_op(op, config)
    if opset not in SUPPORTED_OPSETS:
        raise ValueError(f"opset={opset!r}; allowed: {SUPPORTED_OPSETS.start}..{SUPPORTED_OPSETS.stop - 1}")
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int)
                                   or batch_size < 1):
        raise ValueError(f"batch_size={batch_size!r} must be None (dynamic) or an int >= 1")
    max_pos = getattr(getattr(hf_model, "config", None), "max_position_embeddings", None)
    if max_seq_len is None:
        max_seq_len = min(max_pos or 2048, 2048)
    if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < 1:
        raise ValueError(f"max_seq_len={max_seq_len!r} must be an int >= 1 (prompt + new tokens)")
    capacity = config.capacity(max_seq_len)
    recent = config.recent_window(capacity)
    limits = check_supported(hf_model)  # from the config, before the slow capture
    block = max_seq_len if config.prefill == "full" else config.prefill  # rolling: the last block decides
    CachePlan.check_lengths(config, limits, max_seq_len, rolling_block=block)

    graph, layers, _ = build_graph(hf_model, functional=True, positions=config.positions,
                                   quantized=config.quantized, max_distance=config.max_distance)
    layers = split_kv_heads(graph, layers, head_groups(config, layers))
    dtype = layers[0].dtype
    if dtype not in _DTYPES:
        raise ValueError(f"model dtype {dtype} is not supported by the ONNX export; use float32 or float16")
    policies = config.layer_rules([spec.window for spec in layers])  # before writing anything
    plan = CachePlan.build(config, layers, limits, max_seq_len=max_seq_len)
    set_h2o_params(graph, recent=plan.recent, sinks=plan.sinks, policy=policies, seed=config.seed)

    program = _export_program(graph, plan, batch_size, opset, function_body=op == "function")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "model_file": MODEL_FILE, "config": config.to_dict(),
        "max_distance": config.position_cap(limits.max_positions) or None,
        "capacity": capacity, "recent": recent, "max_seq_len": max_seq_len, "batch_size": batch_size,
        "opset": opset, "op": op, "dtype": _DTYPES[dtype], "vocab_size": int(hf_model.config.vocab_size),
        "num_layers": len(layers),
        "layers": plan.layer_meta(),
        "model_type": getattr(hf_model.config, "model_type", None),
        "architecture": type(hf_model).__name__,
    }
    program.model.metadata_props["h2o_compile"] = json.dumps(meta, sort_keys=True)
    program.save(out_dir / MODEL_FILE)
    (out_dir / CONFIG_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    _save_companions(hf_model, out_dir, tokenizer)
    return out_dir


OPS = ("function", "native")


def _check_op(op, config: H2OConfig) -> None:
    """``op`` is one of OPS and its backends serve ``config`` (the function's, or the native op's on CPU and
    CUDA). Both serve int8 entries: the H2OAttention node itself always sees dequantized caches
    (_h2o_translation), so the native kernel computes the same contract."""
    if op not in OPS:
        raise ValueError(f"op={op!r}; allowed: {', '.join(map(repr, OPS))}")
    for backend in (("ONNX function",) if op == "function" else ()) + ("native ORT CPU", "native ORT CUDA"):
        check_served(config, backend)


def _export_program(graph, plan: CachePlan, batch_size: int | None, opset: int, function_body: bool = True):
    """torch.onnx.export (dynamo) of the functional graph with ``plan``'s state; returns the ONNXProgram with
    the function kept (``function_body`` False: the H2OAttention nodes without a body)."""
    max_seq_len = plan.max_seq_len
    example_b = batch_size or 2
    example_t = 3  # not 0/1 (torch.export would specialise) and different from B so the two stay independent
    device = next(graph.parameters()).device
    input_ids = torch.zeros(example_b, example_t, dtype=torch.long, device=device)
    positions = torch.arange(example_t, device=device).expand(example_b, -1).contiguous()
    valid = torch.ones(example_b, example_t, dtype=torch.bool, device=device)
    state = [t for layer in plan.empty_state(example_b, device) for t in layer]
    quantized = plan.layers[0].spec.quantized
    batch = torch.export.Dim("batch", min=1, max=4096) if batch_size is None else None
    block = torch.export.Dim("block", min=1, max=max(max_seq_len, example_t))
    token_dims = {0: batch, 1: block} if batch is not None else {1: block}
    state_dims = {0: batch} if batch is not None else None
    dynamic = (token_dims, token_dims, token_dims) + (state_dims,) * len(state)
    names_in = ["input_ids", "position_ids", "valid"] + state_input_names(len(plan.layers), quantized)
    names_out = ["logits"] + state_output_names(len(plan.layers), quantized)
    with torch.no_grad(), _quiet_exporter():
        program = torch.onnx.export(
            graph, (input_ids, positions, valid, *state), dynamo=True, dynamic_shapes=dynamic,
            input_names=names_in, output_names=names_out, opset_version=opset,
            custom_translation_table={torch.ops.h2o.attention.default: _h2o_translation},
            optimize=False, verbose=False)
    _attach_h2o_function(program, opset, body=function_body)
    return program


def _attach_h2o_function(program, opset: int, body: bool = True) -> None:
    """Optimize an exported ONNXProgram whose h2o ops went through ``_h2o_translation`` and add the body of
    the H2OAttention function they call (the one function every attention kind shares), unless ``body`` is
    False (op="native")."""
    import onnxscript.optimizer
    from onnxscript import ir

    from .onnx_function import DOMAIN, H2OAttention

    # The exporter's own optimize() inlines every function; fold constants but keep H2OAttention a node.
    onnxscript.optimizer.optimize_ir(program.model, inline=False)
    program.model.opset_imports[DOMAIN] = 1
    if not body:
        return
    function = ir.serde.deserialize_function(H2OAttention.to_function_proto())
    function.opset_imports[""] = opset  # written with opset 18 ops whose semantics 19..23 keep
    program.model.functions[function.identifier()] = function


@contextlib.contextmanager
def _quiet_exporter():
    """Silence exporter notes that do not concern this export (torchvision ops, axis renaming, ...)."""
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*axis name.*will not be used")
            warnings.filterwarnings("ignore", category=FutureWarning, message=r".*LeafSpec.*")
            # The unlifted torch.export module reports training mode but has no dropout and refuses .eval().
            warnings.filterwarnings("ignore", message=r"Exporting a model while it is in training mode")
            yield
    finally:
        logger.setLevel(level)


def _save_companions(hf_model, out_dir: Path, tokenizer) -> None:
    """transformers config + generation config + tokenizer files, so the ORT model needs nothing else."""
    hf_model.config.save_pretrained(out_dir)
    generation_config = getattr(hf_model, "generation_config", None)
    if generation_config is not None:
        generation_config.save_pretrained(out_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
        return
    source = Path(str(getattr(hf_model.config, "_name_or_path", "") or ""))
    if source.is_dir() and source.resolve() != out_dir.resolve():
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copy2(source / name, out_dir / name)
