// The entry points of tokenmill's CPU kernel files, as bindings.cpp exports them to Python and
// decoder.cpp's DecodeStack calls them. Each kernel file includes this header, so a signature that
// drifts from its declaration fails to compile instead of failing to link.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <optional>
#include <tuple>

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
torch::Tensor argmax_rows(torch::Tensor x, KernelPath path);

// paged_attention.cpp
bool supports_head_dim(int64_t D);
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor key_cache, torch::Tensor value_cache,
                                     torch::Tensor key_scale, torch::Tensor value_scale, torch::Tensor block_tables,
                                     torch::Tensor key_start, torch::Tensor key_end, double scale, KernelPath path);

// prefill_attention.cpp
torch::Tensor paged_prefill_attention(torch::Tensor q, torch::Tensor key_cache, torch::Tensor value_cache,
                                      torch::Tensor block_tables, torch::Tensor query_start, torch::Tensor key_start,
                                      torch::Tensor key_end, int64_t window, double scale, KernelPath path);

// int8_linear.cpp
torch::Tensor int8_weight_linear(torch::Tensor x, torch::Tensor weight, torch::Tensor scale, KernelPath path);

// int4_linear.cpp: tinygemm's int4 convention, w = (q - 8) * scale + zero, on group_linear.cpp's kernel
bool int4_linear_fast();
torch::Tensor int4_weight_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales_zeros, int64_t group_size,
                                 KernelPath path);

// group_linear.cpp: grouped codes, w = code * scale + min (GGUF's Q4_0 .. Q8_0, K-quants)
bool group_linear_fast();
// bfloat16 calls of fewer rows than this run grouped codes on integer products, x in 16-bit fixed
// point per group (0: never, on this build)
int64_t fixed_point_rows();
// out_float32 with bfloat16 x: the outputs rounded to bfloat16 as usual, stored as float32 (logits
// read as float32, without a conversion pass over them).
torch::Tensor group_weight_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor sz, int64_t group_size,
                                  int64_t bits, bool out_float32, KernelPath path);
// The shared kernel, shapes already checked: shift_min true for group_weight_linear (min is the
// minimum of code * scale + min), false for int4_weight_linear (zero of (q - 8) * scale + zero).
torch::Tensor grouped_codes_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& sz,
                                   int64_t group_size, int64_t bits, bool shift_min, bool out_float32,
                                   KernelPath path);

// bf16_linear.cpp
bool bf16_linear_fast();
torch::Tensor bf16_pack(torch::Tensor weight);
// out_float32: the outputs rounded to bfloat16 as usual, stored as float32.
torch::Tensor bf16_packed_linear(torch::Tensor x, torch::Tensor packed, int64_t N, torch::Tensor bias,
                                 bool out_float32 = false, KernelPath path = KernelPath::Fastest);
// Whether this process runs bfloat16 products on AMX tiles (the build has them, the OS grants them).
bool amx_tiles();

// sparse_linear.cpp: a pruned bfloat16 weight without its zeros (a mask and the nonzeros per
// vector of bf16_pack's layout), bit-identical to bf16_packed_linear on the dense weight
bool sparse_linear_fast();
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> sparse_bf16_pack(torch::Tensor weight);
torch::Tensor sparse_bf16_linear(torch::Tensor x, torch::Tensor values, torch::Tensor masks, torch::Tensor offsets,
                                 std::optional<torch::Tensor> bias, int64_t N, bool out_float32 = false);

// kv_write.cpp
void write_quantized_kv(torch::Tensor x, torch::Tensor slots, torch::Tensor rows, torch::Tensor scales);

// lora.cpp: batched multi-LoRA (Punica BGMV / SGMV), in place: for every token t with
// slots[t] >= 0, y[t, o] += sum_r B[s, o, r] * h[part(o), r] with h[p, r] = sum_k x[t, k] * A[s, p, r, k],
// s = slots[t], h in float32, y rounded once. x [T, K], y [T, N] (row stride >= N), slots int32 [T],
// A [S, P, R, K], B [S, N, R] (x's dtype, contiguous), part_starts int64 [P + 1] from 0 to N.
// Or A and B int8 with float32 per-row scales A_scale [S, P, R] and B_scale [S, N] (contiguous):
// A = A_q * A_scale[..., None], B = B_q * B_scale[..., None], each scale applied to a finished sum.
void lora_add(torch::Tensor x, torch::Tensor y, torch::Tensor slots, torch::Tensor A, torch::Tensor B,
              torch::Tensor part_starts, std::optional<torch::Tensor> A_scale, std::optional<torch::Tensor> B_scale,
              KernelPath path);

// decoder.cpp: rms_norm, qkv_rope, act_mul, LinearKind, Linear and DecodeStack
void bind_decoder(pybind11::module& m);
