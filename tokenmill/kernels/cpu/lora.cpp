// Batched multi-LoRA on CPU (Punica's BGMV / SGMV): every token of a batch gets the low-rank update
// of its own adapter slot, added in place to the output of a (fused) projection. Built at first use
// by tokenmill/kernels/cpu_ops.py.
//
//   y[t, :] += expand(shrink(x[t, :]))       for every token t with slots[t] >= 0 (others untouched)
//   shrink:  h[p, r] = sum_k x[t, k] * A[s, p, r, k]          s = slots[t]
//   expand:  y[t, o] = y[t, o] + sum_r B[s, o, r] * h[part(o), r]
//
// x [T, K], y [T, N] (rows may be strided: a column slice of a wider tensor), A [S, P, R, K],
// B [S, N, R], part_starts [P + 1]: the projection's outputs are P parts (q | k | v, gate | up, or
// one), part p owning rows part_starts[p] .. part_starts[p + 1] - 1 of B and its own A[s, p]. The
// LoRA scaling is the caller's, folded into B. h stays float32 (never rounded to the model dtype),
// the expand accumulates in float32 and y is rounded once: y = dtype(float(y) + delta).
//
// int8 weights (half the bytes a decode step reads): A and B int8 with float32 scales per row,
// A[s, p, r, k] = A_q * A_scale[s, p, r] and B[s, o, r] = B_q * B_scale[s, o]:
//   h[p, r] = A_scale[s, p, r] * (sum_k x[t, k] * float(A_q[s, p, r, k]))
//   delta[o] = B_scale[s, o] * (sum_r float(B_q[s, o, r]) * h[part(o), r])
// the sums in float32, in the same orders as with float weights (int8 -> float32 is exact), each
// scale applied once to a finished sum.
//
// Fastest path (AVX-512): tokens are grouped by slot (a counting sort) and cut into chunks of up
// to kChunk tokens of one slot, so that a slot's A and B are read once per chunk, not per token.
//  - shrink: A[s] as [P * R, K]; MT tokens times RG rows of A (MT * RG <= 16 accumulators), one
//    16-wide FMA chain per (token, row) over k (bfloat16 with AVX-512 BF16: vdpbf16ps, 32 k per
//    step, products exact, sums float32), then the 16 chains' lanes summed together (sum_lanes16).
//    int8 A: 16 k a step widened to float32 (vpmovsxbd, vcvtdq2ps), FMA chains whatever x's dtype.
//  - expand: per token and output, acc = 0, then acc = fma(h[r], B[o, r], acc) for r = 0 .. R - 1
//    (16 outputs a vector: no horizontal sums), then y = dtype(float(y) + acc). B's rows [o][r] are
//    transposed 16 x 16 at a time (bfloat16: 24 two-source permutes of pairs of r, then widened;
//    float32: 64 shuffles; int8: 8 two-source permutes of groups of 4 r, then each byte moved to
//    the top of its 32 bits and converted, B * 2^24 exactly, the 2^-24 undone on the sum). A
//    chunk of up to kFewTokens tokens (decode: a few tokens a slot) uses each transposed block
//    from registers at once; a longer one (prefill) transposes its range of outputs once into an
//    L1 buffer and runs tiles of 4 tokens x 64 outputs over it.
// Each (token, row) and (token, output) is computed by one fixed sequence of operations whatever
// the tile or path it goes through, the other tokens of the batch and the thread that runs it: a
// token's result is bit-identical alone or in any batch (batch invariance).
//
// Threads: calls under kSerialMacs multiply-adds run on the calling thread; others open one
// parallel region. Its work items, shrink items (chunk, rows of A) and expand items (chunk, range
// of outputs), about kItemMacs multiply-adds each, are split into one contiguous share per thread
// (by cost: multiply-adds and bytes), so that each thread sweeps its own stretch of A, then of B,
// in address order. A thread runs its share's shrink items, then takes what is left of the other
// shares' (an atomic counter each), then does the same with expand items. An expand item waits
// (rarely) until its chunk's shrink items are done, which cannot deadlock since a thread takes an
// expand item only once every shrink item has been taken, by a running thread.
//
// Memory: at decode (a few tokens a slot) the kernel streams its slots' weights, often cold (a
// model's layers' adapters do not stay in cache from one step to the next), in runs of a few KiB
// to tens of KiB: too short for the hardware prefetchers. Every loop over weights prefetches
// ahead of itself in software (the shrink the next tile's rows, the expand kExpandAhead bytes of
// B further, a thread's first items at its start), which with the address-order shares means
// prefetching the thread's own next item.
//
// Portable path: per token, plain loops in the same order of operations (k, then r).

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "simd.h"

