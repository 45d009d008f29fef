"""The one-pass prefill with each key's mass (kernels/native/prefill_mass.cc): built against the installed
torch on first use, loaded as ``torch.ops.h2o_cpu.causal_attend_with_mass``.

torch's fused CPU attention returns the output and each query's log-sum-exp but not the probabilities, so a
rule that reads scores pays a second q.k product over the causal triangle (cpu_prefill._key_mass). This op keeps
each tile of queries' probabilities in cache and reads them twice: the P.V product and the column sums.

Where it cannot be built (no compiler, a torch without its headers) the prefill keeps the two-pass path and says
so once (a warning naming the compiler's message); ``H2O_COMPILE_NATIVE_PREFILL=0`` turns it off.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

from ..native_build import cache_root, compile_cached, compiler, digest

HERE = Path(__file__).resolve().parent / "native"
SOURCE = "prefill_mass.cc"
QUERY_TILE = 64  # queries per tile: their logits ([64, S] fp32, 1 MiB at S = 4096) stay in L2 / L3

_state: dict[str, object] = {}  # "loaded": bool once tried; "why": the reason it is unavailable


def _command() -> tuple[list[str], list[str]]:
    """(compile command without output / source, link arguments) for this torch."""
    root = Path(torch.__file__).resolve().parent  # the wheel's own headers and libraries
    lib, include = root / "lib", root / "include"
    flags = [compiler("the native CPU prefill is compiled on first use"), "-std=c++20", "-O3", "-march=native",
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
    """The built op library for this torch and source (compiled now if missing); NativeBuildError if it cannot
    be built."""
    command, link = _command()
    out_dir = cache_root() / "prefill" / f"torch-{torch.__version__}-{digest(HERE, [SOURCE], command + link)}"
    return compile_cached(out_dir / "libh2o_prefill.so", command, HERE / SOURCE, "the native CPU prefill op",
                          rebuild=rebuild, link=link)


def available() -> bool:
    """Whether the op is loaded (building and loading it on the first call). False, with one warning naming the
    reason, when it cannot be built; False without one when H2O_COMPILE_NATIVE_PREFILL=0."""
    if "loaded" not in _state:
        if os.environ.get("H2O_COMPILE_NATIVE_PREFILL", "1") == "0":
            _state.update(loaded=False, why="H2O_COMPILE_NATIVE_PREFILL=0")
            return False
        try:
            path = library_path()
            if not hasattr(torch.ops.h2o_cpu, "causal_attend_with_mass"):  # registered once per process
                torch.ops.load_library(str(path))
            _state.update(loaded=True)
        except Exception as exc:  # noqa: BLE001 - any failure to build or load means: the two-pass path
            _state.update(loaded=False, why=str(exc))
            warnings.warn("h2o_compile: the one-pass CPU prefill could not be built, so rules that read scores "
                          f"take the two-pass prefill (slower, same result): {exc}", RuntimeWarning, stacklevel=2)
    return bool(_state["loaded"])


@contextlib.contextmanager
def disabled():
    """Within the block, the prefill takes the two-pass path, as where the op cannot be built (benchmarks and
    tests compare the two)."""
    saved = dict(_state)
    _state.update(loaded=False, why="disabled()")
    try:
        yield
    finally:
        _state.clear()
        _state.update(saved)


def causal_attend_with_mass(qf: Tensor, kf: Tensor, vf: Tensor, cache_pos: Tensor, query_pos: Tensor, window: int,
                            scale: float, sink: Optional[Tensor], weight: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """A block's attention over its C cached and T own keys, and each key's mass, in one pass.

    Args:
        qf: [N, G, T, D] (N = B x Hkv, G query heads per KV head); kf: [N, C + T, D]; vf: [N, C + T, Dv];
        cache_pos: [N, C] int64 positions of the cached keys (-1 = an empty slot); query_pos: [N, T] int64, increasing
        along the block (no padding; the block's own keys have these positions); window: the layer's sliding
        window W (0 = none); sink: [N, G] learned sink logits or None; weight: [N, T] fp32 query weights or None.
    Returns:
        out [N, G, T, Dv] in qf's dtype and mass [N, C + T] fp32: sum over the G heads and the T queries of
        weight x probability. Computed in fp32 whatever the input dtype.
    Raises RuntimeError naming the reason when the op could not be built (see ``available``).
    """
    if not available():
        raise RuntimeError(f"the native CPU prefill op is unavailable: {_state['why']}")
    out, mass = torch.ops.h2o_cpu.causal_attend_with_mass(qf.float(), kf.float(), vf.float(), cache_pos, query_pos,
                                                          window, scale, sink, weight, QUERY_TILE)
    return out.to(qf.dtype), mass
