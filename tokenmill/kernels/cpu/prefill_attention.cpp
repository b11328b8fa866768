// Paged prefill attention on CPU: several query tokens per sequence (whole prompts, chunks after a
// cached prefix), causal, optionally over a sliding window; keys and values read in place from
// the block pool. Built at first use by tokenmill/kernels/cpu_ops.py.
//
// Shapes (all contiguous):
//   q            [T, H, D]            float32 or bfloat16
//   key_cache    [num_blocks, block_size, Hkv, D], value_cache likewise, stored as q's dtype
//   block_tables [S, max_blocks] int32: sequence s's token t (0-based, counted from the first
//                table entry) lives in slot t % block_size of block block_tables[s][t / block_size]
//   query_start  [S + 1] int32: the queries of sequence s are rows query_start[s] .. query_start[s+1]-1
//                of q (query_start[0] = 0, query_start[S] = T); they are its last tokens
//   key_start, key_end [S] int32: sequence s's keys are its tokens key_start[s] .. key_end[s] - 1
//                (already written, its new tokens included); query i sits at token
//                key_end[s] - q_len + i and sees the keys at or before it, with window w > 0 only
//                those less than w tokens before it
//   out          [T, H, D]            same dtype as q
//
// Flash-attention style: one task per (sequence, KV head, block of query tokens). A task holds
// the rows of every query head of its KV head (GQA: row = token * group + head) and walks the
// keys in blocks of 32 aligned back from its last query, so that key blocks no query of the task
// sees (causal, window) are never touched. Each key block is packed once per task into a small
// buffer, in the layout its products want (bfloat16: keys transposed into pairs of dimensions,
// values as pairs of tokens, for vdpbf16ps; float32: keys transposed), and reused by every row.
// Rows go 4 at a time: their scores in registers, an online softmax in float32 (running max,
// per-lane partial sums), the weights times the values added into float32 accumulators.
// Tasks run longest first, each thread taking the next; a task writes only its own rows, so a
// sequence's result does not depend on the other sequences of the call nor on the thread count.

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "simd.h"

namespace {

constexpr int NK = 32;  // keys per key block
constexpr int RB = 4;   // rows per register block
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

struct Problem {
  int64_t S, H, Hkv, g, D, bs, max_blocks, window;
  float scale;
  const int32_t* tables;
  const int32_t* qstart;
  const int32_t* kstart;
  const int32_t* kend;
};

// Query tokens i0 .. i0 + n - 1 of sequence s, KV head kvh.
struct Task {
  int64_t s, kvh, i0, n, cost;
};

// The keys a task's queries see: [lo, hi).
struct KeyRange {
  int64_t pos0, lo, hi;
};

inline KeyRange key_range(const Problem& p, const Task& t) {
  const int64_t q_len = p.qstart[t.s + 1] - p.qstart[t.s];
  const int64_t pos0 = p.kend[t.s] - q_len + t.i0;
  const int64_t hi = std::min<int64_t>(p.kend[t.s], pos0 + t.n);
  const int64_t lo = std::max<int64_t>(p.kstart[t.s], p.window > 0 ? pos0 - p.window + 1 : 0);
  return {pos0, lo, hi};
}

// Query tokens per task: about 128 rows (tokens x heads of a KV head), a power of two of tokens.
inline int64_t tokens_per_task(int64_t g) {
  int64_t mq = 1;
  while (mq * 2 * g <= 128 && mq < 64) mq *= 2;
  return mq;
}

std::vector<Task> make_tasks(const Problem& p) {
  std::vector<Task> tasks;
  const int64_t mq = tokens_per_task(p.g);
  for (int64_t s = 0; s < p.S; ++s) {
    const int64_t q_len = p.qstart[s + 1] - p.qstart[s];
    for (int64_t i0 = 0; i0 < q_len; i0 += mq)
      for (int64_t kvh = 0; kvh < p.Hkv; ++kvh) {
        Task t{s, kvh, i0, std::min(mq, q_len - i0), 0};
        const KeyRange r = key_range(p, t);
        t.cost = t.n * (r.hi > r.lo ? r.hi - r.lo : 0) + 64;
        tasks.push_back(t);
      }
  }
  return tasks;
}

// Runs every task: longest first, each thread taking the next one. Results do not depend on
// which thread runs a task. make_work() gives each thread its scratch space.
template <typename MakeWork, typename F>
void run_tasks(std::vector<Task>& tasks, MakeWork&& make_work, F&& f) {
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
  const int64_t n = static_cast<int64_t>(tasks.size());
  if (n == 0) return;
  std::atomic<int64_t> next{0};
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    auto work = make_work();
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) f(tasks[i], work);
  });
}

