// Weight-only linear on CPU over group-wise quantized weights: integer codes, one (scale, min) per
// group of group_size input columns and output channel. Built at first use by
// tokenmill/kernels/cpu_ops.py. Two conventions share everything below:
//   Grouped  (group_weight_linear):  w[n, k] = code[n, k] * scale[n, g] + min[n, g],  g = k / group_size,
//            codes 0..15 (bits 4), 0..31 (bits 5), 0..127 (bits 7, one a byte) or 0..255 (bits 8):
//            the GGUF types (Q4_0 .. Q8_0, Q4_K .. Q6_K) exactly;
//   Tinygemm (int4_weight_linear, int4_linear.cpp): w[n, k] = (q[n, k] - 8) * scale[n, g] + zero[n, g].
// The kernel multiplies by codes shifted to c = code - o (o = 8 for 4 bits, 16 for 5, 128 for 8,
// -128 for 7; Tinygemm's q - 8 is that with o = 8), which bfloat16 holds exactly, and folds the
// offset into the minimum:
//   w = c * scale + mn,  mn = min + o * scale (Grouped, one float32 fma per group), mn = zero (Tinygemm)
//   out[m, n] = sum_g scale[n, g] * (sum_{k in g} c[n, k] x[m, k]) + mn[n, g] * sx[m, g]
// with sx[m, g] the sum of x over the group as the products see it. Signed codes keep the group sums
// small where a symmetric type's min cancels its codes' offset (Q8_0: code q + 128, min -128 d: mn = 0).
// Bits 7 (Q5_0, Q5_1, Q5_K, Q6_K: codes below 64) trade that for speed: a byte code u < 128 OR'd
// into the bits of bfloat16 128.0 (0x4300) is bfloat16 128 + u exactly (the binade [128, 256) has a
// spacing of 1), so a chunk widens in 2 instructions against 6 for int8 -> int32 -> float ->
// bfloat16. The sums then carry 128 sx, taken out again by mn (float32: a few ulp of 128 |x|).
//
// Layouts (tokenmill.quantization.kernels.int4_cpu_pack / group_cpu_pack): output channels in tiles
// of 16, a tile's codes in 32-byte chunks that widen to 32 words = "16 rows x one pair of k", what
// vdpbf16ps multiplies by a broadcast pair of x (16 output channels side by side, no horizontal sums):
//   bits 4: [N / 16, K / 4, 32], chunk c byte 2r + j = code[r, 4c + j] | code[r, 4c + 2 + j] << 4
//           (low nibbles: k pair 2c, high nibbles: k pair 2c + 1; a 32-entry vpermw table gives bf16)
//   bits 8: [N / 16, K / 2, 32], chunk c byte 2r + j = code[r, 2c + j] (xor 0x80 = code - 128 as int8,
//           widened to int32, to float, two vectors packed to bfloat16 pairs)
//   bits 7: bits 8's layout, each byte widened to a word and OR'd with 0x4300 (bfloat16 128 + code)
//   bits 5: [N / 16, 5 K / 16, 32]: bits 4's nibble chunks of the low 4 bits, and after every 4 of
//           them one 32-byte chunk of their fifth bits (8 bytes per chunk: a 32-bit mask for its
//           k pair 2c, bit w = word w, then one for 2c + 1), set into bit 4 of the vpermw index
//           (a 32-entry table of code - 16): 5 / 8 of a byte per weight, as Q5_0 and Q5_1 store them
// and (scale, min) [N / 16, G, 2, 16] (float32, or float16 where every value is one exactly: GGUF's
// Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0, half the bytes; Tinygemm also bfloat16), read once per group;
// or scales alone, [N / 16, G, 1, 16], where every min is -o * scale (mn = 0: Q4_0 at bits 4, Q5_0
// at bits 5, Q8_0 at bits 8, GGUF's symmetric types), 2 bytes less per group: the same sums.
//
// Rounding: codes -> bfloat16 is exact, products are summed in float32 by vdpbf16ps; bfloat16 x is
// used as is, float32 x is split into a bfloat16 high part and a bfloat16 low part (two products per
// pair, about 16 bits of x kept). Activations are not quantized, except by the fixed-point schedule
// below (bfloat16 x rounded to 15 bits beside its group's largest value).
//
// Two schedules, one sum. Every output is, whatever the schedule, the number of rows, the other
// rows and the thread count:
//   res = 0; for each group g: acc = 0; for each k pair p of g: acc = dpbf16(acc, c_p, xh_p)
//            [float32 x: then acc = dpbf16(acc, c_p, xl_p)]; res = fma(scale, acc, res);
//            res = fma(mn, sx, res)
// (explicit fma / dpbf16 intrinsics only, which -ffast-math does not reassociate), so a row's result
// is bit for bit the same at M = 1 and inside any batch (tests/kernels/test_group_linear.py):
//   few rows (M < kGemmRows = 24): each thread streams its tiles' codes once per call, each chunk
//     unpacked in registers for all the rows of a block (rows x tiles at once: 1-2 x 4, 3-6 x 2,
//     7-23 rows x 1 tile in blocks of up to 9, so that there are enough independent vdpbf16ps chains);
//   many rows (where the dequantize-once GEMM below does not apply): each thread unpacks a strip of
//     2 tiles to bfloat16 once per call (bf16_linear.cpp's layout, [K / 2][2][32], in L1/L2) and
//     runs a register-blocked loop over it: blocks of up to
//     12 rows (as even as they come) x 2 tiles, the 24 group accumulators in registers, the results
//     in L1 between groups, x copied once per call into row-block panels (slabs of 16 k pairs of
//     the block's rows side by side, so that every broadcast is one pointer plus a constant). A
//     group's end is interleaved with the next group's first pair; the mn fma is skipped for a
//     strip whose mn are all 0 (fma(0, sx, r) == r: the same result).
// AMX hosts (amx.h), bfloat16 x, calls of at least 4 rows: a third schedule instead of both
// (tile_column: per group, tile products from zero, stored, then the same group_end fold); fewer
// rows and float32 x keep the vector schedules. There the vector units' folds, not the tile
// products, set the pace: about 0.6-0.9 of bf16_linear.cpp's tiles with many rows.
// Calls of dequant_rows_limit() = 24 rows or more with bfloat16 x, on every host with the fast
// path: the weights dequantized to bfloat16 once per call and bf16_linear.cpp's GEMM over them
// (tiles_dequant, below: other sums, those of the bfloat16 copy of the dequantized weights).
// Hosts with AVX-512 VNNI, bfloat16 x, calls of 1-6 rows (M < kFixedRows = 7: decode steps of up
// to 6 sequences, verifications of up to 5 draft tokens): integer products instead of both
// (strip_rows_fixed), x in 16-bit fixed point per group, codes widened to int16, two vpdpwssd per 64
// codes where vdpbf16ps needs two per 64 plus a table lookup each (measured on the AMX host, one
// core, Q4_1-style codes hot in cache: 20-25 against 12 G weights/s; 30 layers of SmolLM2 shapes
// streamed, 2 threads, 4 rows: 12.7 ms against 13.9-15.9 on tiles, 8 rows in blocks of 3: 19.5-26.9
// against 16.2-17.5; on the AMD host with 6-row blocks, against the vector schedules: 5 rows x0.80-0.97
// the time, 6 rows x0.92-1.03, 7-8 rows in two blocks x1.15-1.47). TOKENMILL_FIXED_ROWS=n moves
// the line (0: off); KernelPath::VECTOR keeps the vector schedules at every row count.
// The price of grouped weights against bf16_linear.cpp (one dpbf16 per k pair and nothing else) is
// the group ends, 2 float32 fmas per group_size / 2 dpbf16 of every accumulator, on the same two
// pipes: at group_size 32 a bound of 16 / 18 = 89% of the bfloat16 GEMM's speed (94% when mn = 0,
// as for Q4_0 and Q8_0); bench/quantized_linear.py measures what is reached.

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "amx.h"
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

// float32 storage of an output rounded to bfloat16 (what a bfloat16 output holds, widened): x
// bfloat16 with out_float32, for logits that are read as float32 without a conversion pass.
struct Bf16InFloat {
  float v;
  Bf16InFloat() = default;
  explicit Bf16InFloat(float f) : v(static_cast<float>(c10::BFloat16(f))) {}
};
static_assert(sizeof(Bf16InFloat) == sizeof(float));

inline float to_float(float v) { return v; }
inline float to_float(at::BFloat16 v) { return static_cast<float>(v); }
inline float to_float(at::Half v) { return static_cast<float>(v); }

// A row-count line from the environment variable `name` (a whole number >= 0), else fallback.
int64_t rows_from_env(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  const long long n = std::strtoll(v, &end, 10);
  TORCH_CHECK(end && *end == '\0' && n >= 0, name, " must be a whole number >= 0, got '", v, "'");
  return static_cast<int64_t>(n);
}

// What every tile task reads.
template <typename S>
struct Problem {
  const uint16_t* xh;  // [M, K] bfloat16 bits of x (the high part for float32 x)
  const uint16_t* xl;  // [M, K] the low part (float32 x only), else nullptr
  const float* sx;     // [M, G] group sums of x as the products see it (xh + xl)
  const uint8_t* w;    // [N / 16, K / 4 or K / 2, 32]
  const S* sz;         // [N / 16, G, 2, 16], or [N / 16, G, 1, 16]: scales alone, every mn 0
  int64_t M, K, N, G, gs;
  int bits;            // 4, 5, 7 or 8
  bool shift_min;      // Grouped: mn = min + o * scale; Tinygemm: mn = zero
  int64_t zs;          // sz values per group of a tile: 32 (scale, min) or 16 (scale alone)
};

// The codes' offset o: the kernel multiplies by code - o.
inline int code_offset(int bits) { return bits == 4 ? 8 : bits == 5 ? 16 : bits == 7 ? -128 : 128; }

// Rows of 32 bytes in one 16-row tile of packed codes (see the layouts above).
inline int64_t tile_rows(int64_t K, int bits) { return bits == 4 ? K / 4 : bits == 5 ? 5 * K / 16 : K / 2; }

// Where chunk c of a tile starts (its nibbles, for bits 5).
inline const uint8_t* chunk_at(const uint8_t* tile, int64_t c, int bits) {
  return bits == 5 ? tile + (c >> 2) * 160 + (c & 3) * 32 : tile + c * 32;
}

