// Test-only custom op that checks ort_abi.h's later slots on a CPU machine: slot 192 must be HasValue
// (OrtValue*, int*) and slot 193 KernelContext_GetGPUComputeStream (the CUDA library's only call there).
// Op probe::Probe(x float) -> y float [3] = [HasValue(x), stream == nullptr, both statuses were OK].
#include <cstring>

#include "../../../h2o_compile/export/native/ort_abi.h"

namespace {
const OrtApi* g_api = nullptr;
using HasValueFn = OrtStatus* (*)(const OrtValue*, int*);

OrtStatus* compute(void*, OrtKernelContext* ctx) {
  const OrtValue* x = nullptr;
  if (OrtStatus* st = g_api->KernelContext_GetInput(ctx, 0, &x)) return st;
  int has = -1;
  void** table = reinterpret_cast<void**>(const_cast<OrtApi*>(g_api));
  OrtStatus* st1 = reinterpret_cast<HasValueFn>(table[192])(x, &has);
  void* stream = reinterpret_cast<void*>(1);
  OrtStatus* st2 = g_api->KernelContext_GetGPUComputeStream(ctx, &stream);
  const int64_t dims[] = {3};
  OrtValue* y = nullptr;
  if (OrtStatus* st = g_api->KernelContext_GetOutput(ctx, 0, dims, 1, &y)) return st;
  void* data = nullptr;
  if (OrtStatus* st = g_api->GetTensorMutableData(y, &data)) return st;
  float* out = static_cast<float*>(data);
  out[0] = static_cast<float>(has);
  out[1] = stream == nullptr ? 1.f : 0.f;
  out[2] = (st1 == nullptr && st2 == nullptr) ? 1.f : 0.f;
  if (st1) g_api->ReleaseStatus(st1);
  if (st2) g_api->ReleaseStatus(st2);
  return nullptr;
}

OrtStatus* create(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo*, void** kernel) {
  *kernel = nullptr;
  return nullptr;
}

OrtCustomOp make() {
  OrtCustomOp op;
  std::memset(&op, 0, sizeof(op));
  op.version = H2O_ORT_API_VERSION;
  op.GetName = [](const OrtCustomOp*) { return "Probe"; };
  op.GetExecutionProviderType = [](const OrtCustomOp*) -> const char* { return nullptr; };
  op.GetInputType = [](const OrtCustomOp*, size_t) { return static_cast<int>(kOrtFloat); };
  op.GetInputTypeCount = [](const OrtCustomOp*) -> size_t { return 1; };
  op.GetOutputType = [](const OrtCustomOp*, size_t) { return static_cast<int>(kOrtFloat); };
  op.GetOutputTypeCount = [](const OrtCustomOp*) -> size_t { return 1; };
  op.KernelDestroy = [](void*) {};
  op.GetInputCharacteristic = [](const OrtCustomOp*, size_t) { return static_cast<int>(kOrtRequired); };
  op.GetOutputCharacteristic = [](const OrtCustomOp*, size_t) { return static_cast<int>(kOrtRequired); };
  op.GetInputMemoryType = [](const OrtCustomOp*, size_t) { return static_cast<int>(kOrtMemTypeDefault); };
  op.GetVariadicInputMinArity = [](const OrtCustomOp*) { return 1; };
  op.GetVariadicInputHomogeneity = [](const OrtCustomOp*) { return 1; };
  op.GetVariadicOutputMinArity = [](const OrtCustomOp*) { return 1; };
  op.GetVariadicOutputHomogeneity = [](const OrtCustomOp*) { return 1; };
  op.CreateKernelV2 = create;
  op.KernelComputeV2 = compute;
  return op;
}

OrtCustomOp g_op = make();
}  // namespace

extern "C" __attribute__((visibility("default"))) OrtStatus* RegisterCustomOps(OrtSessionOptions* options,
                                                                               const OrtApiBase* base) {
  g_api = base->GetApi(H2O_ORT_API_VERSION);
  OrtCustomOpDomain* domain = nullptr;
  if (OrtStatus* st = g_api->CreateCustomOpDomain("probe", &domain)) return st;
  if (OrtStatus* st = g_api->CustomOpDomain_Add(domain, &g_op)) return st;
  return g_api->AddCustomOpDomain(options, domain);
}
