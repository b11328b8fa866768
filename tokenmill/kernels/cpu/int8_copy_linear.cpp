// Grouped codes on 8-bit integer products (AVX-512 VNNI vpdpbusd): the "int8 copy" of a grouped
// weight (w[n, k] = code[n, k] * scale[n, g] + min[n, g], GGUF's types, group_linear.cpp), which
// bfloat16 calls multiply by instead of the packed codes. vpdpbusd does 64 multiply-adds a zmm where
// vdpbf16ps does 32 (measured on the AMD host, one core: 3.4-3.5 G instructions a second each), and
// the copy is one byte a weight plus 4 or 8 bytes per 16 weights of a group, against 2 bytes a
// weight for the bfloat16 copy.
//
// The copy (tokenmill.quantization.grouped.int8_copy_pack), uint8 [T, G, B], T = ceil(N / 16) tiles
// of 16 output channels, G = K / gs groups, B = 16 gs + 64 (symmetric) or + 128 bytes per (tile, group):
//   bytes [64 c, 64 c + 64), c < gs / 4: lane r (4 bytes) = code[16 t + r, g gs + 4 c .. + 3], one
//     vpdpbusd operand, "16 outputs x 4 consecutive k";
//   then float32 scale[16 t .. + 15, g], and unless symmetric float32 min[16 t .. + 15, g].
// Where every scale and min is a float16 exactly (GGUF's Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 store theirs
// so), they are float16 instead: B = 16 gs + 32 (symmetric) or + 64, the same values and so the same
// results. A decode step reads the copy once: Gemma 3's 262k-row Q8_0 head is then 5.6% smaller (34
// bytes per 32 weights, the file's own size, against 36). Its groups then start 32 bytes off a cache
// line every other group, which unaligned loads take as they come: one stream of whole lines still.
// (A tile's codes first and its fields after them, aligned, made that head's 4- and 16-row calls
// twice as slow: two streams per tile.) The kernel tells the layouts apart by B and the offset.
// Symmetric (every min -o scale: Q4_0 o = 8, Q5_0 16, Q6_K 32, Q8_0 128): w = (code - o) scale.
// Rows past N have code 0, scale 0, min 0.
//
// x in two int8 parts per row and group of gs: dx = max |x| / 127, t = x / dx (float32),
// h = t rounded to nearest even (-127 .. 127), l = (t - h) 256 rounded (-127 .. 127, the
// difference exact), so x = dx (h + l / 256) to 2^-9 dx (2^-8 where l is clamped): about 16 bits
// beside the group's largest value, where bfloat16 keeps 8 of each value; in a dot product's sum
// the error is the smaller, so this computes the bfloat16 model's products more exactly than the
// bfloat16 copy does. One part alone (llama.cpp's Q8 activations) flipped SmolLM2's greedy answer
// to the test suite's France prompt at +0.23% perplexity. The group's output, both parts' integer
// sums exact and combined as A = 256 sum code h + sum code l (< 2^29 with a symmetric offset's
// -o S in it), S = 256 sum h + sum l:
//   out[m, n] = sum_g (dx / 256) (scale A + min S)        (symmetric: scale (A - o S))
//
// One part (one_part): x = dx h alone, llama.cpp's Q8 activations: half the vpdpbusd, for calls of
// many rows, where the products are the cost (an LM head of 16-512 rows: the bfloat16 copy's
// vdpbf16ps does as many multiply-adds an instruction as the two parts, over twice the bytes). The
// same h, sums and fold with l = 0: A = 256 sum code h, S = 256 sum h.
//
// Schedule: tiles in parallel; per tile, rows in blocks of up to kMaxBlock (as even as they come;
// one part: kMaxBlockOne), each block's x packed once per call (pack_blocks), per group
// the block's two int32 sums per row in registers (one broadcast of 4 bytes of x's part per
// vpdpbusd), folded into float32 results at the group's end (shift, add, cvt, mul, fma per row;
// the mins' fma unless symmetric, where the sums start at -o times x's sums instead). A row's
// result does not depend on the other rows of the call nor on the thread count. Rows go in panels of
// 128 so that a panel's parts stay in L2 while every tile passes over them.

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "simd.h"