namespace {

constexpr int64_t kChunk = 128;           // tokens of one slot per chunk, at most
constexpr int64_t kShrinkRows = 16;       // rows of A[s] ([P * R, K]) per shrink item: a multiple of this
constexpr int64_t kFewTokens = 4;         // chunks of up to this many tokens: B transposed in registers
constexpr int64_t kPanel = 64;            // outputs per panel of the expand of more tokens
constexpr int64_t kBtFloats = 8192;       // a transposed B range (more tokens), at most (32 KiB)
constexpr int64_t kItemMacs = 32768;      // multiply-adds per work item of a few tokens, about
constexpr int64_t kMaxExpandOut = 1024;   // outputs per expand item, at most
constexpr int64_t kSerialMacs = 1 << 17;  // below this many multiply-adds a call runs on one thread
constexpr int kSpins = 512;               // pauses before a waiting thread yields its core

// T: x's and y's dtype; W: the weights' (T, or int8 with scales).
template <typename T, typename W>
struct Problem {
  const T* x;
  int64_t xs;  // x's row stride
  T* y;
  int64_t ys;  // y's row stride
  const W* A;
  const W* B;
  const float* A_scale;  // int8 W: [S, P * R]; else null
  const float* B_scale;  // int8 W: [S, N]; else null
  const int64_t* starts;  // part_starts [P + 1]
  int64_t K, N, P, R, PR;
};

template <typename W>
constexpr bool kInt8 = std::is_same_v<W, int8_t>;

inline float to_f(float v) { return v; }
inline float to_f(at::BFloat16 v) { return static_cast<float>(v); }
inline float to_f(int8_t v) { return static_cast<float>(v); }

// ---------------------------------------------------------------------------------------------
// Portable path: one token at a time; h in float32, k in order, then r in order (int8: each sum
// times its row's scale).
template <typename T, typename W>
void token_portable(const Problem<T, W>& p, int64_t t, int64_t s, float* h) {
  const T* xr = p.x + t * p.xs;
  const W* As = p.A + s * p.PR * p.K;
  for (int64_t row = 0; row < p.PR; ++row) {
    const W* ar = As + row * p.K;
    float acc = 0.f;
    for (int64_t k = 0; k < p.K; ++k) acc += to_f(xr[k]) * to_f(ar[k]);
    if constexpr (kInt8<W>) acc *= p.A_scale[s * p.PR + row];
    h[row] = acc;
  }
  const W* Bs = p.B + s * p.N * p.R;
  T* yr = p.y + t * p.ys;
  for (int64_t part = 0; part < p.P; ++part) {
    const float* hp = h + part * p.R;
    for (int64_t o = p.starts[part]; o < p.starts[part + 1]; ++o) {
      const W* br = Bs + o * p.R;
      float d = 0.f;
      for (int64_t r = 0; r < p.R; ++r) d += to_f(br[r]) * hp[r];
      if constexpr (kInt8<W>) d *= p.B_scale[s * p.N + o];
      yr[o] = static_cast<T>(to_f(yr[o]) + d);
    }
  }
}

template <typename T, typename W>
void run_portable(const Problem<T, W>& p, const int32_t* slots, int64_t T_) {
  const int64_t per_token = p.PR * p.K + p.N * p.R;
  at::parallel_for(0, T_, std::max<int64_t>(1, kSerialMacs / std::max<int64_t>(per_token, 1)),
                   [&](int64_t begin, int64_t end) {
                     std::vector<float> h(p.PR);
                     for (int64_t t = begin; t < end; ++t)
                       if (slots[t] >= 0) token_portable(p, t, slots[t], h.data());
                   });
}

#if defined(__AVX512F__)
// ---------------------------------------------------------------------------------------------
// Fastest path.

inline __mmask16 lanes(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
}

// Keeps v in a register: the compiler would otherwise fold its load into each FMA that uses it,
// one load per use instead of one.
template <typename V>
inline void in_register(V& v) {
  asm("" : "+v"(v));
}

// 16 weights or x values widened to float32 (int8: exact), all or the lanes of a mask (others 0).
template <typename W>
inline __m512 widen16(const W* p) {
  return load16(p);
}
template <typename W>
inline __m512 widen16(const W* p, __mmask16 m) {
  if constexpr (kInt8<W>) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, p)));
  } else {
    return load16(p, m);
  }
}

// Software prefetch (see "Memory" above): the shrink the next tile's rows (the same offsets, RG
// rows further), the expand kExpandAhead bytes further in B (and the matching B_scale line); past
// an item's end that is the next item of the same thread (see run_fast).
constexpr int64_t kExpandAhead = 2048;  // bytes of B
constexpr int64_t kStartAhead = 4096;   // bytes of a thread's first shrink and first expand item

inline void prefetch_line(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }

// Every line of [p, p + bytes).
inline void prefetch_span(const void* p, int64_t bytes) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  for (uintptr_t line = a & ~uintptr_t{63}; line < a + static_cast<uintptr_t>(bytes); line += 64)
    prefetch_line(reinterpret_cast<const void*>(line));
}

// B's rows [o + kExpandAhead / row bytes, + 16), as the expand starts on outputs [o, o + 16) of
// bs = B[s] (bscale = B_scale[s] with int8 weights, else unused).
template <typename W>
inline void prefetch_b_ahead(const W* bs, const float* bscale, int64_t R, int64_t o) {
  const int64_t row_bytes = R * static_cast<int64_t>(sizeof(W));
  const char* q = reinterpret_cast<const char*>(bs + o * R) + kExpandAhead;
  for (int64_t l = 0; l < 16 * row_bytes; l += 64) prefetch_line(q + l);
  if constexpr (kInt8<W>) {
    if (bscale != nullptr) prefetch_line(bscale + o + kExpandAhead / row_bytes);
  }
}

// y[m][0 .. 15] = dtype(float(y) + d[m]) for MT rows of y, the first live lanes. Every row is
// loaded before any is stored: the rows of y are often a multiple of 4 KiB apart, and a load
// issued after a store to the same address bits waits for that store.
inline void store_full(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store_full(at::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits16(v)));
}

template <int MT, typename T>
inline void add_rows(T* const* yp, int64_t off, const __m512 (&d)[MT], int64_t live) {
  __m512 v[MT];
  if (live >= 16) {
    for (int m = 0; m < MT; ++m) v[m] = load16(yp[m] + off);
    for (int m = 0; m < MT; ++m) store_full(yp[m] + off, _mm512_add_ps(v[m], d[m]));
  } else {
    const __mmask16 mk = lanes(live);
    for (int m = 0; m < MT; ++m) v[m] = load16(yp[m] + off, mk);
    for (int m = 0; m < MT; ++m) store16(yp[m] + off, _mm512_add_ps(v[m], d[m]), mk);
  }
}

// Shrink, MT tokens x RG rows: acc[m][g] = the 16 lane sums of x[m] * a[g] over k, 16 k a step
// (values widened to float32 on load, one FMA each).
template <int MT, int RG, typename T, typename W>
inline void shrink_fma(const T* const* xp, const W* const* ap, int64_t K, __m512 (&acc)[MT][RG], int64_t ahead) {
  for (int m = 0; m < MT; ++m)
    for (int g = 0; g < RG; ++g) acc[m][g] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    if ((k * sizeof(W)) % 64 == 0)
      for (int g = 0; g < RG; ++g) prefetch_line(reinterpret_cast<const char*>(ap[g] + k) + ahead);
    __m512 xv[MT];
    for (int m = 0; m < MT; ++m) {
      xv[m] = widen16(xp[m] + k);
      in_register(xv[m]);
    }
    for (int g = 0; g < RG; ++g) {
      __m512 av = widen16(ap[g] + k);
      in_register(av);
      for (int m = 0; m < MT; ++m) acc[m][g] = _mm512_fmadd_ps(av, xv[m], acc[m][g]);
    }
  }
  if (k < K) {
    const __mmask16 mk = lanes(K - k);
    __m512 xv[MT];
    for (int m = 0; m < MT; ++m) xv[m] = widen16(xp[m] + k, mk);
    for (int g = 0; g < RG; ++g) {
      const __m512 av = widen16(ap[g] + k, mk);
      for (int m = 0; m < MT; ++m) acc[m][g] = _mm512_fmadd_ps(av, xv[m], acc[m][g]);
    }
  }
}