// Bits 5: the fifth bits of chunk c, k pair 2c + i (i = 0, 1), bit w for word w = 2r + j.
inline uint32_t fifth_bits(const uint8_t* tile, int64_t c, int i) {
  uint32_t m;
  std::memcpy(&m, tile + (c >> 2) * 160 + 128 + (c & 3) * 8 + 4 * i, sizeof(m));
  return m;
}

// x as the kernels take it: bfloat16 bits (high and, for float32 x, low parts) and group sums, each
// row by itself (rows in parallel), so a row's values do not depend on the batch.
struct PreparedX {
  at::Tensor xh, xl, sx;
  const uint16_t* h = nullptr;
  const uint16_t* l = nullptr;
  const float* s = nullptr;
};

PreparedX prepare_x(const at::Tensor& x, int64_t gs, bool generic) {
  const int64_t M = x.size(0), K = x.size(1), G = K / gs;
  const bool f32 = x.scalar_type() == at::kFloat;
  PreparedX p;
  p.sx = at::empty({M, G}, x.options().dtype(at::kFloat));
  float* s = p.sx.data_ptr<float>();
  uint16_t* h = nullptr;
  uint16_t* l = nullptr;
  if (f32) {
    p.xh = at::empty({M, K}, x.options().dtype(at::kShort));
    p.xl = at::empty({M, K}, x.options().dtype(at::kShort));
    h = reinterpret_cast<uint16_t*>(p.xh.data_ptr<int16_t>());
    l = reinterpret_cast<uint16_t*>(p.xl.data_ptr<int16_t>());
    p.h = h, p.l = l;
  } else {
    p.h = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());  // used in place
  }
  const float* xf = f32 ? x.data_ptr<float>() : nullptr;
  const uint16_t* xb = p.h;
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      int64_t k0 = 0;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
      // 16 columns at a time: bfloat16 parts by rounding to nearest even (as c10::BFloat16 for
      // finite values), group sums lane-wise then one fixed reduction.
      if (!generic && gs % 16 == 0) {
        for (int64_t g = 0; g < G; ++g) {
          __m512 acc = _mm512_setzero_ps();
          for (int64_t k = g * gs; k < (g + 1) * gs; k += 16) {
            const int64_t i = m * K + k;
            __m512 v;
            if (f32) {
              const __m512 xv = _mm512_loadu_ps(xf + i);
              const __m256i hb = (__m256i)_mm512_cvtneps_pbh(xv);
              const __m512 hv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(hb), 16));
              const __m256i lb = (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(xv, hv));
              const __m512 lv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(lb), 16));
              _mm256_storeu_si256(reinterpret_cast<__m256i*>(h + i), hb);
              _mm256_storeu_si256(reinterpret_cast<__m256i*>(l + i), lb);
              v = _mm512_add_ps(hv, lv);
            } else {
              v = load16(reinterpret_cast<const c10::BFloat16*>(xb + i));
            }
            acc = _mm512_add_ps(acc, v);
          }
          s[m * G + g] = _mm512_reduce_add_ps(acc);
        }
        k0 = K;
      }
#endif
      for (int64_t g = k0 / gs; g < G; ++g) {
        float sum = 0.f;
        for (int64_t k = g * gs; k < (g + 1) * gs; ++k) {
          const int64_t i = m * K + k;
          if (f32) {
            const float v = xf[i];
            h[i] = float_to_bf16_bits(v);
            l[i] = float_to_bf16_bits(v - bf16_bits_to_float(h[i]));
            sum += bf16_bits_to_float(h[i]) + bf16_bits_to_float(l[i]);
          } else {
            sum += bf16_bits_to_float(xb[i]);
          }
        }
        s[m * G + g] = sum;
      }
    }
  });
  p.s = s;
  return p;
}

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
constexpr bool kFast = true;

// One 32-byte chunk of codes -> kPairs vectors of signed codes as bfloat16, "16 rows x a k pair".
template <int Bits>
struct Unpack;

template <>
struct Unpack<4> {
  static constexpr int kPairs = 2;
  __m512i table;
  // bfloat16 of (i & 15) - 8, twice: vpermw reads the low 5 bits of each index word, so a byte's
  // low nibble indexes it directly whatever bit 4 is.
  Unpack() {
    alignas(64) uint16_t t[32];
    for (int i = 0; i < 32; ++i) t[i] = float_to_bf16_bits(static_cast<float>((i & 15) - 8));
    table = _mm512_load_si512(t);
  }
  inline void operator()(const uint8_t* tile, int64_t c, __m512bh* v) const {
    const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + c * 32)));
    v[0] = (__m512bh)_mm512_permutexvar_epi16(b, table);
    v[1] = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(b, 4), table);
  }
};

template <>
struct Unpack<5> {
  static constexpr int kPairs = 2;
  __m512i table;
  Unpack() {  // bfloat16 of i - 16, i = 0 .. 31: the whole 5-bit index
    alignas(64) uint16_t t[32];
    for (int i = 0; i < 32; ++i) t[i] = float_to_bf16_bits(static_cast<float>(i - 16));
    table = _mm512_load_si512(t);
  }
  inline void operator()(const uint8_t* tile, int64_t c, __m512bh* v) const {
    const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk_at(tile, c, 5))));
    const __m512i h0 = _mm512_maskz_set1_epi16(static_cast<__mmask32>(fifth_bits(tile, c, 0)), 0x10);
    const __m512i h1 = _mm512_maskz_set1_epi16(static_cast<__mmask32>(fifth_bits(tile, c, 1)), 0x10);
    // (b & 15) | h0 (ternary logic 0xEA: A & B | C); the high nibble is alone in b >> 4
    v[0] = (__m512bh)_mm512_permutexvar_epi16(_mm512_ternarylogic_epi32(b, _mm512_set1_epi16(0x0F), h0, 0xEA), table);
    v[1] = (__m512bh)_mm512_permutexvar_epi16(_mm512_or_si512(_mm512_srli_epi16(b, 4), h1), table);
  }
};

template <>
struct Unpack<8> {
  static constexpr int kPairs = 1;
  inline void operator()(const uint8_t* tile, int64_t c, __m512bh* v) const {
    const __m256i b = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + c * 32)),
                                       _mm256_set1_epi8(static_cast<char>(0x80)));  // code - 128, as int8
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1)));
    v[0] = _mm512_cvtne2ps_pbh(hi, lo);  // words 0..15 from lo, 16..31 from hi
  }
};

template <>
struct Unpack<7> {
  static constexpr int kPairs = 1;
  inline void operator()(const uint8_t* tile, int64_t c, __m512bh* v) const {
    const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + c * 32)));
    v[0] = (__m512bh)_mm512_or_si512(b, _mm512_set1_epi16(0x4300));  // bfloat16 128 + code, code < 128
  }
};

// The (scale, mn) of a tile's group, as float32 (scales alone: mn 0).
template <typename S>
inline void scale_min(const S* szg, int64_t zs, bool shift, float offset, __m512* scale, __m512* mn) {
  *scale = load16(szg);
  if (zs == 16) {
    *mn = _mm512_setzero_ps();
    return;
  }
  *mn = load16(szg + 16);
  if (shift) *mn = _mm512_fmadd_ps(_mm512_set1_ps(offset), *scale, *mn);
}

// A group's end, the one place where both schedules fold an accumulator into its result.
template <bool WithMin = true>
inline __m512 group_end(__m512 res, __m512 acc, __m512 scale, __m512 mn, const float* sx) {
  res = _mm512_fmadd_ps(scale, acc, res);
  if constexpr (WithMin) res = _mm512_fmadd_ps(mn, _mm512_set1_ps(*sx), res);
  return res;
}

inline __m512bh bcast_pair(const uint16_t* x, int64_t p) {
  int32_t pair;
  std::memcpy(&pair, x + 2 * p, sizeof(pair));
  return (__m512bh)_mm512_set1_epi32(pair);
}

// f(std::integral_constant<int, n>()) for a runtime n in 1 .. Max: a register block's rows as a
// template argument.
template <int Max, typename F>
inline void with_constant(int n, F&& f) {
  [&]<int... I>(std::integer_sequence<int, I...>) {
    ((n == I + 1 ? (f(std::integral_constant<int, I + 1>()), true) : false) || ...);
  }(std::make_integer_sequence<int, Max>());
}

template <typename T>
inline void store_out(T* y, __m512 v) {
  store16(y, v, static_cast<__mmask16>(0xffff));
}

// Rounded to bfloat16, nearest even (vcvtneps2bf16: store16's rounding for finite values, in one
// instruction), then stored as bfloat16 or widened back.
inline void store_out(c10::BFloat16* y, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), (__m256i)_mm512_cvtneps_pbh(v));
}
inline void store_out(Bf16InFloat* y, __m512 v) {
  const __m512i wide = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v));
  _mm512_storeu_ps(reinterpret_cast<float*>(y), _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
}

