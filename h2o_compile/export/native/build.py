"""Compile the ONNX Runtime custom-op library once per (ONNX Runtime version, source hash, compiler command),
and cache it (h2o_compile/native_build.py: where, and why built here).

The op needs no ONNX Runtime header or import library (the C ABI it calls is declared in ort_abi.h), only a
C++17 compiler. The CPU library lives under ``native/ort-<version>-<hash>/`` in the cache.
"""

from __future__ import annotations

import ctypes
import os
import shlex
import shutil
import subprocess
from pathlib import Path

from ...kernels.native_build import NativeBuildError, cache_root, compile_cached, compiler, digest
from ...kernels.rules import POLICY_CODES, SCORES

HERE = Path(__file__).resolve().parent
SOURCES = ("ort_abi.h", "h2o_shapes.h", "h2o_rule.h", "h2o_glue.h", "h2o_kernel.h", "h2o_op.cc")
CUDA_SOURCES = ("ort_abi.h", "h2o_shapes.h", "h2o_rule.h", "h2o_glue.h", "h2o_op_cuda.cu")
LIBRARY = "libh2o_ort.so"
API_VERSION = 16  # H2O_ORT_API_VERSION of ort_abi.h; api_version_of() reads the built library's own answer
# The integer codes h2o_rule.h compares with, read from the rule registry (kernels/rules.py).
RULE_CODES = [f"-DH2O_POLICY_H2O={POLICY_CODES['h2o']}", f"-DH2O_POLICY_RANDOM={POLICY_CODES['random']}",
              f"-DH2O_SCORE_MEAN={SCORES['mean'].onnx_code}", f"-DH2O_SCORE_PEAK={SCORES['max'].onnx_code}"]
_FLAGS = ["-std=c++17", "-O3", "-march=native", "-fopenmp-simd", "-fPIC", "-shared", "-fvisibility=hidden",
          "-pthread", *RULE_CODES]

__all__ = ["NativeBuildError", "library_path", "api_version_of", "cuda_library_path", "compile_cuda"]


def _ort_version() -> str:
    import onnxruntime

    return onnxruntime.__version__


def library_path(*, rebuild: bool = False) -> Path:
    """The compiled CPU library (built now if this ONNX Runtime version and these sources have none yet).

    Raises NativeBuildError naming the compiler command when it fails."""
    cxx = compiler("the native H2OAttention op is compiled on first use; use op='function' (the default) to run "
                   "without it")
    command = [cxx, *_FLAGS]
    out_dir = cache_root() / "native" / f"ort-{_ort_version()}-{digest(HERE, SOURCES, command)}"
    return compile_cached(out_dir / LIBRARY, command, HERE / "h2o_op.cc", "the native H2OAttention op",
                          rebuild=rebuild)


def api_version_of(path: str | os.PathLike) -> int:
    """The ONNX Runtime C API version a built library declares (its exported ``h2o_native_api_version``)."""
    lib = ctypes.CDLL(str(path))
    lib.h2o_native_api_version.restype = ctypes.c_uint32
    return int(lib.h2o_native_api_version())


def cuda_library_path() -> Path:
    """The CUDA-provider library, compiled into the cache on first use (see compile_cuda)."""
    digest_ = digest(HERE, CUDA_SOURCES, ["nvcc", "sm_90"])
    out_dir = cache_root() / "native" / f"ort-{_ort_version()}-cuda-{digest_}"
    target = out_dir / "libh2o_ort_cuda.so"
    return target if target.is_file() else compile_cuda(out_dir)


def compile_cuda(out_dir: str | os.PathLike, *, arch: str = "sm_90", nvcc: str | None = None) -> Path:
    """Compile h2o_op_cuda.cu into ``out_dir/libh2o_ort_cuda.so`` for ``arch`` with nvcc (a compile check
    here; benchmarks/gpu_check.sh loads it into onnxruntime-gpu on a GPU machine). NativeBuildError if nvcc is
    missing or fails."""
    nvcc = nvcc or os.environ.get("NVCC") or shutil.which("nvcc") or (
        "/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").is_file() else None)
    if not nvcc:
        raise NativeBuildError("nvcc not found (set NVCC or put CUDA's bin directory on PATH)")
    out = Path(out_dir) / "libh2o_ort_cuda.so"
    out.parent.mkdir(parents=True, exist_ok=True)
    full = [nvcc, "-std=c++17", "-O3", f"-arch={arch}", "-Xcompiler", "-fPIC,-fvisibility=hidden", "-shared",
            *RULE_CODES, "-o", str(out), str(HERE / "h2o_op_cuda.cu")]
    try:
        result = subprocess.run(full, capture_output=True, text=True)
    except OSError as exc:
        raise NativeBuildError(f"could not run nvcc: {shlex.join(full)}\n{exc}") from exc
    if result.returncode != 0:
        raise NativeBuildError(f"nvcc failed (exit {result.returncode}):\n  {shlex.join(full)}\n"
                               f"{result.stderr.strip()}")
    return out
