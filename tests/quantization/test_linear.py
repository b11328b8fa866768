"""Quantized linear layers against float references: kernel output vs the dequantized weight
(catches a wrong zero-point or packing convention) and SQNR thresholds per method."""

from __future__ import annotations

import pytest
import torch

from tests.kernel_utils import kernels_or_none, off_reason
from tokenmill.errors import UnsupportedModelError
from tokenmill.kernels.linear_spec import LinearKind
from tokenmill.quantization import kernels
from tokenmill.quantization.linear import (
    Int4Linear,
    Int8Linear,
    quantize_int4_groupwise,
    sqnr,
)

DTYPES = [torch.float32, torch.bfloat16]


def _weight(n: int = 192, k: int = 256, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.02


def _x(m: int, k: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _close(y: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    scale = ref.abs().max().item()
    assert (y.float() - ref).abs().max().item() <= tol * scale


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 5, 33])
def test_int8_kernel_matches_dequantized_reference(dtype, m):
    layer = Int8Linear.from_float(_weight(), None, dtype)
    x = _x(m, 256, dtype)
    _close(layer(x), x.float() @ layer.dequantize().T, dtype)
    assert layer.qweight.dtype == torch.int8 and layer.qweight.abs().max() <= 127


def test_the_pytorch_int8_path_takes_scales_of_another_dtype(monkeypatch):
    """Without tokenmill's kernels (TOKENMILL_CPU_KERNELS=0, CUDA) a float32 input with bfloat16
    scales (a float32 head in a bfloat16 model) is multiplied, not refused by PyTorch's kernel."""
    layer = Int8Linear.from_float(_weight(), None, torch.bfloat16)
    x = _x(3, 256, torch.float32)
    monkeypatch.setattr(kernels.dispatch, "for_tensors", lambda *tensors: None)
    y = kernels.int8_weight_mm(x, layer.qweight, layer.scale)
    assert y.dtype == torch.float32
    _close(y, x @ layer.dequantize().float().T, torch.bfloat16)


def test_bfloat16_int8_runs_on_the_grouped_kernel_with_the_same_products():
    """bfloat16 int8 layers take the grouped kernel (one group per row, exact codes): the result is
    the per-channel kernel's sum of the same exact products up to summation order, rounded once to
    bfloat16 (calls of dequant_rows() rows or more: of the weights rounded to bfloat16, at most
    2^-9 of each product more), and a row's result does not depend on the rows beside it (N = 40:
    padded rows cut)."""
    ops = kernels_or_none()
    if ops is None or not ops.group_linear_fast():
        pytest.skip(off_reason() or "the grouped CPU kernel needs AVX-512 BF16")
    layer = Int8Linear.from_float(_weight(n=40), torch.randn(40), torch.bfloat16)
    spec = layer.cpu_kernel_spec()
    assert spec.kind is LinearKind.GROUPED and (spec.bits, spec.group_size, spec.out_features) == (8, 256, 40)
    x = _x(70, 256, torch.bfloat16)
    product = layer.matmul(x)  # before the bias: one rounding to bfloat16
    exact = x.double() @ layer.dequantize().double().T
    weight_rounding = 2 ** -9 * (x.double().abs() @ layer.dequantize().double().abs().T)
    assert ops.dequant_rows() <= 70
    assert ((product.double() - exact).abs() <= 2 ** -8 * exact.abs() + weight_rounding + 1e-5 * exact.abs().max()).all()
    as_bfloat16 = x.double() @ layer.dequantize().bfloat16().double().T  # what 70 rows multiply by
    assert ((product.double() - as_bfloat16).abs() <= 2 ** -8 * as_bfloat16.abs() + 1e-5 * exact.abs().max()).all()
    per_channel = kernels.int8_weight_mm(x, layer.qweight, layer.scale)
    assert (product.float() - per_channel.float()).abs().max() <= 2 ** -7 * per_channel.float().abs().max()
    together = layer(x)
    assert torch.equal(layer(x[40:]), together[40:])  # 30 rows: dequantized too
    for i in (0, 9, 69):  # single rows as in calls of 3
        assert torch.equal(layer(x[i:i + 1])[0], layer(x[max(0, i - 2):i + 1])[-1])
    # an LM head's logits: the same values written as float32 by the kernel (with a bias: converted)
    head = Int8Linear.from_float(_weight(n=40), None, torch.bfloat16)
    assert torch.equal(head.forward_float32(x), head(x).float()) and head.forward_float32(x).dtype == torch.float32
    assert torch.equal(layer.forward_float32(x), together.float())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "group_size,k,n", [(32, 256, 192), (64, 256, 192), (128, 256, 192), (128, 192, 192), (64, 96, 40)])
def test_int4_kernel_matches_dequantized_reference(dtype, group_size, k, n):
    """K not a multiple of the group size (192 in groups of 128) and N not of 16 (40) are padded."""
    layer = Int4Linear.from_float(_weight(n=n, k=k), None, dtype, group_size)
    x = _x(7, k, dtype)
    _close(layer(x), x.float() @ layer.dequantize().T, dtype)
    assert layer.dequantize().shape == (n, k)
    assert layer(x).shape == (7, n)


