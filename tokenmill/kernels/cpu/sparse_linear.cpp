// bfloat16 linear over a pruned (zero-containing) weight stored without its zeros: the same
// out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) as bf16_packed_linear, bit for bit, for any M.
// Built at first use by tokenmill/kernels/cpu_ops.py.
//
// Layout (sparse_bf16_pack): the dense packed layout of bf16_linear.cpp, [ceil(N / 16), K / 2, 16,
// 2], is a sequence of 32-element vectors (16 output channels times a pair of k). Each vector is
// stored as a 32-bit mask (bit i set where element i is stored) and its stored elements, in order,
// appended to its tile's value stream:
//
//   masks    int32 [tiles, K / 2]      vector (t, p)'s mask
//   values   bfloat16 [nnz + 32]       tile t's stream is values[offsets[t] : offsets[t + 1]], its
//                                      vectors one after the other (the 32 zeros at the end let the
//                                      last vector's 64-byte load stay inside the tensor)
//   offsets  int64 [tiles + 1]         offsets[0] = 0, offsets[tiles] = nnz
//
// An element is stored unless it is +0.0 or -0.0 (magnitude pruning's w *= keep leaves -0.0 where
// w was negative). Expanding -0.0 back as +0.0 changes no output bit: vdpbf16ps adds the exact
// product x * (+-0.0) = +-0.0 to a float32 sum s that starts at +0.0, and s + +-0.0 = s unless s
// is -0.0, which round-to-nearest never makes from +0.0; with x infinite or NaN the product is
// the same NaN either way. (The one way to -0.0 is the flush to zero of a negative denormal
// partial sum, under 1.2e-38 in magnitude: if the rest of that sum were zeros, the dense kernel
// could then end at -0.0 where this one ends at +0.0. Equal values; no real activations do that.)
// At 50% density a weight costs 16 * 0.5 + 1 = 9 bits instead of 16.
//
// Kernel: a vector is one unaligned 64-byte load of its tile's stream, _mm512_maskz_expand_epi16
// with its mask, and the stream pointer advanced by the mask's popcount. The register form of the
// expand: GCC, left alone, folds the load into vpexpandw's memory form, which on this AMD Zen 4
// took 1.67 ns a vector instead of 0.92 (1 row, 576 -> 3072 at 50%, weights hot, one thread) and
// 5.1 instead of 1.4 at 8 rows. The expanded vector
// goes into the very vdpbf16ps of bf16_linear.cpp: one broadcast x pair per row, the p (k pair)
// order of the dense kernel, float32 sums, bias added then rounded once to bfloat16 (out_float32:
// that value widened). So every output equals bf16_packed_linear's on the dense weight whatever
// the register blocking, the batch and the threads are; tests/kernels/test_sparse_linear.py
// checks it bit for bit.
//
// Register blocks and threads as the dense kernel, MB rows times NB tiles (MB * NB <= 24), threads
// splitting the output tiles, each block of rows expanding its tiles' vectors again as it
// multiplies (one expand per 16 x 2 weights per MB rows); except that 1 to 3 rows take 4 tiles at
// once, not the dense kernel's 8. There the expands, not vdpbf16ps's latency, bound the loop, and
// 8 tiles are 16 streams (values and masks) per thread: measured at 1 row, one thread, 576 -> 3072,
// 4 tiles took 39 / 36 us hot and 81 / 78 us cold at density 0.5 / 0.2, 8 tiles 46 / 42 and
// 83 / 141.
//
// Why: batch-1 decode streams every weight from DRAM once per token; 9 bits per weight instead
// of 16 cuts those bytes by 44% at 50% density. What it costs is the expand (and a popcount and
// an add) per vector, which many rows amortize and few rows do not; bench/sparse_linear.py
// measures where that leaves it against the dense kernel.

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "simd.h"

namespace {

constexpr int64_t kVector = 32;  // bfloat16 elements per vector: 16 channels x 2 k
constexpr int64_t kTail = 32;    // zeros after the last stream, for the last vector's full load
// Software prefetch distances, per tile stream. With weights streaming from DRAM the hardware
// prefetcher alone left the kernel latency-bound (each thread walks 16 streams at once, NB tiles'
// values and masks, advancing at uneven rates): measured cold at 1 row, 576 -> 3072 at 50%, it
// moved 10-16 GB/s of the compressed weight where the dense kernel moves 23-28. Each stream is
// consumed at a few bytes per ns, so about 100 ns of DRAM latency is covered by a few hundred
// bytes ahead; 2 KiB of values and 256 B of masks leave a margin, and stay well inside L1 / L2 for
// 8 streams.
constexpr int64_t kPrefetchValues = 1024;  // bfloat16 elements ahead in a tile's value stream
constexpr int64_t kPrefetchMasks = 64;     // masks ahead, one prefetch per 64-byte line (16 masks)

// Whether a bfloat16 element is stored: anything but +0.0 and -0.0.
inline bool stored(uint16_t v) { return (v & 0x7fff) != 0; }

// The 32-bit mask of a vector's stored elements: bit i where element i is stored.
inline uint32_t stored_mask(const uint16_t* v) {
  uint32_t mask = 0;
  for (int i = 0; i < kVector; ++i) mask |= static_cast<uint32_t>(stored(v[i])) << i;
  return mask;
}

#if defined(__AVX512BF16__) && defined(__AVX512VBMI2__)
constexpr bool kFast = true;

// The compressed weight, as the kernel reads it.
struct Sparse {
  const uint16_t* values;
  const uint32_t* masks;
  const int64_t* offsets;
  int64_t K2;
};

// NB consecutive tiles' vectors, in p order, expanded from their streams in registers.
template <int NB>
struct Expanding {
  const uint16_t* stream[NB];
  const uint32_t* mask[NB];

