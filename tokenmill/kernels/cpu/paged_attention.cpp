// Paged decode attention on CPU: one query token per sequence, keys and values read in place
// from the block pool (no gather copy), GQA/MQA by serving every query head of a KV head from
// one pass over its keys. Built at first use by tokenmill/kernels/cpu_ops.py.
//
// Shapes (all contiguous):
//   q            [B, H, D]            float32 or bfloat16
//   key_cache    [num_blocks, block_size, Hkv, D], value_cache likewise, same dtype as q
//   block_tables [B, max_blocks] int32: sequence b's token t (0-based, counted from the first
//                table entry) lives in slot t % block_size of block block_tables[b][t / block_size]
//   key_start, key_end [B] int32: sequence b attends to its tokens key_start[b] .. key_end[b] - 1
//   out          [B, H, D]            same dtype as q
//
// One task per sequence (or per (sequence, KV head) when there are few sequences): it walks the
// sequence's tokens in order, reading each token's contiguous [Hkv, D] row once, computes the
// scores of all query heads, an exact softmax (max-subtracted, float32), then the weighted sum
// of values. A sequence's result does not depend on which other sequences share the batch.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

inline float load(const float* p, int64_t i) { return p[i]; }

inline float load(const at::BFloat16* p, int64_t i) {
  uint32_t bits = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[i]) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Ask for the row of the token one block ahead: blocks are scattered, the hardware prefetcher
// cannot guess the next one.
template <typename T>
inline void prefetch_row(const T* base, const int32_t* table, int64_t pos, int64_t end, int64_t bs, int64_t row) {
  if (pos >= end) return;
  const char* p = reinterpret_cast<const char*>(base + (static_cast<int64_t>(table[pos / bs]) * bs + pos % bs) * row);
  for (int64_t off = 0; off < row * static_cast<int64_t>(sizeof(T)); off += 64) __builtin_prefetch(p + off);
}

inline void store(float* p, int64_t i, float v) { p[i] = v; }
inline void store(at::BFloat16* p, int64_t i, float v) { p[i] = at::BFloat16(v); }

template <typename T, int D>
inline float dot(const float* __restrict q, const T* __restrict k) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int d = 0; d < D; ++d) s += q[d] * load(k, d);
  return s;
}

template <typename T, int D>
inline void axpy(float p, const T* __restrict v, float* __restrict acc) {
#pragma omp simd
  for (int d = 0; d < D; ++d) acc[d] += p * load(v, d);
}

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