#if defined(__AVX512BF16__)
// The same for bfloat16 with vdpbf16ps: 32 k a step, each lane adding the exact products of a pair.
template <int MT, int RG>
inline void shrink_dp(const at::BFloat16* const* xp, const at::BFloat16* const* ap, int64_t K,
                      __m512 (&acc)[MT][RG], int64_t ahead) {
  for (int m = 0; m < MT; ++m)
    for (int g = 0; g < RG; ++g) acc[m][g] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    for (int g = 0; g < RG; ++g) prefetch_line(reinterpret_cast<const char*>(ap[g] + k) + ahead);
    __m512bh xv[MT];
    for (int m = 0; m < MT; ++m) {
      xv[m] = (__m512bh)_mm512_loadu_si512(xp[m] + k);
      in_register(xv[m]);
    }
    for (int g = 0; g < RG; ++g) {
      __m512bh av = (__m512bh)_mm512_loadu_si512(ap[g] + k);
      in_register(av);
      for (int m = 0; m < MT; ++m) acc[m][g] = _mm512_dpbf16_ps(acc[m][g], av, xv[m]);
    }
  }
  if (k < K) {
    const __mmask32 mk = _cvtu32_mask32(static_cast<uint32_t>((uint64_t{1} << (K - k)) - 1));
    __m512bh xv[MT];
    for (int m = 0; m < MT; ++m) xv[m] = (__m512bh)_mm512_maskz_loadu_epi16(mk, xp[m] + k);
    for (int g = 0; g < RG; ++g) {
      const __m512bh av = (__m512bh)_mm512_maskz_loadu_epi16(mk, ap[g] + k);
      for (int m = 0; m < MT; ++m) acc[m][g] = _mm512_dpbf16_ps(acc[m][g], av, xv[m]);
    }
  }
}
#endif

// h[m][row0 .. row0 + RG - 1] (the rows below row_end) of MT tokens, x rows xp, as = A[s] as
// [P * R, K] (rows past row_end repeat the last one; their sums are dropped); int8: each sum times
// its row's scale, scale = A_scale[s].
template <int MT, int RG, typename T, typename W>
inline void shrink_tile(const T* const* xp, const W* as, const float* scale, int64_t K, int64_t row0,
                        int64_t row_end, float* const* hp) {
  const W* ap[RG];
  for (int g = 0; g < RG; ++g) ap[g] = as + std::min<int64_t>(row0 + g, row_end - 1) * K;
  const int64_t ahead = RG * K * static_cast<int64_t>(sizeof(W));  // the next tile's rows
  __m512 acc[MT][RG];
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, at::BFloat16> && std::is_same_v<W, T>) {
    shrink_dp<MT, RG>(xp, ap, K, acc, ahead);
  } else {
    shrink_fma<MT, RG, T, W>(xp, ap, K, acc, ahead);
  }
#else
  shrink_fma<MT, RG, T, W>(xp, ap, K, acc, ahead);
#endif
  __m512 v[16];
  for (int i = 0; i < 16; ++i) v[i] = _mm512_setzero_ps();
  for (int m = 0; m < MT; ++m)
    for (int g = 0; g < RG; ++g) v[m * RG + g] = acc[m][g];
  alignas(64) float sums[16];
  _mm512_store_ps(sums, sum_lanes16(v));
  const int rows = static_cast<int>(std::min<int64_t>(RG, row_end - row0));
  for (int m = 0; m < MT; ++m)
    for (int g = 0; g < rows; ++g) {
      if constexpr (kInt8<W>) {
        hp[m][row0 + g] = sums[m * RG + g] * scale[row0 + g];
      } else {
        hp[m][row0 + g] = sums[m * RG + g];
      }
    }
}

