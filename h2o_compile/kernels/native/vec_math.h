// Row operations on fp32 buffers with ATen's vector type, shared by the native CPU ops (prefill_mass.cc,
// decode_attend.cc). Vectorized<float> takes the widest instructions CPU_CAPABILITY names (AVX2 / AVX512, set
// by the build), ATen's portable vectors otherwise.
#pragma once

#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace h2o_native {

using Vec = at::vec::Vectorized<float>;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// The lanes of v folded with op (a horizontal max or sum).
template <typename Op>
inline float fold_lanes(const Vec& v, float init, Op op) {
  float lanes[Vec::size()];
  v.store(lanes);
  for (int i = 0; i < Vec::size(); ++i) init = op(init, lanes[i]);
  return init;
}

// max(start, row[0..n))
inline float row_max(const float* row, int64_t n, float start) {
  Vec best(start);
  int64_t j = 0;
  for (; j + Vec::size() <= n; j += Vec::size()) best = at::vec::maximum(best, Vec::loadu(row + j));
  float m = fold_lanes(best, start, [](float a, float b) { return std::max(a, b); });
  for (; j < n; ++j) m = std::max(m, row[j]);
  return m;
}

// row[j] <- exp(row[j] - m) in place; returns their sum. -inf (a hidden key) becomes exactly 0. Fast: ATen's
// exp_u20 (the exponential torch's own CPU flash attention uses, within ~2e-6 relative of the exact one; it
// clamps a NaN logit instead of propagating it); otherwise Sleef's exp within 1 ulp (what torch.softmax uses).
template <bool Fast>
inline float exp_in_place(float* row, int64_t n, float m) {
  const Vec shift(m);
  Vec total(0.f);
  int64_t j = 0;
  for (; j + Vec::size() <= n; j += Vec::size()) {
    const Vec x = Vec::loadu(row + j) - shift;
    const Vec p = Fast ? x.exp_u20() : x.exp();
    p.store(row + j);
    total = total + p;
  }
  float sum = fold_lanes(total, 0.f, [](float a, float b) { return a + b; });
  for (; j < n; ++j) {
    row[j] = std::exp(row[j] - m);
    sum += row[j];
  }
  return sum;
}

// acc[j] += c * row[j]
inline void add_scaled(float* acc, const float* row, int64_t n, float c) {
  const Vec coef(c);
  int64_t j = 0;
  for (; j + Vec::size() <= n; j += Vec::size()) (Vec::loadu(acc + j) + coef * Vec::loadu(row + j)).store(acc + j);
  for (; j < n; ++j) acc[j] += c * row[j];
}

// acc[j] = max(acc[j], c * row[j])
inline void max_scaled(float* acc, const float* row, int64_t n, float c) {
  const Vec coef(c);
  int64_t j = 0;
  for (; j + Vec::size() <= n; j += Vec::size()) {
    at::vec::maximum(Vec::loadu(acc + j), coef * Vec::loadu(row + j)).store(acc + j);
  }
  for (; j < n; ++j) acc[j] = std::max(acc[j], c * row[j]);
}

// sum_j a[j] b[j]
inline float dot(const float* a, const float* b, int64_t n) {
  Vec acc(0.f);
  int64_t j = 0;
  for (; j + Vec::size() <= n; j += Vec::size()) acc = at::vec::fmadd(Vec::loadu(a + j), Vec::loadu(b + j), acc);
  float sum = fold_lanes(acc, 0.f, [](float x, float y) { return x + y; });
  for (; j < n; ++j) sum += a[j] * b[j];
  return sum;
}

}  // namespace h2o_native
