// Greedy sampling's argmax over a vocabulary of logits, one row per sequence. Built at first use
// by tokenmill/kernels/cpu_ops.py.
//
// torch.argmax on CPU took 320-500 us for one row of 49,152 float32 logits on the hosts we measure
// (2 vCPUs), 2 ms for four rows: per decode step, more than a layer of SmolLM2-135M, and at 64
// sequences tens of milliseconds. One vector pass finds the same index: per lane the largest value
// and its first position (any NaN noted, then looked for). A step of fewer sequences than threads
// splits each row among them (Gemma 3's 262k logits at batch 1: 0.14 ms on one core).
//
// Semantics are torch.argmax's: the lowest index of the largest value; a NaN counts as larger than
// every number (the first NaN wins); -0.0 and 0.0 are equal (the first of them wins).

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "kernels.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// The first position of the largest value (or of the first NaN) among x[c0, c1): what each part of
// a row finds; parts combine by value, then by the lower position, and any NaN before any number.
struct Best {
  float value;
  int64_t index;
  bool nan;
};

Best part_portable(const float* x, int64_t c0, int64_t c1) {
  Best b{x[c0], c0, false};
  for (int64_t i = c0; i < c1; ++i) {
    if (std::isnan(x[i])) return {x[i], i, true};
    if (x[i] > b.value) b = {x[i], i, false};
  }
  return b;
}

#if defined(__AVX512F__)
inline __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1);
}

// One pass: per lane and for two interleaved halves (two dependency chains), the largest value and
// where it first is (a strictly larger value moves it: the first of equals stays); then the lanes
// combined. -inf everywhere: each lane keeps its first position.
Best part_vector(const float* x, int64_t c0, int64_t c1) {
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  __m512 mx[2] = {ninf, ninf};
  __m512i at[2] = {_mm512_add_epi32(lane, _mm512_set1_epi32(0)), _mm512_add_epi32(lane, _mm512_set1_epi32(16))};
  __mmask16 nan = 0;
  const int64_t n = c1 - c0;
  int64_t c = 0;
  for (; c + 32 <= n; c += 32) {
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m512 v = _mm512_loadu_ps(x + c0 + c + 16 * h);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      const __mmask16 gt = _mm512_cmp_ps_mask(v, mx[h], _CMP_GT_OQ);
      mx[h] = _mm512_mask_mov_ps(mx[h], gt, v);
      at[h] = _mm512_mask_mov_epi32(at[h], gt, _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(c + 16 * h))));
    }
  }
  for (; c < n; c += 16) {
    const __mmask16 m = tail_mask(n - c);
    const __m512 v = _mm512_maskz_loadu_ps(m, x + c0 + c);
    nan |= _mm512_mask_cmp_ps_mask(m, v, v, _CMP_UNORD_Q);
    const __mmask16 gt = _mm512_mask_cmp_ps_mask(m, v, mx[0], _CMP_GT_OQ);
    mx[0] = _mm512_mask_mov_ps(mx[0], gt, v);
    at[0] = _mm512_mask_mov_epi32(at[0], gt, _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(c))));
  }
  if (nan) {
    for (int64_t i = c0; i < c1; ++i)
      if (std::isnan(x[i])) return {x[i], i, true};
  }
  alignas(64) float v[32];
  alignas(64) int32_t i[32];
  _mm512_store_ps(v, mx[0]), _mm512_store_ps(v + 16, mx[1]);
  _mm512_store_si512(i, at[0]), _mm512_store_si512(i + 16, at[1]);
  // lanes past n (a short part) still hold -inf and a position past its end: not taken unless
  // every value is -inf, when the first position is the answer
  Best b{-std::numeric_limits<float>::infinity(), c0, false};
  for (int k = 0; k < 32; ++k)
    if (i[k] < n && (v[k] > b.value || (v[k] == b.value && c0 + i[k] < b.index))) b = {v[k], c0 + i[k], false};
  return b;
}
#endif

// Parts in order: the first NaN, else the largest value's first position.
Best combine(Best a, Best b) {
  if (a.nan || b.nan) return a.nan ? a : b;
  return b.value > a.value ? b : a;
}

}  // namespace

at::Tensor argmax_rows(at::Tensor x, KernelPath path) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "argmax_rows: x must be a float32 [rows, vocab] CPU tensor");
  TORCH_CHECK(x.size(1) > 0, "argmax_rows: x has no columns");
  const auto xc = x.contiguous();
  const int64_t B = xc.size(0), V = xc.size(1);
  auto out = at::empty({B}, at::dtype(at::kLong));
  if (B == 0) return out;
  const float* xp = xc.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  const bool portable = is_portable(path);
  // fewer rows than threads: each row in as many parts (of at least 4096 values) as there are
  // threads for it, so that one sequence's 262k logits do not wait on one core
  const int64_t threads = at::get_num_threads();
  const int64_t parts = B >= threads ? 1 : std::max<int64_t>(1, std::min((threads + B - 1) / B, V / 4096));
  const int64_t span = (V + parts - 1) / parts;
  std::vector<Best> found(static_cast<size_t>(B * parts));
  at::parallel_for(0, B * parts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const int64_t b = j / parts, c0 = (j % parts) * span, c1 = std::min(V, c0 + span);
#if defined(__AVX512F__)
      found[j] = portable ? part_portable(xp + b * V, c0, c1) : part_vector(xp + b * V, c0, c1);
#else
      (void)portable;
      found[j] = part_portable(xp + b * V, c0, c1);
#endif
    }
  });
  for (int64_t b = 0; b < B; ++b) {
    Best best = found[b * parts];
    for (int64_t j = 1; j < parts; ++j) best = combine(best, found[b * parts + j]);
    o[b] = best.index;
  }
  return out;
}
