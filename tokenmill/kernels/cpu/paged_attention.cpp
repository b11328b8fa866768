// Paged decode attention on CPU: one query token per sequence, keys and values read in place
// from the block pool (no gather copy), GQA/MQA by serving every query head of a KV head from
// one pass over its keys. Built at first use by tokenmill/kernels/cpu_ops.py.
//
// Shapes (all contiguous):
//   q            [B, H, D]            float32 or bfloat16
//   key_cache    [num_blocks, block_size, Hkv, D], value_cache likewise; stored as q's dtype,
//                or quantized: int8, or float8 e4m3 (each row of D with its own scale)
//   key_scale    [num_blocks, block_size, Hkv] float16 for quantized caches (value_scale too):
//                the stored row times its scale is the key; empty tensors otherwise
//   block_tables [B, max_blocks] int32: sequence b's token t (0-based, counted from the first
//                table entry) lives in slot t % block_size of block block_tables[b][t / block_size]
//   key_start, key_end [B] int32: sequence b attends to its tokens key_start[b] .. key_end[b] - 1
//   out          [B, H, D]            same dtype as q
//
// One task per (sequence, KV head): it walks the sequence's keys 16 at a time (flash-decoding
// style, one pass): the scores of the KV head's query heads for those 16 keys, an online softmax
// (running max and sum in float32, earlier partial sums rescaled when the max grows), then
// those 16 values added into accumulators that stay in registers. Every key and value row is
// read once, straight from its block. A sequence's result does not depend on which other
// sequences share the batch, nor on the thread count.

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "simd.h"

namespace {

// float8 e4m3 (fn: no infinities, 0x7f/0xff NaN) as stored by torch.float8_e4m3fn
struct Fp8 {
  uint8_t bits;
};

inline float load(const float* p, int64_t i) { return p[i]; }

inline float load(const at::BFloat16* p, int64_t i) {
  uint32_t bits = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[i]) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline float load(const int8_t* p, int64_t i) { return static_cast<float>(p[i]); }

inline float load(const Fp8* p, int64_t i) {
  const uint8_t b = p[i].bits;
  const int e = (b >> 3) & 0xf, m = b & 0x7;
  const float mag = e == 0 ? std::ldexp(static_cast<float>(m) / 8.f, -6) : std::ldexp(1.f + m / 8.f, e - 7);
  return (b & 0x80) ? -mag : mag;
}

inline void store(float* p, int64_t i, float v) { p[i] = v; }
inline void store(at::BFloat16* p, int64_t i, float v) { p[i] = at::BFloat16(v); }

inline float row_scale(const at::Half* scales, int64_t i) { return scales ? static_cast<float>(scales[i]) : 1.f; }

// Ask for the first 128 bytes of a slot's row (one KV head's part when base points at it).
template <typename KV>
inline void prefetch_row(const KV* base, int64_t slot, int64_t row) {
  const char* p = reinterpret_cast<const char*>(base + slot * row);
  __builtin_prefetch(p);
  if (row * static_cast<int64_t>(sizeof(KV)) > 64) __builtin_prefetch(p + 64);
}

struct Args {
  int64_t B, H, Hkv, bs, max_blocks;
  float scale;
};

// What one task reads: the caches (one row = Hkv * D elements per slot) and the sequence's table.
template <typename KV>
struct Cache {
  const KV* keys;
  const KV* values;
  const at::Half* key_scale;  // nullptr: unquantized
  const at::Half* value_scale;
};

// Walks a sequence's keys first .. last-1 in tiles of at most 16 consecutive slots of one block;
// entering a block, it asks for the next block's rows (blocks are scattered, the hardware
// prefetcher cannot guess the next one).
struct Tiles {
  const int32_t* table;
  int64_t bs, pos, last, bi, off;
  int m = 0;

  Tiles(const int32_t* t, int64_t block_size, int64_t first, int64_t end)
      : table(t), bs(block_size), pos(first), last(end), bi(first / block_size), off(first % block_size) {}