template <typename T>
inline const T* kv_row(const T* cache, const Problem& p, const int32_t* table, int64_t kvh, int64_t t) {
  const int64_t slot = static_cast<int64_t>(table[t / p.bs]) * p.bs + t % p.bs;
  return cache + (slot * p.Hkv + kvh) * p.D;
}

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) { return static_cast<float>(x); }

// ---------------------------------------------------------------------------------------------
// The portable path (no AVX-512, or asked for): per row, one key at a time, online softmax.
template <typename T>
void task_generic(const Task& tk, const T* q, const T* kc, const T* vc, T* out, const Problem& p,
                  std::vector<float>& buf) {
  const int64_t D = p.D, g = p.g;
  const int32_t* table = p.tables + tk.s * p.max_blocks;
  const KeyRange kr = key_range(p, tk);
  buf.resize(2 * D);
  float* qf = buf.data();
  float* acc = qf + D;
  for (int64_t i = 0; i < tk.n; ++i) {
    const int64_t pos = kr.pos0 + i, row = p.qstart[tk.s] + tk.i0 + i;
    const int64_t lo = std::max<int64_t>(kr.lo, p.window > 0 ? pos - p.window + 1 : 0), hi = pos + 1;
    for (int64_t h = 0; h < g; ++h) {
      const T* qr = q + (row * p.H + tk.kvh * g + h) * D;
      for (int64_t d = 0; d < D; ++d) {
        qf[d] = to_float(qr[d]) * p.scale;
        acc[d] = 0.f;
      }
      float mx = NEG_INF, sum = 0.f;
      for (int64_t t = lo; t < hi; ++t) {
        const T* k = kv_row(kc, p, table, tk.kvh, t);
        const T* v = kv_row(vc, p, table, tk.kvh, t);
        float s = 0.f;
        for (int64_t d = 0; d < D; ++d) s += qf[d] * to_float(k[d]);
        if (s > mx) {
          const float corr = std::exp(mx - s);  // 0 for the first key
          sum *= corr;
          for (int64_t d = 0; d < D; ++d) acc[d] *= corr;
          mx = s;
        }
        const float e = std::exp(s - mx);
        sum += e;
        for (int64_t d = 0; d < D; ++d) acc[d] += e * to_float(v[d]);
      }
      const float inv = sum > 0.f ? 1.f / sum : 0.f;
      T* o = out + (row * p.H + tk.kvh * g + h) * D;
      for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(acc[d] * inv);
    }
  }
}

#if defined(__AVX512F__)
// ---------------------------------------------------------------------------------------------
// The AVX-512 path. BF: bfloat16 products with vdpbf16ps (pairs of bfloat16 multiplied and summed
// into float32 lanes); else float32 FMAs (float32 inputs, or bfloat16 widened when the CPU lacks
// AVX512_BF16). E is the packed element: a pair of bfloat16 (uint32_t) or a float.
template <bool BF>
struct Packed {
  using E = std::conditional_t<BF, uint32_t, float>;
  using P = std::conditional_t<BF, uint16_t, float>;  // a softmax weight
  static constexpr int STEP = BF ? 2 : 1;               // dimensions (tokens) per packed element
};

// Per-thread scratch of a task.
template <bool BF, int D>
struct Work {
  using E = typename Packed<BF>::E;
  using P = typename Packed<BF>::P;
  static constexpr int DE = D / Packed<BF>::STEP;
  std::vector<E> q;      // [rows, DE]: the task's queries
  std::vector<float> o;  // [rows, D]: accumulators
  std::vector<float> l;  // [rows, 16]: partial sums of the weights, per lane
  std::vector<float> m;  // [rows]: running max
  alignas(64) E kp[DE * NK];  // keys: element e of key j at kp[e * NK + j]
  alignas(64) E vp[NK / Packed<BF>::STEP * D];  // values: bf16, tokens 2i and 2i+1 of dim d at vp[i * D + d]
  alignas(64) P pw[RB][NK];   // the weights of a register block
};

