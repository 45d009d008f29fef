// The node's attributes and the block's sizes, shared by the kernels (h2o_kernel.h, h2o_op_cuda.cu) and the
// input checks (h2o_glue.h). No ONNX Runtime type appears here.
#pragma once
#include <cstdint>

namespace h2o {

struct Attrs {  // the attributes of export/onnx_function.py's signature
  float scale = 1.f, softcap = 0.f, decay = 1.f;
  int64_t recent = 1, sinks = 0, policy = 0, seed = 0, window = 0, rolling = 0, score = 0;
  int64_t max_distance = 0;  // rolling numbering: 0 = rank, D > 0 = true distance capped at max(D, n_valid - 1)
};

// C = cache slots, T = block tokens, S = C + T, G = Hq / Hkv query heads per KV head.
struct Dims {
  int64_t B, Hq, Hkv, G, T, D, Dv, C, S;
  int64_t rope_rows = 0, rope_len = 0, rope_width = 0;  // B', S', R of the rotary tables (rolling only)
};

}  // namespace h2o