// Few rows: rows m0 .. m0 + MB - 1 of x times tiles t0 .. t0 + NT - 1, each chunk unpacked once
// for them (MB x NT independent vdpbf16ps chains; the x pairs broadcast once for the NT tiles).
template <int MB, int NT, int Bits, typename T, typename S>
void strip_rows(const Problem<S>& p, const Unpack<Bits>& unpack, int64_t t0, int64_t m0, T* y) {
  constexpr bool kTwo = std::is_same_v<T, float>;
  constexpr int P = Unpack<Bits>::kPairs;
  const int64_t tile_bytes = tile_rows(p.K, p.bits) * 32;
  const uint8_t* wt = p.w + t0 * tile_bytes;
  const S* szt = p.sz + t0 * p.G * p.zs;
  const float offset = static_cast<float>(code_offset(p.bits));
  const uint16_t* xh = p.xh + m0 * p.K;
  const uint16_t* xl = kTwo ? p.xl + m0 * p.K : nullptr;
  const float* sx = p.sx + m0 * p.G;
  __m512 res[MB][NT];
#pragma GCC unroll 8
  for (int r = 0; r < MB; ++r)
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t) res[r][t] = _mm512_setzero_ps();
  const int64_t chunks_per_group = p.gs / (2 * P);
  for (int64_t g = 0; g < p.G; ++g) {
    __m512 acc[MB][NT];
#pragma GCC unroll 8
    for (int r = 0; r < MB; ++r)
#pragma GCC unroll 4
      for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_setzero_ps();
    const int64_t c0 = g * chunks_per_group;
    for (int64_t c = c0; c < c0 + chunks_per_group; ++c) {
      __m512bh v[NT][P];
#pragma GCC unroll 4
      for (int t = 0; t < NT; ++t) unpack(wt + t * tile_bytes, c, v[t]);
#pragma GCC unroll 2
      for (int i = 0; i < P; ++i) {
        const int64_t pair = c * P + i;
#pragma GCC unroll 8
        for (int r = 0; r < MB; ++r) {
          const __m512bh xv = bcast_pair(xh + r * p.K, pair);
#pragma GCC unroll 4
          for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], v[t][i], xv);
          if constexpr (kTwo) {
            const __m512bh lv = bcast_pair(xl + r * p.K, pair);
#pragma GCC unroll 4
            for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], v[t][i], lv);
          }
        }
      }
    }
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t) {
      __m512 scale, mn;
      scale_min(szt + (t * p.G + g) * p.zs, p.zs, p.shift_min, offset, &scale, &mn);
#pragma GCC unroll 8
      for (int r = 0; r < MB; ++r) res[r][t] = group_end(res[r][t], acc[r][t], scale, mn, sx + r * p.G + g);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MB; ++r)
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t) store_out(y + (m0 + r) * p.N + (t0 + t) * 16, res[r][t]);
}

// All rows of x times tiles t0 .. t0 + NT - 1, in blocks of at most 2 (NT = 4), 6 (NT = 2) or 9
// rows, as even as they come (a block's row loops are unrolled whole: 10 rows and more spill its
// accumulators, 10-12 rows in one block measured 9.7-10.4 ms on the streamed layers above, against
// 5.3-6.7 in two). Each block reads the tile's codes again, from L1.
template <int NT, int Bits, typename T, typename S>
void strip_few_rows(const Problem<S>& p, const Unpack<Bits>& unpack, int64_t t0, T* y) {
  constexpr int kRows = NT == 4 ? 2 : NT == 2 ? 6 : 9;
  const int64_t blocks = (p.M + kRows - 1) / kRows, base = p.M / blocks, extra = p.M % blocks;
  for (int64_t b = 0, m = 0; b < blocks; ++b) {
    const int rows = static_cast<int>(base + (b < extra));
    with_constant<kRows>(rows, [&](auto mb) { strip_rows<decltype(mb)::value, NT>(p, unpack, t0, m, y); });
    m += rows;
  }
}

// Tiles at once for M rows: enough chains for few rows, registers for more.
inline int few_rows_tiles(int64_t M) { return M <= 2 ? 4 : M <= 6 ? 2 : 1; }

template <int Bits, typename T, typename S>
void tiles_few_rows(const Problem<S>& p, int64_t t_begin, int64_t t_end, T* y) {
  const Unpack<Bits> unpack;
  const int nt = few_rows_tiles(p.M);
  int64_t t = t_begin;
  if (nt == 4)
    for (; t + 4 <= t_end; t += 4) strip_few_rows<4>(p, unpack, t, y);
  if (nt == 2)
    for (; t + 2 <= t_end; t += 2) strip_few_rows<2>(p, unpack, t, y);
  for (; t < t_end; ++t) strip_few_rows<1>(p, unpack, t, y);
}

#if defined(__AVX512VNNI__)
// Few bfloat16 rows (M < fixed_rows_limit(), kFixedRows by default) on integer dot products: vdpbf16ps is slow on some hosts (one
// per 2-3 cycles on the AMX Xeon of amx.h, against two vpdpwssd, 32 multiply-adds each, a cycle),
// and a decode step is nothing but such calls. Codes widen to int16 words without a table and x
// goes to 16-bit fixed point per group: x[k] = xi[k] * 2^-s, s from the group's largest |x| (that
// one needs 8 bits, so |xi| <= 2^14 keeps every x of the group within 2^-6 of it exactly, the rest
// to 2^-14 of the largest). Then a group's sum is exact in int32:
//   acc = sum_k (code - o) xi[k] = sum_k code xi[k] - o sxi,   sxi = sum_k xi[k]
//   res = fma(scale, float(acc) * 2^-s, res);  res = fma(mn, sxi * 2^-s, res)
// with the same o and mn = min + o * scale as the float schedules (bits 7: o = 32, its codes are
// below 64). Integer sums do not depend on their order, so rows, blocks and threads cannot change
// a result either; what differs from the vector schedules is x's rounding to 15 bits beside the
// group's largest, a relative error of at most 2^-15 of it (tests/kernels/test_group_linear.py).
constexpr bool kFixedPoint = true;
// Rows per block of the fixed-point schedule: a tile's codes are unpacked once per block. Blocks of
// at most 3 rows unpacked them twice at 4 rows (a decode step of 4 sequences, or a verification of 3
// draft tokens); SmolLM2's 4-row decode step measured 6.2-8.0 ms against 7.4-9.6 with them (noisy
// host, processes alternated). The row loops are unrolled whole (unroll 8): with unroll 4 a 6-row
// block left its accumulators in memory (a 6-row step 8.9-9.8 ms against 6.8-8.2 on the vector
// schedule); 8-row blocks spill registers (21.7 ms at 8 rows, against 10.6-12.1): 24 accumulators
// beside the codes, broadcasts and constants leave too few of the 32 vector registers.
constexpr int kFixedBlock = 6;
// Every call of fewer rows is one block: two blocks (7-8 rows) measured slower than the vector schedules.
constexpr int64_t kFixedRows = kFixedBlock + 1;

inline int fixed_offset(int bits) { return bits == 7 ? 32 : code_offset(bits); }

// How far ahead (in chunks of 32 bytes) the fixed-point schedule prefetches its codes.
constexpr int64_t kPrefetch = 16;

// x in fixed point: xi [M, K] int16, and per group its sum sxi, the factor 2^-s and sx = sxi 2^-s,
// in one allocation (a decode step makes a call of this per linear, and a tile reads the pointers).
struct FixedX {
  at::Tensor storage;
  int16_t* xi;
  int32_t* sxi;
  float* f;
  float* sx;
};

FixedX fixed_x(const uint16_t* xh, int64_t M, int64_t K, int64_t gs) {
  const int64_t G = K / gs, xi_bytes = (2 * M * K + 63) / 64 * 64;
  FixedX fx;
  fx.storage = at::empty({xi_bytes + 12 * M * G}, at::dtype(at::kByte));
  uint8_t* base = fx.storage.data_ptr<uint8_t>();
  auto* xi = fx.xi = reinterpret_cast<int16_t*>(base);
  auto* sxi = fx.sxi = reinterpret_cast<int32_t*>(base + xi_bytes);
  auto* f = fx.f = reinterpret_cast<float*>(sxi + M * G);
  auto* sx = fx.sx = f + M * G;
  const auto* xb = reinterpret_cast<const c10::BFloat16*>(xh);
  const auto pow2 = [](int e) {  // 2^e for e in [-126, 127]
    const uint32_t bits = static_cast<uint32_t>(127 + e) << 23;
    float v;
    std::memcpy(&v, &bits, sizeof(v));
    return v;
  };
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t k0 = m * K + g * gs;
      __m512 mx = _mm512_setzero_ps();
      __mmask16 nan = 0;  // vmaxps drops a NaN met before a number: counted apart
      for (int64_t k = 0; k < gs; k += 16) {
        const __m512 v = load16(xb + k0 + k);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        mx = _mm512_max_ps(mx, _mm512_abs_ps(v));
      }
      const float amax = _mm512_reduce_max_ps(mx);
      uint32_t bits;
      std::memcpy(&bits, &amax, sizeof(bits));
      const int e = amax > 0.f ? static_cast<int>((bits >> 23) & 255) - 127 : 0;
      const int s = std::clamp(13 - e, -126, 126);
      const __m512 up = _mm512_set1_ps(pow2(s));
      __m512i sum = _mm512_setzero_si512();
      for (int64_t k = 0; k < gs; k += 16) {
        const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(load16(xb + k0 + k), up));  // to nearest even
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(xi + k0 + k), _mm512_cvtepi32_epi16(q));
        sum = _mm512_add_epi32(sum, q);
      }
      sxi[m * G + g] = _mm512_reduce_add_epi32(sum);
      // infinities and NaNs in x: NaN results, as the float schedules give
      f[m * G + g] = !nan && amax <= std::numeric_limits<float>::max() ? pow2(-s)
                                                                 : std::numeric_limits<float>::quiet_NaN();
      sx[m * G + g] = static_cast<float>(sxi[m * G + g]) * f[m * G + g];
    }
  return fx;
}

// One 32-byte chunk of codes -> kPairs vectors of int16 codes (unsigned), in Unpack's word order.
template <int Bits>
struct UnpackInt;

template <>
struct UnpackInt<4> {
  static constexpr int kPairs = 2;
  inline void operator()(const uint8_t* tile, int64_t c, __m512i* v) const {
    const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + c * 32)));
    v[0] = _mm512_and_si512(b, _mm512_set1_epi16(0x0F));
    v[1] = _mm512_srli_epi16(b, 4);
  }
};

template <>
struct UnpackInt<5> {
  static constexpr int kPairs = 2;
  inline void operator()(const uint8_t* tile, int64_t c, __m512i* v) const {
    const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk_at(tile, c, 5))));
    const __m512i h0 = _mm512_maskz_set1_epi16(static_cast<__mmask32>(fifth_bits(tile, c, 0)), 0x10);
    const __m512i h1 = _mm512_maskz_set1_epi16(static_cast<__mmask32>(fifth_bits(tile, c, 1)), 0x10);
    v[0] = _mm512_ternarylogic_epi32(b, _mm512_set1_epi16(0x0F), h0, 0xEA);  // (b & 15) | h0
    v[1] = _mm512_or_si512(_mm512_srli_epi16(b, 4), h1);
  }
};

template <int Bits>  // 7 and 8: a byte each
struct UnpackInt {
  static constexpr int kPairs = 1;
  inline void operator()(const uint8_t* tile, int64_t c, __m512i* v) const {
    v[0] = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + c * 32)));
  }
};

