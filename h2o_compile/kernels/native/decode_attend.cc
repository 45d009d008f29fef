// The decode step's attention: one new token per row against the cached keys and its own, with the mass every
// key received, in one call.
//
// In eager torch this is about fifteen small operators per layer and step (two batched matrix-vector products,
// the masks, the softmax, the sums), each paying a dispatch that costs more than its arithmetic at decode
// sizes (a few hundred cached slots): 420 us per layer at batch 4 against a few tens of microseconds of work.
// Here each (row, KV head) is one work item: its G query heads' logits go into a buffer of G x (C + 1) floats,
// are normalised in place, and that buffer is read once for the output and once for the mass.
//
// Semantics (kernels/reference.py `attend_decode`, the executable spec; W the layer's window, 0 = none):
//   slot c of row b, KV head n is visible when pos[b, n, c] >= 0 and, with a window, pos > new_pos[b, n] - W;
//   the new key is always visible; l = scale q . k, soft-capped (s tanh(l / s)) when s > 0;
//   p = exp(l - lse) with lse = log(sum exp(l) + exp(sink[head])) (no sink term without sinks);
//   out[b, head] = sum_c p_c v_c + p_new v_new;  mass[b, n, c] = sum over the group's G heads of p_c;
//   a padding row (valid false) gets a zero output and zero mass.
// Everything in fp32 (a bf16 / fp16 cache is converted a row at a time; the output takes q's dtype).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#include "vec_math.h"

namespace {

using h2o_native::kNegInf;

// A cache row as fp32: the row itself for an fp32 cache, else converted into `buffer`.
template <typename scalar_t>
const float* as_float(const scalar_t* row, int64_t n, float* buffer) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return row;
  } else {
    for (int64_t i = 0; i < n; ++i) buffer[i] = static_cast<float>(row[i]);
    return buffer;
  }
}

struct DecodeInputs {
  const float* q;         // [B, Hkv, G, D]
  const float* k;         // [B, Hkv, D]
  const float* v;         // [B, Hkv, Dv]
  const bool* valid;      // [B]
  const int64_t* pos;     // [B, Hkv, C]
  const int64_t* newest;  // [B, Hkv] or nullptr (needed with a window only)
  const float* sink;      // [Hkv, G] or nullptr
  float* out;             // [B, Hkv, G, Dv]
  float* mass;            // [B, Hkv, C]
  float* mass_new;        // [B, Hkv]
  int64_t Hkv, G, C, D, Dv, window;
  float scale, softcap;
};

float capped(float logit, float softcap) { return softcap > 0.f ? std::tanh(logit / softcap) * softcap : logit; }