  Expanding(const Sparse& w, int64_t t0) {
    for (int t = 0; t < NB; ++t) stream[t] = w.values + w.offsets[t0 + t], mask[t] = w.masks + (t0 + t) * w.K2;
  }
  __attribute__((always_inline)) inline void next(int64_t p, __m512bh* wv) {
    for (int t = 0; t < NB; ++t) {
      const uint32_t m = mask[t][p];
      __m512i v = _mm512_loadu_si512(stream[t]);
      // keeps the load a load: GCC otherwise folds it into vpexpandw's memory form (slow on Zen 4)
      asm("" : "+v"(v));
      wv[t] = (__m512bh)_mm512_maskz_expand_epi16(m, v);
      _mm_prefetch(reinterpret_cast<const char*>(stream[t] + kPrefetchValues), _MM_HINT_T0);
      if ((p & 15) == 0) _mm_prefetch(reinterpret_cast<const char*>(mask[t] + p + kPrefetchMasks), _MM_HINT_T0);
      stream[t] += _mm_popcnt_u32(m);
    }
  }
};

// bf16_linear.cpp's block with its weight vectors expanded by `src` (taken by value: each row block
// walks the tiles from their start). The multiply and the epilogue are that file's, operation for
// operation: keep them so, the outputs are promised bit-identical to it.
template <int MB, int NB, typename Out>
inline void block(const uint16_t* x, int64_t ldx, Expanding<NB> src, int64_t K2, const float* bias, Out* out, int64_t ldo,
                  int64_t n0, int64_t N) {
  __m512 acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int t = 0; t < NB; ++t) acc[m][t] = _mm512_setzero_ps();
  for (int64_t p = 0; p < K2; ++p) {
    __m512bh wv[NB];
    src.next(p, wv);
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
inline void rows_block(int mb, const uint16_t* x, int64_t ldx, const Expanding<NB>& src, int64_t K2, const float* bias,
                       Out* out, int64_t ldo, int64_t n0, int64_t N) {
  switch (mb) {
#define TM_CASE(R) \
  case R: block<R, NB, Out>(x, ldx, src, K2, bias, out, ldo, n0, N); break;
    TM_CASE(1) TM_CASE(2) TM_CASE(3) TM_CASE(4) TM_CASE(5) TM_CASE(6)
    TM_CASE(7) TM_CASE(8) TM_CASE(9) TM_CASE(10) TM_CASE(11) TM_CASE(12)
#undef TM_CASE
    default: break;
  }
}

// Rows per register block for a given number of tiles at once (MB * NB <= 24), as bf16_linear.cpp.
constexpr int rows_for(int nb) { return nb == 4 ? 6 : 12; }

// Tiles [t0, t0 + NB), all M rows, a register block of rows at a time, each walking the tiles'
// streams from their start (expanding every vector again: measured, that beat expanding a strip
// once into an L2 buffer for the row blocks to read, from 16 to 256 rows, hot and cold).
template <int NB, typename Out>
void tile_group(const Sparse& w, int64_t t0, const uint16_t* x, int64_t M, int64_t K, const float* bias, Out* out,
                int64_t N) {
  constexpr int MB = rows_for(NB);
  for (int64_t m = 0; m < M; m += MB) {
    const int mb = static_cast<int>(std::min<int64_t>(MB, M - m));
    rows_block<NB>(mb, x + m * K, K, Expanding<NB>(w, t0), w.K2, bias, out + m * N, N, 16 * t0, N);
  }
}

// Output tiles [t_begin, t_end) (one thread's share): NB at a time, the rest one by one.
template <int NB, typename Out>
void run_tiles(const Sparse& w, const uint16_t* x, int64_t M, int64_t K, const float* bias, Out* out, int64_t N,
               int64_t t_begin, int64_t t_end) {
  for (int64_t t0 = t_begin; t0 < t_end;) {
    if (t0 + NB <= t_end) {
      tile_group<NB>(w, t0, x, M, K, bias, out, N);
      t0 += NB;
    } else {
      tile_group<1>(w, t0, x, M, K, bias, out, N);
      t0 += 1;
    }
  }
}
#else
constexpr bool kFast = false;
#endif

}  // namespace

bool sparse_linear_fast() { return kFast; }

// weight [N, K] bfloat16, K even -> (values, masks, offsets) as described at the top.
std::tuple<at::Tensor, at::Tensor, at::Tensor> sparse_bf16_pack(at::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16,
              "sparse_bf16_pack: weight must be bfloat16 [N, K]");
  TORCH_CHECK(weight.size(1) % 2 == 0, "sparse_bf16_pack: in_features must be even");
  const auto dense = bf16_pack(weight.detach().cpu());  // [tiles, K2, 16, 2]
  const int64_t tiles = dense.size(0), K2 = dense.size(1);
  const auto* d = reinterpret_cast<const uint16_t*>(dense.data_ptr<at::BFloat16>());
  auto masks = at::empty({tiles, K2}, at::dtype(at::kInt));
  auto* mp = reinterpret_cast<uint32_t*>(masks.data_ptr<int32_t>());
  std::vector<int64_t> counts(tiles, 0);
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t p = 0; p < K2; ++p) {
        const uint32_t m = stored_mask(d + (t * K2 + p) * kVector);
        mp[t * K2 + p] = m;
        counts[t] += __builtin_popcount(m);
      }
  });
  auto offsets = at::empty({tiles + 1}, at::dtype(at::kLong));
  int64_t* op = offsets.data_ptr<int64_t>();
  op[0] = 0;
  for (int64_t t = 0; t < tiles; ++t) op[t + 1] = op[t] + counts[t];
  auto values = at::zeros({op[tiles] + kTail}, at::dtype(at::kBFloat16));
  auto* vp = reinterpret_cast<uint16_t*>(values.data_ptr<at::BFloat16>());
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      uint16_t* o = vp + op[t];
      for (int64_t i = 0; i < K2 * kVector; ++i) {
        const uint16_t v = d[t * K2 * kVector + i];
        if (stored(v)) *o++ = v;
      }
    }
  });
  return {values, masks, offsets};
}

