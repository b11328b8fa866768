"""GGUF quantized weights in one grouped form, exactly: ``w[n, k] = code[n, k] * scale[n, g] + min[n, g]``.

Every type of :data:`NATIVE_TYPES` stores a weight as unsigned integer codes with one (scale, min)
per group of ``group_size`` consecutive columns of a row (g = k // group_size)::

    type   group  codes    scale        min              bits
    Q4_0     32   0..15    d            -8 d               4
    Q4_1     32   0..15    d            m                  4
    Q5_0     32   0..31    d            -16 d              5
    Q5_1     32   0..31    d            m                  5
    Q8_0     32   0..255   d            -128 d             8   (code = q + 128)
    Q4_K     32   0..15    d sc_j       -(dmin m_j)        4   (sub-block j of 32)
    Q5_K     32   0..31    d sc_j       -(dmin m_j)        5
    Q6_K     16   0..63    d sc_j       -32 d sc_j         7   (sc_j int8, may be negative)

``bits`` is how the kernel stores the codes: 4 for the types whose codes fit a nibble, 5 for the
5-bit types (a nibble and a plane of fifth bits, 5/8 of a byte as in the file), one a byte for the
others: 7 where they are below 128 (Q6_K: the kernel widens those to bfloat16 with an OR) and 8 for
Q8_0. A fused projection takes the widest of its parts' (4 < 5 < 7 < 8: each holds the narrower).
d, m, dmin are the file's halves (11 significant bits), sc_j and m_j its 6-bit
(Q6_K: 8-bit signed) integers, so every scale and min above is an exact float32 product, and so is
``code * scale`` (at most 11 + 7 + 6 = 24 significant bits, Q6_K's worst case). ``code * scale +
min`` in float32 is then what ``gguf.quants.dequantize`` computes, bit for bit:

- Q4_1, Q5_1 (``d*q + m``), Q4_K, Q5_K (``(d*sc)*q - dmin*m``): the same two roundings in the same order.
- Q4_0, Q5_0, Q6_K, Q8_0 (``d*(q - o)``): the reference's one product is exact, and so is our sum
  (its exact value ``(q - o) d`` has at most 24 significant bits); the one difference is the sign of
  a zero weight (q = o) under a negative scale: the reference's ``d * 0`` is -0.0, our ``o d - o d``
  is +0.0. Equal as numbers, and no product or sum of a matmul can tell them apart except in the
  sign of an output that is exactly zero.

:func:`gguf_groups` decodes a tensor's raw blocks (with the field extraction of dequant.py);
:meth:`GroupedWeight.concat` joins the parts of a fused projection (q/k/v, gate/up).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from tokenmill.errors import ModelFormatError, UnsupportedModelError
from tokenmill.loading import dequant

GROUP_SIZES: dict[Q, int] = {Q.Q4_0: 32, Q.Q4_1: 32, Q.Q5_0: 32, Q.Q5_1: 32, Q.Q8_0: 32,
                             Q.Q4_K: 32, Q.Q5_K: 32, Q.Q6_K: 16}
"""Columns per (scale, min) of each native type."""
CODE_BITS: dict[Q, int] = {Q.Q4_0: 4, Q.Q4_1: 4, Q.Q4_K: 4, Q.Q5_0: 5, Q.Q5_1: 5, Q.Q5_K: 5, Q.Q6_K: 7, Q.Q8_0: 8}
"""Bits per code in the kernel's layout: 4 for codes 0..15, 5 for 0..31, 7 for 0..127 (a byte each), 8 for 0..255."""
NATIVE_TYPES: frozenset[Q] = frozenset(GROUP_SIZES)
"""The ggml block types whose weights a :class:`GroupedWeight` holds exactly."""


