"""torch.library custom ops ``h2o::*``: the one op boundary torch.compile, torch.export and ONNX see.

Two flavours of the same computation (see kernels/reference.py for the contract and shapes):

- ``torch.ops.h2o.attention_`` mutates the layer's state in place and returns the attention output;
  the PyTorch runtime uses it (static buffers, CUDA-graph friendly).
- ``torch.ops.h2o.attention`` takes the state and returns ``(out, key_cache, value_cache, score_cache,
  pos_cache)``; ONNX export uses it, because exported graphs cannot mutate their inputs.

Their arguments are declared once in ops/schema.py; which kernels compute them is decided in ops/dispatch.py.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import dispatch
from ..kernels import reference
from ..kernels import reference_decode
from ..kernels.rolling import as_tables
from .schema import H2O_ATTENTION


def check_inputs(q: Tensor, k: Tensor, v: Tensor, positions: Tensor, valid: Optional[Tensor],
                 key_cache: Tensor, value_cache: Tensor, score_cache: Tensor, pos_cache: Tensor,
                 recent: int, sinks: int, policy: str, window: int = 0, softcap: float = 0.0,
                 sink_logits: Optional[Tensor] = None, query_from: Optional[Tensor] = None,
                 key_scale: Optional[Tensor] = None, value_scale: Optional[Tensor] = None, **unchecked) -> None:
    """Shape / dtype checks with messages that say what was expected (raised as ValueError); ``unchecked``: the
    op's other arguments (a bound call, ``check_inputs(**H2O_ATTENTION.bind(args, kwargs))``)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be 4-D [B, H, T, D]; got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    b, hq, t, d = q.shape
    hkv = k.shape[1]
    if k.shape[0] != b or k.shape[2] != t or k.shape[3] != d:
        raise ValueError(f"k {tuple(k.shape)} must be [B={b}, Hkv, T={t}, D={d}] to match q {tuple(q.shape)}")
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"v {tuple(v.shape)} must share [B, Hkv, T] with k {tuple(k.shape)}")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    if positions.shape != (b, t) or positions.dtype != torch.int64:
        raise ValueError(f"positions must be int64 [B={b}, T={t}]; got {positions.dtype} {tuple(positions.shape)}")
    if valid is not None and (valid.shape != (b, t) or valid.dtype != torch.bool):
        raise ValueError(f"valid must be bool [B={b}, T={t}]; got {valid.dtype} {tuple(valid.shape)}")
    cap = pos_cache.shape[-1] if pos_cache.dim() == 3 else -1
    expected = {
        "key_cache": (key_cache, (b, hkv, cap, d)),
        "value_cache": (value_cache, (b, hkv, cap, v.shape[3])),
        "score_cache": (score_cache, (b, hkv, cap)),
        "pos_cache": (pos_cache, (b, hkv, cap)),
    }
    for name, (tensor, shape) in expected.items():
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {shape} (C = cache slots)")
    _check_quantized(key_cache, value_cache, key_scale, value_scale, (b, hkv, cap))
    if score_cache.dtype != torch.float32 or pos_cache.dtype != torch.int64:
        raise ValueError(f"score_cache must be float32 and pos_cache int64; got {score_cache.dtype}, "
                         f"{pos_cache.dtype}")
    reference.parse_rule(policy)  # a ValueError names a bad policy or score option
    if query_from is not None and (tuple(query_from.shape) != (b,) or query_from.dtype != torch.int64):
        raise ValueError(f"query_from must be int64 [B={b}]; got {query_from.dtype} {tuple(query_from.shape)}")
    if recent < 1 or sinks < 0 or recent + sinks > cap:
        raise ValueError(f"need recent >= 1, sinks >= 0 and recent + sinks <= C={cap}; got recent={recent}, "
                         f"sinks={sinks}")
    if window < 0 or softcap < 0:
        raise ValueError(f"window={window} and softcap={softcap} must be >= 0 (0 = off)")
    if sink_logits is not None and tuple(sink_logits.shape) != (hq,):
        raise ValueError(f"sink_logits must be [Hq={hq}] (one logit per query head); got {tuple(sink_logits.shape)}")