template <bool BF>
inline __m512 mul_add(__m512 acc, typename Packed<BF>::E a, const void* b) {
  if constexpr (BF) {
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(static_cast<int>(a)),
                            (__m512bh)_mm512_load_si512(b));
  } else {
    return _mm512_fmadd_ps(_mm512_set1_ps(a), _mm512_load_ps(static_cast<const float*>(b)), acc);
  }
}

// Packs keys t0 .. t0 + nk - 1 (lanes 0 .. nk - 1; the rest zero) of the task's KV head.
template <typename T, bool BF, int D>
void pack_block(Work<BF, D>& w, const T* kc, const T* vc, const Problem& p, const int32_t* table, int64_t kvh,
                int64_t t0, int nk) {
  constexpr int DE = Work<BF, D>::DE;
  const T* krows[NK];
  const T* vrows[NK];
  for (int j = 0; j < nk; ++j) {
    krows[j] = kv_row(kc, p, table, kvh, t0 + j);
    vrows[j] = kv_row(vc, p, table, kvh, t0 + j);
  }
  if constexpr (BF) {
    // keys: a transpose of [NK keys, DE pairs] 32-bit words, 16 keys x 16 pairs at a time
    for (int j0 = 0; j0 < NK; j0 += 16) {
      for (int e0 = 0; e0 + 16 <= DE; e0 += 16) {
        __m512i r[16];
        for (int j = 0; j < 16; ++j)
          r[j] = j0 + j < nk ? _mm512_loadu_si512(reinterpret_cast<const uint32_t*>(krows[j0 + j]) + e0)
                             : _mm512_setzero_si512();
        // 16x16 transpose of 32-bit words
        __m512i t[16];
        for (int i = 0; i < 8; ++i) {
          t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
          t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
        }
        for (int i = 0; i < 4; ++i) {
          r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
          r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
          r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
          r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
        }
        // r[4a + b] holds, in 128-bit lane c, words (key 4a .. 4a+3, pair 4c + b)
        for (int b = 0; b < 4; ++b) {
          const __m512i x0 = _mm512_shuffle_i32x4(r[b], r[4 + b], 0x88);       // lanes 0,2 of each
          const __m512i x1 = _mm512_shuffle_i32x4(r[b], r[4 + b], 0xdd);       // lanes 1,3
          const __m512i y0 = _mm512_shuffle_i32x4(r[8 + b], r[12 + b], 0x88);
          const __m512i y1 = _mm512_shuffle_i32x4(r[8 + b], r[12 + b], 0xdd);
          // pair 4c + b for keys 0..15: lane c of r[b], r[4+b], r[8+b], r[12+b]
          const __m512i c0 = _mm512_shuffle_i32x4(x0, y0, 0x88);  // c = 0
          const __m512i c2 = _mm512_shuffle_i32x4(x0, y0, 0xdd);  // c = 2
          const __m512i c1 = _mm512_shuffle_i32x4(x1, y1, 0x88);  // c = 1
          const __m512i c3 = _mm512_shuffle_i32x4(x1, y1, 0xdd);  // c = 3
          uint32_t* dst = w.kp + j0;
          _mm512_store_si512(dst + (e0 + b) * NK, c0);
          _mm512_store_si512(dst + (e0 + 4 + b) * NK, c1);
          _mm512_store_si512(dst + (e0 + 8 + b) * NK, c2);
          _mm512_store_si512(dst + (e0 + 12 + b) * NK, c3);
        }
      }
    }
    for (int e = DE / 16 * 16; e < DE; ++e)  // the pairs past the last 16 (D = 16, 80)
      for (int j = 0; j < NK; ++j) w.kp[e * NK + j] = j < nk ? reinterpret_cast<const uint32_t*>(krows[j])[e] : 0u;
    // values: tokens 2i and 2i + 1 interleaved, dimension by dimension
    const __m256i zero = _mm256_setzero_si256();
    for (int i = 0; i < NK / 2; ++i) {
      const T* a = 2 * i < nk ? vrows[2 * i] : nullptr;
      const T* b = 2 * i + 1 < nk ? vrows[2 * i + 1] : nullptr;
      for (int d = 0; d < D; d += 16) {
        const __m256i x = a ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + d)) : zero;
        const __m256i y = b ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + d)) : zero;
        const __m512i v = _mm512_or_si512(_mm512_cvtepu16_epi32(x), _mm512_slli_epi32(_mm512_cvtepu16_epi32(y), 16));
        _mm512_store_si512(w.vp + i * D + d, v);
      }
    }
  } else {
    for (int j = 0; j < NK; ++j) {
      if (j < nk) {
        for (int d = 0; d < D; ++d) w.kp[d * NK + j] = to_float(krows[j][d]);
        for (int d = 0; d < D; d += 16) _mm512_store_ps(w.vp + j * D + d, load16(vrows[j] + d));
      } else {
        for (int d = 0; d < D; ++d) w.kp[d * NK + j] = 0.f;
        for (int d = 0; d < D; d += 16) _mm512_store_ps(w.vp + j * D + d, _mm512_setzero_ps());
      }
    }
  }
}

