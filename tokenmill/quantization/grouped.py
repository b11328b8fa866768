"""A linear layer over GGUF's quantized weights as the file stores them: no requantization, no rounding.

    GroupedLinear   w[n, k] = code[n, k] * scale[n, k // group_size] + min[n, k // group_size]
                    codes 0..15 (bits 4), 0..31 (bits 5), 0..127 (bits 7) or 0..255 (bits 8), scale and
                    min float32

which is exactly every GGUF type of ``tokenmill.loading.gguf_groups.NATIVE_TYPES`` (Q4_0 ... Q8_0,
Q4_K, Q5_K, Q6_K), or a fused projection of several of them (one group size, the smallest; codes in
the widest ``bits``).

Its persistent buffers are the CPU kernel's own layout, built by ``kernels.group_cpu_pack`` from a
:class:`~tokenmill.loading.gguf_groups.GroupedWeight` (rows padded with zero codes, scales and mins
to a multiple of 16, the extra output columns cut)::

    packed  uint8 [Np / 16, K / 4, 32] (bits 4, two codes a byte), [Np / 16, 5 K / 16, 32] (bits 5:
            the nibbles and a plane of fifth bits) or [Np / 16, K / 2, 32] (bits 7, 8)
    sz      float16 or float32 [Np / 16, K / group_size, 2, 16]: (scale, min) of each group of a tile's
            16 rows, float16 where every value is one exactly (group_cpu_pack decides)

so the weights are held once, at 0.5 or 1 byte each plus 4 or 8 bytes per group (a portable copy
beside them would double that); for the symmetric types (every min -o * scale: Q4_0, Q5_0, Q8_0)
the kernel reads a copy of the scales alone (``kernels.scales_alone``), 2 or 4 bytes per group;
:meth:`GroupedLinear.grouped_weight` unpacks them, exactly.
``matmul`` runs ``kernels.group_weight_mm`` with float32 or bfloat16 activations, the weights
applied in float32 as stored. Where the compiled kernels are not available (not on CPU, or turned
off) it falls back to a dequantized weight in the activations' dtype, built per call: a reference
path, slow and memory-hungry, that tokenmill's loader never chooses (it dequantizes at load then).

Two optional layouts beside the codes (:func:`apply_copies`): the weight dequantized to bfloat16, which
bfloat16 calls of many rows take (:meth:`GroupedLinear.keep_bf16_copy`), and for 8-bit codes the int8
copy (:func:`int8_copy_pack`, ``kernels/cpu/int8_copy_linear.cpp``), which the other bfloat16 calls take
(:meth:`GroupedLinear.keep_int8_copy`).
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F

from tokenmill.kernels import dispatch
from tokenmill.kernels.linear_spec import CpuLinearSpec, LinearKind
from tokenmill.loading.gguf_groups import GroupedWeight
from tokenmill.quantization import kernels
from tokenmill.quantization.linear import QuantizedLinear

logger = logging.getLogger("tokenmill.loading")
_NO_BIAS = torch.empty(0)
ROW_TILE = 16
"""Output channels per tile of the kernel's layout: the rows are padded to a multiple of it."""
BITS = (4, 5, 7, 8)


