// Weight-only INT4 linear on CPU, group-wise asymmetric weights (tinygemm's convention):
//   w[n, k] = (q[n, k] - 8) * scale[n, g] + zero[n, g],  q in 0..15, g = k / group_size
//   out[m, n] = sum_g scale[n, g] * (sum_{k in g} q[n, k] x[m, k] - 8 sx[m, g]) + zero[n, g] * sx[m, g]
// with sx[m, g] the sum of x over the group. Built at first use by tokenmill/kernels/cpu_ops.py.
//
// Layout (built once by tokenmill.quantization.kernels.int4_cpu_pack): output channels in tiles of
// 16; a tile's weights are Kp / 4 chunks of 32 bytes, chunk c holding k = 4c .. 4c + 3 of the 16
// rows: byte 2r + j has q[r, 4c + j] in its low nibble and q[r, 4c + 2 + j] in its high one. So a
// chunk widened to 32 words gives, after a 16-entry table lookup (vpermw) of each nibble, two
// vectors of bfloat16 pairs, "rows 0..15 x k-pair", which vdpbf16ps multiplies by a broadcast pair
// of x: 16 output channels accumulate side by side with no horizontal reduction. Scales and zeros
// are [tiles, groups, 2, 16], read once per group. q -> bfloat16 is exact and the products are
// summed in float32, so the only rounding beyond float32 sums is x's own: bfloat16 x is used as is;
// float32 x is split into a bfloat16 high part and a bfloat16 low part (two products, about 16
// bits of x kept). Activations are never quantized.
//
// The weights stream from memory once per call; up to 4 rows of x share each unpacked chunk, more
// rows go through the tile again (it stays in L1/L2). A row's result does not depend on the
// other rows of the call nor on the thread count.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "simd.h"

namespace {

inline float bf16_bits_to_float(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline uint16_t float_to_bf16_bits(float f) { return c10::BFloat16(f).x; }

inline float to_float(float v) { return v; }
inline float to_float(at::BFloat16 v) { return static_cast<float>(v); }

// What every tile task reads.
template <typename S>
struct Problem {
  const uint16_t* xh;  // [M, Kp] bfloat16 bits of x (high part for float32 x)
  const uint16_t* xl;  // [M, Kp] low part (float32 x only), else nullptr
  const float* sx;     // [M, G] group sums of x as the products see it (xh + xl)
  const uint8_t* w;    // [N / 16, Kp / 4, 32]
  const S* sz;         // [N / 16, G, 2, 16]
  int64_t M, Kp, N, G, gs;
};

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
constexpr bool kFast = true;

// bfloat16 of 0..15, twice: vpermw reads the low 5 bits of each index word, so a byte's low
// nibble indexes it directly whatever bit 4 is.
inline __m512i nibble_table() {
  alignas(64) uint16_t t[32];
  for (int i = 0; i < 32; ++i) t[i] = float_to_bf16_bits(static_cast<float>(i & 15));
  return _mm512_load_si512(t);
}

// Rows m0 .. m0 + MB - 1 of x times tile t; out [M, 16] float32 for this tile (stride 16).
template <int MB, bool TwoTerms, typename S>
void tile_rows(const Problem<S>& p, int64_t t, int64_t m0, __m512i table, float* out) {
  const uint8_t* wt = p.w + t * (p.Kp / 4) * 32;
  const S* szt = p.sz + t * p.G * 32;
  const uint32_t* xh[MB];
  const uint32_t* xl[MB];
  for (int r = 0; r < MB; ++r) {
    xh[r] = reinterpret_cast<const uint32_t*>(p.xh + (m0 + r) * p.Kp);
    xl[r] = TwoTerms ? reinterpret_cast<const uint32_t*>(p.xl + (m0 + r) * p.Kp) : nullptr;
  }
  __m512 res[MB];
  for (int r = 0; r < MB; ++r) res[r] = _mm512_setzero_ps();
  const int64_t chunks_per_group = p.gs / 4;
  for (int64_t g = 0; g < p.G; ++g) {
    __m512 acc[MB];
    for (int r = 0; r < MB; ++r) acc[r] = _mm512_setzero_ps();
    const int64_t c0 = g * chunks_per_group;
    for (int64_t c = c0; c < c0 + chunks_per_group; ++c) {
      const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wt + c * 32)));
      const __m512bh lo = (__m512bh)_mm512_permutexvar_epi16(v, table);
      const __m512bh hi = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), table);
      for (int r = 0; r < MB; ++r) {
        acc[r] = _mm512_dpbf16_ps(acc[r], lo, (__m512bh)_mm512_set1_epi32(xh[r][2 * c]));
        acc[r] = _mm512_dpbf16_ps(acc[r], hi, (__m512bh)_mm512_set1_epi32(xh[r][2 * c + 1]));
        if constexpr (TwoTerms) {
          acc[r] = _mm512_dpbf16_ps(acc[r], lo, (__m512bh)_mm512_set1_epi32(xl[r][2 * c]));
          acc[r] = _mm512_dpbf16_ps(acc[r], hi, (__m512bh)_mm512_set1_epi32(xl[r][2 * c + 1]));
        }
      }
    }
    const __m512 scale = load16(szt + g * 32), zero = load16(szt + g * 32 + 16);
    for (int r = 0; r < MB; ++r) {
      const __m512 s = _mm512_set1_ps(p.sx[(m0 + r) * p.G + g]);
      res[r] = _mm512_fmadd_ps(scale, _mm512_fnmadd_ps(_mm512_set1_ps(8.f), s, acc[r]), res[r]);
      res[r] = _mm512_fmadd_ps(zero, s, res[r]);
    }
  }
  for (int r = 0; r < MB; ++r) _mm512_storeu_ps(out + (m0 + r) * 16, res[r]);
}

