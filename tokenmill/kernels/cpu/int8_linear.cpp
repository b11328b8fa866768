// Weight-only INT8 linear on CPU: out[m, n] = scale[n] * sum_k x[m, k] * w[n, k], x float32 or
// bfloat16, w int8 [N, K] (one symmetric scale per output channel). Built at first use by
// tokenmill/kernels/cpu_ops.py.
//
// x is converted to float32 once per call. Output channels go 16 at a time; each weight row is
// widened to float32 16 values at a time and multiplied into up to 4 rows of x with 2 to 4
// independent FMA chains, and the tile's 16 partial vectors are reduced together with a
// transpose-add tree. The weights are read from memory once per call whatever M is (PyTorch's
// _weight_int8pack_mm reads them once per row of x). int8 -> float32 is exact and each product
// is one FMA, so the result is the float32 dot product up to summation order; a row's result does
// not depend on the other rows of the call nor on the thread count. (An earlier version converted
// each tile to bfloat16 and used vdpbf16ps: as fast at 32 bfloat16 rows, half as fast at 1.)

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "kernels.h"
#include "simd.h"

namespace {

#if defined(__AVX512F__)
// x rows as float32 (converted once per call): xf [M, K]. Rows of x in blocks of MB, weight rows
// one at a time with CH independent FMA chains, the 16 rows' partial vectors reduced together.
template <int MB, int CH>
inline void rows_block(const float* xf, const int8_t* w, int64_t K, int64_t n0, int rows, int64_t m0,
                       __m512 (*part)[16]) {
  for (int r = 0; r < 16; ++r) {
    if (r >= rows) {
      for (int m = 0; m < MB; ++m) part[m][r] = _mm512_setzero_ps();
      continue;
    }
    const int8_t* wr = w + (n0 + r) * K;
    __m512 acc[MB][CH];
    for (int m = 0; m < MB; ++m)
      for (int c = 0; c < CH; ++c) acc[m][c] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 * CH <= K; k += 16 * CH) {
      for (int c = 0; c < CH; ++c) {
        const __m512 wv = load16(wr + k + 16 * c);
        for (int m = 0; m < MB; ++m)
          acc[m][c] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(xf + (m0 + m) * K + k + 16 * c), acc[m][c]);
      }
    }
    for (; k < K; k += 16) {
      const __m512 wv = load16(wr + k);
      for (int m = 0; m < MB; ++m) acc[m][0] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(xf + (m0 + m) * K + k), acc[m][0]);
    }
    for (int m = 0; m < MB; ++m) {
      __m512 s = acc[m][0];
      for (int c = 1; c < CH; ++c) s = _mm512_add_ps(s, acc[m][c]);
      part[m][r] = s;
    }
  }
}

template <typename T>
void tile(const float* xf, const int8_t* w, const T* scale, T* out, int64_t M, int64_t K, int64_t N, int64_t n0,
          int rows) {
  const __mmask16 live = static_cast<__mmask16>((1u << rows) - 1);
  alignas(64) float sc[16] = {};
  for (int r = 0; r < rows; ++r) sc[r] = static_cast<float>(scale[n0 + r]);
  const __m512 scv = _mm512_load_ps(sc);
  __m512 part[4][16];
  int64_t m = 0;
  auto finish = [&](int mb) {
    for (int i = 0; i < mb; ++i) store16(out + (m + i) * N + n0, _mm512_mul_ps(sum_lanes16(part[i]), scv), live);
  };
  for (; m + 4 <= M; m += 4) { rows_block<4, 2>(xf, w, K, n0, rows, m, part); finish(4); }
  switch (M - m) {
    case 3: rows_block<3, 2>(xf, w, K, n0, rows, m, part); finish(3); break;
    case 2: rows_block<2, 4>(xf, w, K, n0, rows, m, part); finish(2); break;
    case 1: rows_block<1, 4>(xf, w, K, n0, rows, m, part); finish(1); break;
    default: break;
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
void run(const T* x, const float* xf, const int8_t* w, const T* scale, T* out, int64_t M, int64_t K, int64_t N,
         bool generic) {
  const int64_t tiles = (N + 15) / 16;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
#if defined(__AVX512F__)
    if (!generic) {
      for (int64_t t = begin; t < end; ++t) {
        const int rows = static_cast<int>(N - 16 * t < 16 ? N - 16 * t : 16);
        tile<T>(xf, w, scale, out, M, K, N, 16 * t, rows);
      }
      return;
    }
#endif
    portable<T>(x, w, scale, out, M, K, N, 16 * begin, std::min(N, 16 * end));
  });
}

}  // namespace

at::Tensor int8_weight_linear(at::Tensor x, at::Tensor weight, at::Tensor scale, KernelPath path) {
  const bool generic = is_portable(path);
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && scale.dim() == 1, "x [M, K], weight [N, K], scale [N]");
  TORCH_CHECK(weight.scalar_type() == at::kChar, "weight must be int8");
  TORCH_CHECK(x.scalar_type() == scale.scalar_type() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x and scale must both be float32 or bfloat16");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(weight.size(1) == K && scale.size(0) == N, "shapes do not match");
  TORCH_CHECK(K % 16 == 0, "in_features must be a multiple of 16");
  auto xc = x.contiguous(), wc = weight.contiguous(), sc = scale.contiguous();
  auto out = at::empty({M, N}, x.options());
  const auto xf32 = xc.to(at::kFloat).contiguous();  // x as float32 once, for every tile
  const float* xf = xf32.data_ptr<float>();
  if (x.scalar_type() == at::kFloat) {
    run<float>(xc.data_ptr<float>(), xf, wc.data_ptr<int8_t>(), sc.data_ptr<float>(), out.data_ptr<float>(), M, K, N,
               generic);
  } else {
    run<at::BFloat16>(xc.data_ptr<at::BFloat16>(), xf, wc.data_ptr<int8_t>(), sc.data_ptr<at::BFloat16>(),
                      out.data_ptr<at::BFloat16>(), M, K, N, generic);
  }
  return out;
}