namespace {

// Rows per block: two parts up to kMaxBlock (2 R sums in registers, the R results in memory past
// kResInRegisters), one part up to kMaxBlockOne. Gemma 3's 262k-row head (Q8_0), one part, ms, after
// the blocks' packing (pack_blocks): 16 rows 5.4-5.8 in one block (8.4 before the packing, whose
// spilled row pointers made 13-16-row blocks slow), 17 rows 6.1 in one block against 7.7-8.0 in two,
// 24 rows 9.4 in two of 12 against 10.2-10.9 in one of 24; two parts, 12 rows 6.7-7.5 in one block
// against 10.3 in two of 6, 48 rows 27.8-28.3 in blocks of 12 against 30.2-35.5 in blocks of 8.
constexpr int kMaxBlock = 12;
constexpr int kMaxBlockOne = 20;
constexpr int64_t kPanel = 128;

// x quantized per row and group: parts h and l int8 [M, K]; d = dx / 256 float32, sh and sl (the
// parts' sums) int32 [M, G].
struct QuantizedX {
  at::Tensor h, l, d, sh, sl;
};

struct RowOut {
  int8_t* h;
  int8_t* l;
  float* d;
  int32_t* sh;
  int32_t* sl;
};

template <typename T>
void quantize_row_portable(const T* x, int64_t K, int64_t gs, RowOut o) {
  for (int64_t g = 0; g < K / gs; ++g) {
    float amax = 0.f;
    for (int64_t k = g * gs; k < (g + 1) * gs; ++k) amax = std::max(amax, std::fabs(static_cast<float>(x[k])));
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    int32_t sh = 0, sl = 0;
    for (int64_t k = g * gs; k < (g + 1) * gs; ++k) {
      const float t = static_cast<float>(x[k]) * inv;
      const float h = std::nearbyint(t);
      const int32_t l = static_cast<int32_t>(std::nearbyint((t - h) * 256.f));
      o.h[k] = static_cast<int8_t>(std::clamp(static_cast<int32_t>(h), -127, 127));
      o.l[k] = static_cast<int8_t>(std::clamp(l, -127, 127));
      sh += o.h[k];
      sl += o.l[k];
    }
    o.d[g] = amax / 127.f / 256.f;
    o.sh[g] = sh;
    o.sl[g] = sl;
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
template <typename T>
void quantize_row_vector(const T* x, int64_t K, int64_t gs, RowOut o) {
  const __m512 sign = _mm512_set1_ps(-0.f);
  const __m512i hi = _mm512_set1_epi32(127), lo = _mm512_set1_epi32(-127);
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  for (int64_t g = 0; g < K / gs; ++g) {
    __m512 amax = _mm512_setzero_ps();
    for (int64_t k = g * gs; k < (g + 1) * gs; k += 16)
      amax = _mm512_max_ps(amax, _mm512_andnot_ps(sign, load16(x + k)));
    const float a = _mm512_reduce_max_ps(amax);
    const __m512 inv = _mm512_set1_ps(a > 0.f ? 127.f / a : 0.f);
    __m512i sh = _mm512_setzero_si512(), sl = _mm512_setzero_si512();
    for (int64_t k = g * gs; k < (g + 1) * gs; k += 16) {
      const __m512 t = _mm512_mul_ps(load16(x + k), inv);
      const __m512 h = _mm512_roundscale_ps(t, kNearest);
      const __m512 l = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_sub_ps(t, h), _mm512_set1_ps(256.f)), kNearest);
      const __m512i hq = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(h), hi), lo);
      const __m512i lq = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(l), hi), lo);
      sh = _mm512_add_epi32(sh, hq);
      sl = _mm512_add_epi32(sl, lq);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o.h + k), _mm512_cvtepi32_epi8(hq));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o.l + k), _mm512_cvtepi32_epi8(lq));
    }
    o.d[g] = a / 127.f / 256.f;
    o.sh[g] = _mm512_reduce_add_epi32(sh);
    o.sl[g] = _mm512_reduce_add_epi32(sl);
  }
}
#endif