template <bool TwoTerms, typename S>
void tile_fast(const Problem<S>& p, int64_t t, __m512i table, float* out) {
  int64_t m = 0;
  for (; m + 4 <= p.M; m += 4) tile_rows<4, TwoTerms>(p, t, m, table, out);
  switch (p.M - m) {
    case 3: tile_rows<3, TwoTerms>(p, t, m, table, out); break;
    case 2: tile_rows<2, TwoTerms>(p, t, m, table, out); break;
    case 1: tile_rows<1, TwoTerms>(p, t, m, table, out); break;
    default: break;
  }
}
#else
constexpr bool kFast = false;
#endif

// Portable path: the same sums, one product at a time.
template <typename S>
void tile_portable(const Problem<S>& p, int64_t t, float* out) {
  const uint8_t* wt = p.w + t * (p.Kp / 4) * 32;
  const S* szt = p.sz + t * p.G * 32;
  for (int64_t m = 0; m < p.M; ++m)
    for (int r = 0; r < 16; ++r) {
      float res = 0.f;
      for (int64_t g = 0; g < p.G; ++g) {
        float acc = 0.f;
        for (int64_t k = g * p.gs; k < (g + 1) * p.gs; ++k) {
          const int64_t c = k / 4, j = k % 4;
          const uint8_t byte = wt[c * 32 + 2 * r + (j & 1)];
          const int q = j < 2 ? byte & 15 : byte >> 4;
          float xv = bf16_bits_to_float(p.xh[m * p.Kp + k]);
          if (p.xl) xv += bf16_bits_to_float(p.xl[m * p.Kp + k]);
          acc += static_cast<float>(q) * xv;
        }
        const float s = p.sx[m * p.G + g];
        res += to_float(szt[g * 32 + r]) * (acc - 8.f * s) + to_float(szt[g * 32 + 16 + r]) * s;
      }
      out[m * 16 + r] = res;
    }
}