// Rows m0 .. m0 + MB - 1 times tiles t0 .. t0 + NT - 1, two int32 accumulators per row and tile
// (a chunk's two k pairs, or for a byte a chunk every other) for enough vpdpwssd chains.
template <int MB, int NT, int Bits, typename T, typename S>
void strip_rows_fixed(const Problem<S>& p, const FixedX& fx, int64_t t0, int64_t m0, T* y) {
  constexpr int P = UnpackInt<Bits>::kPairs;
  const UnpackInt<Bits> unpack;
  const int64_t tile_bytes = tile_rows(p.K, p.bits) * 32;
  const uint8_t* wt = p.w + t0 * tile_bytes;
  const S* szt = p.sz + t0 * p.G * p.zs;
  const int o = fixed_offset(p.bits);
  const int16_t* xi = fx.xi + m0 * p.K;
  const int32_t* sxi = fx.sxi + m0 * p.G;
  const float* f = fx.f + m0 * p.G;
  const float* sx = fx.sx + m0 * p.G;
  __m512 res[MB][NT];
#pragma GCC unroll 8
  for (int r = 0; r < MB; ++r)
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t) res[r][t] = _mm512_setzero_ps();
  const int64_t chunks_per_group = p.gs / (2 * P);  // even: gs is a multiple of 16
  for (int64_t g = 0; g < p.G; ++g) {
    __m512i acc[MB][NT][2];
#pragma GCC unroll 8
    for (int r = 0; r < MB; ++r)
#pragma GCC unroll 4
      for (int t = 0; t < NT; ++t) acc[r][t][0] = acc[r][t][1] = _mm512_setzero_si512();
    const int64_t c0 = g * chunks_per_group;
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t) _mm_prefetch(reinterpret_cast<const char*>(szt + (t * p.G + g + 1) * p.zs), _MM_HINT_T0);
#pragma GCC unroll 8
    for (int64_t c = c0; c < c0 + chunks_per_group; c += 2) {
      // a decode step streams its weights from memory: ask for them kPrefetch chunks ahead (the
      // hardware's streams alone left a core at about 6.6 GB/s on the AMX host, 8.5 with this)
#pragma GCC unroll 4
      for (int t = 0; t < NT; ++t)
        _mm_prefetch(reinterpret_cast<const char*>(chunk_at(wt + t * tile_bytes, c + kPrefetch, Bits)), _MM_HINT_T0);
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        __m512i v[NT][P];
#pragma GCC unroll 4
        for (int t = 0; t < NT; ++t) unpack(wt + t * tile_bytes, c + h, v[t]);
#pragma GCC unroll 2
        for (int i = 0; i < P; ++i)
#pragma GCC unroll 8
          for (int r = 0; r < MB; ++r) {
            const __m512i xv = (__m512i)bcast_pair(reinterpret_cast<const uint16_t*>(xi + r * p.K), (c + h) * P + i);
            const int a = P == 2 ? i : h;
#pragma GCC unroll 4
            for (int t = 0; t < NT; ++t) acc[r][t][a] = _mm512_dpwssd_epi32(acc[r][t][a], v[t][i], xv);
          }
      }
    }
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t) {
      __m512 scale, mn;
      scale_min(szt + (t * p.G + g) * p.zs, p.zs, p.shift_min, static_cast<float>(o), &scale, &mn);
#pragma GCC unroll 8
      for (int r = 0; r < MB; ++r) {
        const __m512i sum = _mm512_sub_epi32(_mm512_add_epi32(acc[r][t][0], acc[r][t][1]),
                                             _mm512_set1_epi32(o * sxi[r * p.G + g]));
        const __m512 part = _mm512_mul_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(f[r * p.G + g]));
        res[r][t] = group_end(res[r][t], part, scale, mn, sx + r * p.G + g);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MB; ++r)
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t) store_out(y + (m0 + r) * p.N + (t0 + t) * 16, res[r][t]);
}

// The parallel split's grain in tiles for M rows.
inline int fixed_tiles(int64_t M) { return M == 1 ? 4 : 2; }

// Rows in blocks of at most kFixedBlock (as even as they come), each block over one tile at a time while its
// codes are in L1: the codes stream from memory once per call. One tile at a time keeps a thread's
// codes and (scale, min) two sequential streams, which the prefetchers serve better than a strip of
// tiles side by side (2 or 4 tiles: 4 to 8 interleaved streams). Measured on an AMD EPYC host, calls
// streaming from DRAM over SmolLM2's layer shapes, against the strips this replaced: 2-3 rows x1.05-
// 1.19 (4, 5, 7 and 8 bits), 4 rows x0.99-1.07; one row of 4-bit codes x1.14-1.20 (x1.29-1.32 on one
// 106 MB matrix). One row of wider codes too (5, 7 and 8 bits), against 4 tiles at a time: Gemma 3
// 270M's Q8_0 LM head (178 MB, 640 x 262144) x0.83-0.91 in one process, its batch-1 decode step
// x0.92-0.93, SmolLM2's x0.99-1.01 (bench/peers/serve_compare.py shows the served figures).
template <int Bits, typename T, typename S>
void tiles_fixed(const Problem<S>& p, const FixedX& fx, int64_t t_begin, int64_t t_end, T* y) {
  const int64_t blocks = (p.M + kFixedBlock - 1) / kFixedBlock, base = p.M / blocks, extra = p.M % blocks;
  for (int64_t t = t_begin; t < t_end; ++t)
    for (int64_t b = 0, m0 = 0; b < blocks; ++b) {
      const int rows = static_cast<int>(base + (b < extra));
      with_constant<kFixedBlock>(rows,
                                 [&](auto mb) { strip_rows_fixed<decltype(mb)::value, 1, Bits>(p, fx, t, m0, y); });
      m0 += rows;
    }
}

// kFixedRows, or TOKENMILL_FIXED_ROWS (read once: 0 turns the fixed-point products off).
int64_t fixed_rows_limit() {
  static const int64_t limit = rows_from_env("TOKENMILL_FIXED_ROWS", kFixedRows);
  return limit;
}

// Whether a call takes the fixed-point products (run) and so needs no prepare_x (run_x).
inline bool fixed_applies(bool generic, bool tiles_ok, bool bf16_x, int64_t M, int64_t gs, int bits, bool shift_min) {
  return !generic && tiles_ok && bf16_x && M < fixed_rows_limit() && gs % 16 == 0 &&
         (shift_min || fixed_offset(bits) == code_offset(bits));
}
#else
constexpr bool kFixedPoint = false;
constexpr int64_t kFixedRows = 0;
inline int64_t fixed_rows_limit() { return 0; }
inline bool fixed_applies(bool, bool, bool, int64_t, int64_t, int, bool) { return false; }
#endif

// Many rows: MB rows x NB tiles over a strip unpacked to bfloat16, w [K / 2][NB][32], smin
// [G][NB][2][16] (scale, mn) as float32. The MB x NB group accumulators stay in registers (enough
// independent vdpbf16ps chains to hide its latency); the results live in `res` (L1) between groups.
constexpr int kStripTiles = 2;
constexpr int kBlockRows = 12;

// A row block's x pairs, in slabs of 16 k pairs: [K / 32][rows][terms][16] (terms: bfloat16 x, or
// float32 x's high and low parts); pair p of row m, term e is
// panel_pair(panel, p, rows * terms)[(m * terms + e) * kSlab].
constexpr int kSlab = 16;
inline const uint32_t* panel_pair(const uint32_t* panel, int64_t p, int64_t row_terms) {
  return panel + (p / kSlab) * row_terms * kSlab + p % kSlab;
}

template <int MB, int NB, bool WithMin, typename T>
inline void gemm_block(const uint32_t* xp, const float* sx, int64_t G, int64_t gp, const uint16_t* w,
                       const float* smin, T* y, int64_t N, float* res) {
  constexpr int kTerms = std::is_same_v<T, float> ? 2 : 1;
#pragma GCC unroll 32
  for (int i = 0; i < MB * NB; ++i) _mm512_store_ps(res + i * 16, _mm512_setzero_ps());
  __m512 acc[MB][NB];
  // res += group g's sums, from acc
  auto fold = [&](int64_t g, int m, int t) {
    const float* sm = smin + (g * NB + t) * 32;
    float* r = res + (m * NB + t) * 16;
    return group_end<WithMin>(_mm512_load_ps(r), acc[m][t], _mm512_load_ps(sm), _mm512_load_ps(sm + 16),
                              sx + m * G + g);
  };
  for (int64_t g = 0; g < G; ++g) {
    const uint16_t* wg = w + g * gp * NB * 32;
    const uint32_t* x0 = panel_pair(xp, g * gp, MB * kTerms);
    {  // the group's first pair, interleaved with the end of the previous group
      __m512bh wv[NB];
#pragma GCC unroll 4
      for (int t = 0; t < NB; ++t) wv[t] = (__m512bh)_mm512_load_si512(wg + t * 32);
#pragma GCC unroll 16
      for (int m = 0; m < MB; ++m) {
        __m512bh xv[kTerms];
#pragma GCC unroll 2
        for (int e = 0; e < kTerms; ++e)
          xv[e] = (__m512bh)_mm512_set1_epi32(static_cast<int>(x0[(m * kTerms + e) * kSlab]));
#pragma GCC unroll 4
        for (int t = 0; t < NB; ++t) {
          __m512 first = _mm512_dpbf16_ps(_mm512_setzero_ps(), wv[t], xv[0]);
          if constexpr (kTerms == 2) first = _mm512_dpbf16_ps(first, wv[t], xv[1]);
          if (g > 0) _mm512_store_ps(res + (m * NB + t) * 16, fold(g - 1, m, t));
          acc[m][t] = first;
        }
      }
    }
    for (int64_t p = 1; p < gp; ++p) {
      const uint32_t* xk = panel_pair(xp, g * gp + p, MB * kTerms);
      __m512bh wv[NB];
#pragma GCC unroll 4
      for (int t = 0; t < NB; ++t) wv[t] = (__m512bh)_mm512_load_si512(wg + (p * NB + t) * 32);
#pragma GCC unroll 16
      for (int m = 0; m < MB; ++m)
#pragma GCC unroll 2
        for (int e = 0; e < kTerms; ++e) {
          const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(xk[(m * kTerms + e) * kSlab]));
#pragma GCC unroll 4
          for (int t = 0; t < NB; ++t) acc[m][t] = _mm512_dpbf16_ps(acc[m][t], wv[t], xv);
        }
    }
  }
