// A linear layer over a few rows, x @ W^T + b, as the decode step runs it: every weight read once from memory
// while the few rows of x stay in L1.
//
// A one-token decode step multiplies the batch's rows by every weight matrix, so its time is the time to stream
// the weights. torch's CPU BLAS does that well for some row counts only (benchmarks/rows_linear.py, this
// project's 2-core AMD EPYC, the KV-bound model's 57 matrices): one row runs as a matrix-vector product at
// about 10 GB/s, and from three rows on the product turns compute-bound early. Here each thread takes a range of
// output features; per feature o, the weight row W[o] is read once, a vector at a time, and multiplied into one
// accumulator per row of x (up to 8 at a time), which are summed across lanes at the end. Two rows, and more than
// eight, keep torch's BLAS (as W @ x^T), which is as fast or faster there on the measured CPU.
//
// Semantics: out[n, o] = sum_i x[n, i] W[o, i] (+ b[o]), fp32 accumulation; other dtypes and any weight that is
// not a contiguous fp32 matrix take torch's BLAS.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <torch/library.h>

#include <optional>

#include "vec_math.h"

namespace {

using h2o_native::Vec;

constexpr int64_t kMaxRows = 8;  // accumulators per weight row: 8 vectors, with the weight's, fit the registers

// out[n, o] for the NT rows of x ([NT, in]) and o in [o0, o1); rows of out are O floats apart.
template <int NT>
void rows_times_weight(const float* w, const float* x, float* out, int64_t in, int64_t O, int64_t o0, int64_t o1) {
  for (int64_t o = o0; o < o1; ++o) {
    const float* w_row = w + o * in;
    Vec acc[NT];
    for (int n = 0; n < NT; ++n) acc[n] = Vec(0.f);
    int64_t i = 0;
    for (; i + Vec::size() <= in; i += Vec::size()) {
      const Vec weights = Vec::loadu(w_row + i);
      for (int n = 0; n < NT; ++n) acc[n] = at::vec::fmadd(weights, Vec::loadu(x + n * in + i), acc[n]);
    }
    for (int n = 0; n < NT; ++n) {
      float sum = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc[n]);
      for (int64_t k = i; k < in; ++k) sum += w_row[k] * x[n * in + k];
      out[n * O + o] = sum;
    }
  }
}

using TileFn = void (*)(const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t);
constexpr TileFn kTiles[kMaxRows] = {rows_times_weight<1>, rows_times_weight<2>, rows_times_weight<3>,
                                     rows_times_weight<4>, rows_times_weight<5>, rows_times_weight<6>,
                                     rows_times_weight<7>, rows_times_weight<8>};

bool streams_weights(int64_t rows) { return rows == 1 || (rows >= 3 && rows <= kMaxRows); }

at::Tensor rows_linear(const at::Tensor& x_in, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x_in.dim() == 2 && weight.dim() == 2 && x_in.size(1) == weight.size(1),
              "rows_linear: x [N, in] and weight [out, in]; got x ", x_in.sizes(), ", weight ", weight.sizes());
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == weight.size(0)),
              "rows_linear: bias must be [out] = [", weight.size(0), "]");
  const int64_t N = x_in.size(0), in = x_in.size(1), O = weight.size(0);
  const bool own = streams_weights(N) && x_in.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat &&
                   weight.is_contiguous();
  if (!own) {  // torch's BLAS, weight as the left operand (the form CPU BLAS streams: weight_major_linear.py)
    auto out = at::mm(weight, x_in.t()).t().contiguous();
    return bias ? out.add_(*bias) : out;
  }
  const auto x = x_in.contiguous();
  auto out = at::empty({N, O}, x.options());
  const float* w = weight.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // Ranges of at least 16 output features (a 16 x in block of the weight per range).
  at::parallel_for(0, O, 16, [&](int64_t o0, int64_t o1) { kTiles[N - 1](w, xp, op, in, O, o0, o1); });
  return bias ? out.add_(*bias) : out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(h2o_cpu, m) { m.def("rows_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor"); }

TORCH_LIBRARY_IMPL(h2o_cpu, CPU, m) { m.impl("rows_linear", &rows_linear); }
