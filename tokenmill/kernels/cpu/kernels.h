// The entry points of tokenmill's CPU kernel files, as bindings.cpp exports them to Python and
// decoder.cpp's DecodeStack calls them. Each kernel file includes this header, so a signature that
// drifts from its declaration fails to compile instead of failing to link.
#pragma once

// ATen's tensor and the few ops the kernels call, not <torch/extension.h>: that header (pybind11,
// autograd, the C++ frontend) takes about 40 s to compile per file, the whole build's largest cost.
// Only bindings.cpp and decoder.cpp, which bind to Python, include more: <torch/python.h>.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

// C++ only: a 64-byte-aligned run of at least `words` words inside `buffer`, a thread_local of the
// caller kept between calls (a fresh allocation per call is fresh pages, a fault each), so that each
// 64-byte row of a tile or panel built there is one cache line.
inline uint16_t* aligned_words(std::vector<uint16_t>& buffer, size_t words) {
  if (buffer.size() < words + 32) buffer.resize(words + 32);
  return reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(buffer.data()) + 63) & ~uintptr_t{63});
}

// Which implementation an entry point runs. Both compute the same function; only the summation
// order (float rounding) differs. Portable exists so that tests can check the vectorized path
// against it on a machine that has both; the engine always asks for Fastest.
enum class KernelPath {
  Fastest,   // the vectorized path this build has (AVX-512 / AVX-512 BF16), else the portable one
  Portable,  // plain C++ loops, whatever the build
  Vector,    // the AVX-512 vector path even where AMX tiles (amx.h) or group_linear.cpp's fixed-point
             // products would run: for tests of kernels that have neither, which match it bit for bit
};

// Whether a call may use AMX tiles.
inline bool tiles_allowed(KernelPath path) { return path == KernelPath::Fastest; }

inline bool is_portable(KernelPath path) { return path == KernelPath::Portable; }

// argmax.cpp: torch.argmax(x, -1) of float32 [rows, vocab] logits (greedy sampling)
at::Tensor argmax_rows(at::Tensor x, KernelPath path);

// int4_search.cpp: the (scale, zero) int4_search_params picks for each group, w float32 [groups, g],
// importance float32 of w's shape (or none), trims float32 [T], rounded as dtype (0 float32,
// 1 bfloat16, 2 float16) stores them: (scale, zero) float32 [groups]
std::tuple<at::Tensor, at::Tensor> int4_range_search(at::Tensor w, std::optional<at::Tensor> importance,
                                                     at::Tensor trims, int64_t dtype);

// gptq.cpp: GPTQ's loop over columns begin..end of one block, w float32 [N, B] updated in place,
// h [B, B] the block of the inverse Hessian's upper Cholesky factor, scale and zero float32
// [N, end - begin] each column's group parameters; writes levels (q - 8) and the errors divided by
// h's diagonal into levels and err [N, B]
void gptq_columns(at::Tensor w, at::Tensor h, at::Tensor scale, at::Tensor zero, int64_t begin, int64_t end,
                  at::Tensor levels, at::Tensor err);

// paged_attention.cpp
bool supports_head_dim(int64_t D);
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor key_cache, at::Tensor value_cache,
                                     at::Tensor key_scale, at::Tensor value_scale, at::Tensor block_tables,
                                     at::Tensor key_start, at::Tensor key_end, double scale, KernelPath path);

// prefill_attention.cpp
at::Tensor paged_prefill_attention(at::Tensor q, at::Tensor key_cache, at::Tensor value_cache,
                                      at::Tensor block_tables, at::Tensor query_start, at::Tensor key_start,
                                      at::Tensor key_end, int64_t window, double scale, KernelPath path);

// int8_linear.cpp
at::Tensor int8_weight_linear(at::Tensor x, at::Tensor weight, at::Tensor scale, KernelPath path);

// int4_linear.cpp: tinygemm's int4 convention, w = (q - 8) * scale + zero, on group_linear.cpp's kernel
bool int4_linear_fast();
at::Tensor int4_weight_linear(at::Tensor x, at::Tensor packed, at::Tensor scales_zeros, int64_t group_size,
                                 KernelPath path);

