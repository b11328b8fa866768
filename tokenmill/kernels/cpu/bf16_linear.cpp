// bfloat16 linear on CPU over weights packed once for AVX-512 BF16: out[m, n] = sum_k x[m, k] * w[n, k]
// (+ bias[n]), accumulated in float32 and rounded once to bfloat16 (stored as bfloat16, or with
// out_float32 widened back and stored as float32: logits read as float32 without a conversion
// pass). Built at first use by tokenmill/kernels/cpu_ops.py.
//
// Packed layout: [ceil(N / 16), K / 2, 16, 2] bfloat16, element (t, p, j, e) = w[16 t + j, 2 p + e]
// (rows past N are zeros). One 64-byte load gives 16 output channels times a pair of k, which
// vdpbf16ps multiplies by a broadcast pair of x and adds into 16 float32 sums, one per channel:
// no horizontal reduction, and the broadcast comes straight from memory.
//
// Register block: MB rows of x times NB tiles of 16 channels, MB * NB <= 24 accumulators that stay
// in registers over the whole of K (MB up to 12 with NB = 2; few rows take more tiles at once so
// that there are enough independent chains to hide vdpbf16ps's latency). Threads split the
// output tiles; each walks its tiles' packed strip (K * NB * 32 bytes, in L1/L2) once per block of
// rows. Every output is the same float32 sum in the same k order whatever M, the other rows and
// the thread count are, so a row's result does not depend on its batch.
//
// Why: oneDNN's bfloat16 GEMM (what torch.nn.functional.linear runs) is slow at few rows on 2 cores
// of this kind. Measured in one process, 2 threads, weights hot, time per call, oneDNN / this kernel:
// 576 -> 3072 at 1 row 0.099 / 0.024 ms, at 32 rows 0.364 / 0.273 ms, at 2048 rows 18.9 / 18.2 ms;
// the 576 -> 49152 LM head at 1 row 3.36 / 1.28 ms, at 32 rows 7.46 / 5.37 ms. So it serves every
// bfloat16 dense linear on CPU, prefill included, which also makes bfloat16 results independent of
// batch composition.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels.h"
#include "simd.h"

namespace {

#if defined(__AVX512BF16__)
constexpr bool kFast = true;

// Out: uint16_t (bfloat16 bits) or float (the same rounded values, widened).
template <int MB, int NB, typename Out>
inline void block(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t K2, const float* bias, Out* out,
                  int64_t ldo, int64_t n0, int64_t N) {
  __m512 acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int t = 0; t < NB; ++t) acc[m][t] = _mm512_setzero_ps();
  const int64_t tile_stride = K2 * 32;  // uint16 elements per tile
  for (int64_t p = 0; p < K2; ++p) {
    __m512bh wv[NB];
    for (int t = 0; t < NB; ++t) wv[t] = (__m512bh)_mm512_loadu_si512(w + t * tile_stride + p * 32);
    for (int m = 0; m < MB; ++m) {
      int32_t pair;
      std::memcpy(&pair, x + m * ldx + 2 * p, sizeof(pair));
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      for (int t = 0; t < NB; ++t) acc[m][t] = _mm512_dpbf16_ps(acc[m][t], xv, wv[t]);
    }
  }
  for (int t = 0; t < NB; ++t) {
    const int64_t n = n0 + 16 * t;
    if (n >= N) break;
    const int64_t live = std::min<int64_t>(16, N - n);
    const __mmask16 mask = static_cast<__mmask16>((1u << live) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n) : _mm512_setzero_ps();
    for (int m = 0; m < MB; ++m) {
      const __m256i r = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[m][t], b));
      if constexpr (std::is_same_v<Out, float>)
        _mm512_mask_storeu_ps(out + m * ldo + n, mask, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(r), 16)));
      else
        _mm256_mask_storeu_epi16(out + m * ldo + n, mask, r);
    }
  }
}

template <int NB, typename Out>
inline void rows_block(int mb, const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t K2, const float* bias,
                       Out* out, int64_t ldo, int64_t n0, int64_t N) {
  switch (mb) {
#define TM_CASE(R) \
  case R: block<R, NB, Out>(x, ldx, w, K2, bias, out, ldo, n0, N); break;
    TM_CASE(1) TM_CASE(2) TM_CASE(3) TM_CASE(4) TM_CASE(5) TM_CASE(6)
    TM_CASE(7) TM_CASE(8) TM_CASE(9) TM_CASE(10) TM_CASE(11) TM_CASE(12)
#undef TM_CASE
    default: break;
  }
}