template <typename T>
QuantizedX quantize_rows(const at::Tensor& x, int64_t gs, bool generic) {
  const int64_t M = x.size(0), K = x.size(1), G = K / gs;
  const auto bytes = x.options().dtype(at::kChar), ints = x.options().dtype(at::kInt);
  QuantizedX q{at::empty({M, K}, bytes), at::empty({M, K}, bytes), at::empty({M, G}, x.options().dtype(at::kFloat)),
               at::empty({M, G}, ints), at::empty({M, G}, ints)};
  const T* xp = x.data_ptr<T>();
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const RowOut o{q.h.data_ptr<int8_t>() + m * K, q.l.data_ptr<int8_t>() + m * K, q.d.data_ptr<float>() + m * G,
                     q.sh.data_ptr<int32_t>() + m * G, q.sl.data_ptr<int32_t>() + m * G};
#if defined(__AVX512F__) && defined(__AVX512BW__)
      if (!generic && gs % 16 == 0) {
        quantize_row_vector(xp + m * K, K, gs, o);
        continue;
      }
#endif
      quantize_row_portable(xp + m * K, K, gs, o);
    }
  });
  return q;
}

// What every tile task reads.
struct Args {
  const int8_t* h;
  const int8_t* l;
  const float* d;
  const int32_t* sh;
  const int32_t* sl;
  const uint8_t* copy;
  const float* bias;  // float32 [N] or nullptr
  int64_t M, K, N, G, gs, block;  // block: bytes per (tile, group)
  int32_t offset;                 // symmetric copy: w = (code - offset) scale, no mins; -1: mins
  bool one_part;                  // x's h part alone (l taken as 0)
  bool half;                      // scales (and mins) as float16
};

// A block of rows as the vector path reads it, packed once per call (pack_blocks): for group g,
// xh[(g C + c) R + r] is row m0 + r's 4 bytes c of its h part (xl the same for l); d[g R + r] its
// dx / 256 (times 256 with one part); ih / il[g R + r] the symmetric offset's start, -o times the
// parts' sums; ms[g R + r] the mins' factor d (256 sh + sl).
struct Block {
  int64_t m0;
  int rows;
  const int32_t* xh;
  const int32_t* xl;
  const float* d;
  const int32_t* ih;
  const int32_t* il;
  const float* ms;
};

// Rows p0 .. p1 in blocks of up to kMaxBlock rows (kMaxBlockOne with one part), as even as they
// come; storage holds every block's packing.
std::vector<Block> pack_blocks(const Args& a, int64_t p0, int64_t p1, std::vector<int32_t>& storage) {
  const int64_t max = a.one_part ? kMaxBlockOne : kMaxBlock;
  const int64_t n = (p1 - p0 + max - 1) / max, C = a.gs / 4, M = p1 - p0;
  const int64_t per_row = a.G * (2 * C + 4);  // xh, xl, d, ih, il, ms
  storage.assign(static_cast<size_t>(M * per_row), 0);
  std::vector<Block> blocks;
  int64_t m = p0;
  int32_t* base = storage.data();
  for (int64_t i = 0; i < n; ++i) {
    const int R = static_cast<int>((p1 - m + (n - i) - 1) / (n - i));
    int32_t* xh = base;
    int32_t* xl = xh + a.G * C * R;
    float* d = reinterpret_cast<float*>(xl + a.G * C * R);
    int32_t* ih = reinterpret_cast<int32_t*>(d + a.G * R);
    int32_t* il = ih + a.G * R;
    float* ms = reinterpret_cast<float*>(il + a.G * R);
    base += R * per_row;
    for (int r = 0; r < R; ++r) {
      const int32_t* h = reinterpret_cast<const int32_t*>(a.h + (m + r) * a.K);
      const int32_t* l = reinterpret_cast<const int32_t*>(a.l + (m + r) * a.K);
      for (int64_t g = 0; g < a.G; ++g) {
        for (int64_t c = 0; c < C; ++c) {
          xh[(g * C + c) * R + r] = h[g * C + c];
          xl[(g * C + c) * R + r] = a.one_part ? 0 : l[g * C + c];
        }
        const int64_t mg = (m + r) * a.G + g;
        const int32_t sl = a.one_part ? 0 : a.sl[mg];
        d[g * R + r] = a.d[mg] * (a.one_part ? 256.f : 1.f);
        ih[g * R + r] = a.offset < 0 ? 0 : -a.offset * a.sh[mg];
        il[g * R + r] = a.offset < 0 ? 0 : -a.offset * sl;
        ms[g * R + r] = a.d[mg] * static_cast<float>(a.sh[mg] * 256 + sl);
      }
    }
    blocks.push_back({m, R, xh, xl, d, ih, il, ms});
    m += R;
  }
  return blocks;
}