template <typename S, typename T>
void run(const Problem<S>& p, T* y, bool generic) {
  const int64_t tiles = p.N / 16;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> out(p.M * 16);
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
    const __m512i table = nibble_table();
#endif
    for (int64_t t = begin; t < end; ++t) {
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
      if (!generic) {
        if (p.xl) tile_fast<true>(p, t, table, out.data());
        else tile_fast<false>(p, t, table, out.data());
      } else
#endif
        tile_portable(p, t, out.data());
      for (int64_t m = 0; m < p.M; ++m)
        for (int r = 0; r < 16; ++r) y[m * p.N + t * 16 + r] = static_cast<T>(out[m * 16 + r]);
    }
  });
}

template <typename S>
torch::Tensor dispatch_x(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& sz, int64_t gs,
                         bool generic) {
  const int64_t M = x.size(0), Kp = x.size(1), N = packed.size(0) * 16, G = Kp / gs;
  const bool f32 = x.scalar_type() == torch::kFloat32;
  // x as bfloat16 bits (high part, and the low part of float32 x), and its group sums
  auto xh = torch::empty({M, Kp}, x.options().dtype(torch::kInt16));
  auto xl = f32 ? torch::empty({M, Kp}, x.options().dtype(torch::kInt16)) : torch::Tensor();
  auto sx = torch::empty({M, G}, x.options().dtype(torch::kFloat32));
  auto* h = reinterpret_cast<uint16_t*>(xh.data_ptr<int16_t>());
  auto* l = f32 ? reinterpret_cast<uint16_t*>(xl.data_ptr<int16_t>()) : nullptr;
  float* s = sx.data_ptr<float>();
  const float* xf = f32 ? x.data_ptr<float>() : nullptr;
  const uint16_t* xb = f32 ? nullptr : reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      float sum = 0.f;
      for (int64_t k = g * gs; k < (g + 1) * gs; ++k) {
        const int64_t i = m * Kp + k;
        if (f32) {
          const float v = xf[i];
          h[i] = float_to_bf16_bits(v);
          l[i] = float_to_bf16_bits(v - bf16_bits_to_float(h[i]));
          sum += bf16_bits_to_float(h[i]) + bf16_bits_to_float(l[i]);
        } else {
          h[i] = xb[i];
          sum += bf16_bits_to_float(h[i]);
        }
      }
      s[m * G + g] = sum;
    }
  const Problem<S> p{h, l, s, packed.data_ptr<uint8_t>(), sz.data_ptr<S>(), M, Kp, N, G, gs};
  auto y = torch::empty({M, N}, x.options());
  if (f32) run(p, y.data_ptr<float>(), generic);
  else run(p, y.data_ptr<at::BFloat16>(), generic);
  return y;
}

}  // namespace

bool int4_linear_fast() { return kFast; }

torch::Tensor int4_weight_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales_zeros, int64_t group_size,
                                 KernelPath path) {
  const bool generic = is_portable(path);
  TORCH_CHECK(x.dim() == 2, "x must be [M, K]");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16,
              "x must be float32 or bfloat16");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == torch::kUInt8 && packed.size(2) == 32,
              "packed weight must be uint8 [N / 16, K / 4, 32]");
  TORCH_CHECK(group_size > 0 && group_size % 4 == 0, "group_size must be a positive multiple of 4");
  const int64_t Kp = x.size(1);
  TORCH_CHECK(packed.size(1) * 4 == Kp, "x has ", Kp, " columns, the weight ", packed.size(1) * 4);
  TORCH_CHECK(Kp % group_size == 0, "K must be a whole number of groups");
  TORCH_CHECK(scales_zeros.dim() == 4 && scales_zeros.size(0) == packed.size(0) &&
                  scales_zeros.size(1) == Kp / group_size && scales_zeros.size(2) == 2 && scales_zeros.size(3) == 16,
              "scales_zeros must be [N / 16, K / group_size, 2, 16]");
  auto xc = x.contiguous(), pc = packed.contiguous(), sc = scales_zeros.contiguous();
  if (sc.scalar_type() == torch::kFloat32) return dispatch_x<float>(xc, pc, sc, group_size, generic);
  TORCH_CHECK(sc.scalar_type() == torch::kBFloat16, "scales must be float32 or bfloat16");
  return dispatch_x<at::BFloat16>(xc, pc, sc, group_size, generic);
}
