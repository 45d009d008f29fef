"""The CUDA source of the native op compiles with nvcc for sm_90 (a compile check: this suite runs without a
GPU; benchmarks/gpu_check.sh runs the library in onnxruntime-gpu when one is lent)."""

from __future__ import annotations

import ctypes
import shutil
from pathlib import Path

import pytest

from h2o_compile.export.native import API_VERSION, NativeBuildError, compile_cuda


def nvcc():
    return shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").is_file() else None)


@pytest.mark.skipif(nvcc() is None, reason="nvcc not installed")
def test_cuda_library_compiles_for_sm90(tmp_path):
    lib = compile_cuda(tmp_path, arch="sm_90", nvcc=nvcc())
    loaded = ctypes.CDLL(str(lib))  # the CUDA runtime is linked statically; loading calls no CUDA function
    loaded.h2o_native_api_version.restype = ctypes.c_uint32
    assert loaded.h2o_native_api_version() == API_VERSION
    assert hasattr(loaded, "RegisterCustomOps")


def test_missing_nvcc_names_it(tmp_path):
    with pytest.raises(NativeBuildError, match="nvcc"):
        compile_cuda(tmp_path, nvcc=str(tmp_path / "no-nvcc-here"))
