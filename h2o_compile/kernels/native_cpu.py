"""The native CPU ops (kernels/native/*.cc), built against the installed torch on first use into one library and
loaded as ``torch.ops.h2o_cpu.*``:

- ``causal_attend_with_mass`` (prefill_mass.cc): a block's causal attention and each key's mass in one pass.
  torch's fused CPU attention returns the output and each query's log-sum-exp but not the probabilities, so a
  rule that reads scores pays a second q.k product over the causal triangle (cpu_prefill._key_mass); this op
  keeps each tile of queries' probabilities in cache and reads them twice: the P.V product and the column sums
  (or, for ``score="max"``, each query's sum over its group's heads and then the column maximum).
- ``attend_decode`` (decode_attend.cc): the decode step's attention and mass (``reference_decode.attend_decode``) in
  one call per layer instead of about fifteen small eager operators, whose dispatch costs more than their
  arithmetic at decode sizes.
- ``rows_linear`` (rows_linear.cc): a linear layer over the decode step's few rows, each weight read once while
  the rows stay in L1; the row counts where torch's BLAS streams the weights as fast go to it.

Where the library cannot be built (no compiler, a torch without its headers) both paths keep their torch
implementations (same results) and say so once, in a warning naming the compiler's message;
``H2O_COMPILE_NATIVE_CPU=0`` turns the ops off (one switch, like ``H2O_COMPILE_BACKEND``: ops/dispatch.py).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

from .native_build import cache_root, compile_cached, compiler, digest

HERE = Path(__file__).resolve().parent / "native"
SOURCES = ("prefill_mass.cc", "decode_attend.cc", "rows_linear.cc")
HEADERS = ("vec_math.h",)
QUERY_TILE = 64  # prefill queries per tile: their logits ([64, S] fp32, 1 MiB at S = 4096) stay in L2 / L3
OFF_SWITCH = "H2O_COMPILE_NATIVE_CPU"
DECODE_CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_state: dict[str, object] = {}  # "loaded": bool once tried; "why": the reason it is unavailable


def _command() -> tuple[list[str], list[str]]:
    """(compile command without output / sources, link arguments) for this torch."""
    root = Path(torch.__file__).resolve().parent  # the wheel's own headers and libraries
    lib, include = root / "lib", root / "include"
    flags = [compiler("the native CPU ops are compiled on first use"), "-std=c++20", "-O3", "-march=native",
             "-fopenmp", "-fPIC", "-shared",
             f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    # ATen's Vectorized<float> picks its instructions from CPU_CAPABILITY: the widest this machine runs
    # (-march=native compiles for it). Anything else takes ATen's portable vectors.
    capability = torch.backends.cpu.get_cpu_capability()
    if capability in ("AVX2", "AVX512"):
        flags += [f"-DCPU_CAPABILITY={capability}", f"-DCPU_CAPABILITY_{capability}"]
    flags += [f"-I{include}", f"-I{include / 'torch' / 'csrc' / 'api' / 'include'}"]
    return flags, [f"-L{lib}", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{lib}"]


def library_path(*, rebuild: bool = False) -> Path:
    """The built op library for this torch and these sources (compiled now if missing); NativeBuildError if it
    cannot be built."""
    command, link = _command()
    key = digest(HERE, SOURCES + HEADERS, command + link)
    out_dir = cache_root() / "cpu" / f"torch-{torch.__version__}-{key}"
    return compile_cached(out_dir / "libh2o_cpu.so", command, [HERE / s for s in SOURCES], "the native CPU ops",
                          rebuild=rebuild, link=link)


def available() -> bool:
    """Whether the ops are loaded (building and loading them on the first call). False, with one warning naming
    the reason, when they cannot be built; False without one when switched off (``OFF_SWITCH`` = 0)."""
    if "loaded" not in _state:
        if os.environ.get(OFF_SWITCH, "1") == "0":
            _state.update(loaded=False, why=f"{OFF_SWITCH}=0")
            return False
        try:
            path = library_path()
            if not hasattr(torch.ops.h2o_cpu, "attend_decode"):  # registered once per process
                torch.ops.load_library(str(path))
                torch.library.register_fake("h2o_cpu::attend_decode")(_attend_decode_fake)
                torch.library.register_fake("h2o_cpu::rows_linear")(_rows_linear_fake)
            _state.update(loaded=True)
        except Exception as exc:  # noqa: BLE001 - any failure to build or load means: the torch paths
            _state.update(loaded=False, why=str(exc))
            warnings.warn("h2o_compile: the native CPU ops could not be built, so the prefill of rules that read "
                          "scores takes the two-pass path and the decode step torch's operators (slower, same "
                          f"result): {exc}", RuntimeWarning, stacklevel=2)
    return bool(_state["loaded"])


@contextlib.contextmanager
def disabled():
    """Within the block, the torch paths run, as where the ops cannot be built (benchmarks and tests compare)."""
    saved = dict(_state)
    _state.update(loaded=False, why="disabled()")
    try:
        yield
    finally:
        _state.clear()
        _state.update(saved)


def causal_attend_with_mass(qf: Tensor, kf: Tensor, vf: Tensor, cache_pos: Tensor, query_pos: Tensor, window: int,
                            scale: float, sink: Optional[Tensor], weight: Optional[Tensor], *, peak: bool = False
                            ) -> tuple[Tensor, Tensor]:
    """A block's attention over its C cached and T own keys, and each key's mass, in one pass.

    Args:
        qf: [N, G, T, D] (N = B x Hkv, G query heads per KV head); kf: [N, C + T, D]; vf: [N, C + T, Dv];
        cache_pos: [N, C] int64 positions of the cached keys (-1 = an empty slot); query_pos: [N, T] int64, increasing
        along the block (no padding; the block's own keys have these positions); window: the layer's sliding
        window W (0 = none); sink: [N, G] learned sink logits or None; weight: [N, T] fp32 query weights or None.
    Returns:
        out [N, G, T, Dv] in qf's dtype and mass [N, C + T] fp32: sum over the G heads and the T queries of
        weight x probability; with ``peak`` (``score="max"``) the maximum over the T queries of weight x the
        probability summed over the G heads. Computed in fp32 whatever the input dtype.
    Raises RuntimeError naming the reason when the op could not be built (see ``available``).
    """
    if not available():
        raise RuntimeError(f"the native CPU ops are unavailable: {_state['why']}")
    out, mass = torch.ops.h2o_cpu.causal_attend_with_mass(qf.float(), kf.float(), vf.float(), cache_pos, query_pos,
                                                          window, scale, sink, weight, QUERY_TILE,
                                                          peak)
    return out.to(qf.dtype), mass


def decodes(q: Tensor, key_cache: Tensor, value_cache: Tensor) -> bool:
    """Whether :func:`attend_decode` takes this step: CPU tensors, float (not int8) keys and values, the ops
    built. (With rolling positions an int8 cache's keys arrive dequantized, its values still int8.)"""
    return (q.device.type == "cpu" and key_cache.dtype in DECODE_CACHE_DTYPES
            and value_cache.dtype == key_cache.dtype and available())


def attend_decode(q: Tensor, k: Tensor, v: Tensor, valid: Tensor, key_cache: Tensor, value_cache: Tensor,
                  pos_cache: Tensor, scale: float, new_pos: Optional[Tensor], window: int = 0, softcap: float = 0.0,
                  sink_logits: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """``reference_decode.attend_decode`` for a float cache in one native call (no check that the ops are built: the
    caller asked :func:`decodes`, outside any traced code, so that a compiled step can call this).

    Args:
        q: [B, Hq, 1, D]; k: [B, Hkv, 1, D]; v: [B, Hkv, 1, Dv]; valid: [B, 1] bool; key_cache: [B, Hkv, C, D];
        value_cache: [B, Hkv, C, Dv] (fp32 / bf16 / fp16); pos_cache: [B, Hkv, C] int64; new_pos: [B, Hkv, 1]
        int64 (needed with a window only); window, softcap, sink_logits [Hq]: the layer's attention kind.
    Returns:
        out [B, Hq, 1, Dv] (q's dtype), mass over the cache [B, Hkv, C] and on the new key [B, Hkv, 1] (fp32).
    """
    return torch.ops.h2o_cpu.attend_decode(q, k, v, valid, key_cache, value_cache, pos_cache, scale, new_pos,
                                           window, softcap, sink_logits)


def rows_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """``F.linear(x, weight, bias)`` for the few rows of a decode step (rows_linear.cc); the caller checked
    :func:`available` outside any traced code, as for :func:`attend_decode`.

    Args:
        x: [..., in]; weight: [out, in]; bias: [out] or None.
    Returns:
        [..., out] (fp32 sums in another order than torch's BLAS: equal within rounding).
    """
    rows = x.reshape(-1, x.shape[-1])
    return torch.ops.h2o_cpu.rows_linear(rows, weight, bias).view(*x.shape[:-1], weight.shape[0])


def _rows_linear_fake(x, weight, bias):
    return x.new_empty(x.shape[0], weight.shape[0])


def _attend_decode_fake(q, k, v, valid, key_cache, value_cache, pos_cache, scale, new_pos, window, softcap, sink):
    b, hq = q.shape[:2]
    mass = q.new_empty(pos_cache.shape, dtype=torch.float32)
    return q.new_empty(b, hq, 1, value_cache.shape[3]), mass, q.new_empty((b, pos_cache.shape[1], 1),
                                                                          dtype=torch.float32)
