// The eviction rule of kernels/rules.py for the native kernels, written once for the CPU kernel (h2o_kernel.h)
// and the CUDA kernel (h2o_op_cuda.cu): how much a query's attention adds, the score a block leaves, each
// entry's priority (larger stays) and the order that picks the T entries a block of T tokens evicts.
// Only arithmetic on scalars here, so the same functions run on the host and on the device.
#pragma once
#include <cmath>
#include <cstdint>

#include "h2o_shapes.h"

#ifdef __CUDACC__
#define H2O_RULE __host__ __device__ __forceinline__
#else
#define H2O_RULE inline
#endif

namespace h2o {

// The integer codes of kernels/rules.py (POLICY_CODES, each Score's onnx_code), given by the build's -D flags
// (export/native/build.py, RULE_CODES), so the registry is the only place they are written.
#if !defined(H2O_POLICY_H2O) || !defined(H2O_POLICY_RANDOM) || !defined(H2O_SCORE_MEAN) || !defined(H2O_SCORE_PEAK)
#error "compile with export/native/build.py's RULE_CODES (-DH2O_POLICY_H2O=... from kernels/rules.py)"
#endif
constexpr int64_t kPolicyH2O = H2O_POLICY_H2O, kPolicyRandom = H2O_POLICY_RANDOM;
constexpr int64_t kScoreMean = H2O_SCORE_MEAN, kScorePeak = H2O_SCORE_PEAK;

H2O_RULE bool reads_mass(const Attrs& a) { return a.policy == kPolicyH2O; }
H2O_RULE bool is_peak(const Attrs& a) { return a.score == kScorePeak; }

H2O_RULE int64_t max_i64(int64_t x, int64_t y) { return x > y ? x : y; }

// rules.query_weights: decay^(newest - qp) for the query at position qp (1 without decay).
H2O_RULE float query_weight(const Attrs& a, int64_t newest, int64_t qp) {
  return a.decay < 1.f ? powf(a.decay, static_cast<float>(max_i64(newest - qp, 0))) : 1.f;
}

// rules.carried_scores: what a cached score is worth after a block of n_valid tokens.
H2O_RULE float carry_factor(const Attrs& a, int64_t n_valid) {
  return a.decay < 1.f ? powf(a.decay, static_cast<float>(n_valid)) : 1.f;
}

// rules.accumulate: the carried score and the block's mass (its peak under score="max").
H2O_RULE float accumulate(const Attrs& a, float carried, float mass) {
  return is_peak(a) ? fmaxf(carried, mass) : carried + mass;
}

// rules.random_priority, bit for bit: int64 arithmetic with torch's % (the result takes the divisor's sign);
// pos * 2654435761 wraps like torch's int64 multiply for huge positions (unsigned arithmetic is defined).
H2O_RULE float random_priority(int64_t pos, int64_t seed) {
  const int64_t mod = 2147483647, mul = 48271;
  int64_t x = static_cast<int64_t>(static_cast<uint64_t>(pos) * 2654435761ull + static_cast<uint64_t>(seed) * 7919ull +
                                   1ull);
  x %= mod;
  if (x < 0) x += mod;
  x = (x * mul) % mod;  // x < 2^31 and mul < 2^16: no overflow, no sign
  x = (x * mul) % mod;
  return static_cast<float>(x);
}

// rules.eviction_priority for the entry at position p (-1 = empty) holding `score`: -inf when it cannot stay
// (empty, or out of the layer's window), +inf when protected (a sink or among the recent), else its key.
H2O_RULE float eviction_priority(const Attrs& a, float score, int64_t p, int64_t newest) {
  float key;
  if (a.policy == kPolicyH2O)
    key = a.score == kScoreMean ? score / static_cast<float>(max_i64(newest - p + 1, 1)) : score;
  else if (a.policy == kPolicyRandom)
    key = random_priority(p, a.seed);
  else
    key = static_cast<float>(p);  // local, sink: oldest first; full never evicts when sized right
  const bool protect = p < a.sinks || p > newest - a.recent;
  const bool live = p >= 0 && (a.window <= 0 || p > newest - a.window);
  return live ? (protect ? INFINITY : key) : -INFINITY;
}

// The eviction order: entry i is evicted before entry j (index j in the S = C + T entries) when its priority
// is lower, then its position, then its index. Entries tied on the first two are empty slots or padding
// (position -1), never live, so the index only makes the order total.
H2O_RULE bool evicted_before(float prio_i, int64_t pos_i, int64_t i, float prio_j, int64_t pos_j, int64_t j) {
  if (prio_i != prio_j) return prio_i < prio_j;
  if (pos_i != pos_j) return pos_i < pos_j;
  return i < j;
}

}  // namespace h2o