@dataclass
class GroupedWeight:
    """A weight [N, K] as codes uint8 [N, K] and float32 scale and min [N, K / group_size]."""

    codes: torch.Tensor
    scale: torch.Tensor
    min: torch.Tensor
    group_size: int
    bits: int
    """4: every code in 0..15; 8: codes in 0..255."""

    def __post_init__(self) -> None:
        n, k = self.codes.shape
        if self.codes.dtype != torch.uint8 or self.bits not in (4, 5, 7, 8):
            raise ValueError(f"GroupedWeight needs uint8 codes and bits 4, 5, 7 or 8, got {self.codes.dtype}, "
                             f"{self.bits}")
        if self.group_size <= 0 or k % self.group_size:
            raise ValueError(f"GroupedWeight: group_size {self.group_size} does not divide the {k} columns")
        groups = (n, k // self.group_size)
        for t in (self.scale, self.min):
            if t.dtype != torch.float32 or tuple(t.shape) != groups:
                raise ValueError(f"GroupedWeight: scale and min must be float32 {groups}, got {t.dtype} "
                                 f"{tuple(t.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K]: ``code * scale + min``, the product rounded before the sum."""
        n, k = self.shape
        w = self.codes.view(n, -1, self.group_size).float()
        w = w.mul_(self.scale.unsqueeze(-1)).add_(self.min.unsqueeze(-1))  # two roundings, no FMA
        return w.view(n, k)

    def regroup(self, group_size: int) -> GroupedWeight:
        """The same weight with ``group_size`` columns per group (a divisor of the current one):
        each scale and min repeated, exactly."""
        if group_size == self.group_size:
            return self
        if group_size <= 0 or self.group_size % group_size:
            raise ValueError(f"cannot regroup groups of {self.group_size} into groups of {group_size}")
        r = self.group_size // group_size
        return GroupedWeight(self.codes, self.scale.repeat_interleave(r, dim=1),
                             self.min.repeat_interleave(r, dim=1), group_size, self.bits)

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> GroupedWeight:
        """``fn`` (a permutation of dim 0, e.g. ``unpermute_rope_rows``) applied to the rows of
        codes, scale and min alike."""
        return GroupedWeight(fn(self.codes), fn(self.scale), fn(self.min), self.group_size, self.bits)

    @classmethod
    def concat(cls, parts: Sequence[GroupedWeight]) -> GroupedWeight:
        """The parts' rows one after another (same K): groups of the smallest group size, codes
        stored in the widest bits."""
        if not parts:
            raise ValueError("GroupedWeight.concat of no parts")
        if len({p.shape[1] for p in parts}) != 1:
            raise ModelFormatError(f"cannot join weights of different widths {[p.shape for p in parts]}")
        group = min(p.group_size for p in parts)
        parts = [p.regroup(group) for p in parts]
        return cls(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]),
                   torch.cat([p.min for p in parts]), group, max(p.bits for p in parts))


# --------------------------------------------------------------------------- per type: (codes, scale, min)
# Each takes blocks (n, type_size) and returns codes (n, block_size) and scale, min (n, groups per block).

Fields = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _symmetric(codes: torch.Tensor, d: torch.Tensor, offset: float) -> Fields:
    """``d * (code - offset)`` as ``code * d + (-offset d)``."""
    return codes, d, d * -offset


def _q4_0(b: torch.Tensor) -> Fields:
    return _symmetric(*dequant.q4_0_fields(b), 8.0)


def _q5_0(b: torch.Tensor) -> Fields:
    return _symmetric(*dequant.q5_0_fields(b), 16.0)


def _q8_0(b: torch.Tensor) -> Fields:
    q, d = dequant.q8_0_fields(b)
    return _symmetric(q.view(torch.uint8) ^ 0x80, d, 128.0)  # q + 128, in 0..255


def _q4_1(b: torch.Tensor) -> Fields:
    return dequant.q4_1_fields(b)


def _q5_1(b: torch.Tensor) -> Fields:
    return dequant.q5_1_fields(b)


def _k_type(codes: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], Fields]:
    def fields(b: torch.Tensor) -> Fields:
        scale, dmin_m = dequant.k_scales(b)
        return codes(b).flatten(1), scale, -dmin_m

    return fields


def _q6_k(b: torch.Tensor) -> Fields:
    codes, scale = dequant.q6_k_fields(b)
    return _symmetric(codes.flatten(1), scale, 32.0)


_FIELDS: dict[Q, Callable[[torch.Tensor], Fields]] = {
    Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q5_0: _q5_0, Q.Q5_1: _q5_1, Q.Q8_0: _q8_0,
    Q.Q4_K: _k_type(dequant.q4_k_codes), Q.Q5_K: _k_type(dequant.q5_k_codes), Q.Q6_K: _q6_k,
}
assert _FIELDS.keys() == NATIVE_TYPES


def gguf_groups(raw: torch.Tensor, qtype: Q, shape: tuple[int, ...], *, name: str = "tensor") -> GroupedWeight:
    """The :class:`GroupedWeight` of a 2-D ``qtype`` tensor of PyTorch-order ``shape`` from its packed
    bytes ``raw`` (uint8, every block, row-major). Never aliases ``raw``. ``name`` labels errors:
    ModelFormatError for a shape or byte count that does not fit, UnsupportedModelError for a
    type outside :data:`NATIVE_TYPES`."""
    qtype = Q(qtype)
    if qtype not in NATIVE_TYPES:
        raise UnsupportedModelError(f"{name}: {qtype.name} has no grouped form (native types: "
                                    f"{', '.join(sorted(t.name for t in NATIVE_TYPES))})")
    if len(shape) != 2:
        raise ModelFormatError(f"{name}: a grouped weight is 2-D, got shape {tuple(shape)}")
    blocks = dequant.checked_bytes(raw, qtype, tuple(shape), name=name).view(-1, GGML_QUANT_SIZES[qtype][1])
    codes, scale, min_ = _FIELDS[qtype](blocks)
    n, k = shape
    group = GROUP_SIZES[qtype]
    return GroupedWeight(codes.reshape(n, k).contiguous(), scale.reshape(n, k // group).contiguous(),
                         min_.reshape(n, k // group).contiguous(), group, CODE_BITS[qtype])
