// Shared by the CPU (h2o_op.cc) and CUDA (h2o_op_cuda.cu) libraries: reading and checking H2OAttention's
// inputs and attributes, and registering its four kernels, one per (q dtype, cache dtype) in
// {float, float16}^2. ONNX Runtime infers a custom op's output types from the kernel whose typed inputs
// match, so q (input 0) and key_cache (input 5) are typed and every other input is declared "any type" and
// checked here, where a wrong one becomes an error status that names it. Shapes are host metadata for every
// provider, so the checks are the same for both; no tensor data is read here.
#pragma once
#include <algorithm>
#include <exception>
#include <initializer_list>
#include <string>
#include <vector>

#include "h2o_shapes.h"
#include "ort_abi.h"

namespace h2o_glue {

inline const char* const kDomain = "ai.h2o_compile";
inline const char* const kName = "H2OAttention";
inline const char* const kInputs[] = {"q", "k", "v", "positions", "valid", "key_cache", "value_cache",
                                      "score_cache", "pos_cache", "sink_logits", "rope_cos", "rope_sin"};
constexpr size_t kNumInputs = 12, kNumOutputs = 5;
inline const OrtApi* g_api = nullptr;

struct Error {  // a message that becomes the OrtStatus of the call
  std::string message;
};

inline const char* type_name(int t) {
  switch (t) {
    case kOrtFloat: return "float32";
    case kOrtFloat16: return "float16";
    case kOrtInt64: return "int64";
    case kOrtInt32: return "int32";
    case kOrtBool: return "bool";
    case kOrtDouble: return "float64";
    case kOrtBFloat16: return "bfloat16";
    default: return "another element type";
  }
}

inline std::string shape_str(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

inline void check(OrtStatus* status, const char* what) {
  if (!status) return;
  std::string message = std::string(what) + ": " + g_api->GetErrorMessage(status);
  g_api->ReleaseStatus(status);
  throw Error{message};
}

struct Input {
  void* data = nullptr;
  int type = kOrtUndefined;
  std::vector<int64_t> shape;
  int64_t numel() const { int64_t n = 1; for (auto d : shape) n *= d; return n; }
};

inline Input read_input(const OrtKernelContext* ctx, size_t index) {
  const OrtValue* value = nullptr;
  check(g_api->KernelContext_GetInput(ctx, index, &value), kInputs[index]);
  if (!value) throw Error{std::string("input '") + kInputs[index] + "' is missing"};
  OrtTensorTypeAndShapeInfo* info = nullptr;
  check(g_api->GetTensorTypeAndShape(value, &info), kInputs[index]);
  Input in;
  size_t rank = 0;
  OrtStatus* st = g_api->GetTensorElementType(info, &in.type);
  if (!st) st = g_api->GetDimensionsCount(info, &rank);
  if (!st) { in.shape.resize(rank); st = g_api->GetDimensions(info, in.shape.data(), rank); }
  g_api->ReleaseTensorTypeAndShapeInfo(info);
  check(st, kInputs[index]);
  check(g_api->GetTensorMutableData(const_cast<OrtValue*>(value), &in.data), kInputs[index]);
  return in;
}

// "input 'name' must be <types> <shape>; got <type> <shape>" unless it matches; -1 in ``shape`` = any size.
inline void expect(const Input& in, size_t index, std::initializer_list<int> types, const std::vector<int64_t>& shape) {
  bool type_ok = false;
  std::string allowed, want = "[";
  for (int t : types) { type_ok |= in.type == t; allowed += (allowed.empty() ? "" : " or ") + std::string(type_name(t)); }
  bool shape_ok = in.shape.size() == shape.size();
  for (size_t i = 0; shape_ok && i < shape.size(); ++i) shape_ok = shape[i] < 0 || in.shape[i] == shape[i];
  if (type_ok && shape_ok) return;
  for (size_t i = 0; i < shape.size(); ++i) want += (i ? ", " : "") + (shape[i] < 0 ? std::string("?") : std::to_string(shape[i]));
  throw Error{std::string("input '") + kInputs[index] + "' must be " + allowed + " " + want + "]; got " +
              type_name(in.type) + " " + shape_str(in.shape)};
}

// Reads the 12 inputs, checks every dtype and shape against each other, and returns the sizes.
inline h2o::Dims check_inputs(OrtKernelContext* ctx, Input (&in)[kNumInputs], int qt, int ct, const h2o::Attrs& a) {
  const bool rolling = a.rolling != 0;
  size_t n_in = 0, n_out = 0;
  check(g_api->KernelContext_GetInputCount(ctx, &n_in), "input count");
  check(g_api->KernelContext_GetOutputCount(ctx, &n_out), "output count");
  if (n_in != kNumInputs || n_out != kNumOutputs)
    throw Error{"expects 12 inputs and 5 outputs; got " + std::to_string(n_in) + " and " + std::to_string(n_out)};
  for (size_t i = 0; i < kNumInputs; ++i) in[i] = read_input(ctx, i);
  expect(in[0], 0, {qt}, {-1, -1, -1, -1});
  h2o::Dims d{};
  d.B = in[0].shape[0]; d.Hq = in[0].shape[1]; d.T = in[0].shape[2]; d.D = in[0].shape[3];
  if (d.T < 1 || d.D < 1 || d.B < 1)
    throw Error{"input 'q' " + shape_str(in[0].shape) + " must have B >= 1, T >= 1 and D >= 1"};
  expect(in[1], 1, {qt}, {d.B, -1, d.T, d.D});
  d.Hkv = in[1].shape[1];
  if (d.Hkv < 1 || d.Hq % d.Hkv != 0)
    throw Error{"input 'k' has " + std::to_string(d.Hkv) + " KV heads, which must divide q's " + std::to_string(d.Hq)};
  d.G = d.Hq / d.Hkv;
  expect(in[2], 2, {qt}, {d.B, d.Hkv, d.T, -1});
  d.Dv = in[2].shape[3];
  expect(in[3], 3, {kOrtInt64}, {d.B, d.T});
  expect(in[4], 4, {kOrtBool}, {d.B, d.T});
  expect(in[5], 5, {ct}, {d.B, d.Hkv, -1, d.D});
  d.C = in[5].shape[2];
  if (d.C < 1) throw Error{"input 'key_cache' " + shape_str(in[5].shape) + " must have C >= 1 slots"};
  d.S = d.C + d.T;
  expect(in[6], 6, {ct}, {d.B, d.Hkv, d.C, d.Dv});
  expect(in[7], 7, {kOrtFloat}, {d.B, d.Hkv, d.C});
  expect(in[8], 8, {kOrtInt64}, {d.B, d.Hkv, d.C});
  expect(in[9], 9, {kOrtFloat, kOrtFloat16}, {d.Hq});
  const Input& c = in[10];
  if (!rolling) {  // placeholders, never read
    for (size_t i : {10, 11})
      if (in[i].type != kOrtFloat && in[i].type != kOrtFloat16 && in[i].type != kOrtBFloat16)
        throw Error{std::string("input '") + kInputs[i] + "' must be a float tensor; got " + type_name(in[i].type)};
    return d;
  }
  if (c.shape.size() == 4) expect(c, 10, {kOrtFloat, kOrtFloat16}, {-1, 1, -1, -1});  // [B', 1, S', R]
  else expect(c, 10, {kOrtFloat, kOrtFloat16}, {-1, -1, -1});                        // [B', S', R]
  d.rope_rows = c.shape[0];
  d.rope_len = c.shape[c.shape.size() - 2];
  d.rope_width = c.shape.back();
  // Rank numbering reaches C + T - 1; capped distances max(D, T - 1) (kernels/rolling.py).
  const int64_t rows_needed = a.max_distance > 0 ? std::max<int64_t>(a.max_distance, d.T - 1) + 1 : d.S;
  if ((d.rope_rows != 1 && d.rope_rows != d.B) || d.rope_len < rows_needed || d.rope_width % 2 || d.rope_width < 2 ||
      d.rope_width > std::min<int64_t>(d.D, 1024))
    throw Error{"input 'rope_cos' " + shape_str(c.shape) + " must be [B' in (1, " + std::to_string(d.B) + "), S' >= " +
                (a.max_distance > 0 ? "max(max_distance, T - 1) + 1 = " : "C + T = ") + std::to_string(rows_needed) +
                ", R even, 2 <= R <= min(D = " + std::to_string(d.D) + ", 1024)]"};
  if (in[11].shape != c.shape || in[11].type != c.type)
    throw Error{"input 'rope_sin' " + std::string(type_name(in[11].type)) + " " + shape_str(in[11].shape) +
                " must match rope_cos " + type_name(c.type) + " " + shape_str(c.shape)};
  return d;
}

// out [B, Hq, T, Dv] and the new state (the shapes of the state inputs); returns the five data pointers.
inline void get_outputs(OrtKernelContext* ctx, const h2o::Dims& d, const Input (&in)[kNumInputs], void* (&outs)[kNumOutputs]) {
  std::vector<int64_t> shapes[kNumOutputs] = {{d.B, d.Hq, d.T, d.Dv}, in[5].shape, in[6].shape, in[7].shape, in[8].shape};
  for (size_t i = 0; i < kNumOutputs; ++i) {
    OrtValue* value = nullptr;
    check(g_api->KernelContext_GetOutput(ctx, i, shapes[i].data(), shapes[i].size(), &value), "output");
    check(g_api->GetTensorMutableData(value, &outs[i]), "output data");
  }
}

struct Kernel {
  h2o::Attrs attrs;
  int q_type, cache_type;
};

struct Variant {  // one registered kernel; `op` must stay first (ONNX Runtime hands back OrtCustomOp*)
  OrtCustomOp op;
  int q_type, cache_type;
  const char* provider;
};

inline const Variant& variant(const OrtCustomOp* op) { return *reinterpret_cast<const Variant*>(op); }

inline OrtStatus* create_kernel_v2(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info, void** out) {
  auto* k = new Kernel{{}, variant(op).q_type, variant(op).cache_type};
  h2o::Attrs& a = k->attrs;
  struct { const char* name; float* dst; } floats[] = {{"scale", &a.scale}, {"softcap", &a.softcap}, {"decay", &a.decay}};
  struct { const char* name; int64_t* dst; } ints[] = {{"recent", &a.recent}, {"sinks", &a.sinks}, {"policy", &a.policy},
      {"seed", &a.seed}, {"window", &a.window}, {"rolling", &a.rolling}, {"score", &a.score}};
  std::string bad;
  for (auto& f : floats)
    if (OrtStatus* st = api->KernelInfoGetAttribute_float(info, f.name, f.dst)) { api->ReleaseStatus(st); bad += std::string(" ") + f.name; }
  for (auto& i : ints)
    if (OrtStatus* st = api->KernelInfoGetAttribute_int64(info, i.name, i.dst)) { api->ReleaseStatus(st); bad += std::string(" ") + i.name; }
  if (bad.empty() && (a.policy < 0 || a.policy > 4)) bad = " policy (0..4)";
  if (bad.empty() && (a.score < 0 || a.score > 2)) bad = " score (0 = sum, 1 = mean, 2 = max)";
  if (bad.empty() && !(a.decay >= 0.f && a.decay <= 1.f)) bad = " decay (in [0, 1])";
  if (bad.empty() && (a.rolling < 0 || a.rolling > 1)) bad = " rolling (0 or 1)";
  // max_distance came with format 4; a model exported before has none and numbers by rank.
  if (OrtStatus* st = api->KernelInfoGetAttribute_int64(info, "max_distance", &a.max_distance)) {
    api->ReleaseStatus(st);
    a.max_distance = 0;
  }
  if (bad.empty() && a.max_distance < 0) bad = " max_distance (>= 0)";
  if (!bad.empty()) {
    delete k;
    return api->CreateStatus(kOrtInvalidArgument, (std::string(kName) + ": missing or invalid attribute(s):" + bad).c_str());
  }
  *out = k;
  return nullptr;
}

inline OrtStatus* status_of(const std::string& message) {
  return g_api->CreateStatus(kOrtInvalidArgument, (std::string(kName) + ": " + message).c_str());
}

// Runs ``body`` and turns every failure into an error status: never a C++ exception across the C ABI.
template <typename F> OrtStatus* guarded(F&& body) {
  try {
    body();
  } catch (const Error& e) {
    return status_of(e.message);
  } catch (const std::exception& e) {  // bad_alloc and the like
    return status_of(std::string("internal error: ") + e.what());
  }
  return nullptr;
}

inline Variant make_variant(int q_type, int cache_type, const char* provider,
                            OrtStatus* (*compute)(void*, OrtKernelContext*)) {
  Variant v{};
  v.op.version = H2O_ORT_API_VERSION;
  v.op.GetName = [](const OrtCustomOp*) { return kName; };
  v.op.GetExecutionProviderType = [](const OrtCustomOp* op) { return variant(op).provider; };
  v.op.GetInputType = [](const OrtCustomOp* op, size_t i) {
    return i == 0 ? variant(op).q_type : i == 5 ? variant(op).cache_type : static_cast<int>(kOrtUndefined);
  };
  v.op.GetInputTypeCount = [](const OrtCustomOp*) { return kNumInputs; };
  v.op.GetOutputType = [](const OrtCustomOp* op, size_t i) {
    const int types[] = {variant(op).q_type, variant(op).cache_type, variant(op).cache_type, kOrtFloat, kOrtInt64};
    return types[i < kNumOutputs ? i : 0];
  };
  v.op.GetOutputTypeCount = [](const OrtCustomOp*) { return kNumOutputs; };
  v.op.KernelDestroy = [](void* kernel) { delete static_cast<Kernel*>(kernel); };
  v.op.GetInputCharacteristic = [](const OrtCustomOp*, size_t) { return static_cast<int>(kOrtRequired); };
  v.op.GetOutputCharacteristic = [](const OrtCustomOp*, size_t) { return static_cast<int>(kOrtRequired); };
  v.op.GetInputMemoryType = [](const OrtCustomOp*, size_t) { return static_cast<int>(kOrtMemTypeDefault); };
  v.op.GetVariadicInputMinArity = [](const OrtCustomOp*) { return 1; };
  v.op.GetVariadicInputHomogeneity = [](const OrtCustomOp*) { return 1; };
  v.op.GetVariadicOutputMinArity = [](const OrtCustomOp*) { return 1; };
  v.op.GetVariadicOutputHomogeneity = [](const OrtCustomOp*) { return 1; };
  v.op.CreateKernelV2 = create_kernel_v2;
  v.op.KernelComputeV2 = compute;
  v.q_type = q_type;
  v.cache_type = cache_type;
  v.provider = provider;
  return v;
}

// RegisterCustomOps' body: the domain with the four kernels of ``variants``, added to the session options.
inline OrtStatus* register_ops(OrtSessionOptions* options, const OrtApiBase* base, Variant* variants, size_t n) {
  const OrtApi* api = base->GetApi(H2O_ORT_API_VERSION);
  if (!api) {  // an older runtime: report it through the oldest table, whose CreateStatus is slot 0 forever
    const OrtApi* oldest = base->GetApi(1);
    std::string msg = std::string("h2o_compile native op: this library needs ONNX Runtime C API version ") +
                      std::to_string(H2O_ORT_API_VERSION) + "; the runtime is " + base->GetVersionString();
    return oldest ? oldest->CreateStatus(kOrtFail, msg.c_str()) : nullptr;
  }
  g_api = api;
  OrtCustomOpDomain* domain = nullptr;  // kept for the process lifetime: sessions may outlive any owner here
  if (OrtStatus* st = api->CreateCustomOpDomain(kDomain, &domain)) return st;
  for (size_t i = 0; i < n; ++i)
    if (OrtStatus* st = api->CustomOpDomain_Add(domain, &variants[i].op)) return st;
  return api->AddCustomOpDomain(options, domain);
}

}  // namespace h2o_glue