// Rows r0 .. r0 + 3 against the packed key block; NV: 16-key vectors holding a visible key.
template <bool BF, int D, int NV>
void attend_rows(Work<BF, D>& w, int64_t r0, const uint32_t* masks, float scale) {
  using E = typename Packed<BF>::E;
  constexpr int DE = Work<BF, D>::DE;
  // scores
  __m512 s[RB][NV];
  for (int rr = 0; rr < RB; ++rr)
    for (int v = 0; v < NV; ++v) s[rr][v] = _mm512_setzero_ps();
  const E* q = w.q.data() + r0 * DE;
  for (int e = 0; e < DE; ++e) {
    for (int rr = 0; rr < RB; ++rr) {
      const E qe = q[rr * DE + e];
      for (int v = 0; v < NV; ++v) s[rr][v] = mul_add<BF>(s[rr][v], qe, w.kp + e * NK + 16 * v);
    }
  }
  // online softmax
  float corr[RB];
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int rr = 0; rr < RB; ++rr) {
    const int64_t r = r0 + rr;
    const uint32_t mask = masks[rr];
    if (!mask) {
      corr[rr] = 1.f;
      std::memset(w.pw[rr], 0, sizeof(w.pw[rr]));
      continue;
    }
    __m512 tmax = _mm512_set1_ps(NEG_INF);
    for (int v = 0; v < NV; ++v) {
      s[rr][v] = _mm512_mask_blend_ps(static_cast<__mmask16>(mask >> (16 * v)), _mm512_set1_ps(NEG_INF),
                                      _mm512_mul_ps(s[rr][v], vscale));
      tmax = _mm512_max_ps(tmax, s[rr][v]);
    }
    const float mnew = std::max(w.m[r], _mm512_reduce_max_ps(tmax));
    corr[rr] = std::exp(w.m[r] - mnew);  // 0 on the row's first keys (max -inf)
    w.m[r] = mnew;
    __m512 lsum = _mm512_mul_ps(_mm512_loadu_ps(w.l.data() + r * 16), _mm512_set1_ps(corr[rr]));
    for (int v = 0; v < NV; ++v) {
      const __m512 e = _mm512_maskz_mov_ps(static_cast<__mmask16>(mask >> (16 * v)),
                                           exp16(_mm512_sub_ps(s[rr][v], _mm512_set1_ps(mnew))));
      lsum = _mm512_add_ps(lsum, e);
      if constexpr (BF) {
        _mm256_store_si256(reinterpret_cast<__m256i*>(w.pw[rr] + 16 * v), (__m256i)_mm512_cvtneps_pbh(e));
      } else {
        _mm512_store_ps(w.pw[rr] + 16 * v, e);
      }
    }
    _mm512_storeu_ps(w.l.data() + r * 16, lsum);
  }
  // weights x values, 4 vectors of 16 dimensions at a time
  constexpr int C = D / 16;
  constexpr int PAIRS = NV * 16 / Packed<BF>::STEP;
  for (int c0 = 0; c0 < C; c0 += 4) {
    __m512 acc[RB][4];
    for (int rr = 0; rr < RB; ++rr)
      for (int c = 0; c < 4; ++c)
        if (c0 + c < C)
          acc[rr][c] = _mm512_mul_ps(_mm512_loadu_ps(w.o.data() + (r0 + rr) * D + 16 * (c0 + c)),
                                     _mm512_set1_ps(corr[rr]));
    for (int i = 0; i < PAIRS; ++i) {
      for (int rr = 0; rr < RB; ++rr) {
        E pe;
        std::memcpy(&pe, reinterpret_cast<const E*>(w.pw[rr]) + i, sizeof(E));
        for (int c = 0; c < 4; ++c)
          if (c0 + c < C) acc[rr][c] = mul_add<BF>(acc[rr][c], pe, w.vp + i * D + 16 * (c0 + c));
      }
    }
    for (int rr = 0; rr < RB; ++rr)
      for (int c = 0; c < 4; ++c)
        if (c0 + c < C) _mm512_storeu_ps(w.o.data() + (r0 + rr) * D + 16 * (c0 + c), acc[rr][c]);
  }
}