inline __m512 load16(const at::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// r[i] = sum of the 16 lanes of a[i]: a transpose-and-add tree, about 3 instructions per vector
// instead of a full horizontal reduction each.
inline __m512 sum_lanes16(const __m512* a) {
  __m512 s[8], u[4];
  for (int i = 0; i < 8; ++i)
    s[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(s[2 * i]), y = _mm512_castps_pd(s[2 * i + 1]);
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 v01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 v23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(v01, v23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(v01, v23, _MM_SHUFFLE(3, 1, 3, 1)));
}

// scores[t] = q . k[t] for m <= 16 keys at once.
template <typename T, int D>
inline void dot16(const float* q, const T* const* keys, int m, float* scores) {
  static_assert(D % 16 == 0, "D must be a multiple of 16");
  __m512 qv[D / 16], acc[16];
  for (int c = 0; c < D / 16; ++c) qv[c] = _mm512_loadu_ps(q + 16 * c);
  for (int t = 0; t < 16; ++t) {
    acc[t] = _mm512_setzero_ps();
    if (t < m)
      for (int c = 0; c < D / 16; ++c) acc[t] = _mm512_fmadd_ps(qv[c], load16(keys[t] + 16 * c), acc[t]);
  }
  _mm512_mask_storeu_ps(scores, static_cast<__mmask16>((1u << m) - 1), sum_lanes16(acc));
}
#endif

struct Args {
  int64_t B, H, Hkv, bs, max_blocks;
  float scale;
};

// Attention of sequence b for KV heads [kv_begin, kv_end).
template <typename T, int D>
void attend(const T* q, const T* kc, const T* vc, const int32_t* tables, const int32_t* key_start,
            const int32_t* key_end, T* out, const Args& a, int64_t b, int64_t kv_begin, int64_t kv_end,
            std::vector<float>& qf, std::vector<float>& acc, std::vector<float>& scores,
            std::vector<const T*>& vrows) {
  const int64_t g = a.H / a.Hkv, heads = (kv_end - kv_begin) * g, h0 = kv_begin * g;
  const int64_t first = key_start[b], n = key_end[b] - first, row = a.Hkv * D;
  const int32_t* table = tables + b * a.max_blocks;
  qf.resize(heads * D);
  acc.assign(heads * D, 0.f);
  scores.resize(heads * n);
  for (int64_t h = 0; h < heads; ++h)
    for (int d = 0; d < D; ++d) qf[h * D + d] = load(q, (b * a.H + h0 + h) * D + d) * a.scale;
#if defined(__AVX512F__)
  if constexpr (D % 16 == 0) {
    const T* keys[16];
    for (int64_t t0 = 0; t0 < n; t0 += 16) {
      const int m = static_cast<int>(n - t0 < 16 ? n - t0 : 16);
      for (int i = 0; i < m; ++i) {
        const int64_t pos = first + t0 + i;
        keys[i] = kc + (static_cast<int64_t>(table[pos / a.bs]) * a.bs + pos % a.bs) * row;
        prefetch_row(kc, table, pos + a.bs, first + n, a.bs, row);
      }
      for (int64_t kvh = kv_begin; kvh < kv_end; ++kvh) {
        const T* shifted[16];
        for (int i = 0; i < m; ++i) shifted[i] = keys[i] + kvh * D;
        for (int64_t j = 0; j < g; ++j) {
          const int64_t h = (kvh - kv_begin) * g + j;
          dot16<T, D>(qf.data() + h * D, shifted, m, scores.data() + h * n + t0);
        }
      }
    }
  } else
#endif
  {
    for (int64_t t = 0; t < n; ++t) {
      const int64_t pos = first + t;
      const T* k = kc + (static_cast<int64_t>(table[pos / a.bs]) * a.bs + pos % a.bs) * row;
      prefetch_row(kc, table, pos + a.bs, first + n, a.bs, row);
      for (int64_t kvh = kv_begin; kvh < kv_end; ++kvh)
        for (int64_t j = 0; j < g; ++j) {
          const int64_t h = (kvh - kv_begin) * g + j;
          scores[h * n + t] = dot<T, D>(qf.data() + h * D, k + kvh * D);
        }
    }
  }
  for (int64_t h = 0; h < heads; ++h) {
    float* s = scores.data() + h * n;
    float m = s[0];
    for (int64_t t = 1; t < n; ++t) m = s[t] > m ? s[t] : m;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < n; ++t) {
      s[t] = std::exp(s[t] - m);
      sum += s[t];
    }
    const float inv = 1.f / sum;
#pragma omp simd
    for (int64_t t = 0; t < n; ++t) s[t] *= inv;
  }
#if defined(__AVX512F__)
  if constexpr (D % 16 == 0) {
    // per KV head and 16-wide slice of D, up to 4 query heads accumulate in registers over all keys
    vrows.resize(n);
    for (int64_t t = 0; t < n; ++t) {
      const int64_t pos = first + t;
      vrows[t] = vc + (static_cast<int64_t>(table[pos / a.bs]) * a.bs + pos % a.bs) * row;
    }
    for (int64_t kvh = kv_begin; kvh < kv_end; ++kvh)
      for (int64_t j0 = 0; j0 < g; j0 += 4) {
        const int64_t h0 = (kvh - kv_begin) * g + j0, w = g - j0 < 4 ? g - j0 : 4;
        const float* p0 = scores.data() + h0 * n;
        for (int c = 0; c < D / 16; ++c) {
          __m512 sum[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
          for (int64_t t = 0; t < n; ++t) {
            const __m512 v = load16(vrows[t] + kvh * D + 16 * c);
            for (int jj = 0; jj < 4; ++jj)
              if (jj < w) sum[jj] = _mm512_fmadd_ps(_mm512_set1_ps(p0[jj * n + t]), v, sum[jj]);
          }
          for (int jj = 0; jj < w; ++jj) _mm512_storeu_ps(acc.data() + (h0 + jj) * D + 16 * c, sum[jj]);
        }
      }
  } else
#endif
  {
    for (int64_t t = 0; t < n; ++t) {
      const int64_t pos = first + t;
      const T* v = vc + (static_cast<int64_t>(table[pos / a.bs]) * a.bs + pos % a.bs) * row;
      prefetch_row(vc, table, pos + a.bs, first + n, a.bs, row);
      for (int64_t kvh = kv_begin; kvh < kv_end; ++kvh)
        for (int64_t j = 0; j < g; ++j) {
          const int64_t h = (kvh - kv_begin) * g + j;
          axpy<T, D>(scores[h * n + t], v + kvh * D, acc.data() + h * D);
        }
    }
  }
  for (int64_t h = 0; h < heads; ++h)
    for (int d = 0; d < D; ++d) store(out, (b * a.H + h0 + h) * D + d, acc[h * D + d]);
}

template <typename T, int D>
void decode(const T* q, const T* kc, const T* vc, const int32_t* tables, const int32_t* key_start,
            const int32_t* key_end, T* out, const Args& a) {
  // enough tasks for every thread: split sequences by KV head when there are few of them
  const bool split = a.B < 4 * at::get_num_threads() && a.Hkv > 1;
  const int64_t per_seq = split ? a.Hkv : 1;
  at::parallel_for(0, a.B * per_seq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf, acc, scores;
    std::vector<const T*> vrows;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / per_seq, part = task % per_seq;
      const int64_t kv_begin = split ? part : 0, kv_end = split ? part + 1 : a.Hkv;
      attend<T, D>(q, kc, vc, tables, key_start, key_end, out, a, b, kv_begin, kv_end, qf, acc, scores, vrows);
    }
  });
}