  // the next tile: its first slot, its length in m; false when done
  template <typename KV>
  bool next(int64_t& slot0, const KV* keys, const KV* values, int64_t row) {
    pos += m;
    off += m;
    if (off == bs) {
      off = 0;
      ++bi;
    }
    if (pos >= last) return false;
    m = static_cast<int>(std::min<int64_t>({16, bs - off, last - pos}));
    slot0 = static_cast<int64_t>(table[bi]) * bs + off;
    if (off == 0 && pos + bs < last) {
      const int64_t next_block = static_cast<int64_t>(table[bi + 1]) * bs;
      const int64_t ahead = std::min<int64_t>(bs, last - pos - bs);
      for (int64_t i = 0; i < ahead; ++i) {
        prefetch_row(keys, next_block + i, row);
        prefetch_row(values, next_block + i, row);
      }
    }
    return true;
  }
};

#if defined(__AVX512F__)
using tokenmill_simd::load16;  // float, bfloat16, int8; the float8 overload is this file's own

// e4m3 -> float16 bit pattern: exponent and mantissa moved up 7 bits give the value / 2^8
// (normal and subnormal alike, the two biases differ by 8), the sign moves to bit 15.
inline __m512 load16(const Fp8* p) {
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7f)), 7),
                                    _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8));
  return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.f));
}

// One tile's step of the online softmax for W heads: s[j] (scores, -inf where no key) becomes
// e^(s - new max); the running sums and the accumulators are rescaled by e^(old max - new max).
template <int W, int C>
inline void online_softmax(__m512* s, __mmask16 live, float* mx, float* sum, __m512 (*acc)[C]) {
  float tile_max[W], corr[W];
  for (int jj = 0; jj < W; ++jj) tile_max[jj] = _mm512_reduce_max_ps(s[jj]);
  for (int jj = 0; jj < W; ++jj) {
    const float new_max = tile_max[jj] > mx[jj] ? tile_max[jj] : mx[jj];
    corr[jj] = std::exp(mx[jj] - new_max);  // 0 on the first tile (mx = -inf)
    mx[jj] = new_max;
  }
  for (int jj = 0; jj < W; ++jj) s[jj] = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(s[jj], _mm512_set1_ps(mx[jj]))));
  for (int jj = 0; jj < W; ++jj) {
    sum[jj] = sum[jj] * corr[jj] + _mm512_reduce_add_ps(s[jj]);
    for (int cc = 0; cc < C; ++cc) acc[jj][cc] = _mm512_mul_ps(acc[jj][cc], _mm512_set1_ps(corr[jj]));
  }
}