template <typename T, bool BF, int D>
void task_avx512(const Task& tk, const T* q, const T* kc, const T* vc, T* out, const Problem& p, Work<BF, D>& w) {
  constexpr int DE = Work<BF, D>::DE;
  const int64_t g = p.g, rows = tk.n * g, padded = (rows + RB - 1) / RB * RB;
  const int32_t* table = p.tables + tk.s * p.max_blocks;
  const KeyRange kr = key_range(p, tk);
  w.q.resize(padded * DE);
  w.o.assign(padded * D, 0.f);
  w.l.assign(padded * 16, 0.f);
  w.m.assign(padded, NEG_INF);
  for (int64_t i = 0; i < tk.n; ++i) {
    const T* src = q + ((p.qstart[tk.s] + tk.i0 + i) * p.H + tk.kvh * g) * D;
    if constexpr (BF) {
      std::memcpy(w.q.data() + i * g * DE, src, g * D * sizeof(T));
    } else {
      for (int64_t x = 0; x < g * D; ++x) w.q[i * g * D + x] = to_float(src[x]);
    }
  }
  std::fill(w.q.begin() + rows * DE, w.q.end(), typename Packed<BF>::E(0));
  // key blocks of NK, aligned back from the last visible key, oldest first
  const int64_t span = kr.hi - kr.lo, blocks = span > 0 ? (span + NK - 1) / NK : 0;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t t1 = kr.hi - (blocks - 1 - b) * NK, t0 = std::max(kr.lo, t1 - NK);
    pack_block<T, BF, D>(w, kc, vc, p, table, tk.kvh, t0, static_cast<int>(t1 - t0));
    for (int64_t r0 = 0; r0 < rows; r0 += RB) {
      uint32_t masks[RB], any = 0;
      for (int rr = 0; rr < RB; ++rr) {
        masks[rr] = 0;
        if (r0 + rr >= rows) continue;
        const int64_t pos = kr.pos0 + (r0 + rr) / g;
        const int64_t lo = std::max(t0, p.window > 0 ? pos - p.window + 1 : t0), hi = std::min(t1, pos + 1);
        if (hi > lo) masks[rr] = static_cast<uint32_t>(((uint64_t{1} << (hi - t0)) - 1) & ~((uint64_t{1} << (lo - t0)) - 1));
        any |= masks[rr];
      }
      if (!any) continue;
      if (any >> 16) {
        attend_rows<BF, D, 2>(w, r0, masks, p.scale);
      } else {
        attend_rows<BF, D, 1>(w, r0, masks, p.scale);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float sum = _mm512_reduce_add_ps(_mm512_loadu_ps(w.l.data() + r * 16));
    const __m512 inv = _mm512_set1_ps(sum > 0.f ? 1.f / sum : 0.f);
    T* o = out + ((p.qstart[tk.s] + tk.i0 + r / g) * p.H + tk.kvh * g + r % g) * D;
    for (int d = 0; d < D; d += 16) store16(o + d, _mm512_mul_ps(_mm512_loadu_ps(w.o.data() + r * D + d), inv), 0xffff);
  }
}
#endif

template <typename T, int D>
void prefill(const T* q, const T* kc, const T* vc, T* out, const Problem& p, bool generic) {
  auto tasks = make_tasks(p);
#if defined(__AVX512F__)
  if (!generic) {
#if defined(__AVX512BF16__)
    constexpr bool BF = std::is_same_v<T, at::BFloat16>;
#else
    constexpr bool BF = false;
#endif
    run_tasks(tasks, [] { return std::make_unique<Work<BF, D>>(); },
              [&](const Task& t, auto& w) { task_avx512<T, BF, D>(t, q, kc, vc, out, p, *w); });
    return;
  }
#endif
  run_tasks(tasks, [] { return std::vector<float>(); },
            [&](const Task& t, auto& buf) { task_generic<T>(t, q, kc, vc, out, p, buf); });
}

template <typename T>
void dispatch(const T* q, const T* kc, const T* vc, T* out, const Problem& p, bool generic) {
  switch (p.D) {
    case 16: return prefill<T, 16>(q, kc, vc, out, p, generic);
    case 32: return prefill<T, 32>(q, kc, vc, out, p, generic);
    case 64: return prefill<T, 64>(q, kc, vc, out, p, generic);
    case 80: return prefill<T, 80>(q, kc, vc, out, p, generic);
    case 96: return prefill<T, 96>(q, kc, vc, out, p, generic);
    case 128: return prefill<T, 128>(q, kc, vc, out, p, generic);
    case 256: return prefill<T, 256>(q, kc, vc, out, p, generic);
    default: TORCH_CHECK(false, "paged_prefill_attention: unsupported head_dim ", p.D);
  }
}

}  // namespace