// x [M, K] bfloat16; (values, masks, offsets) from sparse_bf16_pack of an [out_features, K]
// weight; bias [N] (float32, bfloat16) or none.
at::Tensor sparse_bf16_linear(at::Tensor x, at::Tensor values, at::Tensor masks, at::Tensor offsets,
                                 std::optional<at::Tensor> bias, int64_t N, bool out_float32) {
  TORCH_CHECK(kFast, "sparse_bf16_linear needs AVX-512 BF16 and AVX-512 VBMI2, which this build of the CPU kernels "
                     "lacks (sparse_linear_fast() is False): multiply by the dense weight instead");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "sparse_bf16_linear: x must be bfloat16 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), tiles = (N + 15) / 16;
  TORCH_CHECK(masks.scalar_type() == at::kInt && masks.dim() == 2 && masks.size(0) == tiles &&
                  masks.size(1) * 2 == K && masks.is_contiguous(),
              "sparse_bf16_linear: masks do not match x [", M, ", ", K, "] and N ", N);
  TORCH_CHECK(offsets.scalar_type() == at::kLong && offsets.dim() == 1 && offsets.numel() == tiles + 1 &&
                  offsets.is_contiguous(),
              "sparse_bf16_linear: offsets must be int64 [", tiles + 1, "]");
  TORCH_CHECK(values.scalar_type() == at::kBFloat16 && values.dim() == 1 && values.is_contiguous(),
              "sparse_bf16_linear: values must be a contiguous bfloat16 vector");
  const int64_t* op = offsets.data_ptr<int64_t>();
  TORCH_CHECK(op[0] == 0 && op[tiles] + kTail <= values.numel(),
              "sparse_bf16_linear: offsets do not fit values (use sparse_bf16_pack's three tensors together)");
  auto xc = x.contiguous();
  auto out = at::empty({M, N}, out_float32 ? x.options().dtype(at::kFloat) : x.options());
  at::Tensor bf;
  if (bias && bias->defined() && bias->numel()) {
    TORCH_CHECK(bias->numel() == N, "sparse_bf16_linear: bias must be [", N, "]");
    bf = bias->to(at::kFloat).contiguous();
  }
  if (M == 0 || N == 0) return out;
#if defined(__AVX512BF16__) && defined(__AVX512VBMI2__)
  const Sparse w{reinterpret_cast<const uint16_t*>(values.data_ptr<at::BFloat16>()),
                 reinterpret_cast<const uint32_t*>(masks.data_ptr<int32_t>()), op, K / 2};
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  auto go = [&](auto nb_tag) {
    constexpr int NB = decltype(nb_tag)::value;
    at::parallel_for(0, tiles, NB, [&](int64_t begin, int64_t end) {
      if (out_float32) run_tiles<NB>(w, xp, M, K, bp, out.data_ptr<float>(), N, begin, end);
      else run_tiles<NB>(w, xp, M, K, bp, reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), N, begin, end);
    });
  };
  if (M <= 6) {  // 1 to 3 rows too: see "Register blocks" at the top
    go(std::integral_constant<int, 4>());
  } else {
    go(std::integral_constant<int, 2>());
  }
#endif
  return out;
}