def _check_quantized(key_cache: Tensor, value_cache: Tensor, key_scale: Optional[Tensor],
                     value_scale: Optional[Tensor], shape: tuple) -> None:
    """int8 caches come with both fp32 scales [B, Hkv, C] (kernels/quantized.py); float caches with none."""
    int8 = (key_cache.dtype == torch.int8, value_cache.dtype == torch.int8)
    given = (key_scale is not None, value_scale is not None)
    if int8[0] != int8[1] or given[0] != given[1] or int8[0] != given[0]:
        raise ValueError(f"quantized entries need int8 key_cache and value_cache plus key_scale and value_scale; "
                         f"got key_cache {key_cache.dtype}, value_cache {value_cache.dtype}, key_scale "
                         f"{'given' if given[0] else 'None'}, value_scale {'given' if given[1] else 'None'}")
    for name, scale in (("key_scale", key_scale), ("value_scale", value_scale)):
        if scale is not None and (tuple(scale.shape) != shape or scale.dtype != torch.float32):
            raise ValueError(f"{name} must be float32 {shape} (one scale per slot); got {scale.dtype} "
                             f"{tuple(scale.shape)}")


def _checked_state(a: dict):
    """Check a bound call of the h2o op (``H2O_ATTENTION.bind``); its state as kernels/state.py's object."""
    check_inputs(**a)
    return reference.make_state(*(a[n] for n in H2O_ATTENTION.state))


def _params(a: dict) -> dict:
    """The keyword arguments of the kernels' entry points (``reference_decode.h2o_attention_`` and the others)."""
    return dict(scale=a["scale"], recent=a["recent"], sinks=a["sinks"], policy=a["policy"], seed=a["seed"],
                window=a["window"], softcap=a["softcap"], sink_logits=a["sink_logits"], query_from=a["query_from"],
                rope=as_tables(a["rope_cos"], a["rope_sin"], a["max_distance"]))


def _attention_(*args, **kwargs) -> Tensor:
    """In-place H2O attention over a block of T new tokens. Returns out [B, Hq, T, Dv].

    ``window`` (sliding window, 0 = none), ``softcap`` (0 = none) and ``sink_logits`` ([Hq] or None) are the
    layer's attention kind (kernels/reference.py). ``rope_cos``/``rope_sin`` ([B', S, R] rotary tables, or
    None) switch on rolling positions: q, k and the cache are unrotated and rotated by rank at attention time,
    or by true distance capped at ``max_distance`` when it is > 0 (kernels/rolling.py). ``policy`` is the
    eviction rule (kernels/rules.py: a policy name or an ``EvictionRule.spec``); ``query_from`` ([B] int64 or
    None) is given with the prompt block only.
    ``key_scale``/``value_scale`` ([B, Hkv, C] fp32) come with int8 caches (kernels/quantized.py)."""
    a = H2O_ATTENTION.bind(args, kwargs)
    state = _checked_state(a)
    return dispatch.h2o_attention_(a["q"], a["k"], a["v"], a["positions"], a["valid"], state, **_params(a))


def _attention(*args, **kwargs) -> tuple[Tensor, ...]:
    """Functional H2O attention: returns (out, key_cache, value_cache, score_cache, pos_cache, key_scale,
    value_scale), all new; the two scales are empty [0] tensors when the caches are not quantized (an op has
    one output arity)."""
    a = H2O_ATTENTION.bind(args, kwargs)
    state = _checked_state(a)
    out, new = dispatch.h2o_attention(a["q"], a["k"], a["v"], a["positions"], a["valid"], state, **_params(a))
    fresh = tuple(x.clone() if x is y else x for x, y in zip(new.tensors(), state.tensors()))
    no_scales = () if state.quantized else (a["score_cache"].new_empty(0), a["score_cache"].new_empty(0))
    return (out,) + fresh + no_scales


def _fake_out(a: dict) -> Tensor:
    return a["q"].new_empty(a["q"].shape[:3] + (a["v"].shape[3],))


def _attention_fake(*args, **kwargs):
    a = H2O_ATTENTION.bind(args, kwargs)
    scales = [a["score_cache"].new_empty(0) if a[n] is None else torch.empty_like(a[n])
              for n in ("key_scale", "value_scale")]
    return (_fake_out(a), *(torch.empty_like(a[n]) for n in H2O_ATTENTION.state[:4]), *scales)


