"""The native ONNX Runtime custom op ai.h2o_compile::H2OAttention: a C++ kernel (and a CUDA source) computing
exactly the contract of the model-local ONNX function (export/onnx_function.py).

    from h2o_compile.export.native import library_path
    options = onnxruntime.SessionOptions()
    options.register_custom_ops_library(str(library_path()))   # compiled on first use, then cached

Files: ort_abi.h (our declaration of the ONNX Runtime C ABI slots used, pinned to API version 16),
h2o_rule.h (the eviction rule, shared by both kernels), h2o_kernel.h (the per (row, KV head) arithmetic),
h2o_op.cc (input checks, registration), h2o_op_cuda.cu (the same op for the CUDA provider), build.py (compiling
and caching).
"""

from .build import API_VERSION, NativeBuildError, api_version_of, compile_cuda, library_path

__all__ = ["API_VERSION", "NativeBuildError", "api_version_of", "compile_cuda", "library_path"]
