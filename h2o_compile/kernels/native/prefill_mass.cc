// The causal prefill of a block with each key's attention mass, in one pass over the logits.
//
// torch's fused CPU attention never materialises the probabilities, so a rule that reads scores (every prompt
// query adds its attention to every key's score) costs it a second q.k product over the causal triangle. This
// op computes, per (KV head n, tile of queries) and each query head g of the group, the tile's logits against
// every key it can see into a buffer that stays in cache, normalises them once, and reads that buffer twice:
// the P.V product for the output and the mass. One q.k product, one exponential per logit.
//
// Semantics (kernels/reference.py `attend`, the executable spec, restricted to what the caller routes here: a
// block without padding, its positions increasing, no soft-capping; W the layer's window, 0 = none):
//   query t (position P_t) sees cache slot j < C holding position p_j >= 0 when p_j <= P_t and, with a
//   window, p_j > P_t - W; and the block's key i (position P_i) when i <= t and, with a window, P_i > P_t - W;
//   out[n, g, t]  = sum_j p_gtj v_j,  p_gtj = exp(l_gtj - lse_gt),  l_gtj = scale q_gt . k_j,
//   lse_gt        = log(sum_j exp(l_gtj) + exp(sink[n, g]))   (no sink term without sinks),
//   mass[n, j]    = sum_t w[n, t] sum_g p_gtj                   (w = 1 without weights), or with `peak`
//   mass[n, j]    = max_t w[n, t] sum_g p_gtj                   (score="max": each query's group sum, its peak).
// Everything in fp32 (the caller upcasts bf16 / fp16 and casts the output back).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <mutex>
#include <optional>
#include <tuple>
#include <vector>

#include "vec_math.h"