#if defined(__AVX512BF16__)
// bfloat16 queries over a bfloat16 cache: dot products straight from the stored bytes with
// vdpbf16ps (pairs of bf16 products summed in float32), and values added two tokens at a time:
// rows t and t+1 interleaved so that each float32 lane sums p_t v_t[d] + p_t+1 v_t+1[d]. The
// softmax weights are rounded to bfloat16 for that (as PyTorch's bf16 attention rounds them).
// Accumulator lane j of a 32-wide slice holds d = 8 (j / 4) + j % 4 (+ 4 for the high half).
template <int D, int W>
void attend_bf16(const at::BFloat16* q, const Cache<at::BFloat16>& c, const int32_t* table, int64_t first, int64_t n,
                 at::BFloat16* out, const Args& a, int64_t b, int64_t kvh, int64_t j0) {
  constexpr int HC = W, w = W;
  static_assert(D % 32 == 0, "D must be a multiple of 32");
  constexpr int C2 = D / 32;
  constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
  const int64_t g = a.H / a.Hkv, row = a.Hkv * D, bs = a.bs;
  __m512bh qb[HC][C2];
  for (int64_t jj = 0; jj < HC; ++jj) {
    alignas(64) float qf[D];
    for (int d = 0; d < D; ++d) qf[d] = jj < w ? load(q, (b * a.H + kvh * g + j0 + jj) * D + d) * a.scale : 0.f;
    for (int c2 = 0; c2 < C2; ++c2)
      qb[jj][c2] = _mm512_cvtne2ps_pbh(_mm512_load_ps(qf + 32 * c2 + 16), _mm512_load_ps(qf + 32 * c2));
  }
  __m512 acc[HC][2 * C2];
  float mx[HC], sum[HC];
  for (int jj = 0; jj < HC; ++jj) {
    mx[jj] = NEG_INF;
    sum[jj] = 0.f;
    for (int cc = 0; cc < 2 * C2; ++cc) acc[jj][cc] = _mm512_setzero_ps();
  }
  alignas(64) uint16_t pb[HC][16];
  const auto* keys = reinterpret_cast<const uint16_t*>(c.keys);
  const auto* values = reinterpret_cast<const uint16_t*>(c.values);
  Tiles tiles(table, bs, first, first + n);
  for (int64_t slot0; tiles.next(slot0, c.keys + kvh * D, c.values + kvh * D, row);) {
    const int m = tiles.m;
    const uint16_t* krow = keys + slot0 * row + kvh * D;
    const uint16_t* vrow = values + slot0 * row + kvh * D;
    const __mmask16 live = static_cast<__mmask16>((1u << m) - 1);
    // scores of every head first, then each softmax step for all heads together: the heads'
    // dependency chains (max, exp, sum) overlap instead of running one after another
    __m512 s[W];
    for (int jj = 0; jj < W; ++jj) {
      __m512 dots[16];
      for (int i = 0; i < 16; ++i) {
        dots[i] = _mm512_setzero_ps();
        if (i < m)
          for (int c2 = 0; c2 < C2; ++c2)
            dots[i] = _mm512_dpbf16_ps(dots[i], qb[jj][c2], (__m512bh)_mm512_loadu_si512(krow + i * row + 32 * c2));
      }
      s[jj] = _mm512_mask_blend_ps(live, _mm512_set1_ps(NEG_INF), sum_lanes16(dots));
    }
    online_softmax<W, 2 * C2>(s, live, mx, sum, acc);
    for (int jj = 0; jj < W; ++jj)
      _mm256_store_si256(reinterpret_cast<__m256i*>(pb[jj]), (__m256i)_mm512_cvtneps_pbh(s[jj]));
    for (int i = 0; i < m; i += 2) {
      for (int c2 = 0; c2 < C2; ++c2) {
        const __m512i x = _mm512_loadu_si512(vrow + i * row + 32 * c2);
        const __m512i y = i + 1 < m ? _mm512_loadu_si512(vrow + (i + 1) * row + 32 * c2) : _mm512_setzero_si512();
        const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(x, y), hi = (__m512bh)_mm512_unpackhi_epi16(x, y);
        for (int jj = 0; jj < HC; ++jj) {
          if (jj >= w) break;
          uint32_t pair;
          std::memcpy(&pair, pb[jj] + i, sizeof(pair));  // p_i low, p_i+1 high (0 past the tile)
          const __m512bh wp = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
          acc[jj][2 * c2] = _mm512_dpbf16_ps(acc[jj][2 * c2], wp, lo);
          acc[jj][2 * c2 + 1] = _mm512_dpbf16_ps(acc[jj][2 * c2 + 1], wp, hi);
        }
      }
    }
  }
  for (int64_t jj = 0; jj < w; ++jj) {
    const float inv = 1.f / sum[jj];
    for (int c2 = 0; c2 < C2; ++c2) {
      alignas(64) float lo[16], hi[16];
      _mm512_store_ps(lo, _mm512_mul_ps(acc[jj][2 * c2], _mm512_set1_ps(inv)));
      _mm512_store_ps(hi, _mm512_mul_ps(acc[jj][2 * c2 + 1], _mm512_set1_ps(inv)));
      at::BFloat16* o = out + (b * a.H + kvh * g + j0 + jj) * D + 32 * c2;
      for (int l = 0; l < 16; ++l) {
        o[8 * (l / 4) + l % 4] = at::BFloat16(lo[l]);
        o[8 * (l / 4) + 4 + l % 4] = at::BFloat16(hi[l]);
      }
    }
  }
}
#endif