// 16 x 16 float32 transpose in registers: v[i] lane j -> v[j] lane i.
__attribute__((always_inline)) inline void transpose16(__m512 (&v)[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]);
  }
  __m512 u[16];
  for (int q = 0; q < 4; ++q) {
    const __m512d a = _mm512_castps_pd(t[4 * q]), b = _mm512_castps_pd(t[4 * q + 1]);
    const __m512d c = _mm512_castps_pd(t[4 * q + 2]), d = _mm512_castps_pd(t[4 * q + 3]);
    u[4 * q + 0] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    u[4 * q + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    u[4 * q + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    u[4 * q + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  // u[4q + j] lane-block L = rows 4q .. 4q + 3 at column 4L + j
  for (int j = 0; j < 4; ++j) {
    const __m512 w0 = _mm512_shuffle_f32x4(u[j], u[4 + j], 0x44), w1 = _mm512_shuffle_f32x4(u[j], u[4 + j], 0xEE);
    const __m512 w2 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0x44);
    const __m512 w3 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0xEE);
    v[j] = _mm512_shuffle_f32x4(w0, w2, 0x88);
    v[4 + j] = _mm512_shuffle_f32x4(w0, w2, 0xDD);
    v[8 + j] = _mm512_shuffle_f32x4(w1, w3, 0x88);
    v[12 + j] = _mm512_shuffle_f32x4(w1, w3, 0xDD);
  }
}

// Transposed blocks of B: bt[j] (j < rc) = float32 of B[s, o + i, r0 + j] in lane i, for the
// live <= 16 rows i of b = &B[s, o, 0] (lanes past live zero; rows past live are not read).
__attribute__((always_inline)) inline void block_t(const float* b, int64_t R, int64_t r0, int64_t rc, int64_t live,
                                                   __m512 (&bt)[16]) {
  const __mmask16 cm = lanes(rc);
  for (int64_t i = 0; i < 16; ++i) bt[i] = i < live ? load16(b + i * R + r0, cm) : _mm512_setzero_ps();
  transpose16(bt);
}

// bfloat16: the 16 x 16 block as 16 x 8 pairs of r (32 bits each), 2 rows a register, transposed
// by three levels of two-source permutes (24 at most instead of 64 shuffles), each pair then
// widened in place: r even = pair << 16, r odd = pair & 0xffff0000.
alignas(64) constexpr int32_t kPairIdx[3][2][16] = {
    {{0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27},
     {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31}},
    {{0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29},
     {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31}},
    {{0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30},
     {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31}}};

__attribute__((always_inline)) inline void block_t(const at::BFloat16* b, int64_t R, int64_t r0, int64_t rc,
                                                   int64_t live, __m512 (&bt)[16]) {
  const auto* q = reinterpret_cast<const uint16_t*>(b) + r0;
  // X[i]: rows 2i (lanes 0-7) and 2i + 1 (lanes 8-15), pair c of a row in lane c.
  __m512i X[8];
  if (R == 16 && live == 16) {
    for (int i = 0; i < 8; ++i) X[i] = _mm512_loadu_si512(q + 32 * i);
  } else {
    const __mmask16 cm = lanes(rc);
    for (int i = 0; i < 8; ++i) {
      const __m256i lo = 2 * i < live ? _mm256_maskz_loadu_epi16(cm, q + 2 * i * R) : _mm256_setzero_si256();
      const __m256i hi =
          2 * i + 1 < live ? _mm256_maskz_loadu_epi16(cm, q + (2 * i + 1) * R) : _mm256_setzero_si256();
      X[i] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    }
  }
  const int nd = static_cast<int>((rc + 1) / 2);  // pairs needed
  __m512i idx[3][2];
  for (int l = 0; l < 3; ++l)
    for (int e = 0; e < 2; ++e) idx[l][e] = _mm512_load_si512(kPairIdx[l][e]);
  const __m512i hi_half = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  // Y[a][c]: rows 4a .. 4a + 3, pairs 4c .. 4c + 3. Z[h][c][d]: rows 8h .. 8h + 7, pairs 4c + 2d, + 1.
  __m512i Y[4][2], Z[2][2][2];
  for (int c = 0; c < 2; ++c) {
    if (4 * c >= nd) break;
    for (int a = 0; a < 4; ++a) Y[a][c] = _mm512_permutex2var_epi32(X[2 * a], idx[0][c], X[2 * a + 1]);
    for (int d = 0; d < 2; ++d) {
      if (4 * c + 2 * d >= nd) break;
      for (int h = 0; h < 2; ++h) Z[h][c][d] = _mm512_permutex2var_epi32(Y[2 * h][c], idx[1][d], Y[2 * h + 1][c]);
      for (int e = 0; e < 2; ++e) {
        const int j = 4 * c + 2 * d + e;
        if (j >= nd) break;
        const __m512i D = _mm512_permutex2var_epi32(Z[0][c][d], idx[2][e], Z[1][c][d]);
        bt[2 * j] = _mm512_castsi512_ps(_mm512_slli_epi32(D, 16));
        bt[2 * j + 1] = _mm512_castsi512_ps(_mm512_and_si512(D, hi_half));
      }
    }
  }
}

// int8: the 16 x 16 block as 16 rows x 4 groups of 4 r (32 bits each), 4 rows a register,
// transposed by 8 two-source permutes into T[c] (lane i: group c of row i), then byte j of each
// lane moved to its top byte with the others zero and converted: bt[4c + j] = B[s, o + i, 4c + j]
// * 2^24 in lane i, exactly (the caller multiplies the finished sum by 2^-24, exactly: the sums
// are those of the unscaled values times 2^24, same roundings).
constexpr float kInt8Unscale = 1.f / 16777216.f;  // 2^-24

alignas(64) constexpr int32_t kGroupIdx[2][16] = {
    // rows 0-7 of two registers of 4 rows, group 2e (lanes 0-7) then 2e + 1 (lanes 8-15)
    {0, 4, 8, 12, 16, 20, 24, 28, 1, 5, 9, 13, 17, 21, 25, 29},
    {2, 6, 10, 14, 18, 22, 26, 30, 3, 7, 11, 15, 19, 23, 27, 31}};

// vpshufb indices, byte j (0 .. 2) of each 32-bit lane to its top byte, the others zero.
struct TopByteIdx {
  alignas(64) int8_t v[3][64];
  constexpr TopByteIdx() : v() {
    for (int j = 0; j < 3; ++j)
      for (int b = 0; b < 64; ++b) v[j][b] = b % 4 == 3 ? static_cast<int8_t>(b % 16 - 3 + j) : int8_t{-128};
  }
};
constexpr TopByteIdx kTopByte{};

__attribute__((always_inline)) inline void block_t(const int8_t* b, int64_t R, int64_t r0, int64_t rc, int64_t live,
                                                   __m512 (&bt)[16]) {
  // X[q]: rows 4q .. 4q + 3, 16 bytes (r0 .. r0 + 15) each.
  __m512i X[4];
  if (R == 16 && live == 16) {
    for (int q = 0; q < 4; ++q) X[q] = _mm512_loadu_si512(b + 64 * q);
  } else {
    const __mmask16 cm = lanes(rc);
    for (int q = 0; q < 4; ++q) {
      __m128i row[4];
      for (int i = 0; i < 4; ++i)
        row[i] = 4 * q + i < live ? _mm_maskz_loadu_epi8(cm, b + (4 * q + i) * R + r0) : _mm_setzero_si128();
      X[q] = _mm512_inserti32x4(
          _mm512_inserti32x4(_mm512_inserti32x4(_mm512_castsi128_si512(row[0]), row[1], 1), row[2], 2), row[3], 3);
    }
  }
  const int ng = static_cast<int>((rc + 3) / 4);  // groups needed
  const __m512i top = _mm512_set1_epi32(static_cast<int32_t>(0xFF000000u));
  __m512i L[2][2];  // L[a][e]: rows 8a .. 8a + 7, groups 2e (lanes 0-7) and 2e + 1 (lanes 8-15)
  for (int e = 0; e < 2; ++e) {
    if (2 * e >= ng) break;
    const __m512i idx = _mm512_load_si512(kGroupIdx[e]);
    for (int a = 0; a < 2; ++a) L[a][e] = _mm512_permutex2var_epi32(X[2 * a], idx, X[2 * a + 1]);
  }
  for (int c = 0; c < 4; ++c) {
    if (c >= ng) break;
    const __m512i T = _mm512_shuffle_i32x4(L[0][c / 2], L[1][c / 2], c % 2 ? 0xEE : 0x44);
    for (int j = 0; j < 4; ++j) {
      if (4 * c + j >= rc) break;
      const __m512i v = j == 3 ? _mm512_and_si512(T, top) : _mm512_shuffle_epi8(T, _mm512_load_si512(kTopByte.v[j]));
      bt[4 * c + j] = _mm512_cvtepi32_ps(v);
    }
  }
}

// delta = acc (the sum over r) with int8 B: times 2^-24 (block_t's factor), then times B_scale,
// each product kept as such (no fused or reordered multiply-add, whatever the caller).
__attribute__((always_inline)) inline __m512 int8_delta(__m512 acc, __m512 scale) {
  __m512 d = _mm512_mul_ps(acc, _mm512_set1_ps(kInt8Unscale));
  in_register(d);
  d = _mm512_mul_ps(d, scale);
  in_register(d);
  return d;
}

// The expand of MT tokens (few: a decode chunk) over outputs [o0, o1): each block of 16 outputs
// transposed into registers and used at once. Per token and output: acc = 0, then
// acc = fma(h[r], B[o, r], acc) for r = 0 .. R - 1, then y = dtype(float(y) + acc) (int8: acc
// through int8_delta, bscale = B_scale[s]).
template <int MT, typename T, typename W>
inline void expand_regs(const W* bs, const float* bscale, int64_t R, int64_t o0, int64_t o1, const float* const* hp,
                        T* const* yp) {
  for (int64_t o = o0; o < o1; o += 16) {
    const int64_t live = std::min<int64_t>(16, o1 - o);
    prefetch_b_ahead(bs, bscale, R, o);
    __m512 acc[MT];
    for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t r0 = 0; r0 < R; r0 += 16) {
      const int64_t rc = std::min<int64_t>(16, R - r0);
      __m512 bt[16];
      block_t(bs + o * R, R, r0, rc, live, bt);
      if (rc == 16) {
        for (int j = 0; j < 16; ++j)
          for (int m = 0; m < MT; ++m) acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(hp[m][r0 + j]), bt[j], acc[m]);
      } else {  // through memory, so that bt is only indexed by constants and stays in registers
        alignas(64) float tmp[16 * 16];
        for (int j = 0; j < 16; ++j)
          if (j < rc) _mm512_store_ps(tmp + 16 * j, bt[j]);
        for (int64_t j = 0; j < rc; ++j)
          for (int m = 0; m < MT; ++m)
            acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(hp[m][r0 + j]), _mm512_load_ps(tmp + 16 * j), acc[m]);
      }
    }
    if constexpr (kInt8<W>) {
      const __m512 sc = _mm512_maskz_loadu_ps(lanes(live), bscale + o);
      for (int m = 0; m < MT; ++m) acc[m] = int8_delta(acc[m], sc);
    }
    add_rows<MT, T>(yp, o, acc, live);
  }
}