namespace {

using h2o_native::add_scaled;
using h2o_native::kNegInf;
using h2o_native::row_max;

struct Inputs {
  at::Tensor q;         // [N, G, T, D]
  at::Tensor keys;      // [N, S, D], S = C + T
  at::Tensor values;    // [N, S, Dv]
  at::Tensor out;       // [N, G, T, Dv]
  const int64_t* cache_pos;  // [N, C], -1 = an empty slot
  const int64_t* query_pos;  // [N, T], increasing along T (the block's keys have the same positions)
  const float* sink;         // [N, G] or nullptr
  const float* weight;       // [N, T] or nullptr
  int64_t G, T, C, window;
  float scale;
};

// The first block key any query from t on can see: 0 without a window, else the first i with P_i > P_t - W
// (positions increase, so the keys a window hides form a prefix).
int64_t first_block_key(const int64_t* pos, int64_t t, int64_t window) {
  if (window <= 0) return 0;
  return std::partition_point(pos, pos + t, [&](int64_t p) { return p <= pos[t] - window; }) - pos;
}

// One tile: queries [t0, t1) of query head g over KV head n, against key columns [lo, C + t1): every cache
// slot when the cache has any (C > 0), then the block from the first key the tile's first query can see.
// Writes the tile's output and leaves in `logits` ([t1 - t0, C + t1 - lo] floats) each row's unnormalised
// probabilities (zero wherever the query sees nothing) and in `inv` the row's 1 / denominator. The two products
// go through torch's BLAS (at::addmm_out / at::mm_out, one thread inside the parallel region) on views of the
// inputs and the buffer.
struct Tile {
  int64_t t0, rows, lo, cols;
  // The columns row r may see end here: the cache's, then the block's keys up to its own.
  int64_t seen(const Inputs& in, int64_t r) const { return in.C + t0 + r + 1 - lo; }
};

Tile attend_tile(const Inputs& in, int64_t n, int64_t g, int64_t t0, int64_t t1, float* logits, float* inv) {
  const int64_t* qpos = in.query_pos + n * in.T;
  const int64_t* cpos = in.cache_pos + n * in.C;
  const int64_t lo = in.C > 0 ? 0 : first_block_key(qpos, t0, in.window);
  const Tile tile{t0, t1 - t0, lo, in.C + t1 - lo};
  const auto q = in.q[n][g].narrow(0, t0, tile.rows);                              // [rows, D]
  auto logits_view = at::from_blob(logits, {tile.rows, tile.cols}, in.q.options());  // [rows, cols]
  // scale x q.k (beta 0: the buffer's old contents are not read)
  at::addmm_out(logits_view, logits_view, q, in.keys[n].narrow(0, lo, tile.cols).t(), 0.0, in.scale);
  const float sink = in.sink ? in.sink[n * in.G + g] : kNegInf;
  for (int64_t r = 0; r < tile.rows; ++r) {
    const int64_t t = t0 + r, newest = qpos[t];
    const int64_t oldest = in.window > 0 ? newest - in.window : std::numeric_limits<int64_t>::min();
    float* row = logits + r * tile.cols;
    for (int64_t j = 0; j < in.C; ++j) {  // columns 0 .. C-1 are the cache's whenever it has any
      if (cpos[j] < 0 || cpos[j] > newest || cpos[j] <= oldest) row[j] = kNegInf;
    }
    // The block's keys this query cannot see: those a window hides (a prefix), and its future (zeroed: never
    // read as a logit, and zero probability for P.V).
    const int64_t hidden_end = in.C + first_block_key(qpos, t, in.window) - lo;
    std::fill(row + in.C, row + hidden_end, kNegInf);
    const int64_t seen = tile.seen(in, r);
    std::fill(row + seen, row + tile.cols, 0.f);
    const float m = row_max(row, seen, sink);  // finite: the query sees at least itself
    float total = h2o_native::exp_in_place</*Fast=*/true>(row, seen, m);
    if (in.sink) total += std::exp(sink - m);  // a learned sink only adds to the denominator
    inv[r] = 1.f / total;
  }
  auto o = in.out[n][g].narrow(0, t0, tile.rows);                                   // [rows, Dv]
  at::mm_out(o, logits_view, in.values[n].narrow(0, lo, tile.cols));
  float* o_ptr = o.data_ptr<float>();
  const int64_t dv = o.size(1);
  for (int64_t r = 0; r < tile.rows; ++r) {
    for (int64_t d = 0; d < dv; ++d) o_ptr[r * dv + d] *= inv[r];
  }
  return tile;
}

// A query's weight in the mass (1 without weights).
float query_weight(const Inputs& in, int64_t n, int64_t t) { return in.weight ? in.weight[n * in.T + t] : 1.f; }

// The paper's sum: one tile of one query head adds w_t p_gtj to the mass `acc` ([S]) of its KV head.
void sum_tile(const Inputs& in, int64_t n, int64_t g, int64_t t0, int64_t t1, float* logits, float* inv,
              float* acc) {
  const Tile tile = attend_tile(in, n, g, t0, t1, logits, inv);
  for (int64_t r = 0; r < tile.rows; ++r) {
    // A zero weight adds exactly nothing (tested before the product: 0 x a non-finite 1 / total would not be).
    const float w = query_weight(in, n, t0 + r);
    if (w != 0.f) add_scaled(acc + tile.lo, logits + r * tile.cols, tile.seen(in, r), w * inv[r]);
  }
}

// The peak: the group's G query heads of one tile in turn, each query's probabilities summed over them in
// `group_sum` ([t1 - t0, C + t1 - lo]), then acc[j] = max(acc[j], w_t x that sum) row by row. A peak needs
// every head of a query before it can compare queries, hence one work item per (n, tile), not per (n, g, tile).
void peak_tile(const Inputs& in, int64_t n, int64_t t0, int64_t t1, float* logits, float* inv, float* group_sum,
               float* acc) {
  Tile tile{};
  for (int64_t g = 0; g < in.G; ++g) {
    tile = attend_tile(in, n, g, t0, t1, logits, inv);
    if (g == 0) std::fill(group_sum, group_sum + tile.rows * tile.cols, 0.f);
    for (int64_t r = 0; r < tile.rows; ++r) {
      if (query_weight(in, n, t0 + r) != 0.f) {
        add_scaled(group_sum + r * tile.cols, logits + r * tile.cols, tile.seen(in, r), inv[r]);
      }
    }
  }
  for (int64_t r = 0; r < tile.rows; ++r) {
    const float w = query_weight(in, n, t0 + r);
    if (w != 0.f) h2o_native::max_scaled(acc + tile.lo, group_sum + r * tile.cols, tile.seen(in, r), w);
  }
}

std::tuple<at::Tensor, at::Tensor> causal_attend_with_mass(
    const at::Tensor& q_in, const at::Tensor& keys_in, const at::Tensor& values_in, const at::Tensor& cache_pos_in,
    const at::Tensor& query_pos_in, int64_t window, double scale, const std::optional<at::Tensor>& sink_in,
    const std::optional<at::Tensor>& weight_in, int64_t query_tile, bool peak) {
  TORCH_CHECK(q_in.dim() == 4 && keys_in.dim() == 3 && values_in.dim() == 3 && cache_pos_in.dim() == 2 &&
                  query_pos_in.dim() == 2,
              "causal_attend_with_mass: q [N, G, T, D], keys [N, C+T, D], values [N, C+T, Dv], cache_pos [N, C], "
              "query_pos [N, T]");
  TORCH_CHECK(q_in.scalar_type() == at::kFloat && keys_in.scalar_type() == at::kFloat &&
                  values_in.scalar_type() == at::kFloat && cache_pos_in.scalar_type() == at::kLong &&
                  query_pos_in.scalar_type() == at::kLong,
              "causal_attend_with_mass: fp32 q/keys/values and int64 positions");
  TORCH_CHECK(query_tile >= 1, "causal_attend_with_mass: query_tile must be >= 1, got ", query_tile);
  const auto q = q_in.contiguous(), keys = keys_in.contiguous(), values = values_in.contiguous();
  const auto cache_pos = cache_pos_in.contiguous(), query_pos = query_pos_in.contiguous();
  const int64_t N = q.size(0), G = q.size(1), T = q.size(2), D = q.size(3), C = cache_pos.size(1), S = C + T;
  TORCH_CHECK(keys.size(0) == N && keys.size(1) == S && keys.size(2) == D && values.size(0) == N &&
                  values.size(1) == S && cache_pos.size(0) == N && query_pos.size(0) == N && query_pos.size(1) == T,
              "causal_attend_with_mass: keys/values must hold the C cached and T block keys of each head");
  const int64_t* qp = query_pos.data_ptr<int64_t>();
  for (int64_t i = 0; i < N * T; ++i) {
    TORCH_CHECK(i % T == 0 || qp[i] > qp[i - 1], "causal_attend_with_mass: query positions must increase "
                "along the block (a block without padding)");
  }
  std::optional<at::Tensor> sink, weight;
  if (sink_in) {
    sink = sink_in->to(at::kFloat).contiguous();
    TORCH_CHECK(sink->numel() == N * G, "causal_attend_with_mass: sink must be [N, G]");
  }
  if (weight_in) {
    weight = weight_in->to(at::kFloat).contiguous();
    TORCH_CHECK(weight->numel() == N * T, "causal_attend_with_mass: weight must be [N, T]");
  }
  auto out = at::empty({N, G, T, values.size(2)}, q.options());
  const Inputs in{q, keys, values, out, cache_pos.data_ptr<int64_t>(), qp,
                  sink ? sink->data_ptr<float>() : nullptr, weight ? weight->data_ptr<float>() : nullptr,
                  G, T, C, window, static_cast<float>(scale)};
  // Each range of work items (a thread's share) gathers the mass of the KV heads it touches in its own
  // buffer; the buffers are combined (added, or for a peak their maximum taken) in the order of their ranges
  // afterwards: no shared writes, no dependence on the OpenMP runtime's thread numbering, and the same result
  // for the same thread count on every run.
  struct RangeMass {
    int64_t begin, first_head;
    std::vector<float> mass;  // [KV heads in the range, S]
  };
  std::vector<RangeMass> ranges;
  std::mutex ranges_lock;
  // Work items: (n, g, tile) for the sum, (n, tile) for the peak (its tile walks the group's heads itself).
  const int64_t tiles = (T + query_tile - 1) / query_tile, per_head = (peak ? 1 : G) * tiles;
  at::parallel_for(0, N * per_head, 1, [&](int64_t begin, int64_t end) {
    const int64_t first_head = begin / per_head, heads = (end - 1) / per_head - first_head + 1;
    RangeMass local{begin, first_head, std::vector<float>(heads * S, 0.f)};
    std::vector<float> logits(query_tile * S), inv(query_tile), group_sum(peak ? query_tile * S : 0);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t n = item / per_head, i = item % tiles;
      // Tiles in the order first, last, second, second-to-last, ...: a causal tile's cost grows with its
      // index, so every contiguous range of items (one thread's share) holds light and heavy ones alike.
      const int64_t tile = i % 2 == 0 ? i / 2 : tiles - 1 - i / 2;
      const int64_t t0 = tile * query_tile, t1 = std::min(T, t0 + query_tile);
      float* acc = local.mass.data() + (n - first_head) * S;
      if (peak) {
        peak_tile(in, n, t0, t1, logits.data(), inv.data(), group_sum.data(), acc);
      } else {
        sum_tile(in, n, item % per_head / tiles, t0, t1, logits.data(), inv.data(), acc);
      }
    }
    std::lock_guard<std::mutex> guard(ranges_lock);
    ranges.push_back(std::move(local));
  });
  std::sort(ranges.begin(), ranges.end(),
            [](const RangeMass& a, const RangeMass& b) { return a.begin < b.begin; });
  auto mass = at::zeros({N, S}, q.options());
  float* mass_ptr = mass.data_ptr<float>();
  for (const RangeMass& range : ranges) {
    float* dst = mass_ptr + range.first_head * S;
    for (size_t j = 0; j < range.mass.size(); ++j) {
      dst[j] = peak ? std::max(dst[j], range.mass[j]) : dst[j] + range.mass[j];
    }
  }
  return {out, mass};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(h2o_cpu, m) {
  m.def("causal_attend_with_mass(Tensor q, Tensor keys, Tensor values, Tensor cache_pos, Tensor query_pos, "
        "int window, float scale, Tensor? sink, Tensor? weight, int query_tile, bool peak=False) -> "
        "(Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(h2o_cpu, CPU, m) { m.impl("causal_attend_with_mass", &causal_attend_with_mass); }