// Query heads [j0, j0 + W) of KV head kvh of sequence b; accumulators in registers (W is a
// template argument so that every loop over heads unrolls and nothing is indexed at run time).
// Keys are walked block by block, at most 16 at a time: each key tile is converted to float
// once and scored by every head; each value row is converted once and added into every head.
template <typename T, typename KV, int D, int W>
void attend_avx512(const T* q, const Cache<KV>& c, const int32_t* table, int64_t first, int64_t n, T* out,
                   const Args& a, int64_t b, int64_t kvh, int64_t j0) {
  constexpr int HC = W, w = W;
  constexpr int C = D / 16;
  constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
  const int64_t g = a.H / a.Hkv, row = a.Hkv * D, bs = a.bs;
  alignas(64) float qf[HC][D];
  for (int64_t jj = 0; jj < w; ++jj)
    for (int d = 0; d < D; ++d) qf[jj][d] = load(q, (b * a.H + kvh * g + j0 + jj) * D + d) * a.scale;
  __m512 acc[HC][C];
  float mx[HC], sum[HC];
  for (int jj = 0; jj < HC; ++jj) {
    mx[jj] = NEG_INF;
    sum[jj] = 0.f;
    for (int cc = 0; cc < C; ++cc) acc[jj][cc] = _mm512_setzero_ps();
  }
  alignas(64) float kt[16][D];
  alignas(64) float kscale[16], vscale[16], p[HC][16];
  Tiles tiles(table, bs, first, first + n);
  for (int64_t slot0; tiles.next(slot0, c.keys + kvh * D, c.values + kvh * D, row);) {
    const int m = tiles.m;
    const KV* krow = c.keys + slot0 * row + kvh * D;
    const KV* vrow = c.values + slot0 * row + kvh * D;
    for (int i = 0; i < 16; ++i) {
      kscale[i] = i < m ? row_scale(c.key_scale, (slot0 + i) * a.Hkv + kvh) : 0.f;
      vscale[i] = i < m ? row_scale(c.value_scale, (slot0 + i) * a.Hkv + kvh) : 0.f;
    }
    for (int i = 0; i < m; ++i)
      for (int cc = 0; cc < C; ++cc) _mm512_store_ps(kt[i] + 16 * cc, load16(krow + i * row + 16 * cc));
    for (int i = m; i < 16; ++i)
      for (int cc = 0; cc < C; ++cc) _mm512_store_ps(kt[i] + 16 * cc, _mm512_setzero_ps());
    const __mmask16 live = static_cast<__mmask16>((1u << m) - 1);
    const __m512 ks = _mm512_load_ps(kscale), vs = _mm512_load_ps(vscale);
    for (int64_t jj = 0; jj < w; ++jj) {
      __m512 qv[C], dots[16];
      for (int cc = 0; cc < C; ++cc) qv[cc] = _mm512_load_ps(qf[jj] + 16 * cc);
      for (int i = 0; i < 16; ++i) {
        dots[i] = _mm512_mul_ps(qv[0], _mm512_load_ps(kt[i]));
        for (int cc = 1; cc < C; ++cc) dots[i] = _mm512_fmadd_ps(qv[cc], _mm512_load_ps(kt[i] + 16 * cc), dots[i]);
      }
      const __m512 s = _mm512_mask_blend_ps(live, _mm512_set1_ps(NEG_INF), _mm512_mul_ps(sum_lanes16(dots), ks));
      const float tile_max = _mm512_reduce_max_ps(s);
      if (tile_max > mx[jj]) {
        const float corr = mx[jj] == NEG_INF ? 0.f : std::exp(mx[jj] - tile_max);
        sum[jj] *= corr;
        for (int cc = 0; cc < C; ++cc) acc[jj][cc] = _mm512_mul_ps(acc[jj][cc], _mm512_set1_ps(corr));
        mx[jj] = tile_max;
      }
      const __m512 e = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(s, _mm512_set1_ps(mx[jj]))));
      sum[jj] += _mm512_reduce_add_ps(e);
      _mm512_store_ps(p[jj], _mm512_mul_ps(e, vs));  // the value scale rides on the weight
    }
    for (int i = 0; i < m; ++i) {
      __m512 v[C];
      for (int cc = 0; cc < C; ++cc) v[cc] = load16(vrow + i * row + 16 * cc);
      for (int jj = 0; jj < HC; ++jj) {
        if (jj >= w) break;
        const __m512 pj = _mm512_set1_ps(p[jj][i]);
        for (int cc = 0; cc < C; ++cc) acc[jj][cc] = _mm512_fmadd_ps(pj, v[cc], acc[jj][cc]);
      }
    }
  }
  for (int64_t jj = 0; jj < w; ++jj) {
    const float inv = 1.f / sum[jj];
    alignas(64) float o[D];
    for (int cc = 0; cc < C; ++cc) _mm512_store_ps(o + 16 * cc, _mm512_mul_ps(acc[jj][cc], _mm512_set1_ps(inv)));
    for (int d = 0; d < D; ++d) store(out, (b * a.H + kvh * g + j0 + jj) * D + d, o[d]);
  }
}
#endif