inline float round_bf16(float v) { return static_cast<float>(c10::BFloat16(v)); }

template <typename O>
inline void put(O* out, float v) {
  if constexpr (std::is_same_v<O, float>) *out = v;
  else *out = static_cast<O>(v);
}

// Value r of a block's 16 scales (or mins) at p, float32 or float16.
inline float field(const uint8_t* p, int64_t r, bool half) {
  if (half) {
    c10::Half v;
    std::memcpy(&v, p + 2 * r, 2);
    return static_cast<float>(v);
  }
  float v;
  std::memcpy(&v, p + 4 * r, 4);
  return v;
}

// Portable: the same sums, one output at a time (the vector path's order: integer sums exact,
// then per group res = fma(float(A), scale * d, res); res = fma(min, d * float(S), res)).
template <typename O>
void tile_portable(const Args& a, int64_t t, int64_t m0, int64_t m1, O* out, bool bf16_round) {
  const int64_t rows = std::min<int64_t>(16, a.N - 16 * t);
  for (int64_t m = m0; m < m1; ++m)
    for (int64_t r = 0; r < rows; ++r) {
      float res = 0.f;
      for (int64_t g = 0; g < a.G; ++g) {
        const uint8_t* blk = a.copy + (t * a.G + g) * a.block;
        const float scale = field(blk + 16 * a.gs, r, a.half);
        const float mn = a.offset < 0 ? field(blk + 16 * a.gs + (a.half ? 32 : 64), r, a.half) : 0.f;
        const int64_t mg = m * a.G + g;
        int32_t ah = a.offset < 0 ? 0 : -a.offset * a.sh[mg];
        const int32_t sl = a.one_part ? 0 : a.sl[mg];
        int32_t al = a.offset < 0 ? 0 : -a.offset * sl;
        for (int64_t k = 0; k < a.gs; ++k) {
          const int32_t c = blk[64 * (k / 4) + 4 * r + k % 4];
          ah += c * a.h[m * a.K + g * a.gs + k];
          if (!a.one_part) al += c * a.l[m * a.K + g * a.gs + k];
        }
        const float d = a.d[mg];
        res = std::fma(static_cast<float>(ah * 256 + al), scale * d, res);
        if (a.offset < 0) res = std::fma(mn, d * static_cast<float>(a.sh[mg] * 256 + sl), res);
      }
      if (a.bias) res += a.bias[16 * t + r];
      put(out + m * a.N + 16 * t + r, bf16_round ? round_bf16(res) : res);
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
constexpr bool kFast = true;

template <typename O>
inline void store_row(O* p, __m512 v, __mmask16 live, bool bf16_round) {
  if constexpr (std::is_same_v<O, float>) {
    if (bf16_round)  // bfloat16 x, out_float32: the bfloat16 rounding, widened
      v = _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits16(v), 16));
    _mm512_mask_storeu_ps(p, live, v);
  } else {
    store16(p, v, live);
  }
}

// Rows b.m0 .. b.m0 + R of tile t: per group, 2 R int32 sums (R with one part) of C = gs / 4 vpdpbusd
// each, then the fold. Every per-row operand comes from the block's packing (pack_block), at fixed
// offsets from one pointer per stream: the R rows' pointers would not fit the 16 general registers.
// Past kResInRegisters rows the float results live in an aligned stack buffer (read and written
// once per group) so that the sums keep the vector registers.
constexpr int kResInRegisters = 12;

