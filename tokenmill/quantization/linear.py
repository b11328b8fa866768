"""Quantized linear layers: modules that hold low-precision weights and know how to multiply.

Each class stores a portable form of its weight as persistent buffers (what ``state_dict``
saves and a quantized checkpoint holds) and, after :meth:`QuantizedLinear.prepare`, the
device kernel's own layout, used by ``forward``. Nothing is dequantized on the forward path.

    Int8Linear  qweight int8 [N, K], scale [N]:                  w = qweight * scale
    Int4Linear  qweight uint8 [N, Kp / 2] (two 4-bit q per byte,
                even column in the low nibble), scale and zero
                [N, Kp / group_size]:                            w = (q - 8) * scale + zero

    W8A8Linear  qweight int8 [N, K], weight_scale [N] as Int8Linear; the input is quantized to
                int8 too, per token at run time (dynamic) or with the calibrated input_scale
                and input_zero [] (static), and multiplied by an int8 x int8 -> int32 GEMM

Kp is K rounded up to a whole number of groups; the padded columns are zero weights and the
input is zero-padded to match (SmolLM2's 576 columns in groups of 128, for instance).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.errors import UnsupportedModelError
from tokenmill.kernels import dispatch
from tokenmill.kernels.linear_spec import CpuLinearSpec, LinearKind
from tokenmill.quantization import kernels
from tokenmill.quantization.observers import qparams_from_range, quantize_int8


class QuantizedLinear(nn.Module):
    """y = x W^T (+ b) for a quantized W; x [..., K] in the model dtype."""

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        # training through a frozen quantized layer (QLoRA): the kernels have no backward
        y = _InputGradMatmul.apply(flat, self) if torch.is_grad_enabled() and x.requires_grad else self.matmul(flat)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward_float32(self, x: torch.Tensor, kernel_rows: int | None = None) -> torch.Tensor:
        """``forward(x).float()``, the same values; by :meth:`matmul_float32` when there is no bias
        (an LM head's logits: no conversion pass where the kernel writes float32 itself).
        ``kernel_rows``: where the kernel depends on the number of rows, chosen as for this many."""
        if self.bias is not None or (torch.is_grad_enabled() and x.requires_grad):
            return self.forward(x).float()
        return self.matmul_float32(x.reshape(-1, self.in_features), kernel_rows).reshape(*x.shape[:-1],
                                                                                         self.out_features)

    def matmul_float32(self, x: torch.Tensor, kernel_rows: int | None = None) -> torch.Tensor:
        """``matmul(x).float()``: the products rounded to x's dtype as ``matmul`` rounds them, in float32
        (``kernel_rows``: see :meth:`forward_float32`; here one kernel for every row count)."""
        return self.matmul(x).float()

    def prepare(self) -> QuantizedLinear:
        """Build the kernel's layout from the portable buffers (after construction or loading)."""
        return self

    def dequantize(self) -> torch.Tensor:
        """The float weight [N, K] the quantized one stands for: for tests and error analysis only."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class _InputGradMatmul(torch.autograd.Function):
    """``layer.matmul(x)`` whose backward passes the gradient to ``x`` through the dequantized
    weight (the layer itself stays frozen): what LoRA training over a quantized base needs. The
    weight is dequantized in the backward only, one layer at a time."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, layer: QuantizedLinear) -> torch.Tensor:
        ctx.layer = layer
        with torch.no_grad():
            return layer.matmul(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        weight = ctx.layer.dequantize()
        return grad @ weight.to(device=grad.device, dtype=grad.dtype), None


class Int8Linear(QuantizedLinear):
    """INT8 weight, symmetric, one scale per output channel.

    With bfloat16 scales (a bfloat16 model) on CPU with tokenmill's kernels, :meth:`prepare` also
    lays the weight out for the grouped kernel (``group_weight_linear`` bits 8, one group per row:
    code q + 128, scale s, min -128 s, so the kernel's folded minimum is exactly 0 and it multiplies
    by q itself), which takes x as bfloat16 in vdpbf16ps: 2-3x the per-channel kernel's speed with
    many rows. The products are the same exact q x, summed in float32 in another order. Float32
    scales keep ``int8_weight_linear`` (float32 x, one fma per weight)."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__(qweight.shape[1], qweight.shape[0], bias)
        if self.in_features % 16:
            raise UnsupportedModelError(f"int8 kernels need in_features divisible by 16, got {self.in_features}")
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale)
        self._grouped: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def empty(cls, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
              device: torch.device | str = "meta") -> Int8Linear:
        """Right shapes, no values: to be filled by ``load_state_dict(..., assign=True)``."""
        return cls(torch.empty(out_features, in_features, dtype=torch.int8, device=device),
                   torch.empty(out_features, dtype=dtype, device=device),
                   torch.empty(out_features, dtype=dtype, device=device) if bias else None)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                   scale_search: bool = False) -> Int8Linear:
        """``scale_search``: each row's scale searched (see :func:`quantize_int8_per_channel`)."""
        q, scale = quantize_int8_per_channel(weight, dtype, scale_search)
        return cls(q, scale, None if bias is None else bias.to(dtype)).prepare()

    def prepare(self) -> Int8Linear:
        self.qweight, self.scale = kernels.aligned(self.qweight), kernels.aligned(self.scale)
        self._grouped = None
        if self.scale.dtype == torch.bfloat16 and dispatch.for_grouped(self.qweight.device) is not None:
            self._grouped = kernels.int8_grouped_pack(self.qweight, self.scale)
        return self

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, out_float32=False)

    def matmul_float32(self, x: torch.Tensor, kernel_rows: int | None = None) -> torch.Tensor:
        return self._matmul(x, out_float32=True).float()

    def _matmul(self, x: torch.Tensor, out_float32: bool) -> torch.Tensor:
        if self._grouped is not None and x.dtype in dispatch.KERNEL_DTYPES:
            y = kernels.group_weight_mm(x.contiguous(), *self._grouped, self.in_features, 8, out_float32)
            return y if y.shape[1] == self.out_features else y[:, :self.out_features]
        return kernels.int8_weight_mm(x, self.qweight, self.scale)

    def cpu_kernel_spec(self) -> CpuLinearSpec:
        """This layer for tokenmill's CPU decode stack: the grouped kernel over the layout
        :meth:`prepare` built, or ``int8_weight_linear`` over its own (aligned) qweight and scale."""
        if self._grouped is not None:
            return CpuLinearSpec(kind=LinearKind.GROUPED, weight=self._grouped[0], out_features=self.out_features,
                                 in_features=self.in_features, scales=self._grouped[1], bias=self.bias,
                                 group_size=self.in_features, bits=8)
        return CpuLinearSpec(kind=LinearKind.INT8, weight=self.qweight, out_features=self.out_features,
                             in_features=self.in_features, scales=self.scale, bias=self.bias)

    def dequantize(self) -> torch.Tensor:
        return self.qweight.float() * self.scale.float()[:, None]


class Int4Linear(QuantizedLinear):
    """INT4 weight, asymmetric, one (scale, zero) per ``group_size`` input columns."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, in_features: int,
                 bias: torch.Tensor | None = None) -> None:
        super().__init__(in_features, qweight.shape[0], bias)
        self.padded_in = qweight.shape[1] * 2
        self.group_size = self.padded_in // scale.shape[1]
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale)
        self.register_buffer("zero", zero)
        self._kernel_weight: torch.Tensor | None = None
        self._scales_and_zeros: torch.Tensor | None = None
        self._cpu_ops = None

    @classmethod
    def empty(cls, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, group_size: int,
              device: torch.device | str = "meta") -> Int4Linear:
        groups = -(-in_features // group_size)
        return cls(torch.empty(out_features, groups * group_size // 2, dtype=torch.uint8, device=device),
                   torch.empty(out_features, groups, dtype=dtype, device=device),
                   torch.empty(out_features, groups, dtype=dtype, device=device), in_features,
                   torch.empty(out_features, dtype=dtype, device=device) if bias else None)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                   group_size: int, range_search: bool = False, importance: torch.Tensor | None = None,
                   ) -> Int4Linear:
        """Round-to-nearest; ``range_search``: each group's range searched (:func:`int4_search_params`),
        each input column's error weighted by ``importance`` [K] when given."""
        q, scale, zero = quantize_int4_groupwise(weight, group_size, dtype, range_search, importance)
        return cls(pack_int4(q), scale, zero, weight.shape[1], None if bias is None else bias.to(dtype)).prepare()

    def prepare(self) -> Int4Linear:
        """The kernels take N in multiples of 16: extra rows (q = 0, scale = zero = 0) are cut from the output."""
        pad = -self.out_features % 16
        qweight, scale, zero = (F.pad(t, (0, 0, 0, pad)) for t in (self.qweight, self.scale, self.zero))
        self._cpu_ops = dispatch.for_int4(qweight.device)
        if self._cpu_ops is not None:  # tokenmill's kernel: its own layout
            self._kernel_weight, self._scales_and_zeros = kernels.int4_cpu_pack(qweight, scale, zero)
        else:
            self._kernel_weight = kernels.int4_kernel_weight(qweight)
            self._scales_and_zeros = kernels.int4_scales_and_zeros(scale, zero)
        return self

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self._kernel_weight is None:
            raise RuntimeError("Int4Linear used before prepare()")
        if self.padded_in != self.in_features:
            x = F.pad(x, (0, self.padded_in - self.in_features))
        if self._cpu_ops is not None and x.dtype in (torch.float32, torch.bfloat16):
            y = self._cpu_ops.int4_weight_linear(x, self._kernel_weight, self._scales_and_zeros, self.group_size)
        elif self._cpu_ops is not None:  # float16 and others: in float32
            y = self._cpu_ops.int4_weight_linear(x.float(), self._kernel_weight, self._scales_and_zeros,
                                                 self.group_size).to(x.dtype)
        else:
            y = kernels.int4_weight_mm(x.contiguous(), self._kernel_weight, self.group_size, self._scales_and_zeros)
        return y if y.shape[1] == self.out_features else y[:, :self.out_features]

    def cpu_kernel_spec(self) -> CpuLinearSpec | None:
        """This layer for tokenmill's CPU decode stack: ``int4_weight_linear`` over the layout
        :meth:`prepare` built for it, input padded to ``padded_in``; None when prepare chose
        PyTorch's int4 kernel instead (not on CPU, or no AVX-512 BF16 here)."""
        if self._cpu_ops is None:
            return None
        return CpuLinearSpec(kind=LinearKind.INT4, weight=self._kernel_weight, out_features=self.out_features,
                             in_features=self.padded_in, scales=self._scales_and_zeros, bias=self.bias,
                             group_size=self.group_size)

    def dequantize(self) -> torch.Tensor:
        q = kernels.unpack_nibbles(self.qweight).float().view(self.out_features, -1, self.group_size)
        w = (q - 8) * self.scale.float()[..., None] + self.zero.float()[..., None]
        return w.reshape(self.out_features, -1)[:, :self.in_features]

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, group_size={self.group_size}"


class W8A8Linear(QuantizedLinear):
    """INT8 weight (symmetric, per output channel) times INT8 activation, accumulated in int32.

    With x ~ (x_q - z) * s_x (one s_x, z per token, or one per tensor) and w ~ w_q * s_w[n]:

        y[m, n] = s_x[m] * s_w[n] * (sum_k x_q[m, k] w_q[n, k]  -  z[m] * sum_k w_q[n, k])

    The first sum is the int8 GEMM; the second, the weight's row sums, is computed once in
    :meth:`prepare`. Symmetric activations have z = 0 and skip it. Dynamic activations take each
    row's own range; static ones the calibrated ``input_scale`` and ``input_zero``.
    """

    def __init__(self, qweight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None,
                 input_scale: torch.Tensor | None = None, input_zero: torch.Tensor | None = None,
                 symmetric: bool = True) -> None:
        super().__init__(qweight.shape[1], qweight.shape[0], bias)
        if (input_scale is None) != (input_zero is None):
            raise ValueError("W8A8Linear: static activations need both input_scale and input_zero")
        self.symmetric = symmetric
        self.register_buffer("qweight", qweight)
        self.register_buffer("weight_scale", weight_scale)
        self.input_scale: torch.Tensor | None
        self.input_zero: torch.Tensor | None
        self.register_buffer("input_scale", input_scale)
        self.register_buffer("input_zero", input_zero)
        self._row_sum: torch.Tensor | None = None
        self._weight_scale: torch.Tensor | None = None

    @property
    def static(self) -> bool:
        return self.input_scale is not None

    @classmethod
    def empty(cls, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, static: bool,
              symmetric: bool, device: torch.device | str = "meta") -> W8A8Linear:
        """Right shapes, no values: to be filled by ``load_state_dict(..., assign=True)``."""
        return cls(torch.empty(out_features, in_features, dtype=torch.int8, device=device),
                   torch.empty(out_features, dtype=dtype, device=device),
                   torch.empty(out_features, dtype=dtype, device=device) if bias else None,
                   torch.empty((), dtype=dtype, device=device) if static else None,
                   torch.empty((), dtype=torch.int32, device=device) if static else None, symmetric)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                   input_qparams: tuple[torch.Tensor, torch.Tensor] | None = None,
                   symmetric: bool = True) -> W8A8Linear:
        """``input_qparams``: the calibrated (scale, zero_point) of static activations; None: dynamic."""
        q, scale = quantize_int8_per_channel(weight, dtype)
        input_scale = input_zero = None
        if input_qparams is not None:
            input_scale = input_qparams[0].to(device=weight.device, dtype=dtype)
            input_zero = input_qparams[1].to(device=weight.device, dtype=torch.int32)
        return cls(q, scale, None if bias is None else bias.to(dtype), input_scale, input_zero, symmetric).prepare()

    def prepare(self) -> W8A8Linear:
        if self.qweight.device.type == "cuda" and (self.in_features % 8 or self.out_features % 8):
            raise UnsupportedModelError("the CUDA int8 GEMM needs in_features and out_features divisible by 8, "
                                        f"got {self.in_features} and {self.out_features}")
        self._row_sum = self.qweight.sum(dim=1, dtype=torch.int32)
        self._weight_scale = self.weight_scale.float()
        return self

    def quantize_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [M, K] float -> (x_q int8 [M, K], scale float32, zero int32), each [M, 1] or [] (static)."""
        if self.static:
            scale, zero = self.input_scale.float(), self.input_zero
        else:
            lo, hi = torch.aminmax(x, dim=1, keepdim=True)
            scale, zero = qparams_from_range(lo, hi, self.symmetric)
        return quantize_int8(x, scale, zero, self.symmetric), scale, zero

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self._row_sum is None:
            raise RuntimeError("W8A8Linear used before prepare()")
        x_q, scale, zero = self.quantize_input(x)
        acc = kernels.int8_int8_mm(x_q, self.qweight)
        if not self.symmetric:
            acc = acc - zero * self._row_sum
        return (acc.float() * (scale * self._weight_scale)).to(x.dtype)

    def dequantize(self) -> torch.Tensor:
        return self.qweight.float() * self.weight_scale.float()[:, None]

    def extra_repr(self) -> str:
        mode = "static" if self.static else "dynamic"
        return f"{super().extra_repr()}, activation={mode}, symmetric={self.symmetric}"


# --------------------------------------------------------------------------- the arithmetic

INT8_CLIP_RATIOS = torch.linspace(0.70, 1.0, 31).tolist()
"""Scale search of INT8 weights: each row's scale is absmax / 127 times one of these."""


