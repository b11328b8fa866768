// Weight-only INT4 linear on CPU, group-wise asymmetric weights (tinygemm's convention):
//   w[n, k] = (q[n, k] - 8) * scale[n, g] + zero[n, g],  q in 0..15, g = k / group_size
//   out[m, n] = sum_g scale[n, g] * (sum_{k in g} (q[n, k] - 8) x[m, k]) + zero[n, g] * sx[m, g]
// with sx[m, g] the sum of x over the group. Built at first use by tokenmill/kernels/cpu_ops.py.
//
// Layout (built once by tokenmill.quantization.kernels.int4_cpu_pack): output channels in tiles of
// 16; a tile's weights are Kp / 4 chunks of 32 bytes, chunk c holding k = 4c .. 4c + 3 of the 16
// rows: byte 2r + j has q[r, 4c + j] in its low nibble and q[r, 4c + 2 + j] in its high one. Scales
// and zeros are [tiles, groups, 2, 16] (float32 or bfloat16).
//
// The kernel is group_linear.cpp's (the GGUF-style grouped codes, bits 4): the same loops with
// signed codes q - 8 and the minimum taken as zero as is. It streams the weights once per call for
// few rows and unpacks them to bfloat16 once per call for many; either way a row's result does not
// depend on the other rows of the call nor on the thread count.


#include "kernels.h"

bool int4_linear_fast() { return group_linear_fast(); }

at::Tensor int4_weight_linear(at::Tensor x, at::Tensor packed, at::Tensor scales_zeros, int64_t group_size,
                                 KernelPath path) {
  TORCH_CHECK(x.dim() == 2, "x must be [M, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "x must be float32 or bfloat16");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.size(2) == 32,
              "packed weight must be uint8 [N / 16, K / 4, 32]");
  TORCH_CHECK(group_size > 0 && group_size % 4 == 0, "group_size must be a positive multiple of 4");
  const int64_t Kp = x.size(1);
  TORCH_CHECK(packed.size(1) * 4 == Kp, "x has ", Kp, " columns, the weight ", packed.size(1) * 4);
  TORCH_CHECK(Kp % group_size == 0, "K must be a whole number of groups");
  TORCH_CHECK(scales_zeros.dim() == 4 && scales_zeros.size(0) == packed.size(0) &&
                  scales_zeros.size(1) == Kp / group_size && scales_zeros.size(2) == 2 && scales_zeros.size(3) == 16,
              "scales_zeros must be [N / 16, K / group_size, 2, 16]");
  return grouped_codes_linear(x, packed, scales_zeros, group_size, 4, /*shift_min=*/false, /*out_float32=*/false, path);
}