#pragma GCC unroll 16
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 4
    for (int t = 0; t < NB; ++t) store_out(y + m * N + 16 * t, fold(G - 1, m, t));
}

template <int NB, bool WithMin, typename T>
inline void gemm_rows(int mb, const uint32_t* xp, const float* sx, int64_t G, int64_t gp, const uint16_t* w,
                      const float* smin, T* y, int64_t N, float* res) {
  with_constant<kBlockRows>(mb, [&](auto rows) {
    gemm_block<decltype(rows)::value, NB, WithMin>(xp, sx, G, gp, w, smin, y, N, res);
  });
}

// Rows in blocks of at most kBlockRows, as even as they come (257 rows: 15 blocks of 12 and 7 of
// 11, no short last block): block b is rows [start(b), start(b + 1)).
struct RowBlocks {
  int64_t count, base, extra;
  explicit RowBlocks(int64_t M) : count((M + kBlockRows - 1) / kBlockRows), base(0), extra(0) {
    if (count) base = M / count, extra = M % count;
  }
  int64_t start(int64_t b) const { return b * base + std::min(b, extra); }
};

// x of every row block as gemm_block reads it (panel_pair's layout, the last slab zero-padded).
at::Tensor x_panels(const uint16_t* xh, const uint16_t* xl, int64_t M, int64_t K, const RowBlocks& rb) {
  const int terms = xl ? 2 : 1;
  const int64_t pairs = K / 2, slabs = (pairs + kSlab - 1) / kSlab;
  auto out = at::empty({M * slabs * kSlab * terms}, at::dtype(at::kInt));
  auto* o = reinterpret_cast<uint32_t*>(out.data_ptr<int32_t>());
  at::parallel_for(0, rb.count, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t m0 = rb.start(b), mb = rb.start(b + 1) - m0;
      uint32_t* panel = o + m0 * slabs * kSlab * terms;
      for (int64_t m = 0; m < mb; ++m)
        for (int e = 0; e < terms; ++e) {
          const uint32_t* src = reinterpret_cast<const uint32_t*>((e ? xl : xh) + (m0 + m) * K);
          for (int64_t s = 0; s < slabs; ++s) {
            uint32_t* dst = panel + ((s * mb + m) * terms + e) * kSlab;
            const int64_t n = std::min<int64_t>(kSlab, pairs - s * kSlab);
            std::memcpy(dst, src + s * kSlab, n * sizeof(uint32_t));
            if (n < kSlab) std::memset(dst + n, 0, (kSlab - n) * sizeof(uint32_t));
          }
        }
    }
  });
  return out;
}

struct AlignedBuffer {
  void* ptr;
  explicit AlignedBuffer(size_t bytes) : ptr(std::aligned_alloc(64, (bytes + 63) / 64 * 64)) {
    TORCH_CHECK(ptr, "out of memory for a weight strip");
  }
  ~AlignedBuffer() { std::free(ptr); }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
};

// NB tiles from t0 unpacked to bfloat16 [K / 2][NB][32] and their (scale, mn) to [G][NB][2][16];
// whether any mn of them is nonzero.
template <int NB, int Bits, typename S>
bool unpack_strip(const Problem<S>& p, const Unpack<Bits>& unpack, int64_t t0, uint16_t* w, float* smin) {
  constexpr int P = Unpack<Bits>::kPairs;
  const int64_t chunks = p.K / (2 * P);
  const float offset = static_cast<float>(code_offset(p.bits));
  __mmask16 nonzero = 0;
  for (int t = 0; t < NB; ++t) {
    const uint8_t* wt = p.w + (t0 + t) * tile_rows(p.K, p.bits) * 32;
    for (int64_t c = 0; c < chunks; ++c) {
      __m512bh v[P];
      unpack(wt, c, v);
      for (int i = 0; i < P; ++i) _mm512_store_si512(w + ((c * P + i) * NB + t) * 32, (__m512i)v[i]);
    }
    const S* szt = p.sz + (t0 + t) * p.G * p.zs;
    for (int64_t g = 0; g < p.G; ++g) {
      __m512 scale, mn;
      scale_min(szt + g * p.zs, p.zs, p.shift_min, offset, &scale, &mn);
      _mm512_store_ps(smin + (g * NB + t) * 32, scale);
      _mm512_store_ps(smin + (g * NB + t) * 32 + 16, mn);
      nonzero |= _mm512_cmpneq_ps_mask(mn, _mm512_setzero_ps());
    }
  }
  return nonzero != 0;
}

template <int NB, int Bits, typename T, typename S>
void strip_many_rows(const Problem<S>& p, const Unpack<Bits>& unpack, const uint32_t* xp, const RowBlocks& rb,
                     int64_t t0, uint16_t* w, float* smin, float* res, T* y) {
  const bool with_min = unpack_strip<NB>(p, unpack, t0, w, smin);
  const int64_t gp = p.gs / 2, terms = p.xl ? 2 : 1;
  for (int64_t b = 0; b < rb.count; ++b) {
    const int64_t m = rb.start(b);
    const int mb = static_cast<int>(rb.start(b + 1) - m);
    const uint32_t* xb = xp + m * ((p.K / 2 + kSlab - 1) / kSlab) * kSlab * terms;
    T* ym = y + m * p.N + t0 * 16;
    if (with_min) gemm_rows<NB, true>(mb, xb, p.sx + m * p.G, p.G, gp, w, smin, ym, p.N, res);
    else gemm_rows<NB, false>(mb, xb, p.sx + m * p.G, p.G, gp, w, smin, ym, p.N, res);
  }
}

template <int Bits, typename T, typename S>
void tiles_many_rows(const Problem<S>& p, const uint32_t* xp, const RowBlocks& rb, int64_t t_begin, int64_t t_end,
                     T* y) {
  const Unpack<Bits> unpack;
  AlignedBuffer w(static_cast<size_t>(p.K / 2) * kStripTiles * 32 * sizeof(uint16_t));
  AlignedBuffer smin(static_cast<size_t>(p.G) * kStripTiles * 32 * sizeof(float));
  auto* wp = static_cast<uint16_t*>(w.ptr);
  auto* sp = static_cast<float*>(smin.ptr);
  alignas(64) float res[kBlockRows * kStripTiles * 16];
  int64_t t = t_begin;
  for (; t + kStripTiles <= t_end; t += kStripTiles)
    strip_many_rows<kStripTiles>(p, unpack, xp, rb, t, wp, sp, res, y);
  for (; t < t_end; ++t) strip_many_rows<1>(p, unpack, xp, rb, t, wp, sp, res, y);
}
#if defined(TOKENMILL_AMX)
// AMX tiles (amx.h), bfloat16 x, calls of kMinRows rows or more: each thread unpacks a strip of NB
// tiles as the many-rows schedule does; then, per row tile of 16 and output tile, every group's sums come from
// tile products of depth 32 (or 16, for groups of 16) from zeroed accumulators, stored and folded
// into the 16 rows' results (in registers over all groups) with group_end, as the vector schedules
// fold theirs. Groups alternate between two sets of tiles (accumulator 0, x 4, weights 6; and 1, 5,
// 7), and the next group's product is issued before this one's fold, so that the tile unit and the
// vector units work at once.
template <bool WithMin, int NB, typename T, typename S>
inline void tile_column(const Problem<S>& p, const tokenmill_amx::RowTiles& xs, int64_t b, int64_t depth,
                        const uint16_t* w, int t, const float* smin, T* y, int64_t n0) {
  const int live = xs.live(b);
  const int64_t m0 = 16 * b;
  alignas(64) float c[2][256];
  __m512 res[16];
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r) res[r] = _mm512_setzero_ps();
  const int64_t ldw = NB * 64, steps = p.gs / depth;
  constexpr int64_t ldx = tokenmill_amx::kRowBytes;
  const float* sx = p.sx + m0 * p.G;
  // The tile intrinsics take their tile numbers as literals: one branch per set of tiles.
  auto product = [&](auto set, int64_t g) {
    const int64_t kg = g * p.gs;
    const uint16_t* wg = w + (g * p.gs / 2) * NB * 32 + t * 32;
    if constexpr (decltype(set)::value == 0) {
      _tile_zero(0);
      for (int64_t s = 0; s < steps; ++s) {
        _tile_loadd(4, xs.at(b, kg + s * depth), ldx);
        _tile_loadd(6, wg + (s * depth / 2) * NB * 32, ldw);
        _tile_dpbf16ps(0, 4, 6);
      }
      _tile_stored(0, c[0], 64);
    } else {
      _tile_zero(1);
      for (int64_t s = 0; s < steps; ++s) {
        _tile_loadd(5, xs.at(b, kg + s * depth), ldx);
        _tile_loadd(7, wg + (s * depth / 2) * NB * 32, ldw);
        _tile_dpbf16ps(1, 5, 7);
      }
      _tile_stored(1, c[1], 64);
    }
  };
  auto fold = [&](const float* cb, int64_t g) {
    const float* sm = smin + (g * NB + t) * 32;
    const __m512 scale = _mm512_load_ps(sm), mn = _mm512_load_ps(sm + 16);
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r)  // unrolled: res[r] stays in a register; rows past live cost a branch
      if (r < live) res[r] = group_end<WithMin>(res[r], _mm512_load_ps(cb + 16 * r), scale, mn, sx + r * p.G + g);
  };
  const std::integral_constant<int, 0> first;
  const std::integral_constant<int, 1> second;
  product(first, 0);
  for (int64_t g = 0; g < p.G; g += 2) {
    if (g + 1 < p.G) product(second, g + 1);
    fold(c[0], g);
    if (g + 1 < p.G) {
      if (g + 2 < p.G) product(first, g + 2);
      fold(c[1], g + 1);
    }
  }
  for (int r = 0; r < live; ++r) store_out(y + (m0 + r) * p.N + n0, res[r]);
}