def test_int4_zero_point_convention_by_hand():
    """One group of 32 spanning [-1, 2]: w = (q - 8) * scale + zero, scale = 3/15, zero = -1 + 8 * scale."""
    w = torch.linspace(-1.0, 2.0, 32).repeat(16, 1)
    q, scale, zero = quantize_int4_groupwise(w, 32, torch.float32)
    assert torch.allclose(scale, torch.full_like(scale, 0.2)) and torch.allclose(zero, torch.full_like(zero, 0.6))
    assert q[0, 0] == 0 and q[0, -1] == 15
    layer = Int4Linear.from_float(w, None, torch.float32, 32)
    x = torch.eye(32)  # the kernel's output on unit vectors is the dequantized weight itself
    assert torch.allclose(layer(x).T, (q.float() - 8) * 0.2 + 0.6, atol=1e-5)


def test_nibble_packing_round_trips():
    q = torch.randint(0, 16, (8, 64), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    packed = kernels.pack_nibbles(q)
    assert packed.shape == (8, 32) and packed.dtype == torch.uint8
    assert torch.equal(kernels.unpack_nibbles(packed), q)
    assert packed[0, 0] == q[0, 0] | (q[0, 1] << 4)


# SQNR in dB of the weight and of the layer's output, on Gaussian weights: int8 per channel ~42,
# int4 min-max ~22 (g32), ~21 (g64), ~20 (g128). A wrong scale, zero or packing falls far below.
SQNR_RANDOM = {"int8": 40.0, "int4-g32": 21.0, "int4-g64": 20.0, "int4-g128": 19.0}


def _make(method: str, w: torch.Tensor, dtype: torch.dtype):
    if method == "int8":
        return Int8Linear.from_float(w, None, dtype)
    return Int4Linear.from_float(w, None, dtype, int(method.split("-g")[1]))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("method", sorted(SQNR_RANDOM))
def test_sqnr_on_random_weights(method, dtype):
    w = _weight(256, 512)
    layer = _make(method, w, dtype)
    x = _x(16, 512, torch.float32)
    assert sqnr(w, layer.dequantize()) >= SQNR_RANDOM[method]
    assert sqnr(x @ w.T, layer(x.to(dtype))) >= SQNR_RANDOM[method] - 1.0


def test_finer_groups_are_more_accurate():
    w = _weight(256, 512)
    errors = [sqnr(w, Int4Linear.from_float(w, None, torch.float32, g).dequantize()) for g in (32, 64, 128, 256)]
    assert errors == sorted(errors, reverse=True)


def test_bias_is_added():
    w, b = _weight(), torch.randn(192)
    x = _x(3, 256, torch.float32)
    for layer in (Int8Linear.from_float(w, b, torch.float32), Int4Linear.from_float(w, b, torch.float32, 64)):
        _close(layer(x), x @ layer.dequantize().T + b, torch.float32)


def test_misaligned_input_view_is_safe():
    """The CPU int8 kernel crashes on inputs that start off a 32-byte boundary; the layer copies them."""
    layer = Int8Linear.from_float(_weight(), None, torch.bfloat16)
    flat = _x(1, 4 * 256 + 8, torch.bfloat16).flatten()
    x = flat[8:].view(4, 256)
    assert x.data_ptr() % 32
    _close(layer(x), x.float() @ layer.dequantize().T, torch.bfloat16)


def test_int8_rejects_widths_the_kernel_cannot_take():
    with pytest.raises(UnsupportedModelError, match="divisible by 16"):
        Int8Linear.from_float(torch.randn(8, 40), None, torch.float32)


def test_leading_dimensions_are_kept():
    layer = Int4Linear.from_float(_weight(), None, torch.float32, 32)
    x = torch.randn(2, 3, 256)
    assert layer(x).shape == (2, 3, 192)
    _close(layer(x), x @ layer.dequantize().T, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_int8_scale_search_never_increases_a_row_error(dtype):
    """Heavy-tailed rows (Student t): on some rows clipping the largest values lowers the error of
    the rest (with 255 levels, rarely by much: SmolLM2's perplexity through int8 went from +1.02% to
    +0.90%); on no row does the search do worse than absmax."""
    torch.manual_seed(0)
    w = torch.distributions.StudentT(3.0).sample((64, 576)) * 0.02
    errors = []
    for search in (False, True):
        layer = Int8Linear.from_float(w, None, dtype, scale_search=search)
        errors.append(((layer.dequantize() - w) ** 2).sum(1))
    plain, searched = errors
    assert (searched <= plain * (1 + 1e-6)).all()
    assert (searched < plain * (1 - 1e-3)).sum() >= 4
    # the scale rounded to the model dtype is the one the weights were rounded with
    layer = Int8Linear.from_float(w, None, dtype, scale_search=True)
    assert layer.scale.dtype == dtype and layer.qweight.abs().max() <= 127
