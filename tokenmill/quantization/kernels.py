"""The low-precision matmuls, one place per device: PyTorch's packed-weight kernels and ours.

INT8 weight-only: on CPU tokenmill's ``int8_weight_linear`` (tokenmill/kernels/cpu/int8_linear.cpp:
the weights read once per call whatever the number of rows; PyTorch's ``_weight_int8pack_mm``
reads them once per row, 2.4x slower at 32 rows in bfloat16 and 20x in float32), else
``torch._weight_int8pack_mm(x, w_int8 [N, K], scales [N])`` (CUDA, or CPU without the kernels).
INT4 weight-only: on CPU with AVX-512 BF16 (``dispatch.for_int4``), tokenmill's ``int4_weight_linear``
(tokenmill/kernels/cpu/int4_linear.cpp, layout built by :func:`int4_cpu_pack`), else the tinygemm
convention on both devices, ``w = (q - 8) * scale + zero`` with
q in 0..15 and one (scale, zero) per group of ``group_size`` input columns; the weight is
repacked once into each device's own layout (``_convert_weight_to_int4pack_for_cpu`` /
``_convert_weight_to_int4pack``) and multiplied by ``_weight_int4pack_mm_for_cpu`` /
``_weight_int4pack_mm`` with ``scales_and_zeros [K / group_size, N, 2]``.
W8A8: ``torch._int_mm(x_int8 [M, K], w_int8 [N, K].t())`` -> int32 [M, N]. On CPU it is oneDNN's
s8 x s8 -> s32 GEMM (about 3.5x the float32 matmul at M = 512, K = 576, N = 1536 on one thread) and
takes any M, K, N and unaligned inputs. On CUDA (cuBLASLt) it needs M > 16 and K, N multiples of 8: fewer rows are
padded with zero rows here, and :class:`~tokenmill.quantization.linear.W8A8Linear` checks K and N.
"""

from __future__ import annotations

import torch

from tokenmill.kernels import dispatch

ALIGNMENT = 64
"""Bytes. The CPU int8 kernel reads its operands with aligned vector loads and crashes (SIGSEGV, no
error) on a tensor whose data starts off a 32-byte boundary, as a view at an offset or a tensor
read from a safetensors file may; every row must be aligned too, hence K % 16 == 0."""


def aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when contiguous and starting on an ALIGNMENT boundary, else an aligned copy."""
    if t.is_contiguous() and t.data_ptr() % ALIGNMENT == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def int8_weight_mm(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] float, qweight int8 [N, K] and scale [N] in x's dtype, both aligned -> [M, N]."""
    ops = dispatch.for_tensors(x)
    if ops is not None:
        return ops.int8_weight_linear(x, qweight, scale)
    return torch._weight_int8pack_mm(aligned(x), qweight, scale)


CUDA_INT_MM_MIN_ROWS = 17


def int8_int8_mm(x: torch.Tensor, qweight: torch.Tensor) -> torch.Tensor:
    """x int8 [M, K], qweight int8 [N, K] -> x @ qweight^T, int32 [M, N], exact."""
    m = x.shape[0]
    if x.device.type == "cuda" and m < CUDA_INT_MM_MIN_ROWS:
        x = torch.nn.functional.pad(x, (0, 0, 0, CUDA_INT_MM_MIN_ROWS - m))
        return torch._int_mm(x, qweight.t())[:m]
    return torch._int_mm(x.contiguous(), qweight.t())


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K / 2] (even column in the low nibble) -> int32 [N, K] in 0..15."""
    low, high = packed & 0x0F, packed >> 4
    return torch.stack((low, high), dim=-1).reshape(packed.shape[0], -1).to(torch.int32)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """int [N, K] in 0..15 -> uint8 [N, K / 2], even column in the low nibble."""
    q = q.to(torch.uint8)
    return q[:, ::2] | (q[:, 1::2] << 4)


def int4_kernel_weight(packed: torch.Tensor) -> torch.Tensor:
    """Portable nibbles uint8 [N, K / 2] -> the device kernel's own layout."""
    if packed.device.type == "cuda":
        # tinygemm reads high nibble first: swap to (even << 4) | odd
        swapped = (packed >> 4) | (packed << 4)
        k = packed.shape[1] * 2
        inner_k_tiles = next(t for t in (8, 4, 2) if k % (t * 16) == 0)
        return torch._convert_weight_to_int4pack(swapped.contiguous(), inner_k_tiles)
    return torch._convert_weight_to_int4pack_for_cpu(unpack_nibbles(packed), 1)


def int4_scales_and_zeros(scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """scale, zero [N, K / group_size] -> [K / group_size, N, 2], as the kernels take them."""
    return torch.stack((scale, zero), dim=-1).transpose(0, 1).contiguous()


def int4_weight_mm(x: torch.Tensor, kernel_weight: torch.Tensor, group_size: int,
                   scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """x [M, K] float -> [M, N]; see :func:`int4_kernel_weight` and :func:`int4_scales_and_zeros`."""
    if x.device.type == "cuda":
        return torch._weight_int4pack_mm(x, kernel_weight, group_size, scales_and_zeros)
    return torch._weight_int4pack_mm_for_cpu(x, kernel_weight, group_size, scales_and_zeros)


def int4_cpu_pack(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Portable nibbles uint8 [N, Kp / 2], scale and zero [N, G] (N % 16 == 0) -> the layout of
    tokenmill's CPU kernel: weights uint8 [N / 16, Kp / 4, 32], where chunk c of a 16-row tile holds
    byte 2r + j = q[r, 4c + j] | q[r, 4c + 2 + j] << 4, and scales/zeros [N / 16, G, 2, 16]
    (bfloat16 kept as is, any other dtype as float32)."""
    n = packed.shape[0]
    q = unpack_nibbles(packed).to(torch.uint8)  # [N, Kp]
    q = q.view(n // 16, 16, -1, 2, 2)  # tile, row, chunk, (low | high nibble), j
    weight = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).permute(0, 2, 1, 3).reshape(n // 16, -1, 32).contiguous()
    dtype = scale.dtype if scale.dtype == torch.bfloat16 else torch.float32
    sz = torch.stack((scale, zero)).to(dtype).view(2, n // 16, 16, -1).permute(1, 3, 0, 2).contiguous()
    return weight, sz
