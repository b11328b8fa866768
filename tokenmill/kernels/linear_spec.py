"""A linear layer as tokenmill's one-call CPU decode stack (``DecodeStack``, kernels/cpu/decoder.cpp)
multiplies by it: which kernel, over which tensors.

Layers describe themselves with a :class:`CpuLinearSpec` (``cpu_kernel_spec()`` of the quantized
linears; the dense ones in ``tokenmill.models.fused_decode``), so the stack's builder never reads
a layer's private fields. :meth:`CpuLinearSpec.native` converts it, at the boundary, into the C++
``Linear`` the stack holds, with the kind as the C++ enum member of the same name.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from types import ModuleType

import torch


class LinearKind(enum.Enum):
    """Which kernel multiplies; the C++ ``LinearKind`` has the same member names."""

    DENSE = enum.auto()
    """``at::linear``: weight [N, K] in the model dtype."""
    BF16_PACKED = enum.auto()
    """``bf16_packed_linear``: weight packed by ``bf16_pack`` from a bfloat16 [N, K]."""
    INT8 = enum.auto()
    """``int8_weight_linear``: weight int8 [N, K], scales [N] in the model dtype."""
    INT4 = enum.auto()
    """``int4_weight_linear``: weight and scales in ``int4_cpu_pack``'s layout (N rounded up to 16)."""
    GROUPED = enum.auto()
    """``group_weight_linear``: grouped codes (w = code * scale + min, GGUF's types), weight and
    (scale, min) in ``group_cpu_pack``'s layout (N rounded up to 16), ``bits`` 4, 5, 7 or 8."""
    SPARSE_BF16 = enum.auto()
    """``sparse_bf16_linear``: a pruned bfloat16 weight without its zeros, from ``sparse_bf16_pack``:
    weight = the nonzero values (bfloat16, flat), scales = one int32 mask per 32-element vector of
    the packed layout [ceil(N / 16), K / 2], offsets = int64 [ceil(N / 16) + 1], each output tile's
    first value. Bit-identical to BF16_PACKED on the dense weight."""


@dataclass(frozen=True, eq=False)
class CpuLinearSpec:
    """One linear layer for the CPU kernels: y = x W^T (+ bias), x [M, in_features] -> [M, out_features].

    Invariants: INT8, INT4, GROUPED and SPARSE_BF16 have ``scales``; INT4 and GROUPED have
    ``group_size > 0`` dividing ``in_features``; GROUPED has ``bits`` 4, 5, 7 or 8; SPARSE_BF16 has
    ``offsets``. The tensors are the layer's own (no
    copies): a spec is valid while the layer is unchanged."""

    kind: LinearKind
    weight: torch.Tensor
    """In the layout ``kind`` names."""
    out_features: int
    """The layer's output columns (INT4, GROUPED: the kernel's padded rows are cut to these)."""
    in_features: int
    """Input columns the kernel takes: the layer's, or for INT4 and GROUPED rounded up to whole
    groups (the input is zero-padded up to them)."""
    scales: torch.Tensor | None = None
    """INT8: [N]; INT4: scales and zeros in ``int4_cpu_pack``'s layout; GROUPED: scales and mins in
    ``group_cpu_pack``'s; SPARSE_BF16: the masks; else None."""
    bias: torch.Tensor | None = None
    group_size: int = 0
    """INT4, GROUPED: input columns per (scale, zero / min); else 0."""
    bits: int = 0
    """GROUPED: bits per code, 4 (codes 0..15), 5 (0..31), 7 (0..127, one a byte) or 8 (0..255); else 0."""
    offsets: torch.Tensor | None = None
    """SPARSE_BF16: int64 [tiles + 1], where each tile of 16 output channels starts in ``weight``; else None."""
    bf16_copy: torch.Tensor | None = None
    """GROUPED: the weight dequantized to bfloat16 and ``bf16_pack``'ed, which bfloat16 calls of at
    least ``bf16_copy_rows`` rows multiply by instead of the codes; else None."""
    bf16_copy_rows: int = 0
    int8_copy: torch.Tensor | None = None
    """GROUPED: the weight's int8 copy (uint8, ``grouped.int8_copy_pack``), which bfloat16 calls of fewer
    rows than ``bf16_copy_rows`` (all, without a bfloat16 copy) multiply by, x in two int8 parts per
    group (``int8_copy_linear``); else None."""
    int8_copy_offset: int = -1
    """The int8 copy's symmetric code offset (``grouped.symmetric_offset``), -1 where it holds mins."""
    int8_copy_two_part: bool = True
    """Whether the int8 copy takes bfloat16 calls below ``bf16_copy_rows`` (outside the one-part rows) with
    x in two parts; else the codes take them."""
    int8_one_part_rows: tuple[int, int] = (0, 0)
    """[from, below): bfloat16 calls of this many rows multiply the int8 copy by x in one int8 part,
    before the bfloat16 copy's rows apply (``int8_copy_linear(..., one_part=True)``); (0, 0): none."""

    def __post_init__(self) -> None:
        if self.kind in (LinearKind.INT8, LinearKind.INT4, LinearKind.GROUPED,
                         LinearKind.SPARSE_BF16) and self.scales is None:
            raise ValueError(f"{self.kind.name} needs its scales")
        if self.kind is LinearKind.SPARSE_BF16 and self.offsets is None:
            raise ValueError("SPARSE_BF16 needs its offsets")
        if self.kind in (LinearKind.INT4, LinearKind.GROUPED) and (
                self.group_size <= 0 or self.in_features % self.group_size):
            raise ValueError(f"{self.kind.name} needs group_size > 0 dividing in_features, got {self.group_size}, "
                             f"{self.in_features}")
        if self.kind is LinearKind.GROUPED and self.bits not in (4, 5, 7, 8):
            raise ValueError(f"GROUPED needs bits 4, 5, 7 or 8, got {self.bits}")
        if (self.bf16_copy is not None) != (self.bf16_copy_rows > 0) or (
                self.bf16_copy is not None and self.kind is not LinearKind.GROUPED):
            raise ValueError("a bfloat16 copy goes with a GROUPED weight and bf16_copy_rows >= 1")
        if self.int8_copy is not None and self.kind is not LinearKind.GROUPED:
            raise ValueError("an int8 copy goes with a GROUPED weight")
        if self.int8_one_part_rows != (0, 0) and (self.int8_copy is None or not
                                                  0 < self.int8_one_part_rows[0] < self.int8_one_part_rows[1]):
            raise ValueError(f"int8_one_part_rows {self.int8_one_part_rows} need an int8 copy and 0 < from < below")

    def native(self, ops: ModuleType):
        """This spec as the compiled module ``ops``' ``Linear``, for ``DecodeStack.add_layer``."""
        return ops.Linear(kind=ops.LinearKind[self.kind.name], weight=self.weight, out_features=self.out_features,
                          in_features=self.in_features, scales=self.scales, bias=self.bias,
                          group_size=self.group_size, bits=self.bits, offsets=self.offsets,
                          bf16_copy=self.bf16_copy, bf16_copy_rows=self.bf16_copy_rows, int8_copy=self.int8_copy,
                          int8_copy_offset=self.int8_copy_offset, int8_copy_two_part=self.int8_copy_two_part,
                          int8_one_part_from=self.int8_one_part_rows[0],
                          int8_one_part_below=self.int8_one_part_rows[1])