// The portable path (no AVX-512, or asked for): the same one-pass online softmax, one key at a time.
template <typename T, typename KV, int D>
void attend_generic(const T* q, const Cache<KV>& c, const int32_t* table, int64_t first, int64_t n, T* out,
                    const Args& a, int64_t b, int64_t kvh) {
  const int64_t g = a.H / a.Hkv, row = a.Hkv * D;
  std::vector<float> qf(g * D), acc(g * D, 0.f), mx(g, -std::numeric_limits<float>::infinity()), sum(g, 0.f);
  for (int64_t j = 0; j < g; ++j)
    for (int d = 0; d < D; ++d) qf[j * D + d] = load(q, (b * a.H + kvh * g + j) * D + d) * a.scale;
  for (int64_t t = 0; t < n; ++t) {
    const int64_t pos = first + t;
    const int64_t slot = static_cast<int64_t>(table[pos / a.bs]) * a.bs + pos % a.bs;
    const KV* k = c.keys + slot * row + kvh * D;
    const KV* v = c.values + slot * row + kvh * D;
    const float ks = row_scale(c.key_scale, slot * a.Hkv + kvh), vs = row_scale(c.value_scale, slot * a.Hkv + kvh);
    for (int64_t j = 0; j < g; ++j) {
      float s = 0.f;
      for (int d = 0; d < D; ++d) s += qf[j * D + d] * load(k, d);
      s *= ks;
      if (s > mx[j]) {
        const float corr = mx[j] == -std::numeric_limits<float>::infinity() ? 0.f : std::exp(mx[j] - s);
        sum[j] *= corr;
        for (int d = 0; d < D; ++d) acc[j * D + d] *= corr;
        mx[j] = s;
      }
      const float e = std::exp(s - mx[j]);
      sum[j] += e;
      const float pv = e * vs;
      for (int d = 0; d < D; ++d) acc[j * D + d] += pv * load(v, d);
    }
  }
  for (int64_t j = 0; j < g; ++j)
    for (int d = 0; d < D; ++d) store(out, (b * a.H + kvh * g + j) * D + d, acc[j * D + d] / sum[j]);
}

#if defined(__AVX512F__)
// f(std::integral_constant<int, w>) for a run-time 1 <= w <= HC
template <int HC, typename F>
void with_width(int64_t w, F&& f) {
  if constexpr (HC > 1) {
    if (w < HC) return with_width<HC - 1>(w, f);
  }
  f(std::integral_constant<int, HC>{});
}
#endif

template <typename T, typename KV, int D>
void decode(const T* q, const Cache<KV>& c, const int32_t* tables, const int32_t* key_start, const int32_t* key_end,
            T* out, const Args& a, bool generic) {
  const int64_t g = a.H / a.Hkv;
  // query heads of one KV head served per pass over its keys: as many as keep the accumulators
  // (HC x D/16 vectors) in registers
  constexpr int HC = D <= 64 ? 4 : (D <= 128 ? 2 : 1);
  const int64_t chunks = (g + HC - 1) / HC;
  at::parallel_for(0, a.B * a.Hkv * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / (a.Hkv * chunks), kvh = (task / chunks) % a.Hkv, chunk = task % chunks;
      const int32_t* table = tables + b * a.max_blocks;
      const int64_t first = key_start[b], n = key_end[b] - first;
#if defined(__AVX512F__)
      if (!generic) {
        const int64_t j0 = chunk * HC, w = g - j0 < HC ? g - j0 : HC;
        with_width<HC>(w, [&](auto width) {
          constexpr int W = decltype(width)::value;
#if defined(__AVX512BF16__)
          if constexpr (std::is_same_v<T, at::BFloat16> && std::is_same_v<KV, at::BFloat16> && D % 32 == 0) {
            attend_bf16<D, W>(q, c, table, first, n, out, a, b, kvh, j0);
            return;
          }
#endif
          attend_avx512<T, KV, D, W>(q, c, table, first, n, out, a, b, kvh, j0);
        });
        continue;
      }
#endif
      if (chunk == 0) attend_generic<T, KV, D>(q, c, table, first, n, out, a, b, kvh);
    }
  });
}

template <typename T, typename KV>
void dispatch(int64_t D, const T* q, const Cache<KV>& c, const int32_t* tables, const int32_t* ks, const int32_t* ke,
              T* out, const Args& a, bool generic) {
  switch (D) {
    case 16: return decode<T, KV, 16>(q, c, tables, ks, ke, out, a, generic);
    case 32: return decode<T, KV, 32>(q, c, tables, ks, ke, out, a, generic);
    case 64: return decode<T, KV, 64>(q, c, tables, ks, ke, out, a, generic);
    case 80: return decode<T, KV, 80>(q, c, tables, ks, ke, out, a, generic);
    case 96: return decode<T, KV, 96>(q, c, tables, ks, ke, out, a, generic);
    case 128: return decode<T, KV, 128>(q, c, tables, ks, ke, out, a, generic);
    case 256: return decode<T, KV, 256>(q, c, tables, ks, ke, out, a, generic);
    default: TORCH_CHECK(false, "paged_decode_attention: unsupported head_dim ", D);
  }
}

