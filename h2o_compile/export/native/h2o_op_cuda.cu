// ai.h2o_compile::H2OAttention for ONNX Runtime's CUDA provider: the same contract as h2o_kernel.h (the CPU
// kernel), one thread block per (batch row, KV head), launched on the provider's compute stream. Inputs and
// outputs are device tensors; h2o_glue.h checks their shapes and dtypes (host metadata) first.
//
// Per block: the queries of the KV group one at a time (logits over the S = C + T entries in shared memory,
// block max / sum reductions, output dims across threads), the per-key mass, then the eviction: an entry is
// evicted when fewer than T entries rank below it by (priority, position, index), which is the CPU kernel's
// "bottom T" without a sort. Shared memory: 4 S + C ints/floats + D floats (checked against the device).
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <cmath>

#include "h2o_glue.h"
#include "h2o_rule.h"

namespace {

using namespace h2o_glue;

constexpr int kThreads = 128;

__device__ __forceinline__ int64_t imax(int64_t a, int64_t b) { return a > b ? a : b; }
__device__ __forceinline__ int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
__device__ __forceinline__ float tof(float x) { return x; }
__device__ __forceinline__ float tof(__half x) { return __half2float(x); }
template <typename T> __device__ __forceinline__ T fromf(float x);
template <> __device__ __forceinline__ float fromf<float>(float x) { return x; }
template <> __device__ __forceinline__ __half fromf<__half>(float x) { return __float2half_rn(x); }
__device__ __forceinline__ float ldany(const void* p, bool half, int64_t i) {
  return half ? __half2float(static_cast<const __half*>(p)[i]) : static_cast<const float*>(p)[i];
}

template <typename QT, typename CT> struct Args {
  const QT *q, *k, *v;
  const int64_t* positions;
  const bool* valid;
  const CT *key_cache, *value_cache;
  const float* score_cache;
  const int64_t* pos_cache;
  const void *sink, *rope_cos, *rope_sin;
  bool sink_half, rope_half;
  QT* out;
  CT *new_keys, *new_values;
  float* new_scores;
  int64_t* new_pos;
};

__device__ float block_reduce(float x, bool is_max, float* red) {
  for (int o = 16; o > 0; o >>= 1) {
    float y = __shfl_xor_sync(0xffffffffu, x, o);
    x = is_max ? fmaxf(x, y) : x + y;
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) red[warp] = x;
  __syncthreads();
  float r = red[0];
  for (int w = 1; w < kThreads / 32; ++w) r = is_max ? fmaxf(r, red[w]) : r + red[w];
  return r;
}

template <typename QT, typename CT>
__global__ void h2o_pair_kernel(h2o::Attrs a, h2o::Dims d, Args<QT, CT> x) {
  extern __shared__ float smem[];
  const int64_t C = d.C, T = d.T, S = d.S, D = d.D, Dv = d.Dv, G = d.G;
  float* logits = smem;             // [S]
  float* mass = logits + S;         // [S], then the scores
  float* prio = mass + S;           // [S] under score="max" first each query's mass, then the priorities
  int* aux = reinterpret_cast<int*>(prio + S);  // [S] rolling rank, then keep | held << 1
  int* src = aux + S;               // [C] block token filling each freed slot, -1 = none
  float* sq = reinterpret_cast<float*>(src + C);  // [D] the current query (rotated when rolling)
  __shared__ float red[kThreads / 32];
  __shared__ int64_t newest_s, n_valid_s, held_s;
  const int64_t pair = blockIdx.x, b = pair / d.Hkv, h = pair % d.Hkv, tid = threadIdx.x;
  const int64_t* positions = x.positions + b * T;
  const bool* valid = x.valid + b * T;
  const int64_t* pos_cache = x.pos_cache + pair * C;
  auto pos = [&](int64_t j) -> int64_t { return j < C ? pos_cache[j] : (valid[j - C] ? positions[j - C] : -1); };
  if (tid == 0) {
    int64_t newest = -1, nv = 0, held = 0;
    for (int64_t t = 0; t < T; ++t) if (valid[t]) { newest = imax(newest, positions[t]); ++nv; }
    for (int64_t j = 0; j < C; ++j) held += pos_cache[j] >= 0;
    newest_s = newest; n_valid_s = nv; held_s = held;
  }
  __syncthreads();
  const int64_t newest = newest_s;
  const bool peak_rule = h2o::is_peak(a);
  for (int64_t j = tid; j < S; j += kThreads) {
    mass[j] = 0.f;
    if (!a.rolling) continue;
    int64_t r = 0;
    if (a.max_distance > 0) {  // true distance to the newest valid token, capped at max(D, n_valid - 1)
      const int64_t cap = imax(a.max_distance, n_valid_s - 1);
      r = imin(imax(pos(j) - (newest - cap), 0), cap);
    } else if (j < C) {  // rank among the held entries by position (0 for an empty slot, which nobody sees)
      if (pos_cache[j] >= 0) for (int64_t i = 0; i < C; ++i) r += pos_cache[i] >= 0 && pos_cache[i] < pos_cache[j];
    } else {
      int64_t seen = 0;
      for (int64_t t = 0; t <= j - C; ++t) seen += valid[t];
      r = held_s + imax(seen - 1, 0);
    }
    aux[j] = static_cast<int>(r);
  }
  __syncthreads();
  const int64_t R = d.rope_width, half = R / 2, row = d.rope_rows == 1 ? 0 : b;
  // Element i of entry j's key in fp32 (the block's cast to the cache dtype first), rotated when rolling.
  auto key = [&](int64_t j, int64_t i) -> float {
    auto raw = [&](int64_t e) -> float {
      return j < C ? tof(x.key_cache[(pair * C + j) * D + e])
                   : tof(fromf<CT>(tof(x.k[(pair * T + j - C) * D + e])));
    };
    if (!a.rolling || i >= R) return raw(i);
    const int64_t at = (row * d.rope_len + aux[j]) * R + i;
    const float turned = i < half ? -raw(i + half) : raw(i - half);
    return raw(i) * ldany(x.rope_cos, x.rope_half, at) + turned * ldany(x.rope_sin, x.rope_half, at);
  };
  auto value = [&](int64_t j, int64_t i) -> float {
    return j < C ? tof(x.value_cache[(pair * C + j) * Dv + i]) : tof(fromf<CT>(tof(x.v[(pair * T + j - C) * Dv + i])));
  };
  for (int64_t t = 0; t < T; ++t) {
    const int64_t qp = positions[t];
    const float weight = h2o::query_weight(a, newest, qp);
    // score="max": the query's probabilities summed over the group's heads in prio, then the max into mass. Each
    // thread owns the same entries j in every loop, so the buffer needs no barrier of its own.
    float* into = peak_rule ? prio : mass;
    if (peak_rule) for (int64_t j = tid; j < S; j += kThreads) into[j] = 0.f;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t head = h * G + g;
      QT* out = x.out + ((b * d.Hq + head) * T + t) * Dv;
      if (!valid[t]) { for (int64_t i = tid; i < Dv; i += kThreads) out[i] = fromf<QT>(0.f); continue; }
      const QT* q = x.q + ((b * d.Hq + head) * T + t) * D;
      for (int64_t i = tid; i < D; i += kThreads) {
        float v = tof(q[i]);
        if (a.rolling && i < R) {
          const int64_t at = (row * d.rope_len + aux[C + t]) * R + i;
          const float turned = i < half ? -tof(q[i + half]) : tof(q[i - half]);
          v = v * ldany(x.rope_cos, x.rope_half, at) + turned * ldany(x.rope_sin, x.rope_half, at);
        }
        sq[i] = v;
      }
      __syncthreads();
      const float sink = ldany(x.sink, x.sink_half, head);
      float peak = sink;
      for (int64_t j = tid; j < S; j += kThreads) {
        const int64_t kp = pos(j);
        float logit = -FLT_MAX;
        if (kp >= 0 && kp <= qp && (a.window <= 0 || kp > qp - a.window)) {
          float acc = 0.f;
          for (int64_t i = 0; i < D; ++i) acc += sq[i] * key(j, i);
          logit = acc * a.scale;
          if (a.softcap > 0.f) logit = tanhf(logit / a.softcap) * a.softcap;
          peak = fmaxf(peak, logit);
        }
        logits[j] = logit;
      }
      peak = block_reduce(peak, true, red);
      float total = 0.f;
      for (int64_t j = tid; j < S; j += kThreads) {
        const float e = logits[j] == -FLT_MAX ? 0.f : expf(logits[j] - peak);
        logits[j] = e;
        total += e;
      }
      total = block_reduce(total, false, red) + expf(sink - peak);
      for (int64_t j = tid; j < S; j += kThreads) {
        logits[j] /= total;
        if (h2o::reads_mass(a)) into[j] += logits[j] * weight;
      }
      __syncthreads();
      for (int64_t i = tid; i < Dv; i += kThreads) {
        float acc = 0.f;
        for (int64_t j = 0; j < S; ++j) if (logits[j] != 0.f) acc += logits[j] * value(j, i);
        out[i] = fromf<QT>(acc);
      }
      __syncthreads();
    }
    if (peak_rule) for (int64_t j = tid; j < S; j += kThreads) mass[j] = fmaxf(mass[j], into[j]);
  }
  // Scores and eviction priority (larger stays): the rule of h2o_rule.h, as in the CPU kernel.
  const float carry = h2o::carry_factor(a, n_valid_s);
  for (int64_t j = tid; j < S; j += kThreads) {
    const float carried = j < C ? x.score_cache[pair * C + j] * carry : 0.f;
    mass[j] = h2o::accumulate(a, carried, mass[j]);
    prio[j] = h2o::eviction_priority(a, mass[j], pos(j), newest);
  }
  __syncthreads();
  for (int64_t j = tid; j < S; j += kThreads) {  // evicted iff fewer than T entries rank below it
    const int64_t pj = pos(j);
    int64_t below = 0;
    for (int64_t i = 0; i < S && below < T; ++i) {
      const int64_t pi = pos(i);
      below += h2o::evicted_before(prio[i], pi, i, prio[j], pj, j);
    }
    const int keep = below >= T && prio[j] != -INFINITY;
    aux[j] = keep | ((j < C && pos_cache[j] >= 0) << 1);  // read pos_cache now: new_pos may alias it
  }
  __syncthreads();
  if (tid == 0) {  // the r-th freed slot receives the r-th kept new token
    int64_t next = 0;
    for (int64_t j = 0; j < C; ++j) {
      src[j] = -1;
      if (aux[j] & 1) continue;
      while (next < T && !(aux[C + next] & 1)) ++next;
      if (next < T) src[j] = static_cast<int>(next++);
    }
  }
  __syncthreads();
  CT* nk = x.new_keys + pair * C * D;
  CT* nv = x.new_values + pair * C * Dv;
  const CT* ok = x.key_cache + pair * C * D;
  const CT* ov = x.value_cache + pair * C * Dv;
  for (int64_t e = tid; e < C * (D + Dv); e += kThreads) {
    const bool is_key = e < C * D;
    const int64_t width = is_key ? D : Dv, flat = is_key ? e : e - C * D, j = flat / width, i = flat % width;
    CT* dst = (is_key ? nk : nv) + flat;
    const CT* old = (is_key ? ok : ov) + flat;
    const int s = src[j];
    if (aux[j] & 1 || (s < 0 && !(aux[j] & 2))) { if (dst != old) *dst = *old; }  // kept, or an empty slot
    else if (s >= 0) *dst = fromf<CT>(is_key ? tof(x.k[(pair * T + s) * D + i]) : tof(x.v[(pair * T + s) * Dv + i]));
    else *dst = fromf<CT>(0.f);  // an evicted entry leaves zeros
  }
  for (int64_t j = tid; j < C; j += kThreads) {
    const int s = src[j];
    const bool kept = aux[j] & 1;
    x.new_scores[pair * C + j] = kept ? mass[j] : s >= 0 ? mass[C + s] : 0.f;
    x.new_pos[pair * C + j] = kept ? pos_cache[j] : s >= 0 ? positions[s] : -1;
  }
}