at::Tensor paged_prefill_attention(at::Tensor q, at::Tensor key_cache, at::Tensor value_cache,
                                      at::Tensor block_tables, at::Tensor query_start, at::Tensor key_start,
                                      at::Tensor key_end, int64_t window, double scale, KernelPath path) {
  const bool generic = is_portable(path);
  TORCH_CHECK(q.dim() == 3 && key_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes(),
              "q must be [T, H, D] and key_cache, value_cache [blocks, block_size, Hkv, D]");
  TORCH_CHECK(q.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "paged_prefill_attention supports float32 and bfloat16, got ", q.scalar_type());
  TORCH_CHECK(key_cache.scalar_type() == q.scalar_type() && value_cache.scalar_type() == q.scalar_type(),
              "keys and values must be stored as q's dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && query_start.scalar_type() == at::kInt &&
                  key_start.scalar_type() == at::kInt && key_end.scalar_type() == at::kInt,
              "block tables, query_start and key ranges must be int32");
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: none)");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t num_blocks = key_cache.size(0), bs = key_cache.size(1), Hkv = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == D && Hkv > 0 && H % Hkv == 0, "head_dim or head counts do not match");
  auto tables = block_tables.contiguous();
  auto qs = query_start.contiguous(), ks = key_start.contiguous(), ke = key_end.contiguous();
  TORCH_CHECK(tables.dim() == 2, "block_tables must be [S, max_blocks]");
  const int64_t S = tables.size(0), max_blocks = tables.size(1);
  TORCH_CHECK(qs.numel() == S + 1 && ks.numel() == S && ke.numel() == S, "one table and key range per sequence");
  const int32_t* qsp = qs.data_ptr<int32_t>();
  const int32_t* ksp = ks.data_ptr<int32_t>();
  const int32_t* kep = ke.data_ptr<int32_t>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  TORCH_CHECK(qsp[0] == 0 && qsp[S] == T, "query_start must run from 0 to T");
  for (int64_t s = 0; s < S; ++s) {
    const int64_t q_len = qsp[s + 1] - qsp[s];
    TORCH_CHECK(q_len >= 0 && ksp[s] >= 0 && ksp[s] <= kep[s] && kep[s] <= max_blocks * bs && q_len <= kep[s],
                "sequence ", s, ": bad query or key range");
    TORCH_CHECK(q_len == 0 || kep[s] - q_len >= ksp[s], "sequence ", s, ": its first query sees no key");
    if (kep[s] > ksp[s])
      for (int64_t b = ksp[s] / bs; b <= (kep[s] - 1) / bs; ++b)
        TORCH_CHECK(tp[s * max_blocks + b] >= 0 && tp[s * max_blocks + b] < num_blocks,
                    "sequence ", s, ": block id out of range");
  }
  auto out = at::empty_like(q);
  const Problem p{S, H, Hkv, H / Hkv, D, bs, max_blocks, window, static_cast<float>(scale), tp, qsp, ksp, kep};
  if (q.scalar_type() == at::kFloat) {
    dispatch<float>(q.data_ptr<float>(), key_cache.data_ptr<float>(), value_cache.data_ptr<float>(),
                    out.data_ptr<float>(), p, generic);
  } else {
    dispatch<at::BFloat16>(q.data_ptr<at::BFloat16>(), key_cache.data_ptr<at::BFloat16>(),
                           value_cache.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), p, generic);
  }
  return out;
}