template <int NB, int Bits, typename T, typename S>
void strip_tiles(const Problem<S>& p, const Unpack<Bits>& unpack, const tokenmill_amx::RowTiles& xs, int64_t depth,
                 int64_t t0, uint16_t* w, float* smin, T* y) {
  const bool with_min = unpack_strip<NB>(p, unpack, t0, w, smin);
  for (int64_t b = 0; b < xs.blocks(); ++b) {
    for (int t = 0; t < NB; ++t) {
      if (with_min) tile_column<true, NB>(p, xs, b, depth, w, t, smin, y, (t0 + t) * 16);
      else tile_column<false, NB>(p, xs, b, depth, w, t, smin, y, (t0 + t) * 16);
    }
  }
}

template <int Bits, typename T, typename S>
void tiles_amx(const Problem<S>& p, const tokenmill_amx::RowTiles& xs, int64_t t_begin, int64_t t_end, T* y) {
  const Unpack<Bits> unpack;
  const int64_t depth = p.gs % 32 == 0 ? 32 : 16;
  AlignedBuffer w(static_cast<size_t>(p.K / 2) * kStripTiles * 32 * sizeof(uint16_t));
  AlignedBuffer smin(static_cast<size_t>(p.G) * kStripTiles * 32 * sizeof(float));
  auto* wp = static_cast<uint16_t*>(w.ptr);
  auto* sp = static_cast<float*>(smin.ptr);
  tokenmill_amx::configure(static_cast<int>(depth), xs.tile_rows());
  int64_t t = t_begin;
  for (; t + kStripTiles <= t_end; t += kStripTiles) strip_tiles<kStripTiles>(p, unpack, xs, depth, t, wp, sp, y);
  for (; t < t_end; ++t) strip_tiles<1>(p, unpack, xs, depth, t, wp, sp, y);
  _tile_release();
}

#endif  // TOKENMILL_AMX

// Many rows (calls of dequant_rows_limit() rows or more, bfloat16 x, K a multiple of 32, fastest
// path): each thread turns panels of its output tiles into bfloat16 weights once per call and runs
// the bfloat16 GEMM over them, bf16_linear.cpp's own schedule (AMX: tokenmill_amx::rows_2x2; else
// bf16_panel_vector). A weight is
//   w = bfloat16(fma(code, scale, min))   (scales alone: (code - o) * scale; Tinygemm: fma(q - 8, scale, zero))
// rounded to nearest even: the file's float32 dequantization, rounded as a bfloat16 copy of the
// dequantized model holds it, so a row's result is bit for bit bf16_packed_linear's over that copy
// (on the same host, same number of rows' schedule). It is not the group-by-group sum of the other
// schedules: the weights lose their bits past bfloat16's 8 (relative 2^-9 at most, the rounding
// bfloat16 x already has), and the call pays one pass over the weights (about 15 G weights/s on 2
// cores; on AMX hosts mostly beside the tile products), 1 / M of the products' work per weight. It replaces the group ends' folds, which held
// the tile schedule to 0.6-0.9 of bf16_linear.cpp's speed and the vector one to at most 16 / 18.
// From how many rows it pays (2 threads, SmolLM2 and Gemma 3 shapes, Q4_1-style codes hot, the
// best of two runs): on AMX against tile_column, 16 rows 1.05-1.11x the time, 24 rows 0.94-1.05x,
// 32 rows 0.85-0.95x; on vectors (TOKENMILL_AMX=0) against the many-rows schedule, 16 rows
// 0.99-1.07x, 24 rows 0.93-1.00x, 32 rows 0.92-0.95x; hence 24 for both. (With the pass overlapping
// the tile products, tiles_dequant_amx, measured again: x bf16 at 16 rows 0.39-0.60 against
// tile_column's 0.47-0.70, at 20 rows 0.55-0.73 against 0.46-0.80, at 32 rows 0.50-0.69 against
// 0.37-0.73: the line stays.)
constexpr int64_t kDequantRows = 24;
constexpr int64_t kPanelBytes = 512 * 1024;  // bfloat16 weights per panel: beside a row chunk of x in L2

// kDequantRows, or TOKENMILL_DEQUANT_ROWS (read once: 0 turns the path off).
int64_t dequant_rows_limit() {
  static const int64_t limit = rows_from_env("TOKENMILL_DEQUANT_ROWS", kDequantRows);
  return limit;
}

// Whether a call takes tiles_dequant (run) and so needs no group sums of x (run_x).
inline bool dequant_applies(bool generic, bool tiles_ok, bool bf16_x, int64_t M, int64_t K) {
  const int64_t rows = dequant_rows_limit();
  return !generic && tiles_ok && bf16_x && rows && M >= rows && K % 32 == 0;
}

// One 32-byte chunk of codes as float32, unshifted (0 .. 2^bits - 1): for each of its kPairs k
// pairs, words 0..15 (rows 0..7) in lo and 16..31 (rows 8..15) in hi. Straight from the bytes, not
// through Unpack's bfloat16: what dequantizing needs.
template <int Bits>
struct CodeFloats {
  static constexpr int kPairs = Unpack<Bits>::kPairs;
  inline void operator()(const uint8_t* tile, int64_t c, __m512* lo, __m512* hi) const {
    const uint8_t* chunk = Bits == 5 ? chunk_at(tile, c, 5) : tile + c * 32;
    const __m512i b0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk)));
    const __m512i b1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk + 16)));
    if constexpr (Bits == 4 || Bits == 5) {
      const __m512i nibble = _mm512_set1_epi32(15);
      __m512i l0 = _mm512_and_si512(b0, nibble), h0 = _mm512_and_si512(b1, nibble);
      __m512i l1 = _mm512_srli_epi32(b0, 4), h1 = _mm512_srli_epi32(b1, 4);
      if constexpr (Bits == 5) {  // bit 4 of word w of k pair 2c + i: bit w of fifth_bits(i)
        const uint32_t f0 = fifth_bits(tile, c, 0), f1 = fifth_bits(tile, c, 1);
        const __m512i sixteen = _mm512_set1_epi32(16);
        l0 = _mm512_mask_or_epi32(l0, static_cast<__mmask16>(f0), l0, sixteen);
        h0 = _mm512_mask_or_epi32(h0, static_cast<__mmask16>(f0 >> 16), h0, sixteen);
        l1 = _mm512_mask_or_epi32(l1, static_cast<__mmask16>(f1), l1, sixteen);
        h1 = _mm512_mask_or_epi32(h1, static_cast<__mmask16>(f1 >> 16), h1, sixteen);
      }
      lo[0] = _mm512_cvtepi32_ps(l0), hi[0] = _mm512_cvtepi32_ps(h0);
      lo[1] = _mm512_cvtepi32_ps(l1), hi[1] = _mm512_cvtepi32_ps(h1);
    } else {
      lo[0] = _mm512_cvtepi32_ps(b0), hi[0] = _mm512_cvtepi32_ps(b1);
    }
  }
};

// How a tile's weights come from its float codes: fma(code, scale, min) (Grouped, mins stored);
// fma(code - o, scale, mn) (Tinygemm: (q - 8) * scale + zero); (code - o) * scale (scales alone).
enum class Dequant { kMin, kShiftedMin, kScaleAlone };

// Tiles [t_first, t_first + count) as bfloat16 weights in bf16_pack's layout, tile i at
// w + i * K / 2 * 32 (K / 2 k pairs of 32 words), made chunk by chunk in order on request: all at
// once (dequant_tiles) or a few chunks at a time between the tile products of the tiles made
// before (tiles_dequant_amx), where the vector units would otherwise wait on the tile unit.
template <int Bits, typename S>
class DequantCursor {
 public:
  static constexpr int kPairs = CodeFloats<Bits>::kPairs;

  DequantCursor(const Problem<S>& p, int64_t t_first, int64_t count, uint16_t* w)
      : p_(p),
        w_(w),
        d_(p.zs == 16 ? Dequant::kScaleAlone : p.shift_min ? Dequant::kMin : Dequant::kShiftedMin),
        t_first_(t_first),
        per_tile_(p.K / (2 * kPairs)),
        per_group_(p.gs / (2 * kPairs)),
        end_(count * per_tile_),
        o_(_mm512_set1_ps(static_cast<float>(code_offset(p.bits)))) {}

  int64_t chunks_per_tile() const { return per_tile_; }
  int64_t made() const { return next_; }
  // Makes chunks until `until` of them (counted from the first tile's first) are made.
  void make_until(int64_t until) {
    until = std::min(until, end_);
    for (; next_ < until; ++next_) {
      if (c_ == per_tile_) c_ = 0, g_ = 0, ++t_;
      if (c_ == g_ * per_group_) load_group(), ++g_;
      switch (d_) {
        case Dequant::kMin: chunk<Dequant::kMin>(); break;
        case Dequant::kShiftedMin: chunk<Dequant::kShiftedMin>(); break;
        case Dequant::kScaleAlone: chunk<Dequant::kScaleAlone>(); break;
      }
      ++c_;
    }
  }

 private:
  // The scales and mins of chunk c_'s group, per word: word 2r + j of a k pair is row r, so words
  // 0..15 (rows 0..7) take the lo vectors and 16..31 (rows 8..15) the hi ones.
  void load_group() {
    const __m512i lo_rows = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i hi_rows = _mm512_add_epi32(lo_rows, _mm512_set1_epi32(8));
    const S* sz = p_.sz + ((t_first_ + t_) * p_.G + g_) * p_.zs;
    const __m512 scale = load16(sz);
    s_lo_ = _mm512_permutexvar_ps(lo_rows, scale), s_hi_ = _mm512_permutexvar_ps(hi_rows, scale);
    if (d_ != Dequant::kScaleAlone) {
      const __m512 mn = load16(sz + 16);
      m_lo_ = _mm512_permutexvar_ps(lo_rows, mn), m_hi_ = _mm512_permutexvar_ps(hi_rows, mn);
    }
  }