// Outputs [o0, o0 + ld) of B[s] as float32 bt[r * ld + (o - o0)], ld a multiple of 64 (outputs past
// o1 zero; int8: times 2^24): the expand of more tokens transposes its range once and reads it per
// tile of tokens.
template <typename W>
inline void transpose_range(const W* bs, int64_t R, int64_t o0, int64_t o1, float* bt, int64_t ld) {
  for (int64_t o = o0; o < o0 + ld; o += 16) {
    const int64_t live = std::min<int64_t>(16, o1 - o);
    if (live > 0) prefetch_b_ahead(bs, static_cast<const float*>(nullptr), R, o);
    for (int64_t r0 = 0; r0 < R; r0 += 16) {
      const int64_t rc = std::min<int64_t>(16, R - r0);
      __m512 v[16];
      if (live > 0) {
        block_t(bs + o * R, R, r0, rc, live, v);
      } else {
        for (int j = 0; j < 16; ++j) v[j] = _mm512_setzero_ps();
      }
      for (int64_t j = 0; j < rc; ++j) _mm512_storeu_ps(bt + (r0 + j) * ld + (o - o0), v[j]);
    }
  }
}

// The same arithmetic as expand_regs (so bit-identical results) for MT tokens over a panel of 64
// outputs of bt: 4 x MT accumulators, each bt vector loaded once for the MT tokens.
template <int MT, typename T, typename W>
inline void expand_panel(const float* bt, const float* bscale, int64_t ld, int64_t R, const float* const* hp,
                         T* const* yp, int64_t o, int64_t live) {
  constexpr int kVecs = 4;
  __m512 acc[MT][kVecs];
  for (int m = 0; m < MT; ++m)
    for (int w = 0; w < kVecs; ++w) acc[m][w] = _mm512_setzero_ps();
  for (int64_t r = 0; r < R; ++r) {
    __m512 b[kVecs];
    for (int w = 0; w < kVecs; ++w) {
      b[w] = _mm512_loadu_ps(bt + r * ld + 16 * w);
      in_register(b[w]);
    }
    for (int m = 0; m < MT; ++m) {
      const __m512 hv = _mm512_set1_ps(hp[m][r]);
      for (int w = 0; w < kVecs; ++w) acc[m][w] = _mm512_fmadd_ps(hv, b[w], acc[m][w]);
    }
  }
  for (int w = 0; w < kVecs; ++w) {
    if (16 * w >= live) break;
    __m512 d[MT];
    for (int m = 0; m < MT; ++m) d[m] = acc[m][w];
    if constexpr (kInt8<W>) {
      const __m512 sc = _mm512_maskz_loadu_ps(lanes(live - 16 * w), bscale + o + 16 * w);
      for (int m = 0; m < MT; ++m) d[m] = int8_delta(d[m], sc);
    }
    add_rows<MT, T>(yp, o + 16 * w, d, live - 16 * w);
  }
}

// Tokens of one slot, positions [begin, end) of the sorted order.
struct Chunk {
  int64_t slot, begin, end;
};
struct ShrinkItem {
  int64_t chunk, row0, row1;
};
struct ExpandItem {
  int64_t chunk, o0, o1;
};

template <typename T, typename W>
struct Fast {
  const Problem<T, W>& p;
  const int32_t* order;  // token index of each sorted position
  float* H;              // [positions, P * R]

  void shrink(const Chunk& c, int64_t row0, int64_t row1) const {
    const W* as = p.A + c.slot * p.PR * p.K;
    const float* scale = kInt8<W> ? p.A_scale + c.slot * p.PR : nullptr;
    if constexpr (kInt8<W>) prefetch_span(scale + row0, (row1 - row0) * 4);  // read after the first tile
    for (int64_t pos = c.begin; pos < c.end;) {
      const int mt = static_cast<int>(std::min<int64_t>(4, c.end - pos));
      const T* xp[4];
      float* hp[4];
      for (int m = 0; m < mt; ++m) {
        xp[m] = p.x + order[pos + m] * p.xs;
        hp[m] = H + (pos + m) * p.PR;
      }
      for (int64_t g0 = row0; g0 < row1;) {
        switch (mt) {
          case 4: shrink_tile<4, 4, T, W>(xp, as, scale, p.K, g0, row1, hp); g0 += 4; break;
          case 3: shrink_tile<3, 4, T, W>(xp, as, scale, p.K, g0, row1, hp); g0 += 4; break;
          case 2: shrink_tile<2, 8, T, W>(xp, as, scale, p.K, g0, row1, hp); g0 += 8; break;
          default: shrink_tile<1, 16, T, W>(xp, as, scale, p.K, g0, row1, hp); g0 += 16; break;
        }
      }
      pos += mt;
    }
  }