template <typename T>
c10::ScalarType q_type() { return std::is_same_v<T, float> ? at::kFloat : at::kBFloat16; }

template <typename T>
void dispatch_cache(int64_t D, const T* q, const at::Tensor& kc, const at::Tensor& vc, const at::Half* kscale,
                    const at::Half* vscale, const int32_t* tables, const int32_t* ks, const int32_t* ke, T* out,
                    const Args& a, bool generic) {
  const auto kind = kc.scalar_type();
  if (kind == at::kChar) {
    dispatch<T, int8_t>(D, q, Cache<int8_t>{kc.data_ptr<int8_t>(), vc.data_ptr<int8_t>(), kscale, vscale},
                        tables, ks, ke, out, a, generic);
  } else if (kind == at::kFloat8_e4m3fn) {
    dispatch<T, Fp8>(D, q, Cache<Fp8>{reinterpret_cast<const Fp8*>(kc.data_ptr()),
                                      reinterpret_cast<const Fp8*>(vc.data_ptr()), kscale, vscale},
                     tables, ks, ke, out, a, generic);
  } else {
    TORCH_CHECK(kind == q_type<T>(), "keys and values must be stored as q's dtype, int8 or float8_e4m3fn");
    dispatch<T, T>(D, q, Cache<T>{static_cast<const T*>(kc.data_ptr()), static_cast<const T*>(vc.data_ptr()),
                                  nullptr, nullptr},
                   tables, ks, ke, out, a, generic);
  }
}

}  // namespace

bool supports_head_dim(int64_t D) { return D == 16 || D == 32 || D == 64 || D == 80 || D == 96 || D == 128 || D == 256; }

at::Tensor paged_decode_attention(at::Tensor q, at::Tensor key_cache, at::Tensor value_cache,
                                     at::Tensor key_scale, at::Tensor value_scale, at::Tensor block_tables,
                                     at::Tensor key_start, at::Tensor key_end, double scale, KernelPath path) {
  const bool generic = is_portable(path);
  TORCH_CHECK(q.dim() == 3 && key_cache.dim() == 4, "q must be [B, H, D] and key_cache [blocks, block_size, Hkv, D]");
  TORCH_CHECK(q.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(key_cache.scalar_type() == value_cache.scalar_type(), "keys and values must share one dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && key_start.scalar_type() == at::kInt &&
                  key_end.scalar_type() == at::kInt, "block tables and key ranges must be int32");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t bs = key_cache.size(1), Hkv = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == D && H % Hkv == 0, "head_dim or head counts do not match");
  TORCH_CHECK(block_tables.size(0) == B && key_start.size(0) == B && key_end.size(0) == B, "one table per sequence");
  const bool quantized = key_cache.scalar_type() == at::kChar || key_cache.scalar_type() == at::kFloat8_e4m3fn;
  const at::Half* kscale = nullptr;
  const at::Half* vscale = nullptr;
  if (quantized) {
    TORCH_CHECK(key_scale.scalar_type() == at::kHalf && value_scale.scalar_type() == at::kHalf &&
                    key_scale.is_contiguous() && value_scale.is_contiguous() &&
                    key_scale.numel() == key_cache.numel() / D && value_scale.numel() == key_cache.numel() / D,
                "a quantized cache needs contiguous float16 scales [blocks, block_size, Hkv]");
    kscale = key_scale.data_ptr<at::Half>();
    vscale = value_scale.data_ptr<at::Half>();
  }
  auto tables = block_tables.contiguous();
  auto out = at::empty_like(q);
  const Args a{B, H, Hkv, bs, tables.size(1), static_cast<float>(scale)};
  if (q.scalar_type() == at::kFloat) {
    dispatch_cache<float>(D, q.data_ptr<float>(), key_cache, value_cache, kscale, vscale, tables.data_ptr<int32_t>(),
                          key_start.data_ptr<int32_t>(), key_end.data_ptr<int32_t>(), out.data_ptr<float>(), a,
                          generic);
  } else if (q.scalar_type() == at::kBFloat16) {
    dispatch_cache<at::BFloat16>(D, q.data_ptr<at::BFloat16>(), key_cache, value_cache, kscale, vscale,
                                 tables.data_ptr<int32_t>(), key_start.data_ptr<int32_t>(),
                                 key_end.data_ptr<int32_t>(), out.data_ptr<at::BFloat16>(), a, generic);
  } else {
    TORCH_CHECK(false, "paged_decode_attention supports float32 and bfloat16 queries, got ", q.scalar_type());
  }
  return out;
}
