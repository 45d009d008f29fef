"""Which implementation computes the h2o ops, decided here and nowhere else, and what each backend serves.

The rule arithmetic lives in kernels/rules.py (torch), export/onnx_function.py (ONNX) and
export/native/h2o_rule.h (C++); kernels/reference.py is the executable spec in plain PyTorch. This module
picks, per call:

- the backend of ``torch.ops.h2o.attention_`` (:func:`backend_for`): the Triton kernels for CUDA tensors when
  Triton is importable, else the reference; ``H2O_COMPILE_BACKEND=reference|triton`` forces one;
- on the reference backend, the attention of a block (torch's fused CPU attention, kernels/cpu_prefill.py,
  where it applies) and of a decode step (the native CPU op, kernels/native_cpu.py, where it is built);
- the graph the compiled decode step runs (:func:`decode_step_graph`) and its attention
  (:func:`compiled_decode_attend`).

:data:`CAPABILITIES` says which scores, prompt options, entry dtypes and position schemes every backend serves;
:func:`check_served` refuses a configuration by name before any work.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch

from .kernels import cpu_prefill, native_cpu, reference
from .kernels.rules import SCORES

_BACKEND_ENV = "H2O_COMPILE_BACKEND"
_FORCED = ("auto", "reference", "triton")


def backend_for(device: torch.device) -> str:
    """``reference`` or ``triton`` for tensors on ``device``, honouring ``H2O_COMPILE_BACKEND``."""
    forced = os.environ.get(_BACKEND_ENV, "auto")
    if forced not in _FORCED:
        raise ValueError(f"{_BACKEND_ENV}={forced!r}; allowed: {', '.join(_FORCED)}")
    if forced != "auto":
        return forced
    if device.type == "cuda" and _triton_available():
        return "triton"
    return "reference"


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def attend_block(q, keys, values, key_pos, positions, valid, scale, *, new_from, window, softcap, sink_logits,
                 query_weight, need_mass, peak=False):
    """The attention of a block over (cache + block) on the reference backend: torch's fused attention where it
    applies (the mass only where a rule reads it), else ``reference.attend``. Shapes as ``reference.attend``."""
    kind = dict(new_from=new_from, window=window, sink_logits=sink_logits, query_weight=query_weight,
                need_mass=need_mass, peak=peak)
    if cpu_prefill.supports(q, softcap):
        return cpu_prefill.attend_sdpa(q, keys, values, key_pos, positions, valid, scale, **kind)
    return reference.attend(q, keys, values, key_pos, positions, valid, scale, softcap=softcap, **kind)


def attend_decode_step(q, k, v, valid, state, scale, new_pos, *, window, softcap, sink_logits):
    """The decode step's attention on the reference backend: the native CPU op where it applies (CPU tensors, a
    float cache, the library built; one call instead of ~15 eager operators), else ``reference.attend_decode``."""
    if native_cpu.decodes(q, state.key_cache, state.value_cache):
        return native_cpu.attend_decode(q, k, v, valid, state.key_cache, state.value_cache, state.pos_cache, scale,
                                        new_pos, window, softcap, sink_logits)
    return reference.attend_decode(q, k, v, valid, state, scale, new_pos, window=window, softcap=softcap,
                                   sink_logits=sink_logits)


def compiled_decode_attend(native: bool, quantized: bool):
    """The attention of the compiled decode step (``ops.decode_fusable_``), ``reference.attend_decode``'s
    signature: int8 entries in the open, so the compiler reads the int8 bytes inside its own reduction loops (a
    BLAS product would need an fp32 copy of every slot chunk first); else the native CPU op where ``native``
    (decided when the graph is built), else the opaque ``h2o::attend_decode``, which keeps its two batched
    matrix-vector products on the BLAS kernels."""
    if quantized:
        return _int8_decode_in_the_open
    return _native_decode if native else _opaque_decode


def _int8_decode_in_the_open(q, k, v, valid, state, scale, new_pos, *, window, softcap, sink_logits):
    # materialize: the query is computed before the reduction loops, the output before the cache writes.
    [q] = torch.ops.h2o.materialize([q])
    out = reference.attend_decode(q, k, v, valid, state, scale, new_pos, window=window, softcap=softcap,
                                  sink_logits=sink_logits, fused_dequant=True)
    return tuple(torch.ops.h2o.materialize(list(out)))


def _native_decode(q, k, v, valid, state, scale, new_pos, *, window, softcap, sink_logits):
    return native_cpu.attend_decode(q, k, v, valid, state.key_cache, state.value_cache, state.pos_cache, scale,
                                    new_pos, window, softcap, sink_logits)


def _opaque_decode(q, k, v, valid, state, scale, new_pos, *, window, softcap, sink_logits):
    return torch.ops.h2o.attend_decode(q, k, v, valid, state.key_cache, state.value_cache, state.pos_cache, scale,
                                       new_pos, window, softcap, sink_logits)


def h2o_attention_(q, k, v, positions, valid, state, **params):
    """``torch.ops.h2o.attention_``'s computation on the backend of ``q``'s device (params as the op's)."""
    if backend_for(q.device) == "triton":
        from .kernels import triton_ops

        return triton_ops.h2o_attention_(q, k, v, positions, valid, state, **params)
    return reference.h2o_attention_(q, k, v, positions, valid, state, attend_fn=attend_block,
                                    attend_decode_fn=attend_decode_step, **params)


def h2o_attention(q, k, v, positions, valid, state, **params):
    """``torch.ops.h2o.attention``'s computation (the functional op, what ONNX export traces)."""
    return reference.h2o_attention(q, k, v, positions, valid, state, attend_fn=attend_block, **params)


def decode_step_graph(graph: torch.fx.GraphModule, mode: str, device: torch.device) -> torch.fx.GraphModule:
    """The graph H2OModel compiles for its one-token step in ``mode``. On the reference backend a copy sharing
    the weights whose eviction bookkeeping is plain torch ops Inductor fuses (passes.fuse_decode_bookkeeping;
    the Triton decode kernel fuses it on GPU), on CPU its attention through the native op where it is built
    and its linear layers as ``weight @ x^T`` or through the native ``rows_linear`` (passes/
    weight_major_linear.py) unless the mode freezes the weights, which Inductor then prepacks as they are."""
    from .compiling import freezes_weights
    from .passes import fuse_decode_bookkeeping, weight_major_linears

    if backend_for(device) != "reference":
        return graph
    native = device.type == "cpu" and native_cpu.available()
    step = fuse_decode_bookkeeping(graph, native=native)
    if device.type == "cpu" and not freezes_weights(mode, device):
        weight_major_linears(step, native=native)
    return step


# -- what every backend serves ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Capability:
    """What one backend serves. ``scores`` None = every registered score (the torch paths call the registry);
    ``prompt_options``: SnapKV's prompt window and pooling (they need to know which block is the prompt)."""

    scores: Optional[tuple[str, ...]] = None
    prompt_options: bool = True
    kv_dtypes: tuple[str, ...] = ("model", "int8")
    positions: tuple[str, ...] = ("true", "rolling", "capped")
    why_not: str = ""  # said with every refusal

    def serves_score(self, score: str) -> bool:
        return self.scores is None or score in self.scores


_ONNX_WHY = ("the exported graph has no input that marks the prompt block, and the rule's arithmetic is "
             "written out in ONNX (export/onnx_function.py) and C++ (export/native/h2o_rule.h) for the scores "
             "listed there only")
# The scores of export.onnx.ONNX_SCORE_CODES.
_ONNX = Capability(scores=("sum", "mean", "max"), prompt_options=False, why_not=_ONNX_WHY)

# The backends a user can end up on: optimize() runs the first four (by device and compile), export_onnx() the
# last three (H2OOrtModel picks the native op when its library is built). "native CPU ops" compute the attention
# and mass only; the rule around them is the torch code, so they serve what the reference serves.
CAPABILITIES: dict[str, Capability] = {
    "reference": Capability(),
    "compiled CPU step": Capability(),
    "native CPU ops": Capability(),
    "Triton": Capability(),
    "ONNX function": _ONNX,
    "native ORT CPU": _ONNX,
    "native ORT CUDA": _ONNX,
}


def served_by(config) -> list[str]:
    """The backends that serve every setting of ``config`` (an H2OConfig)."""
    return [name for name in CAPABILITIES if not _refusals(config, CAPABILITIES[name])]


def _refusals(config, cap: Capability) -> list[str]:
    rule = config.rule
    scores = [rule.score] + ([rule.sliding_score] if rule.sliding_score else [])
    refused = [f"score={s!r}" for s in scores if config.policy == "h2o" and not cap.serves_score(s)]
    if config.scores_prompt_specially and not cap.prompt_options:
        refused.append(f"prompt_window={rule.prompt_window} / prompt_pool={rule.prompt_pool}")
    if config.kv_dtype not in cap.kv_dtypes:
        refused.append(f"kv_dtype={config.kv_dtype!r}")
    if config.positions not in cap.positions:
        refused.append(f"positions={config.positions!r}")
    return refused


def check_served(config, backend: str) -> None:
    """ValueError naming what ``backend`` does not serve of ``config`` and the backends that serve it."""
    if backend not in CAPABILITIES:
        raise ValueError(f"backend={backend!r}; known: {', '.join(CAPABILITIES)}")
    cap = CAPABILITIES[backend]
    refused = _refusals(config, cap)
    if refused:
        why = f" ({cap.why_not})" if cap.why_not else ""
        raise ValueError(f"{', '.join(refused)} is not served by the {backend}{why}; served by: "
                         f"{', '.join(served_by(config)) or 'no backend'}")


def capability_table() -> str:
    """The table as Markdown: one row per backend, one column per registered score, then the other options."""
    head = ["backend"] + [f"score={s}" for s in SCORES] + ["prompt window / pool", "int8 entries", "positions"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, cap in CAPABILITIES.items():
        cells = [name] + ["yes" if cap.serves_score(s) else "refused" for s in SCORES]
        cells += ["yes" if cap.prompt_options else "refused", "yes" if "int8" in cap.kv_dtypes else "refused",
                  ", ".join(cap.positions)]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)
