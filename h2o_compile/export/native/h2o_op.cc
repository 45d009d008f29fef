// ai.h2o_compile::H2OAttention as an ONNX Runtime custom op on the CPU provider: h2o_glue.h checks the
// inputs, h2o_kernel.h runs once per (batch row, KV head). Built by build.py.
#include <cstdlib>
#include <thread>
#include <vector>

#include "h2o_glue.h"
#include "h2o_kernel.h"

namespace {

using namespace h2o_glue;

std::vector<float> as_floats(const Input& in) {  // small inputs (sink logits, rotary tables) in fp32
  std::vector<float> out(in.numel());
  for (size_t i = 0; i < out.size(); ++i)
    out[i] = in.type == kOrtFloat ? static_cast<const float*>(in.data)[i]
                                  : static_cast<float>(static_cast<const h2o::f16*>(in.data)[i]);
  return out;
}

int worker_count(const h2o::Dims& d) {
  // H2O_NATIVE_THREADS sets the workers. Default: one for a decode step (its work, about a millisecond, is
  // less than what waking threads next to ONNX Runtime's own pool costs), every core for a prefill block.
  const int64_t pairs = d.B * d.Hkv;
  const char* env = std::getenv("H2O_NATIVE_THREADS");
  int64_t n = env ? std::atoi(env) : (d.T > 1 ? static_cast<int64_t>(std::thread::hardware_concurrency()) : 1);
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(n, pairs)));
}

template <typename QT, typename CT>
void compute(const Kernel& kern, OrtKernelContext* ctx) {
  Input in[kNumInputs];
  const h2o::Dims d = check_inputs(ctx, in, kern.q_type, kern.cache_type, kern.attrs);
  std::vector<float> sink = as_floats(in[9]), cos, sin;
  if (kern.attrs.rolling) { cos = as_floats(in[10]); sin = as_floats(in[11]); }
  void* outs[kNumOutputs];
  get_outputs(ctx, d, in, outs);
  h2o::Tensors<QT, CT> x{
      static_cast<const QT*>(in[0].data), static_cast<const QT*>(in[1].data), static_cast<const QT*>(in[2].data),
      static_cast<const int64_t*>(in[3].data), static_cast<const bool*>(in[4].data),
      static_cast<const CT*>(in[5].data), static_cast<const CT*>(in[6].data), static_cast<const float*>(in[7].data),
      static_cast<const int64_t*>(in[8].data), sink.data(), cos.empty() ? nullptr : cos.data(),
      sin.empty() ? nullptr : sin.data(), static_cast<QT*>(outs[0]), static_cast<CT*>(outs[1]),
      static_cast<CT*>(outs[2]), static_cast<float*>(outs[3]), static_cast<int64_t*>(outs[4])};
  const int64_t pairs = d.B * d.Hkv;
  const int workers = worker_count(d);
  auto run = [&](int wid) {
    static thread_local h2o::Scratch scratch;
    for (int64_t p = wid; p < pairs; p += workers) h2o::run_pair(kern.attrs, d, x, p / d.Hkv, p % d.Hkv, scratch);
  };
  if (workers == 1) { run(0); return; }
  std::vector<std::thread> threads;
  for (int wid = 1; wid < workers; ++wid) threads.emplace_back(run, wid);
  run(0);
  for (auto& t : threads) t.join();
}

OrtStatus* compute_v2(void* kernel, OrtKernelContext* ctx) {
  const Kernel& k = *static_cast<Kernel*>(kernel);
  return guarded([&] {
    const bool qf = k.q_type == kOrtFloat, cf = k.cache_type == kOrtFloat;
    if (qf && cf) compute<float, float>(k, ctx);
    else if (qf) compute<float, h2o::f16>(k, ctx);
    else if (cf) compute<h2o::f16, float>(k, ctx);
    else compute<h2o::f16, h2o::f16>(k, ctx);
  });
}

Variant g_variants[] = {make_variant(kOrtFloat, kOrtFloat, nullptr, compute_v2),
                        make_variant(kOrtFloat, kOrtFloat16, nullptr, compute_v2),
                        make_variant(kOrtFloat16, kOrtFloat, nullptr, compute_v2),
                        make_variant(kOrtFloat16, kOrtFloat16, nullptr, compute_v2)};

}  // namespace

extern "C" {

// The ONNX Runtime C API version this library was built for (read with ctypes by build.api_version_of).
__attribute__((visibility("default"))) uint32_t h2o_native_api_version() { return H2O_ORT_API_VERSION; }

__attribute__((visibility("default"))) OrtStatus* RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* base) {
  return register_ops(options, base, g_variants, 4);
}

}  // extern "C"