// group_linear.cpp: grouped codes, w = code * scale + min (GGUF's Q4_0 .. Q8_0, K-quants)
bool group_linear_fast();
// bfloat16 calls of fewer rows than this run grouped codes on integer products, x in 16-bit fixed
// point per group (0: never, on this build)
int64_t fixed_point_rows();
// From how many rows a bfloat16 call of group_weight_linear / int4_weight_linear runs the bfloat16
// GEMM over its weights dequantized to bfloat16 once per call (0: never, on this build or by
// TOKENMILL_DEQUANT_ROWS=0: the group-by-group sums at every row count).
int64_t dequant_rows();
// out_float32 with bfloat16 x: the outputs rounded to bfloat16 as usual, stored as float32 (logits
// read as float32, without a conversion pass over them).
at::Tensor group_weight_linear(at::Tensor x, at::Tensor packed, at::Tensor sz, int64_t group_size,
                                  int64_t bits, bool out_float32, KernelPath path);
// The shared kernel, shapes already checked: shift_min true for group_weight_linear (min is the
// minimum of code * scale + min), false for int4_weight_linear (zero of (q - 8) * scale + zero).
at::Tensor grouped_codes_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& sz,
                                   int64_t group_size, int64_t bits, bool shift_min, bool out_float32,
                                   KernelPath path);

// int8_copy_linear.cpp: a grouped weight's int8 copy (codes one byte each, 4 k per 32-bit lane,
// float32 scales, or float16 where each is one exactly, and mins unless offset >= 0 (w = (code -
// offset) scale): tokenmill.quantization.
// grouped.int8_copy_pack) times x in two int8 parts per row and group, on vpdpbusd (AVX-512 VNNI).
// out_float32 with bfloat16 x: the outputs rounded to bfloat16, stored as float32; float32 x gives
// float32 outputs, unrounded. one_part: x in one int8 part (llama.cpp's Q8 activations), half the
// products, for calls of many rows.
bool int8_copy_linear_fast();
at::Tensor int8_copy_linear(at::Tensor x, at::Tensor copy, int64_t N, int64_t group_size, int64_t offset,
                            at::Tensor bias, bool out_float32 = false, bool one_part = false,
                            KernelPath path = KernelPath::Fastest);

// bf16_linear.cpp
bool bf16_linear_fast();
at::Tensor bf16_pack(at::Tensor weight);
// C++ only: bf16_packed_linear's vector schedule on the calling thread, over `tiles` output tiles
// in bf16_pack's layout at w, into out (row stride ldo; bfloat16 bits, or float32 holding the
// bfloat16-rounded values), no bias: the same bits as bf16_packed_linear's vector path.
void bf16_panel_vector(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t tiles, uint16_t* out,
                       int64_t ldo);
void bf16_panel_vector(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t tiles, float* out,
                       int64_t ldo);
// out_float32: the outputs rounded to bfloat16 as usual, stored as float32.
at::Tensor bf16_packed_linear(at::Tensor x, at::Tensor packed, int64_t N, at::Tensor bias,
                                 bool out_float32 = false, KernelPath path = KernelPath::Fastest);
// Whether this process runs bfloat16 products on AMX tiles (the build has them, the OS grants them).
bool amx_tiles();

// sparse_linear.cpp: a pruned bfloat16 weight without its zeros (a mask and the nonzeros per
// vector of bf16_pack's layout), bit-identical to bf16_packed_linear on the dense weight
bool sparse_linear_fast();
std::tuple<at::Tensor, at::Tensor, at::Tensor> sparse_bf16_pack(at::Tensor weight);
at::Tensor sparse_bf16_linear(at::Tensor x, at::Tensor values, at::Tensor masks, at::Tensor offsets,
                                 std::optional<at::Tensor> bias, int64_t N, bool out_float32 = false);

// kv_write.cpp
void write_quantized_kv(at::Tensor x, at::Tensor slots, at::Tensor rows, at::Tensor scales);

// lora.cpp: batched multi-LoRA (Punica BGMV / SGMV), in place: for every token t with
// slots[t] >= 0, y[t, o] += sum_r B[s, o, r] * h[part(o), r] with h[p, r] = sum_k x[t, k] * A[s, p, r, k],
// s = slots[t], h in float32, y rounded once. x [T, K], y [T, N] (row stride >= N), slots int32 [T],
// A [S, P, R, K], B [S, N, R] (x's dtype, contiguous), part_starts int64 [P + 1] from 0 to N.
// Or A and B int8 with float32 per-row scales A_scale [S, P, R] and B_scale [S, N] (contiguous):
// A = A_q * A_scale[..., None], B = B_q * B_scale[..., None], each scale applied to a finished sum.
void lora_add(at::Tensor x, at::Tensor y, at::Tensor slots, at::Tensor A, at::Tensor B,
              at::Tensor part_starts, std::optional<at::Tensor> A_scale, std::optional<at::Tensor> B_scale,
              KernelPath path);
