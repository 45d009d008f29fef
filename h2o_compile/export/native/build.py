"""Compile the custom-op library with the machine's C++ compiler, once per (ONNX Runtime version, source
hash, compiler command), and cache it.

Why compile here instead of shipping a binary: the op needs no ONNX Runtime header or import library (the
C ABI it calls is declared in ort_abi.h), only a C++17 compiler, and a library built on the machine can use
its vector units (-march=native). Nothing is downloaded. The cache lives in ``$H2O_COMPILE_CACHE`` (default
``~/.cache/h2o_compile``) under ``native/ort-<version>-<hash>/``; the library is written to a temporary name
and renamed, so concurrent first uses never load a half-written file.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCES = ("ort_abi.h", "h2o_shapes.h", "h2o_glue.h", "h2o_kernel.h", "h2o_op.cc")
CUDA_SOURCES = ("ort_abi.h", "h2o_shapes.h", "h2o_glue.h", "h2o_op_cuda.cu")
LIBRARY = "libh2o_ort.so"
API_VERSION = 16  # H2O_ORT_API_VERSION of ort_abi.h; api_version_of() reads the built library's own answer
_FLAGS = ["-std=c++17", "-O3", "-march=native", "-fopenmp-simd", "-fPIC", "-shared", "-fvisibility=hidden",
          "-pthread"]


class NativeBuildError(RuntimeError):
    """The compiler is missing or failed; the message names the command that was run."""


def _cache_root() -> Path:
    return Path(os.environ.get("H2O_COMPILE_CACHE") or Path.home() / ".cache" / "h2o_compile")


def _compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if not cxx:
        raise NativeBuildError("no C++ compiler found (set CXX, or install g++): the native H2OAttention op is "
                               "compiled on first use; use op='function' (the default) to run without it")
    return cxx


def _digest(files, command) -> str:
    h = hashlib.sha256(" ".join(command).encode())
    for name in files:
        h.update(name.encode() + b"\0" + (HERE / name).read_bytes())
    return h.hexdigest()[:16]


def _ort_version() -> str:
    import onnxruntime

    return onnxruntime.__version__


def library_path(*, rebuild: bool = False) -> Path:
    """The compiled CPU library (built now if this ONNX Runtime version and these sources have none yet).

    Raises NativeBuildError naming the compiler command when it fails."""
    cxx = _compiler()
    command = [cxx, *_FLAGS]
    out_dir = _cache_root() / "native" / f"ort-{_ort_version()}-{_digest(SOURCES, command)}"
    target = out_dir / LIBRARY
    if target.is_file() and not rebuild:
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".so.tmp")
    os.close(fd)
    full = command + ["-o", tmp, str(HERE / "h2o_op.cc")]
    try:
        result = subprocess.run(full, capture_output=True, text=True)
    except OSError as exc:
        os.unlink(tmp)
        raise NativeBuildError(f"could not run the C++ compiler: {shlex.join(full)}\n{exc}") from exc
    if result.returncode != 0:
        os.unlink(tmp)
        raise NativeBuildError(f"compiling the native H2OAttention op failed (exit {result.returncode}):\n"
                               f"  {shlex.join(full)}\n{result.stderr.strip()}")
    os.replace(tmp, target)
    return target


def api_version_of(path: str | os.PathLike) -> int:
    """The ONNX Runtime C API version a built library declares (its exported ``h2o_native_api_version``)."""
    lib = ctypes.CDLL(str(path))
    lib.h2o_native_api_version.restype = ctypes.c_uint32
    return int(lib.h2o_native_api_version())


def cuda_library_path() -> Path:
    """The CUDA-provider library, compiled into the cache on first use (see compile_cuda)."""
    digest = _digest(CUDA_SOURCES, ["nvcc", "sm_90"])
    out_dir = _cache_root() / "native" / f"ort-{_ort_version()}-cuda-{digest}"
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
            "-o", str(out), str(HERE / "h2o_op_cuda.cu")]
    try:
        result = subprocess.run(full, capture_output=True, text=True)
    except OSError as exc:
        raise NativeBuildError(f"could not run nvcc: {shlex.join(full)}\n{exc}") from exc
    if result.returncode != 0:
        raise NativeBuildError(f"nvcc failed (exit {result.returncode}):\n  {shlex.join(full)}\n"
                               f"{result.stderr.strip()}")
    return out