def quantize_int8_per_channel(weight: torch.Tensor, dtype: torch.dtype,
                              search: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (int8 q [N, K], scale [N] in ``dtype``), symmetric: q in -127..127.

    The scale is rounded to ``dtype`` before q is computed, so q is the best choice for the
    scale the kernel will actually use. ``search``: each row's scale is the one among
    absmax / 127 x :data:`INT8_CLIP_RATIOS` (clipping its largest values) with the least squared
    rounding error; ratio 1 is among them, so the error never exceeds plain absmax's."""
    w = weight.float()
    amax = w.abs().amax(dim=1).clamp(min=1e-10 * 127)
    scale = (amax / 127.0).to(dtype)
    if search:
        best = torch.full_like(amax, float("inf"))
        for lo in range(0, w.shape[0], 4096):  # row chunks: a few [4096, K] temporaries at a time
            rows, a = w[lo:lo + 4096], amax[lo:lo + 4096]
            for ratio in INT8_CLIP_RATIOS:
                s = (a * ratio / 127.0).to(dtype)
                err = ((torch.round(rows / s.float()[:, None]).clamp(-127, 127) * s.float()[:, None] - rows) ** 2).sum(1)
                better = err < best[lo:lo + 4096]
                best[lo:lo + 4096] = torch.where(better, err, best[lo:lo + 4096])
                scale[lo:lo + 4096] = torch.where(better, s, scale[lo:lo + 4096])
    q = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def pad_to_groups(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """weight [N, K] float32 -> [N, Kp] with zero columns appended up to a multiple of group_size."""
    pad = -weight.shape[1] % group_size
    return F.pad(weight.float(), (0, pad)) if pad else weight.float()


def int4_group_params(w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Min-max asymmetric parameters of groups w [..., group_size] -> (scale, zero) [...] in ``dtype``,
    so that q = round((w - zero) / scale) + 8 spans 0..15 over [min, max]."""
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    scale = ((hi - lo) / 15.0).clamp(min=1e-8).to(dtype)
    zero = (lo + 8.0 * scale.float()).to(dtype)
    return scale, zero


def int4_round(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Nearest q in 0..15 for w [..., g] under (scale, zero) [...]: int32 [..., g]."""
    q = torch.round((w - zero.float()[..., None]) / scale.float()[..., None]) + 8
    return q.clamp(0, 15).to(torch.int32)


RANGE_TRIMS = (0.0, 0.02, 0.04, 0.06, 0.08, 0.1)
"""Fractions of a group's [min, max] range that :func:`int4_search_params` tries cutting from
each end (36 pairs, the range kept between 80% and 100%)."""


def int4_group_error(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                     importance: torch.Tensor | None = None) -> torch.Tensor:
    """Squared rounding error of groups w [..., g] under (scale, zero) [...], summed over each group
    and weighted per column by ``importance`` (broadcast against w; None: 1): float32 [...]."""
    w, scale, zero = w.float(), scale.float(), zero.float()
    return _error(w, _levels(w, scale, zero), scale, zero, importance)


def int4_fit_params(w: torch.Tensor, q: torch.Tensor, importance: torch.Tensor | None,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted least-squares (scale, zero) [...] for fixed levels q [..., g]: the best w ~ (q - 8) * scale
    + zero; float32, or NaN where the levels are all equal (no scale can be fitted)."""
    w = w.float()
    c = torch.ones_like(w) if importance is None else importance.expand_as(w)
    return _fit(w, q.float() - 8, importance, c.sum(-1), (c * w).sum(-1))


SEARCH_CHUNK_ELEMENTS = 1 << 18
"""Weights :func:`int4_search_params` searches at once (1 MiB of float32): a chunk and its
temporaries stay in cache across the 36 trims, instead of each trim streaming the whole matrix."""


_KERNEL_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
"""The output dtypes the CPU kernel ``int4_range_search`` rounds parameters to, by its code."""


def int4_search_params(w: torch.Tensor, dtype: torch.dtype, importance: torch.Tensor | None = None,
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Like :func:`int4_group_params` for groups w [..., g], but the (scale, zero) that minimise each
    group's (``importance``-weighted) squared rounding error among: plain min-max, and for each
    range trimmed by :data:`RANGE_TRIMS` at either end, its own parameters and the least-squares
    refit of them to the levels they round to (llama.cpp's make_qkx / AWQ's clip search).

    Trimming lets a few outliers clip so that the other weights get a finer grid. Min-max is
    a candidate and parameters are compared as rounded to ``dtype``, so no group's error is ever
    above min-max's. ``importance`` broadcasts against w, or has w's first dimension.

    On CPU the compiled kernel ``int4_range_search`` tries every candidate of one group while the
    group is in cache (about 10x PyTorch's speed); elsewhere, or with the kernels off, PyTorch
    searches :data:`SEARCH_CHUNK_ELEMENTS` weights at a time along the first dimension."""
    w = w.float()
    ops = dispatch.for_tensors(w) if dtype in _KERNEL_DTYPE_CODES and w.numel() else None
    if ops is not None:
        g = w.shape[-1]
        weights = None if importance is None else importance.float().expand_as(w).reshape(-1, g)
        scale, zero = ops.int4_range_search(w.reshape(-1, g), weights, torch.tensor(RANGE_TRIMS),
                                            _KERNEL_DTYPE_CODES[dtype])
        return scale.view(w.shape[:-1]).to(dtype), zero.view(w.shape[:-1]).to(dtype)
    rows = max(1, SEARCH_CHUNK_ELEMENTS // max(1, w[0].numel())) if w.dim() > 1 else w.shape[0]
    if w.dim() < 2 or rows >= w.shape[0]:
        return _search_params(w, dtype, importance)
    cut = importance is not None and importance.dim() == w.dim() and importance.shape[0] == w.shape[0] > 1
    parts = [_search_params(w[i:i + rows], dtype, importance[i:i + rows] if cut else importance)
             for i in range(0, w.shape[0], rows)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def _levels(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """q - 8 as float for :func:`int4_round`'s q (the same rounding: clamp(round(x), -8, 7) + 8 is
    clamp(round(x) + 8, 0, 15))."""
    return torch.round((w - zero[..., None]) / scale[..., None]).clamp_(-8, 7)


def _error(w: torch.Tensor, u: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
           importance: torch.Tensor | None) -> torch.Tensor:
    """:func:`int4_group_error` for levels u = q - 8 already rounded."""
    err = torch.addcmul(zero[..., None] - w, u, scale[..., None]).square_()
    return (err if importance is None else err.mul_(importance)).sum(dim=-1)


def _fit(w: torch.Tensor, u: torch.Tensor, importance: torch.Tensor | None, n: torch.Tensor, sw: torch.Tensor,
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`int4_fit_params` for levels u = q - 8, with the groups' weight sums n and sums sw given."""
    cu = u if importance is None else u * importance
    su, suu, suw = cu.sum(-1), (cu * u).sum(-1), (cu * w).sum(-1)
    det = n * suu - su * su
    ok = det > 1e-12 * n * n
    scale = torch.where(ok, (n * suw - su * sw) / torch.where(ok, det, 1.0), float("nan"))
    return scale, (sw - scale * su) / n.clamp(min=1e-30)


def _search_params(w: torch.Tensor, dtype: torch.dtype, importance: torch.Tensor | None,
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    best_scale, best_zero = int4_group_params(w, dtype)
    fs, fz = best_scale.float(), best_zero.float()
    best_err = _error(w, _levels(w, fs, fz), fs, fz, importance)
    if importance is None:
        n, sw = torch.full_like(best_err, w.shape[-1]), w.sum(-1)
    else:
        c = importance.expand_as(w)
        n, sw = c.sum(-1), (c * w).sum(-1)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    span = hi - lo
    for low_trim in RANGE_TRIMS:
        for high_trim in RANGE_TRIMS:
            scale = ((span * (1 - low_trim - high_trim)) / 15.0).clamp(min=1e-8)
            zero = lo + low_trim * span + 8.0 * scale
            fitted_scale, fitted_zero = _fit(w, _levels(w, scale, zero), importance, n, sw)
            usable = fitted_scale > 1e-8  # False for NaN: keep the trimmed parameters there
            candidates = ((scale, zero),
                          (torch.where(usable, fitted_scale, scale), torch.where(usable, fitted_zero, zero)))
            for cand_scale, cand_zero in candidates:
                cand_scale, cand_zero = cand_scale.to(dtype), cand_zero.to(dtype)
                cs, cz = cand_scale.float(), cand_zero.float()
                err = _error(w, _levels(w, cs, cz), cs, cz, importance)
                better = err < best_err
                best_err = torch.where(better, err, best_err)
                best_scale = torch.where(better, cand_scale, best_scale)
                best_zero = torch.where(better, cand_zero, best_zero)
    return best_scale, best_zero


def quantize_int4_groupwise(weight: torch.Tensor, group_size: int, dtype: torch.dtype, range_search: bool = False,
                            importance: torch.Tensor | None = None,
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest: weight [N, K] -> (q int32 [N, Kp] in 0..15, scale, zero [N, Kp / group_size]).

    ``range_search``: each group's parameters by :func:`int4_search_params` instead of min-max,
    its error weighted per input column by ``importance`` [K] (e.g. the inputs' mean square)."""
    w = pad_to_groups(weight, group_size)
    groups = w.view(w.shape[0], -1, group_size)
    if range_search:
        weights = None if importance is None else pad_to_groups(importance.float()[None], group_size).view(
            1, -1, group_size)
        scale, zero = int4_search_params(groups, dtype, weights)
    else:
        scale, zero = int4_group_params(groups, dtype)
    return int4_round(groups, scale, zero).view(w.shape), scale, zero


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q int [N, Kp] in 0..15 -> the portable uint8 [N, Kp / 2]."""
    return kernels.pack_nibbles(q)


def sqnr(reference: torch.Tensor, approximation: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: 20 log10(||ref|| / ||ref - approx||)."""
    ref, approx = reference.float(), approximation.float()
    noise = torch.linalg.vector_norm(ref - approx)
    if noise == 0:
        return float("inf")
    return float(20 * torch.log10(torch.linalg.vector_norm(ref) / noise))