  // Outputs [o0, o1) of the chunk's tokens, part by part.
  void expand(const Chunk& c, int64_t o0, int64_t o1, float* bt) const {
    if constexpr (kInt8<W>)  // the scales of the outputs before prefetch_b_ahead's first
      prefetch_span(p.B_scale + c.slot * p.N + o0, std::min(o1 - o0, kExpandAhead / p.R + 16) * 4);
    for (int64_t part = 0; part < p.P; ++part) {
      const int64_t lo = std::max(o0, p.starts[part]), hi = std::min(o1, p.starts[part + 1]);
      if (lo < hi) expand_part(c, part, lo, hi, bt);
    }
  }

  void expand_part(const Chunk& c, int64_t part, int64_t o0, int64_t o1, float* bt) const {
    const W* bs = p.B + c.slot * p.N * p.R;
    const float* bscale = kInt8<W> ? p.B_scale + c.slot * p.N : nullptr;
    const int64_t n = c.end - c.begin;
    const float* hp[4];
    T* yp[4];
    auto rows = [&](int64_t pos, int mt) {
      for (int m = 0; m < mt; ++m) {
        hp[m] = H + (pos + m) * p.PR + part * p.R;
        yp[m] = p.y + order[pos + m] * p.ys;
      }
    };
    if (n <= kFewTokens) {
      rows(c.begin, static_cast<int>(n));
      switch (n) {
        case 4: expand_regs<4, T, W>(bs, bscale, p.R, o0, o1, hp, yp); break;
        case 3: expand_regs<3, T, W>(bs, bscale, p.R, o0, o1, hp, yp); break;
        case 2: expand_regs<2, T, W>(bs, bscale, p.R, o0, o1, hp, yp); break;
        default: expand_regs<1, T, W>(bs, bscale, p.R, o0, o1, hp, yp); break;
      }
      return;
    }
    const int64_t ld = (o1 - o0 + kPanel - 1) / kPanel * kPanel;
    transpose_range(bs, p.R, o0, o1, bt, ld);
    for (int64_t pos = c.begin; pos < c.end;) {
      const int mt = static_cast<int>(std::min<int64_t>(4, c.end - pos));
      rows(pos, mt);
      for (int64_t o = o0; o < o1; o += kPanel) {
        const float* bo = bt + (o - o0);
        const int64_t live = std::min<int64_t>(kPanel, o1 - o);
        switch (mt) {
          case 4: expand_panel<4, T, W>(bo, bscale, ld, p.R, hp, yp, o, live); break;
          case 3: expand_panel<3, T, W>(bo, bscale, ld, p.R, hp, yp, o, live); break;
          case 2: expand_panel<2, T, W>(bo, bscale, ld, p.R, hp, yp, o, live); break;
          default: expand_panel<1, T, W>(bo, bscale, ld, p.R, hp, yp, o, live); break;
        }
      }
      pos += mt;
    }
  }
};

// Outputs per expand item, a multiple of 64: for a few tokens about kItemMacs multiply-adds; for
// more, what keeps their transposed B range (R x outputs float32) within kBtFloats.
inline int64_t expand_width(int64_t tokens, int64_t R) {
  const int64_t rp = (R + 15) / 16 * 16;
  const int64_t w = tokens > kFewTokens ? kBtFloats / rp : kItemMacs / (tokens * rp);
  return std::max(kPanel, std::min(w / kPanel * kPanel, kMaxExpandOut));
}