template <int R, int C, bool Sym, bool Two, typename O>
inline void tile_block(const Args& a, const Block& b, int64_t t, O* out, bool bf16_round) {
  constexpr bool kResMem = R > kResInRegisters;
  __m512 res[kResMem ? 1 : R];
  alignas(64) float acc[kResMem ? R * 16 : 16];
  if constexpr (kResMem) {
    for (int r = 0; r < R; ++r) _mm512_store_ps(acc + 16 * r, _mm512_setzero_ps());
  } else {
    for (int r = 0; r < R; ++r) res[r] = _mm512_setzero_ps();
  }
  const int32_t* xh = b.xh;
  const int32_t* xl = b.xl;
  const float* d = b.d;
  const int32_t* ih = b.ih;
  const int32_t* il = b.il;
  const float* ms = b.ms;
  const uint8_t* blk = a.copy + t * a.G * a.block;
  for (int64_t g = 0; g < a.G; ++g, blk += a.block, xh += C * R, xl += C * R, d += R, ih += R, il += R, ms += R) {
    __m512i ah[R], al[Two ? R : 1];
#pragma GCC unroll 24
    for (int r = 0; r < R; ++r) {
      ah[r] = Sym ? _mm512_set1_epi32(ih[r]) : _mm512_setzero_si512();
      if constexpr (Two) al[r] = Sym ? _mm512_set1_epi32(il[r]) : _mm512_setzero_si512();
    }
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const __m512i w = _mm512_loadu_si512(reinterpret_cast<const __m512i*>(blk + 64 * c));
#pragma GCC unroll 24
      for (int r = 0; r < R; ++r) {
        ah[r] = _mm512_dpbusd_epi32(ah[r], w, _mm512_set1_epi32(xh[c * R + r]));
        if constexpr (Two) al[r] = _mm512_dpbusd_epi32(al[r], w, _mm512_set1_epi32(xl[c * R + r]));
      }
    }
    const uint8_t* sm = blk + 64 * C;
    const __m512 scale = a.half ? load16(reinterpret_cast<const c10::Half*>(sm)) : load16(reinterpret_cast<const float*>(sm));
    __m512 mn = _mm512_setzero_ps();
    if constexpr (!Sym)
      mn = a.half ? load16(reinterpret_cast<const c10::Half*>(sm + 32)) : load16(reinterpret_cast<const float*>(sm + 64));
#pragma GCC unroll 24
    for (int r = 0; r < R; ++r) {
      // one part: 256 sum code h as (sum code h) times 256 d, exactly (a power of two)
      const __m512i sum = Two ? _mm512_add_epi32(_mm512_slli_epi32(ah[r], 8), al[r]) : ah[r];
      __m512 v = kResMem ? _mm512_load_ps(acc + 16 * r) : res[r];
      v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(scale, _mm512_set1_ps(d[r])), v);
      if constexpr (!Sym) v = _mm512_fmadd_ps(mn, _mm512_set1_ps(ms[r]), v);
      if constexpr (kResMem) _mm512_store_ps(acc + 16 * r, v);
      else res[r] = v;
    }
  }
  const int64_t rows = std::min<int64_t>(16, a.N - 16 * t);
  const __mmask16 live = static_cast<__mmask16>((1u << rows) - 1);
  const __m512 bias = a.bias ? _mm512_maskz_loadu_ps(live, a.bias + 16 * t) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) {
    const __m512 v = kResMem ? _mm512_load_ps(acc + 16 * r) : res[r];
    store_row(out + (b.m0 + r) * a.N + 16 * t, a.bias ? _mm512_add_ps(v, bias) : v, live, bf16_round);
  }
}

template <int C, bool Sym, bool Two, typename O, int R = (Two ? kMaxBlock : kMaxBlockOne)>
inline void block_of(const Args& a, const Block& b, int64_t t, O* out, bool bf16_round) {
  if constexpr (R > 1) {
    if (b.rows < R) return block_of<C, Sym, Two, O, R - 1>(a, b, t, out, bf16_round);
  }
  tile_block<R, C, Sym, Two>(a, b, t, out, bf16_round);
}

template <int C, bool Sym, bool Two, typename O>
void tile_vector(const Args& a, const std::vector<Block>& blocks, int64_t t, O* out, bool bf16_round) {
  for (const Block& b : blocks) block_of<C, Sym, Two>(a, b, t, out, bf16_round);
}
template <int C, typename O>
void tile_dispatch_c(const Args& a, const std::vector<Block>& blocks, int64_t t, O* out, bool bf16_round) {
  if (a.offset < 0)
    a.one_part ? tile_vector<C, false, false>(a, blocks, t, out, bf16_round)
               : tile_vector<C, false, true>(a, blocks, t, out, bf16_round);
  else
    a.one_part ? tile_vector<C, true, false>(a, blocks, t, out, bf16_round)
               : tile_vector<C, true, true>(a, blocks, t, out, bf16_round);
}