  template <Dequant D>
  inline void chunk() {
    const uint8_t* wt = p_.w + (t_first_ + t_) * tile_rows(p_.K, p_.bits) * 32;
    uint16_t* w = w_ + t_ * (p_.K / 2) * 32 + c_ * kPairs * 32;
    __m512 lo[kPairs], hi[kPairs];
    CodeFloats<Bits>()(wt, c_, lo, hi);
#pragma GCC unroll 2
    for (int i = 0; i < kPairs; ++i) {
      if constexpr (D != Dequant::kMin) lo[i] = _mm512_sub_ps(lo[i], o_), hi[i] = _mm512_sub_ps(hi[i], o_);
      __m512 w_lo, w_hi;  // one rounding each: the products are exact
      if constexpr (D == Dequant::kScaleAlone) {
        w_lo = _mm512_mul_ps(lo[i], s_lo_), w_hi = _mm512_mul_ps(hi[i], s_hi_);
      } else {
        w_lo = _mm512_fmadd_ps(lo[i], s_lo_, m_lo_), w_hi = _mm512_fmadd_ps(hi[i], s_hi_, m_hi_);
      }
      _mm512_store_si512(w + i * 32, (__m512i)_mm512_cvtne2ps_pbh(w_hi, w_lo));
    }
  }

  const Problem<S>& p_;
  uint16_t* w_;
  Dequant d_;
  int64_t t_first_, per_tile_, per_group_, end_;
  __m512 o_, s_lo_, s_hi_, m_lo_ = _mm512_setzero_ps(), m_hi_ = _mm512_setzero_ps();
  // next_: chunks made; the next one is chunk c_ of tile t_, whose first g_ groups' scales have been
  // loaded (the vectors above hold group g_ - 1's)
  int64_t next_ = 0, t_ = 0, c_ = 0, g_ = 0;
};

// Tiles [t_first, t_first + count) as bfloat16 weights, tile i at w + i * K / 2 * 32.
template <int Bits, typename S>
void dequant_tiles(const Problem<S>& p, int64_t t_first, int64_t count, uint16_t* w) {
  DequantCursor<Bits, S> cursor(p, t_first, count, w);
  cursor.make_until(count * cursor.chunks_per_tile());
}

// The bfloat16 weight buffer of the calling thread, at least `words` long, 64-byte aligned: kept
// between calls (a fresh allocation of this size is fresh pages, a fault each).
inline uint16_t* thread_weights(size_t words) {
  thread_local std::vector<uint16_t> buffer;
  return aligned_words(buffer, words);
}

#if defined(TOKENMILL_AMX)
// x of up to this many bytes stays in L2 beside the weights: every row at once; more: rows in
// chunks of tokenmill_amx::kChunkRows, each chunk over all of the panel's tile pairs.
constexpr int64_t kRowsInL2 = 1 << 20;
// A thread's tile pairs are dequantized as one panel (in L2 or L3, read again per row chunk, as
// bf16_linear.cpp reads its packed weights) up to this many bytes; more (an LM head): panels of
// kPanelBytes. Each pair of a panel after its first is made during the previous pair's products
// over the first row chunk, a few chunks after each k step (rows_2x2's between): the vector units
// dequantize while the tile unit multiplies, and the new pair is in L2 when its turn comes.
// Measured on the AMX host (2 threads, SmolLM2 and Gemma 3 shapes, bits 4 / 5 / 8, paired
// against making the whole panel first in the same process): 256 rows 1.02-1.15x faster (x bf16
// 0.90-1.13 against 0.80-1.05), 64 rows 0.97-1.12x.
constexpr int64_t kThreadWeightBytes = 8 << 20;

template <int Bits, typename T, typename S>
void tiles_dequant_amx(const Problem<S>& p, const tokenmill_amx::RowTiles& rows, int64_t q_begin, int64_t q_end,
                       T* y) {
  const int64_t tiles = p.N / 16, tile_words = p.K / 2 * 32, pair_words = 2 * tile_words, blocks = rows.blocks();
  const int64_t chunk_blocks = p.M * p.K * 2 <= kRowsInL2 ? blocks : tokenmill_amx::kChunkRows / 16;
  const int64_t panel_pairs = (q_end - q_begin) * pair_words * 2 <= kThreadWeightBytes
                                  ? q_end - q_begin
                                  : std::max<int64_t>(1, kPanelBytes / (pair_words * 2));
  uint16_t* w = thread_weights(static_cast<size_t>(std::min(panel_pairs, q_end - q_begin) * pair_words));
  // k steps of rows_2x2 per pair in the first row chunk, between which the next pair is made
  const int64_t steps = (std::min(chunk_blocks, blocks) + 1) / 2 * (p.K / 32);
  tokenmill_amx::configure(32, rows.tile_rows());
  for (int64_t q0 = q_begin; q0 < q_end; q0 += panel_pairs) {
    const int64_t q1 = std::min(q0 + panel_pairs, q_end);
    DequantCursor<Bits, S> cursor(p, 2 * q0, std::min(2 * q1, tiles) - 2 * q0, w);
    const int64_t per_pair = 2 * cursor.chunks_per_tile(), per_step = (per_pair + steps - 1) / steps;
    cursor.make_until(per_pair);  // the panel's first pair; each next one between its predecessor's products
    for (int64_t b0 = 0; b0 < blocks; b0 += chunk_blocks)
      for (int64_t q = q0; q < q1; ++q) {
        const int64_t t0 = 2 * q, made = (q - q0 + 2) * per_pair;  // through the next pair
        const uint16_t* w0 = w + (q - q0) * pair_words;
        tokenmill_amx::rows_2x2(
            rows, b0, std::min(b0 + chunk_blocks, blocks), w0, t0 + 1 < tiles ? w0 + tile_words : nullptr, p.K,
            [&](const float* c, int live, int64_t b, int j) {
              T* o = y + 16 * b * p.N + (t0 + j) * 16;
              for (int r = 0; r < live; ++r) store_out(o + r * p.N, _mm512_load_ps(c + 16 * r));
            },
            [&] { cursor.make_until(std::min(cursor.made() + per_step, made)); });
        cursor.make_until(made);
      }
  }
  _tile_release();
}
#endif

// Pairs of output tiles [q_begin, q_end) (one thread's share; the last pair of an odd count has
// one tile). xs: x's row tiles where the products run on AMX tiles, else nullptr.
template <int Bits, typename T, typename S>
void tiles_dequant(const Problem<S>& p, [[maybe_unused]] const void* xs, int64_t q_begin, int64_t q_end, T* y) {
#if defined(TOKENMILL_AMX)
  if (xs) return tiles_dequant_amx<Bits>(p, *static_cast<const tokenmill_amx::RowTiles*>(xs), q_begin, q_end, y);
#endif
  // vectors: panels of kPanelBytes, each then through the vector GEMM
  const int64_t tiles = p.N / 16, tile_words = p.K / 2 * 32;
  const int64_t panel_pairs = std::max<int64_t>(1, kPanelBytes / (2 * tile_words * 2));
  uint16_t* w = thread_weights(static_cast<size_t>(std::min(panel_pairs, q_end - q_begin) * 2 * tile_words));
  for (int64_t q0 = q_begin; q0 < q_end; q0 += panel_pairs) {
    const int64_t q1 = std::min(q0 + panel_pairs, q_end), t_first = 2 * q0, t_last = std::min(2 * q1, tiles);
    dequant_tiles<Bits>(p, t_first, t_last - t_first, w);
    // c10::BFloat16 and Bf16InFloat: bfloat16 bits and float32 holding bfloat16 values, as bf16_linear.cpp stores them
    using Out = std::conditional_t<std::is_same_v<T, c10::BFloat16>, uint16_t, float>;
    bf16_panel_vector(p.xh, p.M, p.K, w, t_last - t_first, reinterpret_cast<Out*>(y + 16 * t_first), p.N);
  }
}
#else
constexpr bool kFast = false;
inline int64_t dequant_rows_limit() { return 0; }
inline bool dequant_applies(bool, bool, bool, int64_t, int64_t) { return false; }
constexpr bool kFixedPoint = false;
constexpr int64_t kFixedRows = 0;
inline int64_t fixed_rows_limit() { return 0; }
inline bool fixed_applies(bool, bool, bool, int64_t, int64_t, int, bool) { return false; }
#endif


// Bfloat16 scales come only from int4_weight_linear, at bits 4 (tinygemm's layout).
template <typename S>
constexpr bool kInt4Scales = std::is_same_v<S, c10::BFloat16>;

// f(std::integral_constant<int, bits>()) for bits 4, 5, 7 or 8 (any other: 8, as checked before);
// for int4_weight_linear's scales, bits 4 alone (fewer instances to compile).
template <typename S, typename F>
inline void with_bits(int bits, F&& f) {
  if constexpr (kInt4Scales<S>) {
    TORCH_CHECK(bits == 4, "bfloat16 scales are int4_weight_linear's, at bits 4; got bits ", bits);
    f(std::integral_constant<int, 4>());
  } else if (bits == 4) f(std::integral_constant<int, 4>());
  else if (bits == 5) f(std::integral_constant<int, 5>());
  else if (bits == 7) f(std::integral_constant<int, 7>());
  else f(std::integral_constant<int, 8>());
}

// Rows at which the unpack-once schedule takes over (the same sums either way: only speed), where
// the dequantize-once GEMM (dequant_rows_limit(), the same 24 by default) does not apply first: float32
// x, or TOKENMILL_DEQUANT_ROWS set higher. A call of a whole model's layers streams its codes from
// memory, and the few-rows schedule overlaps that stream with its products where the unpack-once
// schedule stalls on each strip's codes before its products start: 30 layers of SmolLM2's shapes in
// 4-bit codes (60 MB, past L3), AMD EPYC, 2 threads, against that schedule from 10 rows: 10 rows
// 5.3-5.6 ms against 7.6-7.8, 12 rows 6.1-6.7 against 8.0-8.2, 16 rows 7.7-8.0 against 9.8, 20 rows
// 9.1-9.3 against 11.0-11.3; with the weights hot in cache the two are within noise (0.59-0.72 of the
// bfloat16 GEMM). TOKENMILL_GEMM_ROWS=n moves the line.
constexpr int64_t kGemmRows = 24;

