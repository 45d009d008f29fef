// H2O attention over one block for one (batch row, KV head): the arithmetic of the ONNX function
// ai.h2o_compile::H2OAttention (export/onnx_function.py), written for one pair at a time so the state is
// read once and only the slots that change are written. No ONNX Runtime type appears here; h2o_op.cc
// checks the inputs and hands over raw pointers.
//
// Shapes (C = cache slots, T = block tokens, S = C + T, G = Hq / Hkv query heads per KV head):
//   q [B, Hq, T, D], k [B, Hkv, T, D], v [B, Hkv, T, Dv], positions [B, T] int64, valid [B, T] bool,
//   key_cache [B, Hkv, C, D], value_cache [B, Hkv, C, Dv], score_cache [B, Hkv, C] f32,
//   pos_cache [B, Hkv, C] int64, sink_logits [Hq] f32, rope tables [B', S', R] f32 (already converted).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "h2o_rule.h"
#include "h2o_shapes.h"

namespace h2o {

using f16 = _Float16;  // IEEE binary16; conversions round to nearest even, as ONNX Cast does

template <typename T> inline float to_f(T x) { return static_cast<float>(x); }
template <typename T> inline T from_f(float x) { return static_cast<T>(x); }

// Borrowed pointers for the whole batch; outputs may alias the cache inputs (in-place state).
template <typename QT, typename CT> struct Tensors {
  const QT *q, *k, *v;
  const int64_t* positions;
  const bool* valid;
  const CT *key_cache, *value_cache;
  const float* score_cache;
  const int64_t* pos_cache;
  const float* sink;                    // [Hq], -inf = no sink for that head
  const float *rope_cos, *rope_sin;     // [B', S', R] or null
  QT* out;
  CT *new_keys, *new_values;
  float* new_scores;
  int64_t* new_pos;
};

inline float dot(const float* a, const float* b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

// x[:R] <- x[:R] * cos + rotate_half(x[:R]) * sin (kernels/rolling.py), in fp32 as the function does.
inline void rotate(float* x, const float* cos, const float* sin, int64_t width) {
  const int64_t half = width / 2;  // width <= 1024, checked with the inputs
  float turned[1024] = {};
  for (int64_t i = 0; i < half; ++i) { turned[i] = -x[half + i]; turned[half + i] = x[i]; }
  for (int64_t i = 0; i < width; ++i) x[i] = x[i] * cos[i] + turned[i] * sin[i];
}

// Scratch of one worker, reused across pairs and calls.
struct Scratch {
  std::vector<float> keys, keys_t, values, queries, logits, mass, query_mass, scores, priority;
  std::vector<int64_t> pos, order, rank;
  std::vector<uint8_t> keep;
  std::vector<int64_t> source;
};

template <typename QT, typename CT>
void run_pair(const Attrs& a, const Dims& d, const Tensors<QT, CT>& x, int64_t b, int64_t h, Scratch& w) {
  const int64_t C = d.C, T = d.T, S = d.S, D = d.D, Dv = d.Dv, G = d.G;
  const int64_t pair = b * d.Hkv + h;
  const int64_t* positions = x.positions + b * T;
  const bool* valid = x.valid + b * T;
  const int64_t* pos_cache = x.pos_cache + pair * C;
  const float* score_cache = x.score_cache + pair * C;
  const CT* key_cache = x.key_cache + pair * C * D;
  const CT* value_cache = x.value_cache + pair * C * Dv;
  const QT* k = x.k + pair * T * D;
  const QT* v = x.v + pair * T * Dv;

  // ---- entries: C cached slots then the T block tokens (padding = position -1) -----------------------
  w.pos.resize(S);
  int64_t newest = -1, n_valid = 0;
  for (int64_t j = 0; j < C; ++j) w.pos[j] = pos_cache[j];
  for (int64_t t = 0; t < T; ++t) {
    w.pos[C + t] = valid[t] ? positions[t] : -1;
    newest = std::max(newest, w.pos[C + t]);
    n_valid += valid[t] ? 1 : 0;
  }
  // Keys / values in fp32, the block's first cast to the cache dtype (the function stores it so).
  // An fp32 cache without rolling is read in place; otherwise it is converted once per pair.
  const bool direct = std::is_same<CT, float>::value && !a.rolling;
  w.keys.resize((direct ? T : S) * D);
  w.values.resize((direct ? T : S) * Dv);
  float* block_keys = w.keys.data() + (direct ? 0 : C * D);
  float* block_values = w.values.data() + (direct ? 0 : C * Dv);
  if (!direct) {
    for (int64_t i = 0; i < C * D; ++i) w.keys[i] = to_f(key_cache[i]);
    for (int64_t i = 0; i < C * Dv; ++i) w.values[i] = to_f(value_cache[i]);
  }
  for (int64_t i = 0; i < T * D; ++i) block_keys[i] = to_f(from_f<CT>(to_f(k[i])));
  for (int64_t i = 0; i < T * Dv; ++i) block_values[i] = to_f(from_f<CT>(to_f(v[i])));
  auto key_row = [&](int64_t j) -> const float* {
    if (j >= C) return block_keys + (j - C) * D;
    if (direct) return reinterpret_cast<const float*>(key_cache) + j * D;
    return w.keys.data() + j * D;
  };
  auto value_row = [&](int64_t j) -> const float* {
    if (j >= C) return block_values + (j - C) * Dv;
    if (direct) return reinterpret_cast<const float*>(value_cache) + j * Dv;
    return w.values.data() + j * Dv;
  };
  // Queries of the group: row g * T + t is query head h * G + g at block index t.
  w.queries.resize(G * T * D);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t t = 0; t < T; ++t) {
      const QT* src = x.q + (((b * d.Hq) + h * G + g) * T + t) * D;
      float* dst = w.queries.data() + (g * T + t) * D;
      for (int64_t i = 0; i < D; ++i) dst[i] = to_f(src[i]);
    }

  // ---- rolling positions: rank among held entries, the block's valid tokens after them; or the true
  // distance to the newest valid token capped at max(D, n_valid - 1) (kernels/rolling.py) ---------------
  if (a.rolling && a.max_distance > 0) {
    const int64_t cap = std::max<int64_t>(a.max_distance, n_valid - 1), base = newest - cap;
    w.rank.resize(S);
    for (int64_t j = 0; j < S; ++j) w.rank[j] = std::min(std::max<int64_t>(w.pos[j] - base, 0), cap);
  } else if (a.rolling) {
    w.order.clear();
    for (int64_t j = 0; j < C; ++j) if (pos_cache[j] >= 0) w.order.push_back(j);
    std::sort(w.order.begin(), w.order.end(), [&](int64_t i, int64_t j) { return pos_cache[i] < pos_cache[j]; });
    const int64_t held = static_cast<int64_t>(w.order.size());
    w.rank.assign(S, 0);
    for (int64_t r = 0; r < held; ++r) w.rank[w.order[r]] = r;
    int64_t seen = 0;
    for (int64_t t = 0; t < T; ++t) { seen += valid[t] ? 1 : 0; w.rank[C + t] = held + std::max<int64_t>(seen - 1, 0); }
  }
  if (a.rolling) {
    const int64_t row = d.rope_rows == 1 ? 0 : b, R = d.rope_width;
    auto table = [&](const float* tab, int64_t rank) { return tab + (row * d.rope_len + rank) * R; };
    for (int64_t j = 0; j < S; ++j)  // the cache part of w.keys is a converted copy, block_keys too
      rotate(const_cast<float*>(key_row(j)), table(x.rope_cos, w.rank[j]), table(x.rope_sin, w.rank[j]), R);
    for (int64_t g = 0; g < G; ++g)
      for (int64_t t = 0; t < T; ++t)
        rotate(w.queries.data() + (g * T + t) * D, table(x.rope_cos, w.rank[C + t]), table(x.rope_sin, w.rank[C + t]), R);
  }

  // ---- attention: each valid query over the keys it sees, fp32, softmax with the optional sink --------
  // With several queries per pair (a prefill block, or a GQA group) the keys are transposed once to
  // [D, S], so each query's logits are D vectorized passes over contiguous keys instead of S short dot
  // products; a single query (the usual decode step) reads the keys in place, once.
  const bool transposed = G * T > 2;
  if (transposed) {
    w.keys_t.resize(D * S);
    for (int64_t j = 0; j < S; ++j) {
      const float* kr = key_row(j);
      for (int64_t i = 0; i < D; ++i) w.keys_t[i * S + j] = kr[i];
    }
  }
  const float floor_logit = -std::numeric_limits<float>::max();
  const bool h2o_policy = reads_mass(a);
  const bool peak_rule = is_peak(a);  // score="max": each query's mass over its group's heads, then their max
  w.mass.assign(S, 0.f);
  if (peak_rule) w.query_mass.resize(S);
  w.logits.resize(S);
  std::vector<float> acc(Dv);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t qp = positions[t];
    const float weight = query_weight(a, newest, qp);
    float* into = peak_rule ? w.query_mass.data() : w.mass.data();  // where this query's probabilities add up
    if (peak_rule) std::fill(into, into + S, 0.f);
    for (int64_t g = 0; g < G; ++g) {
      QT* out = x.out + (((b * d.Hq) + h * G + g) * T + t) * Dv;
      if (!valid[t]) { for (int64_t i = 0; i < Dv; ++i) out[i] = from_f<QT>(0.f); continue; }
      const float* q = w.queries.data() + (g * T + t) * D;
      float peak = x.sink[h * G + g];
      if (transposed) {
        float* l = w.logits.data();
        std::fill(l, l + S, 0.f);
        for (int64_t i = 0; i < D; ++i) {
          const float qi = q[i];
          const float* kt = w.keys_t.data() + i * S;
#pragma omp simd
          for (int64_t j = 0; j < S; ++j) l[j] += qi * kt[j];
        }
      }
      for (int64_t j = 0; j < S; ++j) {
        const int64_t kp = w.pos[j];
        const bool seen = kp >= 0 && kp <= qp && (a.window <= 0 || kp > qp - a.window);
        float logit = floor_logit;
        if (seen) {
          logit = (transposed ? w.logits[j] : dot(q, key_row(j), D)) * a.scale;
          if (a.softcap > 0.f) logit = std::tanh(logit / a.softcap) * a.softcap;
          peak = std::max(peak, logit);
        }
        w.logits[j] = logit;
      }
      float total = 0.f;
      for (int64_t j = 0; j < S; ++j) {
        const float e = w.logits[j] == floor_logit ? 0.f : std::exp(w.logits[j] - peak);
        w.logits[j] = e;
        total += e;
      }
      total += std::exp(x.sink[h * G + g] - peak);  // exp(-inf) = 0: no sink
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < S; ++j) {
        if (w.logits[j] == 0.f) continue;
        const float p = w.logits[j] / total;
        const float* vr = value_row(j);
#pragma omp simd
        for (int64_t i = 0; i < Dv; ++i) acc[i] += p * vr[i];
        if (h2o_policy) into[j] += p * weight;
      }
      for (int64_t i = 0; i < Dv; ++i) out[i] = from_f<QT>(acc[i]);
    }
    if (peak_rule)
      for (int64_t j = 0; j < S; ++j) w.mass[j] = std::max(w.mass[j], into[j]);
  }

  // ---- scores and eviction priority (larger stays) -------------------------------------------------------
  const float carry = carry_factor(a, n_valid);
  w.scores.resize(S);
  w.priority.resize(S);
  for (int64_t j = 0; j < S; ++j) {
    const float carried = j < C ? score_cache[j] * carry : 0.f;
    w.scores[j] = accumulate(a, carried, w.mass[j]);
    w.priority[j] = eviction_priority(a, w.scores[j], w.pos[j], newest);
  }
  // Evict the bottom T in the rule's order (h2o_rule.h); the rest stays when live.
  w.order.resize(S);
  for (int64_t j = 0; j < S; ++j) w.order[j] = j;
  auto lower = [&](int64_t i, int64_t j) {
    return evicted_before(w.priority[i], w.pos[i], i, w.priority[j], w.pos[j], j);
  };
  if (T == 1) {
    std::swap(w.order[0], w.order[*std::min_element(w.order.begin(), w.order.end(), lower)]);
  } else {
    std::nth_element(w.order.begin(), w.order.begin() + (T - 1), w.order.end(), lower);
  }
  w.keep.assign(S, 1);
  for (int64_t r = 0; r < T; ++r) w.keep[w.order[r]] = 0;
  for (int64_t j = 0; j < S; ++j)
    if (w.priority[j] == -INFINITY) w.keep[j] = 0;

  // ---- slot-stable assignment: the r-th freed slot receives the r-th kept new token ---------------------
  w.source.assign(C, -1);
  int64_t next = 0;
  for (int64_t j = 0; j < C; ++j) {
    if (w.keep[j]) continue;
    while (next < T && !w.keep[C + next]) ++next;
    if (next < T) w.source[j] = next++;
  }
  CT* new_keys = x.new_keys + pair * C * D;
  CT* new_values = x.new_values + pair * C * Dv;
  float* new_scores = x.new_scores + pair * C;
  int64_t* new_pos = x.new_pos + pair * C;
  if (new_keys != key_cache) std::memcpy(new_keys, key_cache, sizeof(CT) * C * D);
  if (new_values != value_cache) std::memcpy(new_values, value_cache, sizeof(CT) * C * Dv);
  for (int64_t j = 0; j < C; ++j) {
    const int64_t held = pos_cache[j];  // read before new_pos[j] is written: the two may be one buffer
    if (w.keep[j]) { new_scores[j] = w.scores[j]; new_pos[j] = held; continue; }
    const int64_t s = w.source[j];
    if (s >= 0) {
      for (int64_t i = 0; i < D; ++i) new_keys[j * D + i] = from_f<CT>(to_f(k[s * D + i]));
      for (int64_t i = 0; i < Dv; ++i) new_values[j * Dv + i] = from_f<CT>(to_f(v[s * Dv + i]));
      new_scores[j] = w.scores[C + s];
      new_pos[j] = w.pos[C + s];
    } else {
      if (held >= 0) {  // an evicted entry: the slot becomes empty, zeros as every empty slot holds
        std::fill(new_keys + j * D, new_keys + (j + 1) * D, from_f<CT>(0.f));
        std::fill(new_values + j * Dv, new_values + (j + 1) * Dv, from_f<CT>(0.f));
      }
      new_scores[j] = 0.f;
      new_pos[j] = -1;
    }
  }
}

}  // namespace h2o
