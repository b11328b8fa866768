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
//
// AMX hosts (amx.h): calls of at least 4 rows with K a multiple of 32 run on tiles instead, 32 rows
// x 32 channels a step (fewer rows: tiles of M rows), accumulating over the whole of K in the tiles;
// a row's result is again independent of the other rows of a call of 4 rows or more. Measured on
// such a host, 2 threads, weights hot: 576 -> 3072 at 256 rows 893 GFLOP/s against 122 for the
// vector path and 1,059 for oneDNN.

#include <ATen/Parallel.h>
#include <ATen/ops/constant_pad_nd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "kernels.h"
#include "simd.h"

namespace {

#if defined(__AVX512BF16__)
constexpr bool kFast = true;

// The live channels of the output tile starting at n.
inline __mmask16 out_mask(int64_t n, int64_t N) {
  return static_cast<__mmask16>((1u << std::min<int64_t>(16, N - n)) - 1);
}

// v rounded to bfloat16 into the mask's lanes of dst: Out uint16_t (bfloat16 bits) or float (the
// same rounded values, widened).
template <typename Out>
inline void store_rounded(Out* dst, __mmask16 mask, __m512 v) {
  const __m256i r = (__m256i)_mm512_cvtneps_pbh(v);
  if constexpr (std::is_same_v<Out, float>)
    _mm512_mask_storeu_ps(dst, mask, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(r), 16)));
  else
    _mm256_mask_storeu_epi16(dst, mask, r);
}

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
    const __mmask16 mask = out_mask(n, N);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n) : _mm512_setzero_ps();
    for (int m = 0; m < MB; ++m) store_rounded(out + m * ldo + n, mask, _mm512_add_ps(acc[m][t], b));
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

// Tiles at once for M rows: more for few rows, so that there are enough independent chains.
constexpr int tiles_for(int64_t M) { return M <= 3 ? 8 : M <= 6 ? 4 : 2; }

// run_tiles with NB = tiles_for(M).
template <typename Out>
void run_tiles_for(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, const float* bias, Out* out, int64_t N,
                   int64_t t_begin, int64_t t_end) {
  if (tiles_for(M) == 8) run_tiles<8>(x, M, K, w, bias, out, N, t_begin, t_end);
  else if (tiles_for(M) == 4) run_tiles<4>(x, M, K, w, bias, out, N, t_begin, t_end);
  else run_tiles<2>(x, M, K, w, bias, out, N, t_begin, t_end);
}
#else
constexpr bool kFast = false;
#endif

#if defined(TOKENMILL_AMX)
// AMX: 32 rows x 32 channels at a time (tiles 0-3 accumulate over the whole of K, 4-5 hold two row
// tiles of x, 6-7 two weight tiles read in place from the packed layout). Each thread takes pairs
// of output tiles; rows go in chunks (tokenmill_amx::kChunkRows) that stay in L2 while the
// thread's weight strips pass.

template <typename Out>
void amx_store(const float* c, int live, const float* bias, Out* out, int64_t ldo, int64_t n, int64_t N) {
  if (n >= N) return;
  const __mmask16 mask = out_mask(n, N);
  const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n) : _mm512_setzero_ps();
  for (int r = 0; r < live; ++r) store_rounded(out + r * ldo + n, mask, _mm512_add_ps(_mm512_load_ps(c + 16 * r), b));
}

// Row tiles [b0, b1) times output tiles t0 and (two_n) t0 + 1.
template <typename Out>
void amx_rows(const tokenmill_amx::RowTiles& xs, int64_t b0, int64_t b1, const uint16_t* w, int64_t K, bool two_n,
              const float* bias, Out* out, int64_t N, int64_t t0) {
  tokenmill_amx::rows_2x2(xs, b0, b1, w, two_n ? w + (K / 2) * 32 : nullptr, K,
                          [&](const float* c, int live, int64_t b, int j) {
                            amx_store(c, live, bias, out + 16 * b * N, N, 16 * (t0 + j), N);
                          });
}