template <typename T, typename W>
void run_fast(const Problem<T, W>& p, const int32_t* slots, int64_t T_, int64_t S) {
  // Tokens grouped by slot, in token order within a slot (counting sort).
  std::vector<int64_t> count(S + 1, 0);
  int64_t active = 0;
  for (int64_t t = 0; t < T_; ++t)
    if (slots[t] >= 0) ++count[slots[t] + 1], ++active;
  if (active == 0) return;
  for (int64_t s = 0; s < S; ++s) count[s + 1] += count[s];
  std::vector<int32_t> order(active);
  {
    std::vector<int64_t> next(count.begin(), count.end() - 1);
    for (int64_t t = 0; t < T_; ++t)
      if (slots[t] >= 0) order[next[slots[t]]++] = static_cast<int32_t>(t);
  }
  std::vector<Chunk> chunks;
  for (int64_t s = 0; s < S; ++s)
    for (int64_t b = count[s]; b < count[s + 1]; b += kChunk)
      chunks.push_back({s, b, std::min(b + kChunk, count[s + 1])});

  // Work items of about kItemMacs multiply-adds (shrink: 16 rows of A at least; expand: 64 outputs
  // at least, and with more than kFewTokens tokens what their transposed B range allows).
  std::vector<ShrinkItem> shrinks;
  std::vector<ExpandItem> expands;
  for (int64_t c = 0; c < static_cast<int64_t>(chunks.size()); ++c) {
    const int64_t n = chunks[c].end - chunks[c].begin;
    const int64_t rows = std::max<int64_t>(1, kItemMacs / (n * p.K * kShrinkRows)) * kShrinkRows;
    for (int64_t r = 0; r < p.PR; r += rows) shrinks.push_back({c, r, std::min(r + rows, p.PR)});
    const int64_t w = expand_width(n, p.R);
    for (int64_t o = 0; o < p.N; o += w) expands.push_back({c, o, std::min(o + w, p.N)});
  }
  std::unique_ptr<float[]> H(new float[active * p.PR]);
  const Fast<T, W> f{p, order.data(), H.get()};
  const int64_t n_shrink = static_cast<int64_t>(shrinks.size());
  const int64_t n_items = n_shrink + static_cast<int64_t>(expands.size());
  // Scratch for a transposed B range, where a chunk has more than kFewTokens tokens.
  bool many = false;
  for (const auto& c : chunks) many |= c.end - c.begin > kFewTokens;
  const int64_t bt_floats = many ? (p.R + 15) / 16 * 16 * expand_width(kFewTokens + 1, p.R) : 0;

  const int64_t macs = active * (p.PR * p.K + p.N * p.R);
  const int64_t threads = macs < kSerialMacs || at::in_parallel_region()
                              ? 1
                              : std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n_items));
  // The first kStartAhead bytes of a thread's first shrink item and of its first expand item: the
  // expand's are read long after, by then the in-loop prefetches have not reached them.
  auto prefetch_start = [&](int64_t shrink, int64_t expand) {
    if (shrink < n_shrink) {
      const ShrinkItem& it = shrinks[shrink];
      prefetch_span(p.A + (chunks[it.chunk].slot * p.PR + it.row0) * p.K,
                    std::min<int64_t>(kStartAhead, (it.row1 - it.row0) * p.K * sizeof(W)));
    }
    if (expand < n_items - n_shrink) {
      const ExpandItem& it = expands[expand];
      prefetch_span(p.B + (chunks[it.chunk].slot * p.N + it.o0) * p.R,
                    std::min<int64_t>(kStartAhead, (it.o1 - it.o0) * p.R * sizeof(W)));
    }
  };
  if (threads == 1) {
    std::unique_ptr<float[]> bt(new float[bt_floats]);
    prefetch_start(0, 0);
    for (const auto& it : shrinks) f.shrink(chunks[it.chunk], it.row0, it.row1);
    for (const auto& it : expands) f.expand(chunks[it.chunk], it.o0, it.o1, bt.get());
    return;
  }
  std::vector<int64_t> need(chunks.size(), 0);  // shrink items per chunk
  for (const auto& it : shrinks) ++need[it.chunk];
  // Shrink items done per chunk, a cache line each (a waiting thread reads its own line only).
  struct alignas(64) Counter {
    std::atomic<int64_t> n{0};
  };
  std::unique_ptr<Counter[]> done(new Counter[chunks.size()]);
  // Each thread's share: a contiguous run of the shrink items and one of the expand items, of
  // about equal cost (multiply-adds, plus kByteCost per byte of weights read), so that a thread
  // sweeps one stretch of A, then one of B, in address order (what prefetching ahead needs: its
  // next item lies right after its current one). A thread runs the shrink items of its share,
  // then takes what is left of the others' shrink items, then does the same with expand items.
  // An expand item waits for its chunk's shrink items, which cannot deadlock: a thread takes an
  // expand item only once every shrink item has been taken, by a running thread.
  constexpr double kByteCost = 8.0;
  auto split = [&](int64_t n, auto cost, std::vector<int64_t>& bounds) {
    std::vector<double> prefix(n + 1, 0.0);
    for (int64_t i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + cost(i);
    bounds.assign(threads + 1, n);
    bounds[0] = 0;
    for (int64_t t = 1, i = 0; t < threads; ++t) {
      const double target = prefix[n] * static_cast<double>(t) / static_cast<double>(threads);
      while (i < n && prefix[i + 1] <= target) ++i;
      const int64_t b = i < n && prefix[i + 1] - target < target - prefix[i] ? i + 1 : i;
      bounds[t] = std::max(b, bounds[t - 1]);
    }
  };
  auto tokens = [&](int64_t chunk) { return static_cast<double>(chunks[chunk].end - chunks[chunk].begin); };
  const double byte_cost = kByteCost * static_cast<double>(sizeof(W));
  std::vector<int64_t> shrink_bounds, expand_bounds;
  split(
      n_shrink,
      [&](int64_t i) {
        const ShrinkItem& it = shrinks[i];
        return static_cast<double>((it.row1 - it.row0) * p.K) * (tokens(it.chunk) + byte_cost);
      },
      shrink_bounds);
  split(
      n_items - n_shrink,
      [&](int64_t i) {
        const ExpandItem& it = expands[i];
        return static_cast<double>((it.o1 - it.o0) * p.R) * (tokens(it.chunk) + byte_cost);
      },
      expand_bounds);
  struct alignas(64) Share {
    std::atomic<int64_t> next{0};  // the share's next item (shrink_bounds or expand_bounds)
  };
  std::unique_ptr<Share[]> shares(new Share[2 * threads]);  // shrink shares, then expand shares
  for (int64_t t = 0; t < threads; ++t) {
    shares[t].next.store(shrink_bounds[t], std::memory_order_relaxed);
    shares[threads + t].next.store(expand_bounds[t], std::memory_order_relaxed);
  }
  at::parallel_for(0, threads, 1, [&](int64_t first, int64_t) {
    std::unique_ptr<float[]> bt(new float[bt_floats]);
    prefetch_start(shrink_bounds[first] < shrink_bounds[first + 1] ? shrink_bounds[first] : n_shrink,
                   expand_bounds[first] < expand_bounds[first + 1] ? expand_bounds[first] : n_items - n_shrink);
    for (int64_t u = 0; u < threads; ++u) {
      const int64_t t = (first + u) % threads;
      for (int64_t i; (i = shares[t].next.fetch_add(1, std::memory_order_relaxed)) < shrink_bounds[t + 1];) {
        const ShrinkItem& it = shrinks[i];
        f.shrink(chunks[it.chunk], it.row0, it.row1);
        done[it.chunk].n.fetch_add(1, std::memory_order_release);
      }
    }
    for (int64_t u = 0; u < threads; ++u) {
      const int64_t t = (first + u) % threads;
      for (int64_t i; (i = shares[threads + t].next.fetch_add(1, std::memory_order_relaxed)) < expand_bounds[t + 1];) {
        const ExpandItem& it = expands[i];
        // Spin briefly, then yield: the thread finishing that shrink may have lost its core.
        for (int spins = 0; done[it.chunk].n.load(std::memory_order_acquire) < need[it.chunk]; ++spins) {
          if (spins < kSpins) {
            _mm_pause();
          } else {
            std::this_thread::yield();
          }
        }
        f.expand(chunks[it.chunk], it.o0, it.o1, bt.get());
      }
    }
  });
}
#endif

template <typename T, typename W>
void run(const Problem<T, W>& p, const int32_t* slots, int64_t T_, int64_t S, bool generic) {
#if defined(__AVX512F__)
  if (!generic) {
    run_fast(p, slots, T_, S);
    return;
  }
#endif
  (void)S;
  run_portable(p, slots, T_);
}

// A dtype as Python spells it (torch.int8, not Char).
std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "float32";
    case at::kBFloat16: return "bfloat16";
    case at::kHalf: return "float16";
    case at::kDouble: return "float64";
    case at::kChar: return "int8";
    case at::kInt: return "int32";
    case at::kLong: return "int64";
    default: return c10::toString(t);
  }
}

}  // namespace