attention_ = torch.library.custom_op("h2o::attention_", _attention_, mutates_args=H2O_ATTENTION.state,
                                     schema=H2O_ATTENTION.torch_schema("Tensor", mutating=True))
attention_.register_fake(lambda *args, **kwargs: _fake_out(H2O_ATTENTION.bind(args, kwargs)))
attention = torch.library.custom_op("h2o::attention", _attention, mutates_args=(),  # out and the 6 state tensors
                                    schema=H2O_ATTENTION.torch_schema(f"({', '.join(['Tensor'] * 7)})", mutating=False))
attention.register_fake(_attention_fake)


@torch.library.custom_op("h2o::attend_decode", mutates_args=())
def attend_decode(q: Tensor, k: Tensor, v: Tensor, valid: Tensor, key_cache: Tensor, value_cache: Tensor,
                  pos_cache: Tensor, scale: float, new_pos: Tensor, window: int = 0, softcap: float = 0.0,
                  sink_logits: Optional[Tensor] = None, key_scale: Optional[Tensor] = None,
                  value_scale: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """The attention half of the decode step (reference_decode.attend_decode): (out [B, Hq, 1, Dv], mass over the
    cache [B, Hkv, C], mass on the new key [B, Hkv, 1]). Opaque to the compiler, which keeps its two
    batched matrix-vector products on the BLAS kernels."""
    state = reference.make_state(key_cache, value_cache, None, pos_cache, key_scale, value_scale)
    out, mass_cache, mass_new = reference_decode.attend_decode(q, k, v, valid, state, scale, new_pos, window=window,
                                                        softcap=softcap, sink_logits=sink_logits)
    return out, mass_cache.contiguous(), mass_new.clone()  # views of one tensor: outputs may not alias


@attend_decode.register_fake
def _(q, k, v, valid, key_cache, value_cache, pos_cache, scale, new_pos, window=0, softcap=0.0, sink_logits=None,
      key_scale=None, value_scale=None):
    mass = pos_cache.new_empty(pos_cache.shape, dtype=torch.float32)
    return q.new_empty(q.shape[:3] + (value_cache.shape[3],)), mass, mass.new_empty(pos_cache.shape[:2] + (1,))


@torch.library.custom_op("h2o::materialize", mutates_args=())
def materialize(tensors: list[Tensor]) -> list[Tensor]:
    """Copies of ``tensors`` (each with its input's shape, dtype and device) that the compiled graph must
    compute here, once, each as its own buffer.

    Two Inductor behaviours this opaque op stops in the int8 decode step, whose attention is plain torch ops:
    a pointwise producer is inlined into every consumer loop, so the query rotated by the model's rotary
    embedding (sin and cos per element) would be recomputed for each of the C cached slots; and the post-grad
    locality pass moves a value that only the next layer reads (the attention output) past the cache writes,
    which then can no longer be done in place (a full copy of the value cache every step)."""
    return [t.clone() for t in tensors]


@materialize.register_fake
def _(tensors):
    return [torch.empty_like(t) for t in tensors]


def decode_fusable_(*args, native: bool = False, **kwargs) -> Tensor:
    """``torch.ops.h2o.attention_`` for T = 1 with its bookkeeping in the open: ``reference_decode.h2o_decode_`` traced
    into the step, so the eviction bookkeeping (reference_decode.evict_and_write_) is plain torch ops that torch.compile
    fuses into the step's generated code (on CPU one loop nest per layer instead of many small eager kernels),
    around the attention ``dispatch.compiled_decode_attend`` picks. Same arguments and result as the op, plus
    ``native``: the attention through the native CPU op (kernels/native_cpu.py; decided when the graph is built,
    since the check that builds the library cannot run inside traced code). The compiled CPU decode graph calls
    this (passes.fuse_decode_bookkeeping)."""
    a = H2O_ATTENTION.bind(args, kwargs)
    state = _checked_state(a)
    if a["q"].shape[2] != 1:
        raise ValueError(f"decode_fusable_ takes one token per row (T = 1); got T = {a['q'].shape[2]}")
    return reference_decode.h2o_decode_(a["q"], a["k"], a["v"], a["positions"], a["valid"], state, **_params(a),
                                 attend_decode_fn=dispatch.compiled_decode_attend(native, state.quantized))
