"""Dequantize GGML tensor data (as stored in GGUF files) to float32, in vectorized torch.

Every quantized type stores a tensor as consecutive fixed-size blocks, row-major, each
block covering ``block_size`` consecutive elements of one row (so a row's length is a
multiple of ``block_size``). A decoder here turns a ``(n_blocks, type_size)`` uint8
tensor into ``(n_blocks, block_size)`` float32, using whole-tensor shifts and masks.

Layouts (little-endian; ``f16`` is an IEEE half; QK_K = 256)::

    Q8_0  [d f16][q int8 x32]                      x = d*q
    Q4_0  [d f16][qs 16B]                          x = d*(nibble-8)
    Q4_1  [d f16][m f16][qs 16B]                   x = d*nibble + m
    Q5_0  [d f16][qh u32][qs 16B]                  x = d*((nibble | bit<<4) - 16)
    Q5_1  [d f16][m f16][qh u32][qs 16B]           x = d*(nibble | bit<<4) + m
          element j < 16 is the low nibble of qs[j], element j+16 its high nibble;
          the fifth bit of element j is bit j of qh.
    Q2_K  [scales 16B][qs 64B][d f16][dmin f16]    16 sub-blocks of 16, 2-bit q
    Q3_K  [hmask 32B][qs 64B][scales 12B][d f16]   16 sub-blocks of 16, 6-bit signed scales
    Q4_K  [d f16][dmin f16][scales 12B][qs 128B]   8 sub-blocks of 32, 6-bit scale and min
    Q5_K  [d f16][dmin f16][scales 12B][qh 32B][qs 128B]
    Q6_K  [ql 128B][qh 64B][scales int8 x16][d f16]
    Q8_K  [d f32][q int8 x256][bsums int16 x16]    x = d*q

The arithmetic order (e.g. ``(d*sc)*q - dmin*m``) follows ``gguf.quants`` so results
are bit-identical to its reference dequantizer.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from tokenmill.errors import ModelFormatError, UnsupportedModelError

QK_K = 256

Decoder = Callable[[torch.Tensor], torch.Tensor]


def _f16(b: torch.Tensor) -> torch.Tensor:
    """``(n, 2)`` uint8 bytes of one half per row -> ``(n, 1)`` float32."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """``(..., k)`` uint8 -> ``(..., 2, k)``: all low nibbles, then all high nibbles."""
    return torch.stack((qs & 0x0F, qs >> 4), dim=-2)


def _crumbs(qs: torch.Tensor, bits: int) -> torch.Tensor:
    """``(..., k)`` uint8 -> ``(..., 8 // bits, k)``: the ``bits``-wide fields, lowest first."""
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8).view(-1, 1)
    return (qs.unsqueeze(-2) >> shifts) & ((1 << bits) - 1)