template <typename QT, typename CT>
void compute(const Kernel& kern, OrtKernelContext* ctx) {
  Input in[kNumInputs];
  const h2o::Dims d = check_inputs(ctx, in, kern.q_type, kern.cache_type, kern.attrs);
  void* outs[kNumOutputs];
  get_outputs(ctx, d, in, outs);
  void* stream = nullptr;
  check(g_api->KernelContext_GetGPUComputeStream(ctx, &stream), "compute stream");
  const size_t bytes = sizeof(float) * (4 * d.S + d.C + d.D);
  int device = 0, limit = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (bytes > static_cast<size_t>(limit))
    throw Error{"C + T = " + std::to_string(d.S) + " entries need " + std::to_string(bytes) +
                " bytes of shared memory per block; this device has " + std::to_string(limit)};
  cudaFuncSetAttribute(h2o_pair_kernel<QT, CT>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  Args<QT, CT> x{static_cast<const QT*>(in[0].data), static_cast<const QT*>(in[1].data),
                 static_cast<const QT*>(in[2].data), static_cast<const int64_t*>(in[3].data),
                 static_cast<const bool*>(in[4].data), static_cast<const CT*>(in[5].data),
                 static_cast<const CT*>(in[6].data), static_cast<const float*>(in[7].data),
                 static_cast<const int64_t*>(in[8].data), in[9].data, in[10].data, in[11].data,
                 in[9].type == kOrtFloat16, in[10].type == kOrtFloat16, static_cast<QT*>(outs[0]),
                 static_cast<CT*>(outs[1]), static_cast<CT*>(outs[2]), static_cast<float*>(outs[3]),
                 static_cast<int64_t*>(outs[4])};
  h2o_pair_kernel<QT, CT><<<static_cast<unsigned>(d.B * d.Hkv), kThreads, bytes, static_cast<cudaStream_t>(stream)>>>(
      kern.attrs, d, x);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw Error{std::string("CUDA launch failed: ") + cudaGetErrorString(err)};
}

OrtStatus* compute_v2(void* kernel, OrtKernelContext* ctx) {
  const Kernel& k = *static_cast<Kernel*>(kernel);
  return guarded([&] {
    const bool qf = k.q_type == kOrtFloat, cf = k.cache_type == kOrtFloat;
    if (qf && cf) compute<float, float>(k, ctx);
    else if (qf) compute<float, __half>(k, ctx);
    else if (cf) compute<__half, float>(k, ctx);
    else compute<__half, __half>(k, ctx);
  });
}

const char* const kCuda = "CUDAExecutionProvider";
Variant g_variants[] = {make_variant(kOrtFloat, kOrtFloat, kCuda, compute_v2),
                        make_variant(kOrtFloat, kOrtFloat16, kCuda, compute_v2),
                        make_variant(kOrtFloat16, kOrtFloat, kCuda, compute_v2),
                        make_variant(kOrtFloat16, kOrtFloat16, kCuda, compute_v2)};

}  // namespace

extern "C" {

__attribute__((visibility("default"))) uint32_t h2o_native_api_version() { return H2O_ORT_API_VERSION; }

__attribute__((visibility("default"))) OrtStatus* RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* base) {
  return register_ops(options, base, g_variants, 4);
}

}  // extern "C"