def packed_rows(in_features: int, bits: int) -> int:
    """The packed layout's second dimension (rows of 32 bytes per tile) for K = ``in_features``."""
    return {4: in_features // 4, 5: 5 * in_features // 16}.get(bits, in_features // 2)


def in_features_of(rows: int, bits: int) -> int:
    """The inverse of :func:`packed_rows`."""
    return {4: rows * 4, 5: rows * 16 // 5}.get(bits, rows * 2)


def pack_grouped(weight: GroupedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """A grouped weight [N, K] -> (packed, sz), rows padded to a multiple of 16 (code 0, scale 0, min 0)."""
    pad = -weight.shape[0] % ROW_TILE
    fields = (weight.codes, weight.scale, weight.min)
    if pad:
        fields = tuple(F.pad(t, (0, 0, 0, pad)) for t in fields)
    return kernels.group_cpu_pack(*fields, weight.bits)


def symmetric_offset(weight: GroupedWeight) -> int:
    """The code offset o where every min is -o * scale exactly (GGUF's symmetric types: Q4_0 8, Q5_0 16,
    Q6_K 32, Q8_0 128), else -1."""
    scale, min_ = weight.scale.float(), weight.min.float()
    live = scale != 0
    if not bool(live.any()):
        return -1 if bool((min_ != 0).any()) else 0
    o = torch.round(-min_[live] / scale[live])
    first = int(o[0])
    if not 0 <= first <= 255 or not bool((o == first).all()) or not torch.equal(min_, -first * scale):
        return -1
    return first


def int8_copy_pack(weight: GroupedWeight) -> tuple[torch.Tensor, int]:
    """A grouped weight [N, K] -> (copy, offset) for ``int8_copy_linear`` (kernels/cpu/int8_copy_linear.cpp):
    uint8 [ceil(N / 16), K / gs, 16 gs + 64 or 128], per tile of 16 rows and group of gs columns the
    codes with 4 consecutive columns of a row per 32-bit lane, then the 16 scales (float32), then the
    16 mins unless the weight is symmetric (``offset`` = :func:`symmetric_offset` >= 0; else -1).
    Where every scale (and min) kept is a float16 exactly (GGUF's Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0),
    they are kept as float16 instead: 16 gs + 32 or 64 bytes a group, the same products."""
    n, k = weight.shape
    gs, groups = weight.group_size, k // weight.group_size
    if gs % 4:
        raise ValueError(f"int8_copy_pack: group_size must be a multiple of 4, got {gs}")
    offset = symmetric_offset(weight)
    tiles, pad = -(-n // ROW_TILE), -n % ROW_TILE
    fields = (weight.codes, weight.scale.float(), weight.min.float())
    if pad:
        fields = tuple(F.pad(t, (0, 0, 0, pad)) for t in fields)
    codes, scale, min_ = fields
    kept = (scale,) if offset >= 0 else (scale, min_)
    dtype = torch.float16 if all(torch.equal(t.half().float(), t) for t in kept) else torch.float32
    parts = [codes.view(tiles, ROW_TILE, groups, gs // 4, 4).permute(0, 2, 3, 1, 4).reshape(tiles, groups, -1)]
    for t in kept:
        parts.append(t.view(tiles, ROW_TILE, groups).permute(0, 2, 1).to(dtype).contiguous().view(torch.uint8)
                     .reshape(tiles, groups, dtype.itemsize * ROW_TILE))
    return kernels.aligned(torch.cat(parts, dim=2)), offset


def unpack_grouped(packed: torch.Tensor, sz: torch.Tensor, out_features: int, bits: int) -> GroupedWeight:
    """The inverse of :func:`pack_grouped`: the first ``out_features`` rows, as codes, scale and min."""
    tiles = packed.shape[0]
    rows = tiles * ROW_TILE
    fifth = None
    if bits == 5:  # per 4 nibble chunks, one chunk of fifth bits (kernels._five_bit_tiles)
        groups = packed.view(tiles, -1, 5, 32)
        fifth = groups[:, :, 4].reshape(tiles, -1, 2, 4).to(torch.int64)  # tile, chunk, pair i, byte
        masks = (fifth << (8 * torch.arange(4))).sum(-1)  # tile, chunk, i
        fifth = ((masks[..., None] >> torch.arange(32)) & 1).view(tiles, -1, 2, ROW_TILE, 2)  # ..., r, j
        fifth = fifth.permute(0, 3, 1, 2, 4).to(torch.uint8)  # tile, row, chunk, i, j
        packed = groups[:, :, :4].reshape(tiles, -1, 32)
    chunks = packed.shape[1]
    b = packed.reshape(tiles, chunks, ROW_TILE, 2).permute(0, 2, 1, 3)  # tile, row, chunk, j
    if bits in (4, 5):  # byte j of a row's chunk c: code 4c + j (low nibble), 4c + 2 + j (high nibble)
        b = torch.stack((b & 0x0F, b >> 4), dim=3)
        if fifth is not None:
            b = b | (fifth << 4)
    codes = b.reshape(rows, -1)
    groups = sz.shape[1]
    scale, min_ = sz.float().permute(2, 0, 3, 1).reshape(2, rows, groups)
    return GroupedWeight(codes[:out_features].contiguous(), scale[:out_features].contiguous(),
                         min_[:out_features].contiguous(), codes.shape[1] // groups, bits)


ONE_PART_BELOW = 512
"""An LM head's calls from its bfloat16 copy's rows up to this many (exclusive) take the int8 copy with x
in one part (:meth:`GroupedLinear.use_one_part`); below the copy's rows they keep two parts, which hold
the answers of Hugging Face's bfloat16 model where one part moved a near-tie (at 1 row, one part turned
SmolLM2's answer to ``tests/test_cli.py``'s France question from "Paris" to "L'Étoile", though it was
the faster there too: Gemma 3's head 3.6 against 4.4 ms, SmolLM2's 0.29 against 0.36). 2 vCPUs (AMD),
milliseconds, one part / bfloat16 copy, after the int8 kernel's block packing (blocks of up to 20
rows): Gemma 3's 262k-row Q8_0 head, 16 rows 5.5 / 15.2, 64 rows 20.8 / 34.2, 128 rows 42.4 / 60.1, 256
rows 92 / 120, 512 rows 312 / 365; SmolLM2's 49k-row head, 16 rows 0.8 / 2.3, 128 rows 6.6 / 10.2, 512
rows 27.3 / 38.1. (Before the packing, two parts / one part / bfloat16 copy: 12 rows 12.4 / 5.8 / 12.7,
16 rows 16.0 / 8.4 / 14.6, 32 rows 29.3 / 16.1 / 20.6, 128 rows 122 / 62.4 / 61.7.) Numerics, on 768 of
Gemma 3's own final hidden states (bfloat16) against float64 products of the same weights: logits' rms
error 0.041 (max 0.49) with one part, 0.014 (max 0.22) with the bfloat16 copy; 7 and 8 argmax changes,
all at top-2 gaps under 0.13 (the bfloat16 rounding of the logits alone moves a top-2 gap of 0.06); a
bfloat16 forward pass's logits differ from float32's by 0.15 rms."""


class GroupedLinear(QuantizedLinear):
    """y = x W^T (+ b) for W = codes * scale + min, one (scale, min) per ``group_size`` input columns."""

    def __init__(self, packed: torch.Tensor, sz: torch.Tensor, out_features: int, group_size: int, bits: int,
                 bias: torch.Tensor | None = None) -> None:
        if bits not in BITS:
            raise ValueError(f"GroupedLinear: bits must be 4, 5, 7 or 8, got {bits}")
        super().__init__(in_features_of(packed.shape[1], bits), out_features, bias)
        if group_size <= 0 or self.in_features % group_size or sz.shape[1] * group_size != self.in_features:
            raise ValueError(f"GroupedLinear: {sz.shape[1]} groups of {group_size} do not make {self.in_features} "
                             "input columns")
        if packed.shape[0] * ROW_TILE < out_features or sz.shape[0] != packed.shape[0]:
            raise ValueError(f"GroupedLinear: {packed.shape[0]} tiles of 16 rows cannot hold {out_features} rows")
        self.group_size, self.bits = group_size, bits
        self.register_buffer("packed", packed)
        self.register_buffer("sz", sz)
        self._ops = None
        self._prepared = False
        self._kernel_sz = sz
        self._bf16_copy: tuple[torch.Tensor, int] | None = None  # (bf16_pack'ed weight, from rows)
        self._int8_copy: tuple[torch.Tensor, int] | None = None  # (int8_copy_pack'ed weight, its offset)
        self._int8_two_part = False
        """Whether the int8 copy takes the bfloat16 calls below the bfloat16 copy's rows, x in two parts
        (:meth:`keep_int8_copy`; else those take the codes)."""
        self._one_part_rows = (0, 0)
        """[from, below): bfloat16 calls of this many rows take the int8 copy with x in one part
        (:meth:`use_one_part`); (0, 0): none."""

    @classmethod
    def empty(cls, in_features: int, out_features: int, bias: bool, group_size: int, bits: int,
              bias_dtype: torch.dtype = torch.float32, device: torch.device | str = "meta") -> GroupedLinear:
        """Right shapes, no values: to be filled by ``load_state_dict(..., assign=True)``."""
        tiles = -(-out_features // ROW_TILE)
        return cls(torch.empty(tiles, packed_rows(in_features, bits), 32, dtype=torch.uint8, device=device),
                   torch.empty(tiles, in_features // group_size, 2, ROW_TILE, dtype=torch.float32, device=device),
                   out_features, group_size, bits,
                   torch.empty(out_features, dtype=bias_dtype, device=device) if bias else None)

    @classmethod
    def from_gguf(cls, weight: GroupedWeight, bias: torch.Tensor | None = None) -> GroupedLinear:
        """The layer of a GGUF weight in grouped form (``GGUFFile.load_grouped``, ``gguf_groups``), prepared."""
        packed, sz = pack_grouped(weight)
        return cls(packed, sz, weight.shape[0], weight.group_size, weight.bits, bias).prepare()

    def grouped_weight(self) -> GroupedWeight:
        """The weight as codes, scale and min (unpacked from the kernel's layout, exactly)."""
        return unpack_grouped(self.packed, self.sz, self.out_features, self.bits)

    @property
    def native(self) -> bool:
        """Whether :meth:`prepare` found tokenmill's CPU kernels (else ``matmul`` dequantizes per call)."""
        return self._ops is not None

    def prepare(self) -> GroupedLinear:
        """Pick the kernel for where the buffers are (after construction, loading or a move)."""
        self.packed, self.sz = kernels.aligned(self.packed), kernels.aligned(self.sz)
        self._ops = dispatch.cpu_ops() if self.packed.device.type == "cpu" else None
        # a symmetric type's kernel reads its scales alone (the saved sz keeps the (scale, min) layout)
        self._kernel_sz = kernels.aligned(kernels.scales_alone(self.sz, self.bits)) if self._ops else self.sz
        self._bf16_copy = self._int8_copy = None  # copies of the buffers as they were: keep_* make new ones
        self._int8_two_part = False
        self._one_part_rows = (0, 0)
        self._prepared = True
        return self

    def keep_bf16_copy(self, rows: int) -> int:
        """Also hold the weight dequantized to bfloat16 (``bf16_pack``'ed), for bfloat16 calls of at
        least ``rows`` rows: there the bfloat16 GEMM, with no group ends and nothing to unpack, beats
        the grouped kernel (its products are those of the rounded copy, not of the exact weights).
        -> the bytes it adds (0 where the bfloat16 kernel cannot run here: nothing kept)."""
        if rows < 1:
            raise ValueError(f"keep_bf16_copy: rows must be at least 1, got {rows}")
        if self._ops is None or not self._ops.bf16_linear_fast() or self.in_features % 2:
            return 0
        packed = kernels.aligned(self._ops.bf16_pack(self.dequantize().to(torch.bfloat16)))
        self._bf16_copy = (packed, rows)
        return packed.numel() * packed.element_size()

    def keep_int8_copy(self, two_part: bool = True) -> int:
        """Also hold the int8 copy (:func:`int8_copy_pack`: the codes one byte each, 4 consecutive
        columns a 32-bit lane, float32 scales), for bfloat16 calls of fewer rows than the bfloat16
        copy's (every bfloat16 call without one): ``int8_copy_linear`` multiplies it by x in two
        int8 parts per row and group (about 16 bits of x beside its group's largest value, closer to
        x than bfloat16 is) on AVX-512 VNNI, twice vdpbf16ps's multiply-adds an instruction with
        nothing to unpack; without ``two_part``, for :meth:`use_one_part`'s calls alone. -> the bytes it
        adds (0 where that kernel cannot run here: nothing kept)."""
        if self._ops is None or not int8_copy_runs(self, self._ops):
            return 0
        packed, offset = int8_copy_pack(self.grouped_weight())
        self._int8_copy = (packed, offset)
        self._int8_two_part = two_part
        return packed.numel() * packed.element_size()

    def use_one_part(self, below_rows: int = ONE_PART_BELOW, from_rows: int | None = None) -> bool:
        """bfloat16 calls of ``from_rows`` (default: the bfloat16 copy's rows, those it would take) to
        ``below_rows`` - 1 rows multiply the int8 copy by x in one int8 part per group (llama.cpp's Q8
        activations: half the products of two parts, and the bfloat16 copy's vdpbf16ps does as many per
        instruction as two parts, over twice the bytes). Numerics: see :data:`ONE_PART_BELOW`. ->
        whether it applies (an int8 copy kept, and a bfloat16 copy without ``from_rows``)."""
        if self._int8_copy is None or (from_rows is None and self._bf16_copy is None):
            return False
        self._one_part_rows = (self._bf16_copy[1] if from_rows is None else from_rows, below_rows)
        return True

    def _copy_for(self, x: torch.Tensor, rows: int) -> torch.Tensor | None:
        copy = self._bf16_copy
        return copy[0] if copy is not None and x.dtype == torch.bfloat16 and rows >= copy[1] else None

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, out_float32=False)

    def matmul_float32(self, x: torch.Tensor, kernel_rows: int | None = None) -> torch.Tensor:
        return self._matmul(x, out_float32=True, kernel_rows=kernel_rows).float()

    def _matmul(self, x: torch.Tensor, out_float32: bool, kernel_rows: int | None = None) -> torch.Tensor:
        """``out_float32``: with bfloat16 x, the kernel writes its rounded outputs as float32.
        ``kernel_rows``: the kernel (copy, parts) chosen as for a call of this many rows (each of its
        kernels gives a row the same bits whatever the call's other rows: a speculative step's
        verification rows get the numerics of a plain step over the same sequences)."""
        if not self._prepared:
            raise RuntimeError("GroupedLinear used before prepare()")
        if self._ops is None:  # no kernel here: the reference path
            return F.linear(x, self.dequantize().to(device=x.device, dtype=x.dtype))
        rows = x.shape[0] if kernel_rows is None else kernel_rows
        copy = self._copy_for(x, rows)
        bf16 = x.dtype == torch.bfloat16
        one_part = bf16 and self._one_part_rows[0] <= rows < self._one_part_rows[1]
        if self._int8_copy is not None and (one_part or (bf16 and copy is None and self._int8_two_part)):
            packed, offset = self._int8_copy
            return self._ops.int8_copy_linear(x.contiguous(), packed, self.out_features, self.group_size, offset,
                                              _NO_BIAS, out_float32=out_float32, one_part=one_part)
        if copy is not None:
            return self._ops.bf16_packed_linear(x.contiguous(), copy, self.out_features, _NO_BIAS,
                                                out_float32=out_float32)
        if x.dtype in dispatch.KERNEL_DTYPES:
            y = kernels.group_weight_mm(x.contiguous(), self.packed, self._kernel_sz, self.group_size, self.bits,
                                        out_float32)
        else:  # float16 and others: in float32
            y = kernels.group_weight_mm(x.float().contiguous(), self.packed, self._kernel_sz, self.group_size,
                                        self.bits).to(x.dtype)
        return y if y.shape[1] == self.out_features else y[:, :self.out_features]

    def cpu_kernel_spec(self) -> CpuLinearSpec | None:
        """This layer for tokenmill's CPU decode stack: the grouped kernel over its buffers; None
        where the kernels are not available (the stack then runs layer by layer)."""
        if self._ops is None:
            return None
        copy, rows = self._bf16_copy or (None, 0)
        int8_copy, offset = self._int8_copy or (None, -1)
        return CpuLinearSpec(kind=LinearKind.GROUPED, weight=self.packed, out_features=self.out_features,
                             in_features=self.in_features, scales=self._kernel_sz, bias=self.bias,
                             group_size=self.group_size, bits=self.bits, bf16_copy=copy, bf16_copy_rows=rows,
                             int8_copy=int8_copy, int8_copy_offset=offset, int8_copy_two_part=self._int8_two_part,
                             int8_one_part_rows=self._one_part_rows)

    def dequantize(self) -> torch.Tensor:
        return self.grouped_weight().dequantize()

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, group_size={self.group_size}, bits={self.bits}"


AUTO_COPY_ROWS = 12
"""The default bf16_copy_rows of 5-, 7- and 8-bit codes: measured, the bfloat16 GEMM over the copy wins
from about 12 rows on (SmolLM2 and Gemma 3 decode at 12 and 16 sequences) and the codes at 8 (README,
"A second layout")."""
AUTO_COPY_ROWS_4BIT = 24
"""...and of 4-bit codes: these stream at half a byte a weight and unpack in two instructions, so the
codes' few-rows schedule stays ahead of the copy (4 times their bytes) up to where the kernel turns to
its dequantize-once GEMM itself (SmolLM2 as stored, decode steps of 12, 16 and 20 rows over
128-token prompts, ``python bench/decode_steps.py`` and ``--bf16-copy-rows 12`` alternated: 11.9-12.2,
14.8-14.9 and 16.9-17.7 ms with these defaults against 13.6-13.8, 16.4-16.8 and 18.1-18.5)."""
AUTO_COPY_SHARE = 1 / 16
"""...where the copies take at most this share of the machine's memory (small models), else none."""


def auto_copy_rows(bits: int) -> int:
    """The default bf16_copy_rows of a layer with ``bits``-bit codes."""
    return AUTO_COPY_ROWS_4BIT if bits == 4 else AUTO_COPY_ROWS


def auto_bf16_copies(model: torch.nn.Module, memory_bytes: int | None = None) -> bool:
    """Whether ``model`` gets bfloat16 copies by default: it has grouped layers and their copies fit
    AUTO_COPY_SHARE of ``memory_bytes`` (default: this machine's physical memory)."""
    size = sum(2 * m.out_features * m.in_features for m in model.modules() if isinstance(m, GroupedLinear))
    if memory_bytes is None:
        try:
            memory_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):  # not a POSIX host: no copies
            return False
    return 0 < size <= memory_bytes * AUTO_COPY_SHARE


def keep_bf16_copies(model: torch.nn.Module, rows: int | None = None) -> int:
    """:meth:`GroupedLinear.keep_bf16_copy` on every grouped layer of ``model`` (the tied LM head
    included): the "second layout for large batches", for calls of ``rows`` rows or more (None: each
    layer's :func:`auto_copy_rows`). -> the bytes added in all."""
    return sum(m.keep_bf16_copy(auto_copy_rows(m.bits) if rows is None else rows)
               for m in model.modules() if isinstance(m, GroupedLinear))


INT8_COPY_BITS = (8,)
"""Codes that get an int8 copy by default: 8-bit ones (Q8_0, the shipped models' LM heads). Their codes
stream at the copy's bytes (1 + 1 / 16 a weight) but widen in several instructions each; the copy's
products need none (Gemma 3's 262k-row Q8_0 head, ``python bench/quantized_linear.py --shapes heads
--kernels group8 i8copy8 --mins symmetric``: 1 / 4 / 8 rows 4.87 / 5.75 / 6.47 ms against 5.86 / 6.64 /
8.38 on the codes, level at 12, behind from 16, where the bfloat16 copy takes over). Narrower codes stream
fewer bytes than their copy would and keep them (Gemma's 5-bit down projection, hot: 4 rows 0.025 ms
on the copy against 0.033 ms on the codes but 8 rows 0.053 against 0.037)."""
INT8_COPY_GROUPS = (16, 32)
"""Group sizes the int8 copy's vector kernel runs (every GGUF type's)."""


def int8_copy_runs(layer: GroupedLinear, ops) -> bool:
    """Whether ``layer``'s int8 copy would run on the vector kernel here (AVX-512 VNNI, its group size)."""
    return bool(ops.int8_copy_linear_fast()) and layer.group_size in INT8_COPY_GROUPS


def keep_int8_copies(model: torch.nn.Module, bits: tuple[int, ...] = INT8_COPY_BITS) -> int:
    """:meth:`GroupedLinear.keep_int8_copy` on every grouped layer of ``model`` with codes of one of
    ``bits`` (the tied LM head included). -> the bytes added in all."""
    return sum(m.keep_int8_copy() for m in model.modules() if isinstance(m, GroupedLinear) and m.bits in bits)


def apply_copies(model: torch.nn.Module, bf16_copy_rows: int | None = None, int8_copies: bool = True,
                 head_int8_activations: bool = True, int8_activations: bool = False) -> int:
    """What ``LoadConfig.bf16_copy_rows``, ``int8_copies``, ``head_int8_activations`` and
    ``int8_activations`` ask of a loaded ``model``: bfloat16 copies for calls of ``bf16_copy_rows``
    rows or more (None: each layer's default, where :func:`auto_bf16_copies` finds them small; 0:
    none), and with ``int8_copies`` the 8-bit layers' int8 copies for the calls below those rows,
    wherever the bfloat16 copies are kept (so 0 keeps the model at its file's size), and with
    ``head_int8_activations`` and the default rows the LM head's one-part calls
    (:meth:`GroupedLinear.use_one_part`); with ``int8_activations``, :func:`use_int8_activations`
    whatever the copies. Logs what it kept. -> the bytes added."""
    rows = bf16_copy_rows
    added = 0
    if rows or (rows is None and auto_bf16_copies(model)):
        added += _keep_copies(model, rows, int8_copies, head_int8_activations)
    if int8_activations:
        added += use_int8_activations(model)
    return added


def _keep_copies(model: torch.nn.Module, rows: int | None, int8_copies: bool, head_int8_activations: bool) -> int:
    """:func:`apply_copies` where the bfloat16 copies are kept: them, the 8-bit layers' int8 copies and
    the head's one part. -> the bytes added."""
    added = keep_bf16_copies(model, rows)
    if added:
        logger.info("bfloat16 copies of the quantized linears for calls of %s rows or more: %.1f MiB",
                    rows or f"{AUTO_COPY_ROWS_4BIT} (4-bit codes) or {AUTO_COPY_ROWS}", added / 2**20)
    if int8_copies:
        int8 = keep_int8_copies(model)
        if int8:
            logger.info("int8 copies of the 8-bit quantized linears for bfloat16 calls below those rows: %.1f MiB",
                        int8 / 2**20)
        added += int8
        head = getattr(model, "lm_head", None)
        # with the default copies (a number given asks for the bfloat16 copy's products from there)
        if head_int8_activations and rows is None and isinstance(head, GroupedLinear) and head.use_one_part():
            logger.info("LM head: bfloat16 calls of %d to %d rows on its int8 copy, x in one int8 part",
                        head._bf16_copy[1], ONE_PART_BELOW - 1)
    return added


INT8_ACTIVATIONS_FROM_4BIT = 8
"""With ``int8_activations``, 4-bit layers take their one-part calls from this many rows: below it
their codes (half a byte a weight against the copy's one) stream faster than the copy computes.
SmolLM2's 120 Q4_1 linears streamed one pass each, ms, codes / one part: 1 row 2.64 / 3.26, 4 rows
3.08 / 3.69, 8 rows 4.28 / 4.07, 16 rows 8.53 / 5.84; Gemma 3's 72 linears (mostly 5-bit), 1 row
2.73 / 2.46, 16 rows 7.99 / 5.23 (2 vCPUs, AMD)."""


def use_int8_activations(model: torch.nn.Module) -> int:
    """``LoadConfig.int8_activations``: every grouped layer whose int8 copy runs here keeps one and
    takes its bfloat16 calls of 1 (4-bit codes: :data:`INT8_ACTIVATIONS_FROM_4BIT`) to
    :data:`ONE_PART_BELOW` - 1 rows on it with x in one int8 part per group, as llama.cpp computes
    (Q8 activations): lossy, faster where the products bound a step. -> the bytes added."""
    added = layers = 0
    for m in model.modules():
        if not isinstance(m, GroupedLinear):
            continue
        if m._int8_copy is None:
            added += m.keep_int8_copy(two_part=False)
        layers += m.use_one_part(ONE_PART_BELOW, from_rows=INT8_ACTIVATIONS_FROM_4BIT if m.bits == 4 else 1)
    if layers:
        logger.info("int8 activations: %d quantized linears take bfloat16 calls below %d rows on int8 copies "
                    "(+%.1f MiB), x in one int8 part", layers, ONE_PART_BELOW, added / 2**20)
    return added
