// INT4 range search (tokenmill/quantization/linear.py's int4_search_params): for each group of
// weights, the (scale, zero) of w ~ (q - 8) * scale + zero, q in 0..15, that minimise the group's
// (importance-weighted) squared rounding error among min-max, each range trimmed at either end and
// the least-squares refit of each trimmed range to the levels it rounds to. Built at first use by
// tokenmill/kernels/cpu_ops.py.
//
// The PyTorch form runs some 150 passes over the whole weight (one per candidate and step): about
// 2 M weights/s on the hosts we measure, a minute for SmolLM2-135M. Here a group stays in L1 while
// all its candidates are tried, each in one or two loops the compiler vectorizes.
//
// Same candidates, same order, same tie rule (a candidate replaces the best only when its error is
// strictly lower), parameters compared as rounded to the output dtype; sums are in another order
// than PyTorch's, so a near-tie between two candidates may go the other way.

#include <algorithm>
#include <cmath>
#include <vector>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "kernels.h"

namespace {

// The value as the output dtype stores it: 0 float32, 1 bfloat16, 2 float16.
inline float round_to(float v, int64_t dtype) {
  if (dtype == 1) return static_cast<float>(c10::BFloat16(v));
  if (dtype == 2) return static_cast<float>(c10::Half(v));
  return v;
}

// q - 8 as int4_round rounds it (to nearest even, clamped to -8..7).
inline float level(float w, float scale, float zero) {
  return std::min(7.0f, std::max(-8.0f, std::nearbyint((w - zero) / scale)));
}

template <bool Weighted>
float group_error(const float* w, const float* imp, int64_t g, float scale, float zero) {
  float err = 0.0f;
  for (int64_t j = 0; j < g; ++j) {
    const float d = zero - w[j] + level(w[j], scale, zero) * scale;
    err += Weighted ? d * d * imp[j] : d * d;
  }
  return err;
}

template <bool Weighted>
void search_group(const float* w, const float* imp, int64_t g, const std::vector<float>& trims, int64_t dtype,
                  float* out_scale, float* out_zero) {
  float lo = w[0], hi = w[0], n = Weighted ? 0.0f : static_cast<float>(g), sw = 0.0f;
  for (int64_t j = 0; j < g; ++j) {
    lo = std::min(lo, w[j]);
    hi = std::max(hi, w[j]);
    if (Weighted) n += imp[j];
    sw += Weighted ? imp[j] * w[j] : w[j];
  }
  const float span = hi - lo;
  float best_scale = round_to(std::max(span / 15.0f, 1e-8f), dtype);
  float best_zero = round_to(lo + 8.0f * best_scale, dtype);
  float best_err = group_error<Weighted>(w, imp, g, best_scale, best_zero);
  auto consider = [&](float scale, float zero) {
    scale = round_to(scale, dtype);
    zero = round_to(zero, dtype);
    const float err = group_error<Weighted>(w, imp, g, scale, zero);
    if (err < best_err) best_err = err, best_scale = scale, best_zero = zero;
  };
  for (const float low : trims) {
    for (const float high : trims) {
      const float scale = std::max(span * (1.0f - low - high) / 15.0f, 1e-8f);
      const float zero = lo + low * span + 8.0f * scale;
      float su = 0.0f, suu = 0.0f, suw = 0.0f;  // least squares of w on the levels u
      for (int64_t j = 0; j < g; ++j) {
        const float u = level(w[j], scale, zero);
        const float cu = Weighted ? u * imp[j] : u;
        su += cu;
        suu += cu * u;
        suw += cu * w[j];
      }
      consider(scale, zero);
      const float det = n * suu - su * su;
      if (det > 1e-12f * n * n) {  // at least two distinct levels carry weight
        const float fitted_scale = (n * suw - su * sw) / det;
        if (fitted_scale > 1e-8f) consider(fitted_scale, (sw - fitted_scale * su) / std::max(n, 1e-30f));
      }
    }
  }
  *out_scale = best_scale;
  *out_zero = best_zero;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> int4_range_search(at::Tensor w, std::optional<at::Tensor> importance,
                                                     at::Tensor trims, int64_t dtype) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.device().is_cpu() && w.size(1) > 0,
              "int4_range_search: w must be a float32 [groups, group_size] CPU tensor");
  TORCH_CHECK(dtype >= 0 && dtype <= 2, "int4_range_search: dtype must be 0 (float32), 1 (bfloat16) or 2 (float16)");
  TORCH_CHECK(trims.dim() == 1 && trims.scalar_type() == at::kFloat, "int4_range_search: trims must be float32 [T]");
  const auto wc = w.contiguous();
  at::Tensor ic;
  if (importance) {
    TORCH_CHECK(importance->sizes() == w.sizes() && importance->scalar_type() == at::kFloat,
                "int4_range_search: importance must be float32 of w's shape");
    ic = importance->contiguous();
  }
  const auto tc = trims.contiguous();
  const std::vector<float> trim_list(tc.data_ptr<float>(), tc.data_ptr<float>() + tc.numel());
  const int64_t M = wc.size(0), g = wc.size(1);
  auto scale = at::empty({M}, wc.options());
  auto zero = at::empty({M}, wc.options());
  const float* wp = wc.data_ptr<float>();
  const float* ip = ic.defined() ? ic.data_ptr<float>() : nullptr;
  float* sp = scale.data_ptr<float>();
  float* zp = zero.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      if (ip)
        search_group<true>(wp + r * g, ip + r * g, g, trim_list, dtype, sp + r, zp + r);
      else
        search_group<false>(wp + r * g, nullptr, g, trim_list, dtype, sp + r, zp + r);
    }
  });
  return {scale, zero};
}
