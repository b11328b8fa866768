// Weight-only INT8 linear on CPU: out[m, n] = scale[n] * sum_k x[m, k] * w[n, k], x float32 or
// bfloat16, w int8 [N, K] (one symmetric scale per output channel). Built at first use by
// tokenmill/kernels/cpu_ops.py.
//
// Output channels go 16 at a time: the tile's 16 weight rows are converted once to x's dtype in
// a per-thread buffer (it stays in L1/L2), then every row of x is multiplied by the tile, 16 dot
// products at once, and the 16 sums reduced together with a transpose-add tree. The weights are
// read from memory once per call whatever M is (PyTorch's _weight_int8pack_mm reads them once
// per row of x, which makes batched decode M times slower than one sequence).
// bfloat16: vdpbf16ps (32 products per instruction, float32 sums); int8 -> bfloat16 is exact.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace {

#if defined(__AVX512F__)
inline __m512 int8x16_to_float(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

inline __m512 load_x16(const float* p) { return _mm512_loadu_ps(p); }

inline __m512 load_x16(const at::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

inline void store_out16(float* p, __m512 v, __mmask16 mask) { _mm512_mask_storeu_ps(p, mask, v); }

inline void store_out16(at::BFloat16* p, __m512 v, __mmask16 mask) {
  alignas(64) float tmp[16];
  _mm512_store_ps(tmp, v);
  for (int i = 0; i < 16; ++i)
    if (mask >> i & 1) p[i] = at::BFloat16(tmp[i]);
}

// One tile of rows n0 .. n0 + rows - 1 (rows <= 16); buf: this thread's scratch.
template <typename T>
void tile(const T* x, const int8_t* w, const T* scale, T* out, int64_t M, int64_t K, int64_t N, int64_t n0,
          int rows, std::vector<float>& buf) {
  const __mmask16 live = static_cast<__mmask16>((1u << rows) - 1);
  alignas(64) float sc[16] = {};
  for (int r = 0; r < rows; ++r) sc[r] = static_cast<float>(scale[n0 + r]);
  const __m512 scv = _mm512_load_ps(sc);
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    // weights as bfloat16 pairs: 16 rows x K, zero rows past the end; K % 16 == 0, the last 32-wide
    // chunk may be half full (masked loads)
    buf.resize(16 * K / 2 + 16);
    auto* wb = reinterpret_cast<uint16_t*>(buf.data());
    for (int r = 0; r < 16; ++r)
      for (int64_t k = 0; k < K; k += 16) {
        const __m512 f = r < rows ? int8x16_to_float(w + (n0 + r) * K + k) : _mm512_setzero_ps();
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(wb + r * K + k), (__m256i)_mm512_cvtneps_pbh(f));
      }
    const int64_t full = K / 32 * 32;
    const auto* xb = reinterpret_cast<const uint16_t*>(x);
    for (int64_t m = 0; m < M; ++m) {
      __m512 acc[16];
      for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
      for (int64_t k = 0; k < full; k += 32) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(xb + m * K + k);
        for (int r = 0; r < 16; ++r)
          acc[r] = _mm512_dpbf16_ps(acc[r], xv, (__m512bh)_mm512_loadu_si512(wb + r * K + k));
      }
      if (full < K) {
        const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(0xffff, xb + m * K + full);
        for (int r = 0; r < 16; ++r)
          acc[r] = _mm512_dpbf16_ps(acc[r], xv, (__m512bh)_mm512_maskz_loadu_epi16(0xffff, wb + r * K + full));
      }
      store_out16(out + m * N + n0, _mm512_mul_ps(sum_lanes16(acc), scv), live);
    }
    return;
  }
#endif
  // float32 x (or no AVX512-BF16): weights as float32, FMA
  buf.resize(16 * K);
  float* wf = buf.data();
  for (int r = 0; r < 16; ++r)
    for (int64_t k = 0; k < K; k += 16)
      _mm512_storeu_ps(wf + r * K + k, r < rows ? int8x16_to_float(w + (n0 + r) * K + k) : _mm512_setzero_ps());
  for (int64_t m = 0; m < M; ++m) {
    __m512 acc[16];
    for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
      const __m512 xv = load_x16(x + m * K + k);
      for (int r = 0; r < 16; ++r) acc[r] = _mm512_fmadd_ps(xv, _mm512_loadu_ps(wf + r * K + k), acc[r]);
    }
    store_out16(out + m * N + n0, _mm512_mul_ps(sum_lanes16(acc), scv), live);
  }
}
#endif

// Portable path: one output at a time.
template <typename T>
void portable(const T* x, const int8_t* w, const T* scale, T* out, int64_t M, int64_t K, int64_t N, int64_t n_begin,
              int64_t n_end) {
  for (int64_t n = n_begin; n < n_end; ++n)
    for (int64_t m = 0; m < M; ++m) {
      float s = 0.f;
      for (int64_t k = 0; k < K; ++k) s += static_cast<float>(x[m * K + k]) * static_cast<float>(w[n * K + k]);
      out[m * N + n] = static_cast<T>(s * static_cast<float>(scale[n]));
    }
}

template <typename T>
void run(const T* x, const int8_t* w, const T* scale, T* out, int64_t M, int64_t K, int64_t N, bool generic) {
  const int64_t tiles = (N + 15) / 16;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
#if defined(__AVX512F__)
    if (!generic) {
      std::vector<float> buf;
      for (int64_t t = begin; t < end; ++t) {
        const int rows = static_cast<int>(N - 16 * t < 16 ? N - 16 * t : 16);
        tile<T>(x, w, scale, out, M, K, N, 16 * t, rows, buf);
      }
      return;
    }
#endif
    portable<T>(x, w, scale, out, M, K, N, 16 * begin, std::min(N, 16 * end));
  });
}

}  // namespace

torch::Tensor int8_weight_linear(torch::Tensor x, torch::Tensor weight, torch::Tensor scale, bool generic) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && scale.dim() == 1, "x [M, K], weight [N, K], scale [N]");
  TORCH_CHECK(weight.scalar_type() == torch::kInt8, "weight must be int8");
  TORCH_CHECK(x.scalar_type() == scale.scalar_type() &&
                  (x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16),
              "x and scale must both be float32 or bfloat16");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(weight.size(1) == K && scale.size(0) == N, "shapes do not match");
  TORCH_CHECK(K % 16 == 0, "in_features must be a multiple of 16");
  auto xc = x.contiguous(), wc = weight.contiguous(), sc = scale.contiguous();
  auto out = torch::empty({M, N}, x.options());
  if (x.scalar_type() == torch::kFloat32) {
    run<float>(xc.data_ptr<float>(), wc.data_ptr<int8_t>(), sc.data_ptr<float>(), out.data_ptr<float>(), M, K, N,
               generic);
  } else {
    run<at::BFloat16>(xc.data_ptr<at::BFloat16>(), wc.data_ptr<int8_t>(), sc.data_ptr<at::BFloat16>(),
                      out.data_ptr<at::BFloat16>(), M, K, N, generic);
  }
  return out;
}
