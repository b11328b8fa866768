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
Grouped codes (GGUF's Q4_0 .. Q8_0 and K-quants, ``w = code * scale + min``, bits 4, 5, 7 or 8): on CPU
tokenmill's ``group_weight_linear`` (tokenmill/kernels/cpu/group_linear.cpp, layout built by
:func:`group_cpu_pack`), the same kernel as INT4's.
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
    """x [M, K] float, qweight int8 [N, K] and scale [N] (float; cast to x's dtype where it differs),
    both aligned -> [M, N]."""
    ops = dispatch.for_tensors(x)
    if ops is not None:
        return ops.int8_weight_linear(x, qweight, scale)
    if scale.dtype != x.dtype:  # PyTorch's kernel wants them alike (a float32 head in a bfloat16 model)
        scale = scale.to(x.dtype)
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


def _nibble_tiles(q: torch.Tensor) -> torch.Tensor:
    """uint8 codes [N, Kp] in 0..15 (N % 16 == 0, Kp % 4 == 0) -> [N / 16, Kp / 4, 32], chunk c of a
    16-row tile holding byte 2r + j = q[r, 4c + j] | q[r, 4c + 2 + j] << 4."""
    n = q.shape[0]
    q = q.view(n // 16, 16, -1, 2, 2)  # tile, row, chunk, (low | high nibble), j
    return (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).permute(0, 2, 1, 3).reshape(n // 16, -1, 32).contiguous()


def _five_bit_tiles(q: torch.Tensor) -> torch.Tensor:
    """uint8 codes [N, K] in 0..31 (N % 16 == 0, K % 16 == 0) -> [N / 16, 5 K / 16, 32]: per 4 chunks
    of :func:`_nibble_tiles` (the low 4 bits), one 32-byte chunk of their fifth bits, 8 bytes per
    chunk c: a little-endian 32-bit mask for k pair 2c (bit 2r + j: code[r, 4c + j] >> 4) and one
    for k pair 2c + 1 (bit 2r + j: code[r, 4c + 2 + j] >> 4)."""
    n, k = q.shape
    nibbles = _nibble_tiles(q & 15).view(n // 16, k // 16, 4, 32)  # tile, super-chunk, chunk, byte
    high = (q >> 4).view(n // 16, 16, k // 4, 2, 2)  # tile, row, chunk, pair i, j
    bits = high.permute(0, 2, 3, 1, 4).reshape(n // 16, k // 4, 2, 32).to(torch.int64)  # bit w = 2r + j
    masks = (bits << torch.arange(32)).sum(-1)  # [tiles, chunks, 2] as integers < 2^32
    le = torch.stack([(masks >> (8 * b)) & 0xFF for b in range(4)], dim=-1).to(torch.uint8)  # [tiles, chunks, 2, 4]
    fifth = le.reshape(n // 16, k // 16, 1, 32)  # 4 chunks x 8 bytes
    return torch.cat((nibbles, fifth), dim=2).reshape(n // 16, 5 * k // 16, 32).contiguous()


def _tile_scales(scale: torch.Tensor, offset: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """scale and zero / min [N, G] -> [N / 16, G, 2, 16] in ``dtype``."""
    n = scale.shape[0]
    return torch.stack((scale, offset)).to(dtype).view(2, n // 16, 16, -1).permute(1, 3, 0, 2).contiguous()


def int4_cpu_pack(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Portable nibbles uint8 [N, Kp / 2], scale and zero [N, G] (N % 16 == 0) -> the layout of
    tokenmill's CPU kernel: weights uint8 [N / 16, Kp / 4, 32], where chunk c of a 16-row tile holds
    byte 2r + j = q[r, 4c + j] | q[r, 4c + 2 + j] << 4, and scales/zeros [N / 16, G, 2, 16]
    (bfloat16 kept as is, any other dtype as float32)."""
    weight = _nibble_tiles(unpack_nibbles(packed).to(torch.uint8))
    dtype = scale.dtype if scale.dtype == torch.bfloat16 else torch.float32
    return weight, _tile_scales(scale, zero, dtype)


GROUP_BITS = {4: (4, 15), 5: (4, 31), 7: (2, 127), 8: (2, 255)}
"""bits -> (input columns per 32-byte chunk of a 16-row tile, largest code)."""


def group_cpu_pack(codes: torch.Tensor, scale: torch.Tensor, min: torch.Tensor,
                   bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped codes, ``w[n, k] = codes[n, k] * scale[n, g] + min[n, g]`` with g = k // group_size and
    group_size = K // G (the GGUF types Q4_0 .. Q8_0, Q4_K .. Q6_K, exactly), into the layout of
    tokenmill's CPU kernel ``group_weight_linear``:

        codes uint8 [N, K], scale and min float32 [N, G]; N % 16 == 0 (pad rows with code 0, scale 0,
        min 0), K a whole number of groups
        bits 4: codes 0..15 -> packed uint8 [N / 16, K / 4, 32], int4_cpu_pack's nibble tiles
                (group_size % 4 == 0)
        bits 8: codes 0..255 -> packed uint8 [N / 16, K / 2, 32], chunk c of a 16-row tile holding
                byte 2r + j = codes[r, 2c + j] (group_size % 2 == 0)
        bits 7: codes 0..127, bits 8's layout (the kernel widens them in 2 instructions, not 6)
        bits 5: codes 0..31 -> packed uint8 [N / 16, 5 K / 16, 32]: bits 4's nibble tiles of the low 4
                bits, with after every 4 chunks one chunk of their fifth bits (see :func:`_five_bit_tiles`;
                K % 16 == 0, group_size % 4 == 0)
        sz [N / 16, G, 2, 16]: (scale, min) of each group of a tile's 16 rows, float16 when every
           scale and min is a float16 value exactly (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: half the bytes
           the kernel streams per group), else float32 (the K-quants' d * sc products)

    Returns (packed, sz) for :func:`group_weight_mm`."""
    if bits not in GROUP_BITS:
        raise ValueError(f"group_cpu_pack: bits must be 4, 5, 7 or 8, got {bits}")
    per_chunk, largest = GROUP_BITS[bits]
    if codes.dim() != 2 or codes.dtype != torch.uint8:
        raise ValueError(f"group_cpu_pack: codes must be uint8 [N, K], got {codes.dtype} {tuple(codes.shape)}")
    n, k = codes.shape
    if scale.dim() != 2 or scale.shape != min.shape or scale.shape[0] != n or scale.shape[1] == 0:
        raise ValueError(f"group_cpu_pack: scale and min must both be [N, G] with N = {n}, got "
                         f"{tuple(scale.shape)} and {tuple(min.shape)}")
    groups = scale.shape[1]
    if n % 16:
        raise ValueError(f"group_cpu_pack: N = {n} must be a multiple of 16 (pad rows with code 0, scale 0, min 0)")
    if k % groups or (k // groups) % per_chunk:
        raise ValueError(f"group_cpu_pack: K = {k} must be G = {groups} groups of a multiple of {per_chunk} "
                         f"columns for bits {bits}")
    if codes.numel() and int(codes.max()) > largest:
        raise ValueError(f"group_cpu_pack: bits {bits} codes must be in 0..{largest}, got {int(codes.max())}")
    if bits == 5 and k % 16:
        raise ValueError(f"group_cpu_pack: bits 5 needs K a multiple of 16, got {k}")
    if bits == 4:
        weight = _nibble_tiles(codes.contiguous())
    elif bits == 5:
        weight = _five_bit_tiles(codes.contiguous())
    else:
        weight = codes.contiguous().view(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3).reshape(n // 16, k // 2, 32)
        weight = weight.contiguous()
    return weight, _tile_scales(scale, min, torch.float16 if _exact_in_half(scale, min) else torch.float32)


CODE_OFFSETS = {4: 8, 5: 16, 7: -128, 8: 128}
"""bits -> o, what ``group_weight_linear`` subtracts from the codes before its products (it folds
o * scale into the min: mn = min + o * scale)."""


def scales_alone(sz: torch.Tensor, bits: int) -> torch.Tensor:
    """:func:`group_cpu_pack`'s sz [N / 16, G, 2, 16] as scales alone, [N / 16, G, 1, 16], when every
    min is exactly -o * scale (the kernel's mn is then 0: GGUF's symmetric Q4_0, Q5_0 and Q8_0, and
    int8 weights), else sz itself. The kernel computes the same sums and streams 2 bytes (float16
    scales) fewer per group: about 6% of a Q8_0 weight's bytes."""
    scale, mn = sz[:, :, 0].float(), sz[:, :, 1].float()
    if torch.equal(mn, -CODE_OFFSETS[bits] * scale):
        return sz[:, :, :1].contiguous()
    return sz


def int8_grouped_pack(qweight: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A symmetric per-channel int8 weight (``w = q * scale[n]``, q int8 [N, K]) as grouped codes
    with one group per row (code q + 128, scale, min -128 scale: exact), rows padded to a multiple of
    16, for :func:`group_weight_mm` with group_size K and bits 8 (the scales alone: min = -128 scale)."""
    pad = -qweight.shape[0] % 16
    codes = (qweight.to(torch.int16) + 128).to(torch.uint8)
    s = scale.float()[:, None]
    if pad:
        codes, s = torch.nn.functional.pad(codes, (0, 0, 0, pad)), torch.nn.functional.pad(s, (0, 0, 0, pad))
    packed, sz = group_cpu_pack(codes, s, -128 * s, 8)
    return packed, scales_alone(sz, 8)


def _exact_in_half(*tensors: torch.Tensor) -> bool:
    """Whether every value of float32 ``tensors`` survives a round trip through float16."""
    return all(torch.equal(t.float().half().float(), t.float()) for t in tensors)


def group_weight_mm(x: torch.Tensor, packed: torch.Tensor, sz: torch.Tensor, group_size: int,
                    bits: int, out_float32: bool = False) -> torch.Tensor:
    """x [M, K] float32 or bfloat16 on CPU -> x @ w^T [M, N] in x's dtype, w the grouped codes that
    :func:`group_cpu_pack` packed into (packed, sz); tokenmill's ``group_weight_linear``.
    ``out_float32``: float32 out, the very values of the bfloat16 one (rounded, then widened)."""
    ops = dispatch.cpu_ops()
    if ops is None:
        raise RuntimeError("group_weight_mm needs tokenmill's CPU kernels, which are off or could not be built "
                           f"({dispatch.ENV_VAR}; see the tokenmill.kernels log)")
    return ops.group_weight_linear(x, packed, sz, group_size, bits, out_float32=out_float32)