void lora_add(at::Tensor x, at::Tensor y, at::Tensor slots, at::Tensor A, at::Tensor B,
              at::Tensor part_starts, std::optional<at::Tensor> A_scale, std::optional<at::Tensor> B_scale,
              KernelPath path) {
  TORCH_CHECK(x.device().is_cpu() && y.device().is_cpu() && slots.device().is_cpu() && A.device().is_cpu() &&
                  B.device().is_cpu() && part_starts.device().is_cpu() && (!A_scale || A_scale->device().is_cpu()) &&
                  (!B_scale || B_scale->device().is_cpu()),
              "lora_add: all tensors must be on the CPU");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "lora_add: x must be float32 or bfloat16, got ",
              dtype_name(dtype));
  const bool a_int8 = A.scalar_type() == at::kChar, b_int8 = B.scalar_type() == at::kChar;
  TORCH_CHECK(a_int8 == b_int8, "lora_add: A and B must be both int8 or both x's dtype (", dtype_name(dtype),
              "), got A ", dtype_name(A.scalar_type()), " and B ", dtype_name(B.scalar_type()));
  const bool int8 = a_int8;
  TORCH_CHECK(y.scalar_type() == dtype && (int8 || (A.scalar_type() == dtype && B.scalar_type() == dtype)),
              "lora_add: x, y, A and B must have the same dtype (or A and B int8, with A_scale and B_scale), got x ",
              dtype_name(dtype), ", y ", dtype_name(y.scalar_type()), ", A ", dtype_name(A.scalar_type()), ", B ",
              dtype_name(B.scalar_type()));
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && A.dim() == 4 && B.dim() == 3 && slots.dim() == 1 &&
                  part_starts.dim() == 1,
              "lora_add: expected x [T, K], y [T, N], slots [T], A [S, P, R, K], B [S, N, R], part_starts [P + 1]");
  const int64_t T_ = x.size(0), K = x.size(1), N = y.size(1);
  const int64_t S = A.size(0), P = A.size(1), R = A.size(2);
  TORCH_CHECK(y.size(0) == T_, "lora_add: y has ", y.size(0), " rows but x has ", T_);
  TORCH_CHECK(A.size(3) == K, "lora_add: A [S, P, R, K] has K = ", A.size(3), " but x has ", K, " columns");
  TORCH_CHECK(B.size(0) == S && B.size(1) == N && B.size(2) == R, "lora_add: B must be [S, N, R] = [", S, ", ", N,
              ", ", R, "] (S and R from A, N from y), got ", B.sizes());
  TORCH_CHECK(A.is_contiguous() && B.is_contiguous(), "lora_add: A and B must be contiguous");
  // int8 A and B: their scales, float32 [S, P, R] and [S, N], contiguous; float A and B: none.
  auto check_scale = [&](const std::optional<at::Tensor>& scale, const char* name, const char* of,
                         bool weights_int8, const at::ScalarType weights_dtype, at::IntArrayRef shape,
                         const char* shape_text) {
    if (!weights_int8) {
      TORCH_CHECK(!scale, "lora_add: ", name, " is only for int8 ", of, ", but ", of, " is ",
                  dtype_name(weights_dtype));
      return;
    }
    TORCH_CHECK(scale.has_value(), "lora_add: int8 ", of, " needs ", name, " (float32 ", shape_text, ")");
    TORCH_CHECK(scale->scalar_type() == at::kFloat, "lora_add: ", name, " must be float32, got ",
                dtype_name(scale->scalar_type()));
    TORCH_CHECK(scale->sizes() == shape, "lora_add: ", name, " must be ", shape_text, " = ", shape, ", got ",
                scale->sizes());
    TORCH_CHECK(scale->is_contiguous(), "lora_add: ", name, " must be contiguous");
  };
  check_scale(A_scale, "A_scale", "A", a_int8, A.scalar_type(), {S, P, R}, "[S, P, R]");
  check_scale(B_scale, "B_scale", "B", b_int8, B.scalar_type(), {S, N}, "[S, N]");
  TORCH_CHECK(slots.scalar_type() == at::kInt, "lora_add: slots must be int32, got ",
              dtype_name(slots.scalar_type()));
  TORCH_CHECK(slots.size(0) == T_, "lora_add: slots has ", slots.size(0), " entries for ", T_, " tokens");
  TORCH_CHECK(part_starts.scalar_type() == at::kLong, "lora_add: part_starts must be int64, got ",
              dtype_name(part_starts.scalar_type()));
  TORCH_CHECK(part_starts.size(0) == P + 1, "lora_add: part_starts must have P + 1 = ", P + 1,
              " entries (P = A.size(1)), got ", part_starts.size(0));
  TORCH_CHECK(N <= 1 || y.stride(1) == 1, "lora_add: y's last dimension must be contiguous");
  TORCH_CHECK(T_ <= 1 || y.stride(0) >= N, "lora_add: y's rows overlap (row stride ", y.stride(0), " < N = ", N, ")");

  const auto starts_c = part_starts.contiguous();
  const int64_t* starts = starts_c.data_ptr<int64_t>();
  TORCH_CHECK(starts[0] == 0 && starts[P] == N, "lora_add: part_starts must go from 0 to N = ", N, ", got ",
              starts[0], " .. ", starts[P]);
  for (int64_t i = 0; i < P; ++i)
    TORCH_CHECK(starts[i] < starts[i + 1], "lora_add: part_starts must increase strictly, got ", starts[i], " then ",
                starts[i + 1]);
  const auto slots_c = slots.contiguous();
  const int32_t* sl = slots_c.data_ptr<int32_t>();
  for (int64_t t = 0; t < T_; ++t)
    TORCH_CHECK(sl[t] < S, "lora_add: slot out of range: slots[", t, "] = ", sl[t], " but A and B hold ", S,
                " slots");
  if (T_ == 0 || N == 0 || K == 0 || R == 0) return;

  auto xc = (x.stride(1) == 1 && (T_ <= 1 || x.stride(0) >= K)) ? x : x.contiguous();
  const bool generic = is_portable(path);
  auto go = [&](auto* tag, auto* wtag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using W = std::remove_pointer_t<decltype(wtag)>;
    const Problem<T, W> p{xc.data_ptr<T>(),
                          T_ <= 1 ? K : xc.stride(0),
                          y.data_ptr<T>(),
                          T_ <= 1 ? N : y.stride(0),
                          A.data_ptr<W>(),
                          B.data_ptr<W>(),
                          int8 ? A_scale->data_ptr<float>() : nullptr,
                          int8 ? B_scale->data_ptr<float>() : nullptr,
                          starts,
                          K,
                          N,
                          P,
                          R,
                          P * R};
    run(p, sl, T_, S, generic);
  };
  if (dtype == at::kFloat) {
    if (int8) {
      go(static_cast<float*>(nullptr), static_cast<int8_t*>(nullptr));
    } else {
      go(static_cast<float*>(nullptr), static_cast<float*>(nullptr));
    }
  } else if (int8) {
    go(static_cast<at::BFloat16*>(nullptr), static_cast<int8_t*>(nullptr));
  } else {
    go(static_cast<at::BFloat16*>(nullptr), static_cast<at::BFloat16*>(nullptr));
  }
}
