// Greedy sampling's argmax over a vocabulary of logits, one row per sequence. Built at first use
// by tokenmill/kernels/cpu_ops.py.
//
// torch.argmax on CPU took 320-500 us for one row of 49,152 float32 logits on the hosts we measure
// (2 vCPUs), 2 ms for four rows: per decode step, more than a layer of SmolLM2-135M, and at 64
// sequences tens of milliseconds. Two vector passes over the row find the same index: its maximum
// (noting any NaN), then the first position holding it.
//
// Semantics are torch.argmax's: the lowest index of the largest value; a NaN counts as larger than
// every number (the first NaN wins); -0.0 and 0.0 are equal (the first of them wins).

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "kernels.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

int64_t row_argmax_portable(const float* x, int64_t V) {
  int64_t best = 0;
  for (int64_t i = 0; i < V; ++i) {
    if (std::isnan(x[i])) return i;
    if (x[i] > x[best]) best = i;
  }
  return best;
}

#if defined(__AVX512F__)
inline __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1);
}

int64_t row_argmax(const float* x, int64_t V) {
  __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __mmask16 nan = 0;
  for (int64_t c = 0; c < V; c += 16) {
    const __mmask16 m = tail_mask(V - c);
    const __m512 v = _mm512_maskz_loadu_ps(m, x + c);
    nan |= _mm512_mask_cmp_ps_mask(m, v, v, _CMP_UNORD_Q);
    mx = _mm512_mask_max_ps(mx, m, mx, v);
  }
  if (nan) {
    for (int64_t i = 0; i < V; ++i)
      if (std::isnan(x[i])) return i;
  }
  const __m512 best = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
  for (int64_t c = 0; c < V; c += 16) {
    const __mmask16 m = tail_mask(V - c);
    const __mmask16 hit = _mm512_mask_cmp_ps_mask(m, _mm512_maskz_loadu_ps(m, x + c), best, _CMP_EQ_OQ);
    if (hit) return c + __builtin_ctz(hit);
  }
  return 0;  // every value -inf: the first
}
#endif

}  // namespace

at::Tensor argmax_rows(at::Tensor x, KernelPath path) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "argmax_rows: x must be a float32 [rows, vocab] CPU tensor");
  TORCH_CHECK(x.size(1) > 0, "argmax_rows: x has no columns");
  const auto xc = x.contiguous();
  const int64_t B = xc.size(0), V = xc.size(1);
  auto out = at::empty({B}, at::dtype(at::kLong));
  const float* xp = xc.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  const bool portable = is_portable(path);
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
#if defined(__AVX512F__)
      o[b] = portable ? row_argmax_portable(xp + b * V, V) : row_argmax(xp + b * V, V);
#else
      (void)portable;
      o[b] = row_argmax_portable(xp + b * V, V);
#endif
    }
  });
  return out;
}
