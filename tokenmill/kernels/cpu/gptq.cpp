// GPTQ's column loop (tokenmill/quantization/gptq.py, Algorithm 1 of Frantar et al.) over some
// columns of one lazy-update block: each column rounded to its INT4 level, its error divided by the
// Cholesky factor's diagonal and pushed onto the block's later columns. Built at first use by
// tokenmill/kernels/cpu_ops.py.
//
// PyTorch ran this as a handful of tensor operations per column, a Python round trip each: about
// 0.25 ms per column on the hosts we measure, half a minute for SmolLM2-135M, almost all of it
// overhead. The rows are independent (a row's error only moves that row's later weights), so here
// each thread takes whole rows and walks their columns in order, the update one vector loop.

#include <algorithm>
#include <cmath>

#include "kernels.h"

void gptq_columns(at::Tensor w, at::Tensor h, at::Tensor scale, at::Tensor zero, int64_t begin, int64_t end,
                  at::Tensor levels, at::Tensor err) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.device().is_cpu() && w.is_contiguous(),
              "gptq_columns: w must be a contiguous float32 [rows, block] CPU tensor");
  const int64_t N = w.size(0), B = w.size(1);
  TORCH_CHECK(0 <= begin && begin <= end && end <= B, "gptq_columns: need 0 <= begin <= end <= block, got ", begin,
              ", ", end, " for a block of ", B);
  TORCH_CHECK(h.sizes() == at::IntArrayRef({B, B}) && h.scalar_type() == at::kFloat && h.is_contiguous(),
              "gptq_columns: h must be a contiguous float32 [block, block] tensor");
  for (const auto* t : {&scale, &zero})
    TORCH_CHECK(t->sizes() == at::IntArrayRef({N, end - begin}) && t->scalar_type() == at::kFloat && t->is_contiguous(),
                "gptq_columns: scale and zero must be contiguous float32 [rows, end - begin]");
  for (const auto* t : {&levels, &err})
    TORCH_CHECK(t->sizes() == w.sizes() && t->scalar_type() == at::kFloat && t->is_contiguous(),
                "gptq_columns: levels and err must be contiguous float32 of w's shape");
  float* wp = w.data_ptr<float>();
  const float* hp = h.data_ptr<float>();
  const float* sp = scale.data_ptr<float>();
  const float* zp = zero.data_ptr<float>();
  float* lp = levels.data_ptr<float>();
  float* ep = err.data_ptr<float>();
  const int64_t S = end - begin;
  at::parallel_for(0, N, 8, [&](int64_t first, int64_t last) {
    for (int64_t n = first; n < last; ++n) {
      float* row = wp + n * B;
      for (int64_t i = begin; i < end; ++i) {
        const float s = sp[n * S + i - begin], z = zp[n * S + i - begin];
        const float u = std::min(7.0f, std::max(-8.0f, std::nearbyint((row[i] - z) / s)));  // q - 8, as int4_round
        const float e = (row[i] - (u * s + z)) / hp[i * B + i];
        lp[n * B + i] = u;
        ep[n * B + i] = e;
        const float* hr = hp + i * B;
        for (int64_t j = i + 1; j < B; ++j) row[j] -= e * hr[j];
      }
    }
  });
}