template <typename T>
void dispatch(int64_t D, const T* q, const T* kc, const T* vc, const int32_t* tables, const int32_t* ks,
              const int32_t* ke, T* out, const Args& a) {
  switch (D) {
    case 16: return decode<T, 16>(q, kc, vc, tables, ks, ke, out, a);
    case 32: return decode<T, 32>(q, kc, vc, tables, ks, ke, out, a);
    case 64: return decode<T, 64>(q, kc, vc, tables, ks, ke, out, a);
    case 80: return decode<T, 80>(q, kc, vc, tables, ks, ke, out, a);
    case 96: return decode<T, 96>(q, kc, vc, tables, ks, ke, out, a);
    case 128: return decode<T, 128>(q, kc, vc, tables, ks, ke, out, a);
    case 256: return decode<T, 256>(q, kc, vc, tables, ks, ke, out, a);
    default: TORCH_CHECK(false, "paged_decode_attention: unsupported head_dim ", D);
  }
}

}  // namespace

bool supports_head_dim(int64_t D) { return D == 16 || D == 32 || D == 64 || D == 80 || D == 96 || D == 128 || D == 256; }

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor key_cache, torch::Tensor value_cache,
                                     torch::Tensor block_tables, torch::Tensor key_start, torch::Tensor key_end,
                                     double scale) {
  TORCH_CHECK(q.dim() == 3 && key_cache.dim() == 4, "q must be [B, H, D] and key_cache [blocks, block_size, Hkv, D]");
  TORCH_CHECK(q.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(q.scalar_type() == key_cache.scalar_type() && q.scalar_type() == value_cache.scalar_type(),
              "q, keys and values must share one dtype");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && key_start.scalar_type() == torch::kInt32 &&
                  key_end.scalar_type() == torch::kInt32, "block tables and key ranges must be int32");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t bs = key_cache.size(1), Hkv = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == D && H % Hkv == 0, "head_dim or head counts do not match");
  TORCH_CHECK(block_tables.size(0) == B && key_start.size(0) == B && key_end.size(0) == B, "one table per sequence");
  auto tables = block_tables.contiguous();
  auto out = torch::empty_like(q);
  const Args a{B, H, Hkv, bs, tables.size(1), static_cast<float>(scale)};
  if (q.scalar_type() == torch::kFloat32) {
    dispatch<float>(D, q.data_ptr<float>(), key_cache.data_ptr<float>(), value_cache.data_ptr<float>(),
                    tables.data_ptr<int32_t>(), key_start.data_ptr<int32_t>(), key_end.data_ptr<int32_t>(),
                    out.data_ptr<float>(), a);
  } else if (q.scalar_type() == torch::kBFloat16) {
    dispatch<at::BFloat16>(D, q.data_ptr<at::BFloat16>(), key_cache.data_ptr<at::BFloat16>(),
                           value_cache.data_ptr<at::BFloat16>(), tables.data_ptr<int32_t>(),
                           key_start.data_ptr<int32_t>(), key_end.data_ptr<int32_t>(),
                           out.data_ptr<at::BFloat16>(), a);
  } else {
    TORCH_CHECK(false, "paged_decode_attention supports float32 and bfloat16, got ", q.scalar_type());
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)");
  m.def("supports_head_dim", &supports_head_dim, "whether paged_decode_attention handles this head_dim");
}