def _as_float(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret packed bytes as ``dtype`` and widen to a float32 tensor that owns its memory."""
    if raw.storage_offset() % dtype.itemsize:
        raw = raw.clone()
    out = raw.view(dtype).float()
    return out.clone() if dtype == torch.float32 else out


# --------------------------------------------------------------------------- field extraction
# The unsigned codes and the per-block (or per-sub-block) fields of the types ``gguf_groups``
# also reads: the decoders below and the grouped form share them.

def q8_0_fields(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (q int8 (n, 32), d (n, 1))."""
    return b[:, 2:].view(torch.int8), _f16(b[:, :2])


def q4_0_fields(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (nibbles uint8 (n, 32) in 0..15, d (n, 1))."""
    return _nibbles(b[:, 2:]).flatten(1), _f16(b[:, :2])


def q4_1_fields(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (nibbles uint8 (n, 32), d (n, 1), m (n, 1))."""
    return _nibbles(b[:, 4:]).flatten(1), _f16(b[:, :2]), _f16(b[:, 2:4])


def _q5_high_bits(qh: torch.Tensor) -> torch.Tensor:
    """``(n, 4)`` bytes of a little-endian u32 -> ``(n, 32)`` uint8 holding bit j at j, shifted to bit 4."""
    return (_crumbs(qh, 1).transpose(1, 2).flatten(1)) << 4


def q5_0_fields(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (codes uint8 (n, 32) in 0..31, d (n, 1))."""
    return _nibbles(b[:, 6:]).flatten(1) | _q5_high_bits(b[:, 2:6]), _f16(b[:, :2])


def q5_1_fields(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (codes uint8 (n, 32) in 0..31, d (n, 1), m (n, 1))."""
    return _nibbles(b[:, 8:]).flatten(1) | _q5_high_bits(b[:, 4:8]), _f16(b[:, :2]), _f16(b[:, 2:4])


def _k_scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K 12 scale bytes -> 8 six-bit scales and 8 six-bit mins (as float32)::

    bytes 0-3 : EEAAAAAA  scale j (j<4) = low 6 bits; its top 2 bits feed scale j+4
    bytes 4-7 : eeaaaaaa  min j (j<4)   = low 6 bits; its top 2 bits feed min j+4
    bytes 8-11: mmmmssss  scale j+4 = ssss | EE<<4, min j+4 = mmmm | ee<<4
    """
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=1)
    return sc.float(), mn.float()


def k_scales(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K sub-block parameters: (d * sc, dmin * m), each float32 (n, 8), as gguf.quants
    computes them (both products exact: an 11-bit half times a 6-bit integer)."""
    sc, mn = _k_scale_min(b[:, 4:16])
    return _f16(b[:, :2]) * sc, _f16(b[:, 2:4]) * mn


def q4_k_codes(b: torch.Tensor) -> torch.Tensor:
    """-> uint8 (n, 8, 32) in 0..15, sub-block j's 32 codes in row j."""
    return _nibbles(b[:, 16:144].reshape(b.shape[0], 4, 32)).reshape(b.shape[0], 8, 32)


def q5_k_codes(b: torch.Tensor) -> torch.Tensor:
    """-> uint8 (n, 8, 32) in 0..31."""
    n = b.shape[0]
    low = _nibbles(b[:, 48:176].reshape(n, 4, 32)).reshape(n, 8, 32)
    return low | (_crumbs(b[:, 16:48], 1) << 4)


def q6_k_fields(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (codes uint8 (n, 16, 16) in 0..63, d * scale float32 (n, 16)). Each 128-element half:
    ql 64B gives the low nibbles, qh 32B the 2-bit high parts; the scales are int8."""
    n = b.shape[0]
    low = _nibbles(b[:, :128].reshape(n, 2, 64)).reshape(n, 8, 32)
    high = _crumbs(b[:, 128:192].reshape(n, 2, 32), 2).reshape(n, 8, 32)
    return (low | (high << 4)).view(n, 16, 16), _f16(b[:, 208:210]) * b[:, 192:208].view(torch.int8).float()


# --------------------------------------------------------------------------- decoders

def _q8_0(b: torch.Tensor) -> torch.Tensor:
    q, d = q8_0_fields(b)
    return q.float() * d


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    q, d = q4_0_fields(b)
    return d * (q.view(torch.int8) - 8).float()


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    q, d, m = q4_1_fields(b)
    return q.float().mul_(d).add_(m)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    q, d = q5_0_fields(b)
    return d * (q.view(torch.int8) - 16).float()


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    q, d, m = q5_1_fields(b)
    return q.float().mul_(d).add_(m)


def _q8_k(b: torch.Tensor) -> torch.Tensor:
    d = b[:, :4].contiguous().view(torch.float32)
    return d * b[:, 4 : 4 + QK_K].view(torch.int8).float()


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scales, qs = b[:, :16], b[:, 16:80]
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
    dl = (d * (scales & 0x0F).float()).view(n, 16, 1)
    ml = (dmin * (scales >> 4).float()).view(n, 16, 1)
    q = _crumbs(qs.reshape(n, 2, 32), 2).reshape(n, 16, 16).float()
    return (dl * q - ml).view(n, QK_K)


def _q3_k_scales(s: torch.Tensor) -> torch.Tensor:
    """12 bytes -> 16 signed 6-bit scales: low 4 bits from bytes 0-7, high 2 from bytes 8-11."""
    n = s.shape[0]
    low = _nibbles(s[:, :8]).reshape(n, 16)
    high = _crumbs(s[:, 8:12], 2).reshape(n, 16)
    return ((low | (high << 4)).view(torch.int8) - 32).float()


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    hmask, qs = b[:, :32], b[:, 32:96]
    dl = (_f16(b[:, 108:110]) * _q3_k_scales(b[:, 96:108])).view(n, 16, 1)
    low = _crumbs(qs.reshape(n, 2, 32), 2).reshape(n, 16, 16).view(torch.int8)
    high_clear = (_crumbs(hmask, 1) ^ 1).reshape(n, 16, 16).view(torch.int8)
    q = (low - (high_clear << 2)).float()
    return (dl * q).view(n, QK_K)


def _k_affine(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Apply Q4_K/Q5_K block scales to ``q`` of shape ``(n, 8, 32)``: ``(d*sc)*q - dmin*m``."""
    n = b.shape[0]
    d, dm = k_scales(b)
    return q.float().mul_(d.view(n, 8, 1)).sub_(dm.view(n, 8, 1)).view(n, QK_K)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    return _k_affine(b, q4_k_codes(b))


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    return _k_affine(b, q5_k_codes(b))


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    q, d = q6_k_fields(b)
    return (d.view(n, 16, 1) * (q.view(torch.int8) - 32).float()).view(n, QK_K)


_BLOCK_DECODERS: dict[Q, Decoder] = {
    Q.Q8_0: _q8_0,
    Q.Q4_0: _q4_0,
    Q.Q4_1: _q4_1,
    Q.Q5_0: _q5_0,
    Q.Q5_1: _q5_1,
    Q.Q2_K: _q2_k,
    Q.Q3_K: _q3_k,
    Q.Q4_K: _q4_k,
    Q.Q5_K: _q5_k,
    Q.Q6_K: _q6_k,
    Q.Q8_K: _q8_k,
}
_FLOAT_TYPES: dict[Q, torch.dtype] = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}

FLOAT_TYPES: frozenset[Q] = frozenset(_FLOAT_TYPES)
SUPPORTED_TYPES: frozenset[Q] = frozenset(_BLOCK_DECODERS) | FLOAT_TYPES


def packed_nbytes(qtype: Q, shape: tuple[int, ...], *, name: str = "tensor") -> int:
    """Bytes a tensor of ``shape`` (PyTorch order) occupies as ``qtype``; rows must be whole blocks."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if shape and shape[-1] % block_size:
        raise ModelFormatError(
            f"{name}: row length {shape[-1]} is not a multiple of the {qtype.name} block size {block_size}"
        )
    return math.prod(shape) // block_size * type_size


def dequantize(raw: torch.Tensor, qtype: Q, shape: tuple[int, ...], *, name: str = "tensor") -> torch.Tensor:
    """Decode the packed bytes ``raw`` (uint8, all blocks, row-major) of a ``qtype`` tensor.

    ``shape`` is the logical PyTorch-order shape (GGUF dims reversed). Returns a float32
    tensor of that shape that never aliases ``raw``. ``name`` only labels error messages.
    """
    if qtype not in SUPPORTED_TYPES:
        supported = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        raise UnsupportedModelError(
            f"{name}: quantization type {Q(qtype).name} is not supported (supported: {supported})"
        )
    raw = checked_bytes(raw, qtype, shape, name=name)
    if qtype in _FLOAT_TYPES:
        return _as_float(raw, _FLOAT_TYPES[qtype]).view(shape)
    return _BLOCK_DECODERS[qtype](raw.view(-1, GGML_QUANT_SIZES[qtype][1])).view(shape)


def checked_bytes(raw: torch.Tensor, qtype: Q, shape: tuple[int, ...], *, name: str = "tensor") -> torch.Tensor:
    """``raw`` flattened, once checked to be uint8 holding exactly the bytes of a ``qtype`` tensor of
    ``shape`` (ModelFormatError otherwise)."""
    expected = packed_nbytes(qtype, shape, name=name)
    if raw.dtype != torch.uint8 or raw.numel() != expected:
        raise ModelFormatError(
            f"{name}: expected {expected} bytes of {qtype.name} data for shape {tuple(shape)}, "
            f"got {raw.numel()} elements of {raw.dtype}"
        )
    return raw.reshape(-1)
