"""Quantized KV cache storage: each stored row (one token, one KV head: ``head_dim`` values)
gets its own float16 scale, computed from the row's absolute maximum when it is written.

    int8   round(x / s) in -127..127,      s = max|x| / 127
    fp8    float8 e4m3 of x / s,           s = max|x| / 448   (448: e4m3's largest finite value)

A row then costs ``head_dim`` bytes plus 2 for its scale, against ``2 * head_dim`` in bfloat16:
1.94x the tokens in the same memory at ``head_dim`` 64. Rows are quantized once, when written;
attention reads them back as ``q * s`` (the CPU kernel reads the bytes in place). New tokens
attend to the same rounded values later tokens will read, so a sequence sees one consistent
cache whatever the chunking.
"""

from __future__ import annotations

import torch

from tokenmill.errors import InvalidParameterError

KV_CACHE_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3")
"""``auto``: the model's dtype, unquantized. ``fp8`` is ``fp8_e4m3``."""

_STORAGE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}
_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
SCALE_DTYPE = torch.float16
_MIN_SCALE = 2.0 ** -24
"""float16's smallest (subnormal) value: an all-zero row still gets a finite scale."""


def check_kv_cache_dtype(kind: str) -> str:
    if kind not in KV_CACHE_DTYPES:
        raise InvalidParameterError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kind!r}")
    return kind


def storage_dtype(kind: str, model_dtype: torch.dtype) -> torch.dtype:
    """The element dtype of a pool for ``kind`` (``auto``: the model's dtype)."""
    check_kv_cache_dtype(kind)
    return model_dtype if kind == "auto" else _STORAGE[kind]


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in _QMAX


def row_bytes(head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one stored row (one token of one KV head), its scale included."""
    return head_dim * dtype.itemsize + (SCALE_DTYPE.itemsize if is_quantized(dtype) else 0)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """float8 tensors viewed as uint8 (index_copy_ and index_select have no float8 kernels); others as they are."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def quantize_rows(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (rows in ``dtype`` [..., D], float16 scales [...])."""
    qmax = _QMAX[dtype]
    amax = x.detach().abs().amax(dim=-1).float()
    scale = (amax / qmax).clamp_min(_MIN_SCALE).to(SCALE_DTYPE)
    # where float16 rounded the scale down, take the next float16 up: the largest value is never clipped
    low = scale.float() * qmax < amax
    scale = torch.where(low, (scale.view(torch.int16) + 1).view(SCALE_DTYPE), scale)
    y = x.float() / scale.float()[..., None]
    if dtype == torch.int8:
        return y.round_().clamp_(-qmax, qmax).to(torch.int8), scale
    return y.clamp_(-qmax, qmax).to(dtype), scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`quantize_rows`: [..., D] in ``dtype``."""
    return (q.float() * scale.float()[..., None]).to(dtype)
