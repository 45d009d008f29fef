// ai.h2o_compile::H2OAttention as an ONNX Runtime custom op (CPU): checks every input, then runs
// h2o_kernel.h once per (batch row, KV head). Built by h2o_compile/export/native/build.py.
//
// Four kernels share the name, one per (q dtype, cache dtype) in {float, float16}^2: ONNX Runtime infers a
// custom op's output types from the kernel whose typed inputs match, so q (input 0) and key_cache (input 5)
// are typed and every other input is declared "any type" and checked here, where a wrong one becomes an
// error status that names it.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "h2o_kernel.h"
#include "ort_abi.h"

namespace {

const char* const kDomain = "ai.h2o_compile";
const char* const kName = "H2OAttention";
const char* const kInputs[] = {"q", "k", "v", "positions", "valid", "key_cache", "value_cache", "score_cache",
                               "pos_cache", "sink_logits", "rope_cos", "rope_sin"};
constexpr size_t kNumInputs = 12, kNumOutputs = 5;
const OrtApi* g_api = nullptr;

struct Error {  // a message that becomes the OrtStatus of the call
  std::string message;
};

const char* type_name(int t) {
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

std::string shape_str(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

void check(OrtStatus* status, const char* what) {
  if (!status) return;
  std::string message = std::string(what) + ": " + g_api->GetErrorMessage(status);
  g_api->ReleaseStatus(status);
  throw Error{message};
}

struct Input {
  const void* data = nullptr;
  int type = kOrtUndefined;
  std::vector<int64_t> shape;
  int64_t numel() const { int64_t n = 1; for (auto d : shape) n *= d; return n; }
};

Input read_input(const OrtKernelContext* ctx, size_t index) {
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
  void* data = nullptr;
  check(g_api->GetTensorMutableData(const_cast<OrtValue*>(value), &data), kInputs[index]);
  in.data = data;
  return in;
}

// "input 'name' must be <type> <shape>; got <type> <shape>" unless it matches. expected -1 = any size.
void expect(const Input& in, size_t index, std::initializer_list<int> types, const std::vector<int64_t>& shape) {
  bool type_ok = false;
  std::string allowed;
  for (int t : types) { type_ok |= in.type == t; allowed += (allowed.empty() ? "" : " or ") + std::string(type_name(t)); }
  bool shape_ok = in.shape.size() == shape.size();
  for (size_t i = 0; shape_ok && i < shape.size(); ++i) shape_ok = shape[i] < 0 || in.shape[i] == shape[i];
  if (type_ok && shape_ok) return;
  std::string want = "[";
  for (size_t i = 0; i < shape.size(); ++i) want += (i ? ", " : "") + (shape[i] < 0 ? std::string("?") : std::to_string(shape[i]));
  throw Error{std::string("input '") + kInputs[index] + "' must be " + allowed + " " + want + "]; got " +
              type_name(in.type) + " " + shape_str(in.shape)};
}

std::vector<float> as_floats(const Input& in) {  // small inputs (sink logits, rotary tables) in fp32
  std::vector<float> out(in.numel());
  for (size_t i = 0; i < out.size(); ++i)
    out[i] = in.type == kOrtFloat ? static_cast<const float*>(in.data)[i]
                                  : static_cast<float>(static_cast<const h2o::f16*>(in.data)[i]);
  return out;
}

int worker_count(int64_t pairs) {
  // H2O_NATIVE_THREADS caps the workers (default 1: ONNX Runtime's own pool already owns the cores).
  const char* env = std::getenv("H2O_NATIVE_THREADS");
  int64_t n = env ? std::atoi(env) : 1;
  return static_cast<int>(std::max<int64_t>(1, std::min(n, pairs)));
}

struct Kernel {
  h2o::Attrs attrs;
  int q_type, cache_type;
};

template <typename QT, typename CT>
void compute(const Kernel& kern, OrtKernelContext* ctx) {
  size_t n_in = 0, n_out = 0;
  check(g_api->KernelContext_GetInputCount(ctx, &n_in), "input count");
  check(g_api->KernelContext_GetOutputCount(ctx, &n_out), "output count");
  if (n_in != kNumInputs || n_out != kNumOutputs)
    throw Error{"expects 12 inputs and 5 outputs; got " + std::to_string(n_in) + " and " + std::to_string(n_out)};
  Input in[kNumInputs];
  for (size_t i = 0; i < kNumInputs; ++i) in[i] = read_input(ctx, i);
  const int qt = kern.q_type, ct = kern.cache_type;
  expect(in[0], 0, {qt}, {-1, -1, -1, -1});
  h2o::Dims d{};
  d.B = in[0].shape[0]; d.Hq = in[0].shape[1]; d.T = in[0].shape[2]; d.D = in[0].shape[3];
  expect(in[1], 1, {qt}, {d.B, -1, d.T, d.D});
  d.Hkv = in[1].shape[1];
  if (d.Hkv < 1 || d.Hq % d.Hkv != 0)
    throw Error{"input 'k' has " + std::to_string(d.Hkv) + " KV heads, which must divide q's " + std::to_string(d.Hq)};
  if (d.T < 1 || d.D < 1) throw Error{"input 'q' " + shape_str(in[0].shape) + " must have T >= 1 and D >= 1"};
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
  std::vector<float> sink = as_floats(in[9]), cos, sin;
  if (kern.attrs.rolling) {
    const Input& c = in[10];
    if (c.shape.size() == 4) expect(c, 10, {kOrtFloat, kOrtFloat16}, {-1, 1, -1, -1});
    else expect(c, 10, {kOrtFloat, kOrtFloat16}, {-1, -1, -1});
    d.rope_rows = c.shape[0];
    d.rope_len = c.shape[c.shape.size() - 2];
    d.rope_width = c.shape.back();
    if ((d.rope_rows != 1 && d.rope_rows != d.B) || d.rope_len < d.S || d.rope_width % 2 || d.rope_width > d.D ||
        d.rope_width < 2 || d.rope_width > 1024)
      throw Error{"input 'rope_cos' " + shape_str(c.shape) + " must be [B' in (1, " + std::to_string(d.B) +
                  "), S' >= C + T = " + std::to_string(d.S) + ", R even, 2 <= R <= min(D = " + std::to_string(d.D) +
                  ", 1024)]"};
    if (in[11].shape != c.shape || in[11].type != c.type)
      throw Error{"input 'rope_sin' " + std::string(type_name(in[11].type)) + " " + shape_str(in[11].shape) +
                  " must match rope_cos " + type_name(c.type) + " " + shape_str(c.shape)};
    cos = as_floats(c);
    sin = as_floats(in[11]);
  } else {
    for (size_t i : {10, 11})
      if (in[i].type != kOrtFloat && in[i].type != kOrtFloat16 && in[i].type != kOrtBFloat16)
        throw Error{std::string("input '") + kInputs[i] + "' must be a float tensor; got " + type_name(in[i].type)};
  }
  // Outputs: out [B, Hq, T, Dv] and the new state, the shapes of the state inputs.
  std::vector<int64_t> shapes[kNumOutputs] = {{d.B, d.Hq, d.T, d.Dv}, in[5].shape, in[6].shape, in[7].shape, in[8].shape};
  void* outs[kNumOutputs];
  for (size_t i = 0; i < kNumOutputs; ++i) {
    OrtValue* value = nullptr;
    check(g_api->KernelContext_GetOutput(ctx, i, shapes[i].data(), shapes[i].size(), &value), "output");
    check(g_api->GetTensorMutableData(value, &outs[i]), "output data");
  }
  h2o::Tensors<QT, CT> x{
      static_cast<const QT*>(in[0].data), static_cast<const QT*>(in[1].data), static_cast<const QT*>(in[2].data),
      static_cast<const int64_t*>(in[3].data), static_cast<const bool*>(in[4].data),
      static_cast<const CT*>(in[5].data), static_cast<const CT*>(in[6].data), static_cast<const float*>(in[7].data),
      static_cast<const int64_t*>(in[8].data), sink.data(), cos.empty() ? nullptr : cos.data(),
      sin.empty() ? nullptr : sin.data(), static_cast<QT*>(outs[0]), static_cast<CT*>(outs[1]),
      static_cast<CT*>(outs[2]), static_cast<float*>(outs[3]), static_cast<int64_t*>(outs[4])};
  const int64_t pairs = d.B * d.Hkv;
  const int workers = worker_count(pairs);
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

OrtStatus* status_of(const std::string& message) {
  return g_api->CreateStatus(kOrtInvalidArgument, (std::string(kName) + ": " + message).c_str());
}

OrtStatus* compute_v2(void* kernel, OrtKernelContext* ctx) {
  const Kernel& k = *static_cast<Kernel*>(kernel);
  try {
    const bool qf = k.q_type == kOrtFloat, cf = k.cache_type == kOrtFloat;
    if (qf && cf) compute<float, float>(k, ctx);
    else if (qf) compute<float, h2o::f16>(k, ctx);
    else if (cf) compute<h2o::f16, float>(k, ctx);
    else compute<h2o::f16, h2o::f16>(k, ctx);
  } catch (const Error& e) {
    return status_of(e.message);
  } catch (const std::exception& e) {  // bad_alloc and the like: still an error status, never a crash
    return status_of(std::string("internal error: ") + e.what());
  }
  return nullptr;
}

struct Variant {  // one registered kernel; `op` must stay first (ONNX Runtime hands back OrtCustomOp*)
  OrtCustomOp op;
  int q_type, cache_type;
};

const Variant& variant(const OrtCustomOp* op) { return *reinterpret_cast<const Variant*>(op); }

OrtStatus* create_kernel_v2(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info, void** out) {
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
  if (bad.empty() && (a.score < 0 || a.score > 1)) bad = " score (0 = sum, 1 = mean)";
  if (bad.empty() && !(a.decay >= 0.f && a.decay <= 1.f)) bad = " decay (in [0, 1])";
  if (bad.empty() && (a.rolling < 0 || a.rolling > 1)) bad = " rolling (0 or 1)";
  if (!bad.empty()) {
    delete k;
    return api->CreateStatus(kOrtInvalidArgument, (std::string(kName) + ": missing or invalid attribute(s):" + bad).c_str());
  }
  *out = k;
  return nullptr;
}

const char* get_name(const OrtCustomOp*) { return kName; }
const char* get_provider(const OrtCustomOp*) { return nullptr; }  // CPU
int get_input_type(const OrtCustomOp* op, size_t i) {
  return i == 0 ? variant(op).q_type : i == 5 ? variant(op).cache_type : kOrtUndefined;
}
size_t get_input_count(const OrtCustomOp*) { return kNumInputs; }
int get_output_type(const OrtCustomOp* op, size_t i) {
  const int types[] = {variant(op).q_type, variant(op).cache_type, variant(op).cache_type, kOrtFloat, kOrtInt64};
  return types[i];
}
size_t get_output_count(const OrtCustomOp*) { return kNumOutputs; }
void destroy(void* kernel) { delete static_cast<Kernel*>(kernel); }
int required(const OrtCustomOp*, size_t) { return kOrtRequired; }
int mem_default(const OrtCustomOp*, size_t) { return kOrtMemTypeDefault; }
int one(const OrtCustomOp*) { return 1; }

Variant make_variant(int q_type, int cache_type) {
  Variant v{};
  v.op.version = H2O_ORT_API_VERSION;
  v.op.GetName = get_name;
  v.op.GetExecutionProviderType = get_provider;
  v.op.GetInputType = get_input_type;
  v.op.GetInputTypeCount = get_input_count;
  v.op.GetOutputType = get_output_type;
  v.op.GetOutputTypeCount = get_output_count;
  v.op.KernelDestroy = destroy;
  v.op.GetInputCharacteristic = required;
  v.op.GetOutputCharacteristic = required;
  v.op.GetInputMemoryType = mem_default;
  v.op.GetVariadicInputMinArity = one;
  v.op.GetVariadicInputHomogeneity = one;
  v.op.GetVariadicOutputMinArity = one;
  v.op.GetVariadicOutputHomogeneity = one;
  v.op.CreateKernelV2 = create_kernel_v2;
  v.op.KernelComputeV2 = compute_v2;
  v.q_type = q_type;
  v.cache_type = cache_type;
  return v;
}

Variant g_variants[] = {make_variant(kOrtFloat, kOrtFloat), make_variant(kOrtFloat, kOrtFloat16),
                        make_variant(kOrtFloat16, kOrtFloat), make_variant(kOrtFloat16, kOrtFloat16)};

}  // namespace

extern "C" {

// The ORT C API version this library was built for (tests and H2OOrtModel read it with ctypes).
__attribute__((visibility("default"))) uint32_t h2o_native_api_version() { return H2O_ORT_API_VERSION; }

__attribute__((visibility("default"))) OrtStatus* RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* base) {
  const OrtApi* api = base->GetApi(H2O_ORT_API_VERSION);
  if (!api) {  // an older runtime: report it through the oldest table, whose CreateStatus is slot 0 forever
    const OrtApi* oldest = base->GetApi(1);
    std::string msg = std::string("h2o_compile native op: this library needs ONNX Runtime C API version ") +
                      std::to_string(H2O_ORT_API_VERSION) + "; the runtime is " + base->GetVersionString();
    return oldest ? oldest->CreateStatus(kOrtFail, msg.c_str()) : nullptr;
  }
  g_api = api;
  OrtCustomOpDomain* domain = nullptr;  // owned by the session options' users for the process lifetime
  if (OrtStatus* st = api->CreateCustomOpDomain(kDomain, &domain)) return st;
  for (auto& v : g_variants)
    if (OrtStatus* st = api->CustomOpDomain_Add(domain, &v.op)) return st;
  return api->AddCustomOpDomain(options, domain);
}

}  // extern "C"