// Row b, KV head n: `probs` holds [G, C + 1] floats (slot C is the new key), `row` D + Dv floats of scratch.
template <typename scalar_t>
void attend_item(const DecodeInputs& in, const scalar_t* keys, const scalar_t* values, int64_t b, int64_t n,
                 float* probs, float* row) {
  const int64_t item = b * in.Hkv + n, C = in.C, S = C + 1;
  float* out = in.out + item * in.G * in.Dv;
  float* mass = in.mass + item * C;
  if (!in.valid[b]) {  // padding attends nowhere
    std::fill(out, out + in.G * in.Dv, 0.f);
    std::fill(mass, mass + C, 0.f);
    in.mass_new[item] = 0.f;
    return;
  }
  const float* q = in.q + item * in.G * in.D;
  const int64_t* pos = in.pos + item * C;
  const int64_t oldest = in.window > 0 ? in.newest[item] - in.window : -1;  // slots at or before it are hidden
  const auto hidden = [&](int64_t c) { return pos[c] < 0 || pos[c] <= oldest; };
  for (int64_t c = 0; c < C; ++c) {
    if (hidden(c)) {
      for (int64_t g = 0; g < in.G; ++g) probs[g * S + c] = kNegInf;
      continue;
    }
    const float* key = as_float(keys + (item * C + c) * in.D, in.D, row);
    for (int64_t g = 0; g < in.G; ++g) {
      probs[g * S + c] = capped(h2o_native::dot(q + g * in.D, key, in.D) * in.scale, in.softcap);
    }
  }
  for (int64_t g = 0; g < in.G; ++g) {
    float* p = probs + g * S;
    p[C] = capped(h2o_native::dot(q + g * in.D, in.k + item * in.D, in.D) * in.scale, in.softcap);
    const float sink = in.sink ? in.sink[n * in.G + g] : kNegInf;
    const float m = h2o_native::row_max(p, S, sink);  // finite: the new key is always visible
    float total = h2o_native::exp_in_place</*Fast=*/false>(p, S, m);
    if (in.sink) total += std::exp(sink - m);  // a learned sink only adds to the denominator
    const float inv = 1.f / total;
    for (int64_t c = 0; c < S; ++c) p[c] *= inv;
  }
  // out = P.V over the slots, one value row read (and converted) once for the G heads; then the new value.
  std::fill(out, out + in.G * in.Dv, 0.f);
  for (int64_t c = 0; c < C; ++c) {
    if (hidden(c)) continue;  // probability exactly 0
    const float* value = as_float(values + (item * C + c) * in.Dv, in.Dv, row);
    for (int64_t g = 0; g < in.G; ++g) h2o_native::add_scaled(out + g * in.Dv, value, in.Dv, probs[g * S + c]);
  }
  float new_mass = 0.f;
  std::fill(mass, mass + C, 0.f);
  for (int64_t g = 0; g < in.G; ++g) {
    h2o_native::add_scaled(out + g * in.Dv, in.v + item * in.Dv, in.Dv, probs[g * S + C]);
    h2o_native::add_scaled(mass, probs + g * S, C, 1.f);
    new_mass += probs[g * S + C];
  }
  in.mass_new[item] = new_mass;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attend_decode(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& valid_in,
    const at::Tensor& key_cache_in, const at::Tensor& value_cache_in, const at::Tensor& pos_cache_in, double scale,
    const std::optional<at::Tensor>& new_pos_in, int64_t window, double softcap,
    const std::optional<at::Tensor>& sink_in) {
  TORCH_CHECK(q_in.dim() == 4 && k_in.dim() == 4 && v_in.dim() == 4 && key_cache_in.dim() == 4 &&
                  value_cache_in.dim() == 4 && pos_cache_in.dim() == 3,
              "attend_decode: q [B, Hq, 1, D], k [B, Hkv, 1, D], v [B, Hkv, 1, Dv], key_cache [B, Hkv, C, D], "
              "value_cache [B, Hkv, C, Dv], pos_cache [B, Hkv, C]");
  const int64_t B = q_in.size(0), Hq = q_in.size(1), D = q_in.size(3);
  const int64_t Hkv = key_cache_in.size(1), C = key_cache_in.size(2), Dv = value_cache_in.size(3);
  TORCH_CHECK(q_in.size(2) == 1 && Hkv > 0 && Hq % Hkv == 0, "attend_decode: one token per row and query heads a "
              "multiple of the KV heads; got q ", q_in.sizes(), ", key_cache ", key_cache_in.sizes());
  TORCH_CHECK(k_in.sizes() == at::IntArrayRef({B, Hkv, 1, D}) && v_in.sizes() == at::IntArrayRef({B, Hkv, 1, Dv}) &&
                  key_cache_in.size(0) == B && key_cache_in.size(3) == D &&
                  value_cache_in.sizes() == at::IntArrayRef({B, Hkv, C, Dv}) &&
                  pos_cache_in.sizes() == at::IntArrayRef({B, Hkv, C}) && valid_in.numel() == B,
              "attend_decode: k, v, the caches, pos_cache and valid must match q's batch and the caches' heads");
  TORCH_CHECK(key_cache_in.scalar_type() == value_cache_in.scalar_type() &&
                  at::isFloatingType(key_cache_in.scalar_type()) && pos_cache_in.scalar_type() == at::kLong &&
                  valid_in.scalar_type() == at::kBool,
              "attend_decode: float caches of one dtype, int64 pos_cache and bool valid");
  TORCH_CHECK(window <= 0 || new_pos_in.has_value(), "attend_decode: a window needs new_pos");
  const auto q = q_in.to(at::kFloat).contiguous(), k = k_in.to(at::kFloat).contiguous();
  const auto v = v_in.to(at::kFloat).contiguous(), valid = valid_in.contiguous();
  const auto key_cache = key_cache_in.contiguous(), value_cache = value_cache_in.contiguous();
  const auto pos_cache = pos_cache_in.contiguous();
  std::optional<at::Tensor> newest, sink;
  if (window > 0) {
    newest = new_pos_in->reshape({B, -1}).expand({B, Hkv}).contiguous();  // [B, 1] or [B, Hkv] -> [B, Hkv]
    TORCH_CHECK(newest->scalar_type() == at::kLong, "attend_decode: new_pos must be int64");
  }
  const int64_t G = Hq / Hkv;
  if (sink_in) {
    sink = sink_in->to(at::kFloat).contiguous();
    TORCH_CHECK(sink->numel() == Hq, "attend_decode: sink must hold one logit per query head (", Hq, ")");
  }
  auto out = at::empty({B, Hq, 1, Dv}, q.options());
  auto mass = at::empty({B, Hkv, C}, q.options());
  auto mass_new = at::empty({B, Hkv, 1}, q.options());
  const DecodeInputs in{q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), valid.data_ptr<bool>(),
                        pos_cache.data_ptr<int64_t>(), newest ? newest->data_ptr<int64_t>() : nullptr,
                        sink ? sink->data_ptr<float>() : nullptr, out.data_ptr<float>(), mass.data_ptr<float>(),
                        mass_new.data_ptr<float>(), Hkv, G, C, D, Dv, window, static_cast<float>(scale),
                        static_cast<float>(softcap)};
  // Items of about 16k multiply-adds or more per thread's share: at a batch of one and a short cache the
  // whole call is a few microseconds, less than waking a second thread.
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, G * (C + 1) * (D + Dv)));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, key_cache.scalar_type(), "attend_decode", [&] {
    const scalar_t* keys = key_cache.data_ptr<scalar_t>();
    const scalar_t* values = value_cache.data_ptr<scalar_t>();
    at::parallel_for(0, B * Hkv, grain, [&](int64_t begin, int64_t end) {
      std::vector<float> probs(G * (C + 1)), row(D + Dv);
      for (int64_t item = begin; item < end; ++item) {
        attend_item<scalar_t>(in, keys, values, item / Hkv, item % Hkv, probs.data(), row.data());
      }
    });
  });
  return {out.to(q_in.scalar_type()), mass, mass_new};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(h2o_cpu, m) {
  m.def("attend_decode(Tensor q, Tensor k, Tensor v, Tensor valid, Tensor key_cache, Tensor value_cache, "
        "Tensor pos_cache, float scale, Tensor? new_pos, int window, float softcap, Tensor? sink) "
        "-> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(h2o_cpu, CPU, m) { m.impl("attend_decode", &attend_decode); }