template <typename Out>
void amx_linear(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, const float* bias, Out* out, int64_t N) {
  const int64_t tiles = (N + 15) / 16, pairs = (tiles + 1) / 2;
  const tokenmill_amx::RowTiles xs = tokenmill_amx::row_tiles(x, M, K);
  constexpr int64_t chunk = tokenmill_amx::kChunkRows / 16;
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    tokenmill_amx::configure(32, xs.tile_rows());
    for (int64_t b0 = 0; b0 < xs.blocks(); b0 += chunk)
      for (int64_t pr = begin; pr < end; ++pr) {
        const int64_t t0 = 2 * pr;
        amx_rows(xs, b0, std::min(b0 + chunk, xs.blocks()), w + t0 * (K / 2) * 32, K, t0 + 1 < tiles, bias, out, N,
                 t0);
      }
    _tile_release();
  });
}
#endif

}  // namespace

bool bf16_linear_fast() { return kFast; }

#if defined(__AVX512BF16__)
// ldo as run_tiles' N: the columns of a panel end at least 16 before the row does, so its masks are full
void bf16_panel_vector(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t tiles, uint16_t* out,
                       int64_t ldo) {
  run_tiles_for(x, M, K, w, nullptr, out, ldo, 0, tiles);
}
void bf16_panel_vector(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t tiles, float* out,
                       int64_t ldo) {
  run_tiles_for(x, M, K, w, nullptr, out, ldo, 0, tiles);
}
#endif

bool amx_tiles() {
#if defined(TOKENMILL_AMX)
  return tokenmill_amx::usable();
#else
  return false;
#endif
}

int64_t amx_min_rows() {
#if defined(TOKENMILL_AMX)
  return tokenmill_amx::kMinRows;
#else
  return 0;
#endif
}

// weight [N, K] bfloat16, K even -> packed [ceil(N / 16), K / 2, 16, 2] bfloat16.
at::Tensor bf16_pack(at::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "bf16_pack: weight must be bfloat16 [N, K]");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(K % 2 == 0, "bf16_pack: in_features must be even");
  const int64_t tiles = (N + 15) / 16;
  auto padded = at::constant_pad_nd(weight, {0, 0, 0, tiles * 16 - N});
  // [tiles, 16, K/2, 2] -> [tiles, K/2, 16, 2]
  return padded.view({tiles, 16, K / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

// x [M, K] bfloat16, packed from bf16_pack of a [N, K] weight, bias [N] (float32, bfloat16) or empty.
at::Tensor bf16_packed_linear(at::Tensor x, at::Tensor packed, int64_t N, at::Tensor bias,
                                 bool out_float32, KernelPath path) {
  TORCH_CHECK(kFast, "bf16_packed_linear needs AVX-512 BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "bf16_packed_linear: x must be bfloat16 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), tiles = (N + 15) / 16;
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 4 && packed.size(0) == tiles &&
                  packed.size(1) * 2 == K && packed.size(2) == 16 && packed.size(3) == 2 && packed.is_contiguous(),
              "bf16_packed_linear: packed weight does not match x [", M, ", ", K, "] and N ", N);
  auto xc = x.contiguous();
  auto out = at::empty({M, N}, out_float32 ? x.options().dtype(at::kFloat) : x.options());
  at::Tensor bf;
  if (bias.defined() && bias.numel()) {
    TORCH_CHECK(bias.numel() == N, "bf16_packed_linear: bias must be [", N, "]");
    bf = bias.to(at::kFloat).contiguous();
  }
  if (M == 0 || N == 0) return out;
#if defined(__AVX512BF16__)
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
#if defined(TOKENMILL_AMX)
  if (tiles_allowed(path) && M >= tokenmill_amx::kMinRows && K % 32 == 0 && amx_tiles()) {
    if (out_float32) amx_linear(xp, M, K, wp, bp, out.data_ptr<float>(), N);
    else amx_linear(xp, M, K, wp, bp, reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), N);
    return out;
  }
#endif
  at::parallel_for(0, tiles, tiles_for(M), [&](int64_t begin, int64_t end) {
    if (out_float32) run_tiles_for(xp, M, K, wp, bp, out.data_ptr<float>(), N, begin, end);
    else run_tiles_for(xp, M, K, wp, bp, reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), N, begin, end);
  });
#endif
  return out;
}

#ifdef TM_STANDALONE
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("bf16_pack", &bf16_pack);
  m.def("bf16_packed_linear", [](at::Tensor x, at::Tensor packed, int64_t N, at::Tensor bias, bool out_float32,
                                 bool vector) {
    return bf16_packed_linear(x, packed, N, bias, out_float32, vector ? KernelPath::Vector : KernelPath::Fastest);
  });
  m.def("bf16_linear_fast", &bf16_linear_fast);
  m.def("amx_tiles", &amx_tiles);
}
#endif