// Portable path: the same sums, one product at a time.
template <typename T, typename S>
void tiles_portable(const Problem<S>& p, int64_t t_begin, int64_t t_end, T* y) {
  const int64_t per_chunk = p.bits == 4 || p.bits == 5 ? 4 : 2;  // k per chunk
  const float offset = static_cast<float>(code_offset(p.bits));
  for (int64_t t = t_begin; t < t_end; ++t) {
    const uint8_t* wt = p.w + t * tile_rows(p.K, p.bits) * 32;
    const S* szt = p.sz + t * p.G * p.zs;
    for (int64_t m = 0; m < p.M; ++m)
      for (int r = 0; r < 16; ++r) {
        float res = 0.f;
        for (int64_t g = 0; g < p.G; ++g) {
          float acc = 0.f;
          for (int64_t k = g * p.gs; k < (g + 1) * p.gs; ++k) {
            const int64_t c = k / per_chunk, j = k % per_chunk;
            int code;
            if (p.bits == 4 || p.bits == 5) {
              const uint8_t byte = chunk_at(wt, c, p.bits)[2 * r + (j & 1)];
              code = j < 2 ? byte & 15 : byte >> 4;
              if (p.bits == 5) code |= static_cast<int>((fifth_bits(wt, c, j >> 1) >> (2 * r + (j & 1))) & 1) << 4;
            } else {
              code = wt[c * 32 + 2 * r + j];
            }
            float xv = bf16_bits_to_float(p.xh[m * p.K + k]);
            if (p.xl) xv += bf16_bits_to_float(p.xl[m * p.K + k]);
            acc += static_cast<float>(code - static_cast<int>(offset)) * xv;
          }
          const float scale = to_float(szt[g * p.zs + r]);
          float mn = p.zs == 16 ? 0.f : to_float(szt[g * p.zs + 16 + r]);
          if (p.shift_min && p.zs == 32) mn += offset * scale;
          res += scale * acc + mn * p.sx[m * p.G + g];
        }
        y[m * p.N + t * 16 + r] = static_cast<T>(res);
      }
  }
}

template <typename T, typename S>
void run(const Problem<S>& p, T* y, bool generic, bool tiles_ok) {
  const int64_t tiles = p.N / 16;
  // T float means float32 x, which has a low part (p.xl): never on the fixed-point products nor on
  // AMX tiles, so neither is compiled for it.
  [[maybe_unused]] constexpr bool bf16_out = !std::is_same_v<T, float>;
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
  // bfloat16 x, fewer than fixed_rows_limit() rows: x in fixed point, integer products (tiles_allowed: the
  // fastest path; KernelPath::VECTOR keeps vdpbf16ps's sums at every row count)
  if constexpr (bf16_out) {
    if (fixed_applies(generic, tiles_ok, !p.xl, p.M, p.gs, p.bits, p.shift_min)) {
      const FixedX fx = fixed_x(p.xh, p.M, p.K, p.gs);
      at::parallel_for(0, tiles, fixed_tiles(p.M), [&](int64_t begin, int64_t end) {
        with_bits<S>(p.bits, [&](auto bits) { tiles_fixed<decltype(bits)::value>(p, fx, begin, end, y); });
      });
      return;
    }
  }
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
  // bfloat16 x, many rows: the bfloat16 GEMM over weights dequantized once per call
  if constexpr (bf16_out) {
    if (dequant_applies(generic, tiles_ok, !p.xl, p.M, p.K)) {
      const void* xs = nullptr;
#if defined(TOKENMILL_AMX)
      tokenmill_amx::RowTiles rows{};
      if (tokenmill_amx::usable()) rows = tokenmill_amx::row_tiles(p.xh, p.M, p.K), xs = &rows;
#endif
      at::parallel_for(0, (tiles + 1) / 2, 1, [&](int64_t begin, int64_t end) {
        with_bits<S>(p.bits, [&](auto bits) { tiles_dequant<decltype(bits)::value>(p, xs, begin, end, y); });
      });
      return;
    }
  }
#endif
#if defined(TOKENMILL_AMX)
  // bfloat16 x from kMinRows rows (a row's sums then do not depend on the other rows of such a
  // call); float32 x keeps the vector schedules (its two products per pair).
  if constexpr (bf16_out) {
    if (!generic && tiles_ok && !p.xl && p.M >= tokenmill_amx::kMinRows && p.gs % 16 == 0 &&
        tokenmill_amx::usable()) {
      const tokenmill_amx::RowTiles xs = tokenmill_amx::row_tiles(p.xh, p.M, p.K);
      at::parallel_for(0, tiles, kStripTiles, [&](int64_t begin, int64_t end) {
        with_bits<S>(p.bits, [&](auto bits) { tiles_amx<decltype(bits)::value>(p, xs, begin, end, y); });
      });
      return;
    }
  }
#else
  (void)tiles_ok;
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
  if (!generic) {
    static const int64_t gemm_rows = rows_from_env("TOKENMILL_GEMM_ROWS", kGemmRows);
    if (p.M >= gemm_rows) {
      const RowBlocks rb(p.M);
      const at::Tensor panels = x_panels(p.xh, p.xl, p.M, p.K, rb);
      const auto* xp = reinterpret_cast<const uint32_t*>(panels.data_ptr<int32_t>());
      at::parallel_for(0, tiles, kStripTiles, [&](int64_t begin, int64_t end) {
        with_bits<S>(p.bits, [&](auto bits) { tiles_many_rows<decltype(bits)::value>(p, xp, rb, begin, end, y); });
      });
    } else {
      at::parallel_for(0, tiles, few_rows_tiles(p.M), [&](int64_t begin, int64_t end) {
        with_bits<S>(p.bits, [&](auto bits) { tiles_few_rows<decltype(bits)::value>(p, begin, end, y); });
      });
    }
    return;
  }
#endif
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) { tiles_portable(p, begin, end, y); });
}

template <typename S>
at::Tensor run_x(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& sz, int64_t gs,
                    int bits, bool shift_min, bool out_float32, KernelPath path) {
  const bool generic = is_portable(path), tiles_ok = tiles_allowed(path);
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * 16, G = K / gs;
  auto y = at::empty({M, N}, out_float32 ? x.options().dtype(at::kFloat) : x.options());
  if (M == 0 || N == 0) return y;
  const bool bf16_x = x.scalar_type() == at::kBFloat16;
  PreparedX px;  // the fixed-point products prepare x themselves (fixed_x); dequantized weights need no sums
  if (fixed_applies(generic, tiles_ok, bf16_x, M, gs, bits, shift_min) ||
      dequant_applies(generic, tiles_ok, bf16_x, M, K))
    px.h = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  else
    px = prepare_x(x, gs, generic);
  const Problem<S> p{px.h, px.l, px.s, packed.data_ptr<uint8_t>(), sz.data_ptr<S>(), M, K, N, G, gs, bits, shift_min,
                     16 * sz.size(2)};
  if (x.scalar_type() == at::kFloat) run(p, y.data_ptr<float>(), generic, tiles_ok);
  else if (out_float32) {
    if constexpr (kInt4Scales<S>) {
      TORCH_CHECK(false, "int4_weight_linear has no float32 output");
    } else {
      run(p, reinterpret_cast<Bf16InFloat*>(y.data_ptr<float>()), generic, tiles_ok);
    }
  }
  else run(p, reinterpret_cast<c10::BFloat16*>(y.data_ptr<at::BFloat16>()), generic, tiles_ok);
  return y;
}

}  // namespace

bool group_linear_fast() { return kFast; }

int64_t fixed_point_rows() { return kFixedPoint ? fixed_rows_limit() : 0; }

int64_t dequant_rows() { return dequant_rows_limit(); }

at::Tensor grouped_codes_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& sz,
                                   int64_t group_size, int64_t bits, bool shift_min, bool out_float32,
                                   KernelPath path) {
  auto xc = x.contiguous(), pc = packed.contiguous(), sc = sz.contiguous();
  if (sc.scalar_type() == at::kFloat)
    return run_x<float>(xc, pc, sc, group_size, static_cast<int>(bits), shift_min, out_float32, path);
  if (sc.scalar_type() == at::kHalf)
    return run_x<c10::Half>(xc, pc, sc, group_size, static_cast<int>(bits), shift_min, out_float32, path);
  TORCH_CHECK(sc.scalar_type() == at::kBFloat16, "scales must be float32, float16 or bfloat16");
  return run_x<c10::BFloat16>(xc, pc, sc, group_size, static_cast<int>(bits), shift_min, out_float32, path);
}

at::Tensor group_weight_linear(at::Tensor x, at::Tensor packed, at::Tensor sz, int64_t group_size,
                                  int64_t bits, bool out_float32, KernelPath path) {
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 7 || bits == 8, "group_weight_linear: bits must be 4, 5, 7 or 8, got ",
              bits);
  TORCH_CHECK(x.dim() == 2, "group_weight_linear: x must be [M, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "group_weight_linear: x must be float32 or bfloat16");
  const int64_t per_chunk = bits == 4 || bits == 5 ? 4 : 2;
  const char* rows = bits == 4 ? "K / 4" : bits == 5 ? "5 K / 16" : "K / 2";
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.size(2) == 32,
              "group_weight_linear: packed weight must be uint8 [N / 16, ", rows, ", 32] for bits ", bits);
  TORCH_CHECK(group_size > 0 && group_size % per_chunk == 0, "group_weight_linear: group_size must be a positive "
              "multiple of ", per_chunk, " for bits ", bits, ", got ", group_size);
  const int64_t K = x.size(1);
  TORCH_CHECK(bits != 5 || K % 16 == 0, "group_weight_linear: bits 5 needs K a multiple of 16, got ", K);
  TORCH_CHECK(packed.size(1) == tile_rows(K, static_cast<int>(bits)), "group_weight_linear: x has ", K,
              " columns, the weight ", packed.size(1), " rows of 32 bytes per tile (", rows, " = ",
              tile_rows(K, static_cast<int>(bits)), " expected)");
  TORCH_CHECK(K % group_size == 0, "group_weight_linear: K = ", K, " is not a whole number of groups of ", group_size);
  TORCH_CHECK(sz.dim() == 4 && sz.size(0) == packed.size(0) && sz.size(1) == K / group_size &&
                  (sz.size(2) == 2 || sz.size(2) == 1) && sz.size(3) == 16,
              "group_weight_linear: scales and mins must be [N / 16, K / group_size, 2, 16] = [", packed.size(0), ", ",
              K / group_size, ", 2, 16] (or [..., 1, 16]: scales alone, min = -o * scale), got ", sz.sizes());
  TORCH_CHECK(sz.scalar_type() == at::kFloat || sz.scalar_type() == at::kHalf,
              "group_weight_linear: scales and mins must be float32 or float16 (exact values only)");
  return grouped_codes_linear(x, packed, sz, group_size, bits, /*shift_min=*/true, out_float32, path);
}
