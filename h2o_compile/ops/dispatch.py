"""Which implementation computes the h2o ops, decided here and nowhere else.

The rule arithmetic lives in kernels/rules.py (torch), export/onnx_function.py (ONNX) and
export/native/h2o_rule.h (C++); kernels/reference.py is the executable spec in plain PyTorch. This module
picks, per call:

- the backend of ``torch.ops.h2o.attention_`` (:func:`backend_for`): the Triton kernels for CUDA tensors when
  Triton is importable, else the reference; ``H2O_COMPILE_BACKEND=reference|triton`` forces one;
- on the reference backend, the attention of a block (torch's fused CPU attention, kernels/cpu_prefill.py,
  where it applies) and of a decode step (the native CPU op, kernels/native_cpu.py, where it is built);
- the decode step: eager or compiled and in which mode (:func:`compile_mode`), how its graph is built
  (:func:`compiled_step_plan`, :func:`eager_step_plan`) and its attention (:func:`compiled_decode_attend`).

What each backend serves is config/capabilities.py's table.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch

from ..kernels import cpu_prefill, native_cpu, reference
from ..kernels import reference_decode

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
    float cache, the library built; one call instead of ~15 eager operators), else
    ``reference_decode.attend_decode``."""
    if native_cpu.decodes(q, state.key_cache, state.value_cache):
        return native_cpu.attend_decode(q, k, v, valid, state.key_cache, state.value_cache, state.pos_cache, scale,
                                        new_pos, window, softcap, sink_logits)
    return reference_decode.attend_decode(q, k, v, valid, state, scale, new_pos, window=window, softcap=softcap,
                                   sink_logits=sink_logits)


def compiled_decode_attend(native: bool, quantized: bool):
    """The attention of the compiled decode step (``ops.decode_fusable_``), ``reference_decode.attend_decode``'s
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
    out = reference_decode.attend_decode(q, k, v, valid, state, scale, new_pos, window=window, softcap=softcap,
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
        from ..kernels import triton_ops

        return triton_ops.h2o_attention_(q, k, v, positions, valid, state, **params)
    return reference_decode.h2o_attention_(q, k, v, positions, valid, state, attend_fn=attend_block,
                                    attend_decode_fn=attend_decode_step, **params)


def h2o_attention(q, k, v, positions, valid, state, **params):
    """``torch.ops.h2o.attention``'s computation (the functional op, what ONNX export traces)."""
    return reference.h2o_attention(q, k, v, positions, valid, state, attend_fn=attend_block, **params)


def compile_mode(setting, device: torch.device) -> Optional[str]:
    """The torch.compile mode of the decode step for optimize's ``compile`` setting on ``device``, or None to
    run eagerly: ``"auto"`` compiles on CUDA only (CUDA graphs), True takes the device's usual mode."""
    if setting == "auto":
        setting = device.type == "cuda"
    if setting is False:
        return None
    if setting is True:
        return "reduce-overhead" if device.type == "cuda" else "default"
    return setting


def freezes_weights(mode: str, device: torch.device) -> bool:
    """Whether the compiled step freezes the weights into its code (max-autotune off CUDA), so that Inductor
    prepacks them for its GEMMs (which needs the linear layers in their usual ``aten.linear`` form)."""
    return mode == "max-autotune" and device.type != "cuda"


@dataclass(frozen=True)
class StepPlan:
    """How the graph of the one-token decode step is built from the model's graph (runtime/compiling.py)."""

    fuse_bookkeeping: bool  # the eviction bookkeeping as plain torch ops (passes.fuse_decode_bookkeeping)
    native: bool            # the attention, and with weight_major the linears, through the native CPU ops
    weight_major: bool      # the linear layers as ``weight @ x^T`` or the native ``rows_linear``


def compiled_step_plan(mode: str, device: torch.device) -> StepPlan:
    """The compiled step's graph: on the reference backend its bookkeeping fused (the Triton decode kernel fuses
    it on GPU); on CPU its attention through the native op where it is built, and its linear layers weight-major
    unless the mode freezes the weights, which Inductor then prepacks as they are."""
    if backend_for(device) != "reference":
        return StepPlan(fuse_bookkeeping=False, native=False, weight_major=False)
    cpu = device.type == "cpu"
    return StepPlan(fuse_bookkeeping=True, native=cpu and native_cpu.available(),
                    weight_major=cpu and not freezes_weights(mode, device))


def eager_step_plan(rows: int) -> StepPlan:
    """The eager one-token step on CPU: the linears through the native ``rows_linear`` where it is built, else,
    with two rows or more, as ``weight @ x^T`` (faster at batch >= 2, docs/results/eager_decode_layout_cpu.md);
    a single row keeps ``aten.linear``, where the measured runs found no consistent difference."""
    native = native_cpu.available()
    return StepPlan(fuse_bookkeeping=False, native=native, weight_major=native or rows > 1)