template <typename O>
void tile_dispatch(const Args& a, const std::vector<Block>& blocks, int64_t t, O* out, bool bf16_round) {
  a.gs == 32 ? tile_dispatch_c<8>(a, blocks, t, out, bf16_round) : tile_dispatch_c<4>(a, blocks, t, out, bf16_round);
}
#else
constexpr bool kFast = false;
#endif

template <typename O>
void run(const Args& a, O* out, bool bf16_round, bool generic) {
  const int64_t tiles = (a.N + 15) / 16;
  const bool vector = kFast && !generic && (a.gs == 32 || a.gs == 16);
  std::vector<int32_t> storage;
  for (int64_t p0 = 0; p0 < a.M; p0 += kPanel) {
    const int64_t p1 = std::min(a.M, p0 + kPanel);
    const std::vector<Block> blocks = vector ? pack_blocks(a, p0, p1, storage) : std::vector<Block>();
    at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
        if (vector) {
          tile_dispatch(a, blocks, t, out, bf16_round);
          continue;
        }
#endif
        tile_portable(a, t, p0, p1, out, bf16_round);
      }
    });
  }
}

}  // namespace

bool int8_copy_linear_fast() { return kFast; }

at::Tensor int8_copy_linear(at::Tensor x, at::Tensor copy, int64_t N, int64_t group_size, int64_t offset,
                            at::Tensor bias, bool out_float32, bool one_part, KernelPath path) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "int8_copy_linear: x must be float32 or bfloat16 [M, K]");
  TORCH_CHECK(copy.dim() == 3 && copy.scalar_type() == at::kByte && copy.is_contiguous(),
              "int8_copy_linear: copy must be contiguous uint8 [tiles, groups, bytes]");
  const int64_t M = x.size(0), K = x.size(1), gs = group_size;
  TORCH_CHECK(gs > 0 && gs % 4 == 0 && K % gs == 0 && copy.size(1) * gs == K,
              "int8_copy_linear: ", copy.size(1), " groups of ", gs, " do not make K = ", K);
  TORCH_CHECK(offset >= -1 && offset <= 255, "int8_copy_linear: offset must be -1 (mins) or a code 0..255");
  const int64_t fields = offset < 0 ? 2 : 1;  // scales, and mins unless symmetric: 16 each per group
  const bool half = copy.size(2) == 16 * gs + 32 * fields;
  TORCH_CHECK(half || copy.size(2) == 16 * gs + 64 * fields, "int8_copy_linear: ", copy.size(2),
              " bytes per group, expected ", 16 * gs + 64 * fields, " (float32 scales) or ", 16 * gs + 32 * fields,
              " (float16)");
  TORCH_CHECK(N > 0 && copy.size(0) == (N + 15) / 16, "int8_copy_linear: ", copy.size(0),
              " tiles do not hold N = ", N);
  TORCH_CHECK(reinterpret_cast<uintptr_t>(copy.data_ptr()) % 64 == 0, "int8_copy_linear: copy must be 64-byte aligned");
  TORCH_CHECK(!bias.defined() || bias.numel() == 0 || bias.numel() == N, "int8_copy_linear: bias must have N values");
  const bool generic = is_portable(path);
  const auto xc = x.contiguous();
  const QuantizedX q = x.scalar_type() == at::kFloat ? quantize_rows<float>(xc, gs, generic)
                                                     : quantize_rows<c10::BFloat16>(xc, gs, generic);
  const auto b = bias.defined() && bias.numel() ? bias.to(at::kFloat).contiguous() : at::Tensor();
  const Args a{q.h.data_ptr<int8_t>(),   q.l.data_ptr<int8_t>(),   q.d.data_ptr<float>(),
               q.sh.data_ptr<int32_t>(), q.sl.data_ptr<int32_t>(), copy.data_ptr<uint8_t>(),
               b.defined() ? b.data_ptr<float>() : nullptr, M, K, N, copy.size(1), gs, copy.size(2),
               static_cast<int32_t>(offset), one_part, half};
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  if (out_float32 || !bf16) {
    auto out = at::empty({M, N}, x.options().dtype(at::kFloat));
    run(a, out.data_ptr<float>(), bf16, generic);
    return out;
  }
  auto out = at::empty({M, N}, x.options());
  run(a, out.data_ptr<c10::BFloat16>(), true, generic);
  return out;
}