// Rows per register block for a given number of tiles at once (MB * NB <= 24).
constexpr int rows_for(int nb) { return nb == 8 ? 3 : nb == 4 ? 6 : 12; }

// Output tiles [t_begin, t_end) (one thread's share): NB at a time, the rest one by one.
template <int NB, typename Out>
void run_tiles(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, const float* bias, Out* out, int64_t N,
               int64_t t_begin, int64_t t_end) {
  const int64_t K2 = K / 2;
  for (int64_t t0 = t_begin; t0 < t_end;) {
    const bool full = t0 + NB <= t_end;
    const uint16_t* wt = w + t0 * K2 * 32;
    for (int64_t m = 0; m < M;) {
      const int mb = static_cast<int>(std::min<int64_t>(full ? rows_for(NB) : 12, M - m));
      if (full) {
        rows_block<NB>(mb, x + m * K, K, wt, K2, bias, out + m * N, N, 16 * t0, N);
      } else {
        rows_block<1>(mb, x + m * K, K, wt, K2, bias, out + m * N, N, 16 * t0, N);
      }
      m += mb;
    }
    t0 += full ? NB : 1;
  }
}
#else
constexpr bool kFast = false;
#endif

}  // namespace

bool bf16_linear_fast() { return kFast; }

// weight [N, K] bfloat16, K even -> packed [ceil(N / 16), K / 2, 16, 2] bfloat16.
torch::Tensor bf16_pack(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kBFloat16, "bf16_pack: weight must be bfloat16 [N, K]");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(K % 2 == 0, "bf16_pack: in_features must be even");
  const int64_t tiles = (N + 15) / 16;
  auto padded = at::constant_pad_nd(weight, {0, 0, 0, tiles * 16 - N});
  // [tiles, 16, K/2, 2] -> [tiles, K/2, 16, 2]
  return padded.view({tiles, 16, K / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

// x [M, K] bfloat16, packed from bf16_pack of a [N, K] weight, bias [N] (float32, bfloat16) or empty.
torch::Tensor bf16_packed_linear(torch::Tensor x, torch::Tensor packed, int64_t N, torch::Tensor bias,
                                 bool out_float32) {
  TORCH_CHECK(kFast, "bf16_packed_linear needs AVX-512 BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16, "bf16_packed_linear: x must be bfloat16 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), tiles = (N + 15) / 16;
  TORCH_CHECK(packed.scalar_type() == torch::kBFloat16 && packed.dim() == 4 && packed.size(0) == tiles &&
                  packed.size(1) * 2 == K && packed.size(2) == 16 && packed.size(3) == 2 && packed.is_contiguous(),
              "bf16_packed_linear: packed weight does not match x [", M, ", ", K, "] and N ", N);
  auto xc = x.contiguous();
  auto out = torch::empty({M, N}, out_float32 ? x.options().dtype(torch::kFloat32) : x.options());
  torch::Tensor bf;
  if (bias.defined() && bias.numel()) {
    TORCH_CHECK(bias.numel() == N, "bf16_packed_linear: bias must be [", N, "]");
    bf = bias.to(torch::kFloat32).contiguous();
  }
  if (M == 0 || N == 0) return out;
#if defined(__AVX512BF16__)
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  auto go = [&](auto nb_tag) {
    constexpr int NB = decltype(nb_tag)::value;
    at::parallel_for(0, tiles, NB, [&](int64_t begin, int64_t end) {
      if (out_float32) run_tiles<NB>(xp, M, K, wp, bp, out.data_ptr<float>(), N, begin, end);
      else run_tiles<NB>(xp, M, K, wp, bp, reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), N, begin, end);
    });
  };
  if (M <= 3) {
    go(std::integral_constant<int, 8>());
  } else if (M <= 6) {
    go(std::integral_constant<int, 4>());
  } else {
    go(std::integral_constant<int, 2>());
  }
#endif
  return out;
}

#ifdef TM_STANDALONE
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("bf16_pack", &bf16_pack);
  m.def("bf16_packed_linear", &bf16_packed_linear);
  m.def("bf16_linear_fast", &bf16_linear_fast);
}
#endif
