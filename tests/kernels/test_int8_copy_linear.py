"""The int8 copy of grouped codes (int8_copy_linear.cpp, grouped.int8_copy_pack): x in two int8 parts
per row and group (or one), integer products on AVX-512 VNNI. Against a float64 reference of the same
quantized x, the vector path against the portable one bit for bit, batch invariance, the
symmetric layout, bias and float32 outputs, bad arguments."""

from __future__ import annotations

import pytest
import torch

from tests.kernel_utils import require_kernels
from tokenmill.loading.gguf_groups import GroupedWeight
from tokenmill.quantization import kernels
from tokenmill.quantization.grouped import int8_copy_pack, symmetric_offset

ops = require_kernels()
needs_vnni = pytest.mark.skipif(not ops.int8_copy_linear_fast(), reason="the vector path needs AVX-512 VNNI")
LARGEST = {4: 15, 5: 31, 7: 63, 8: 255}
NONE = torch.empty(0)


def _weight(n: int, k: int, gs: int, bits: int, offset: int | None, seed: int, half: bool = False) -> GroupedWeight:
    """Random codes over the full range; mins of both signs, or -offset * scale (a symmetric type);
    ``half``: scales and mins that are float16 values, as GGUF's Q4_0 .. Q8_0 store them."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, LARGEST[bits] + 1, (n, k), generator=g, dtype=torch.uint8)
    scale = torch.randn(n, k // gs, generator=g) * 0.02
    mins = torch.randn(n, k // gs, generator=g) * 0.01 * LARGEST[bits]
    if half:
        scale, mins = scale.half().float(), mins.half().float()
    return GroupedWeight(codes, scale, mins if offset is None else -offset * scale, gs, bits)


def _widened(copy: torch.Tensor, gs: int) -> torch.Tensor:
    """A copy with float16 scales (and mins) laid out again with the same values as float32."""
    codes, fields = copy[..., :16 * gs], copy[..., 16 * gs:].contiguous()
    wide = fields.view(torch.float16).float().contiguous().view(torch.uint8)
    return kernels.aligned(torch.cat([codes, wide], dim=2))


def _reference(x: torch.Tensor, w: GroupedWeight, one_part: bool = False) -> torch.Tensor:
    """float64 products of the weights and x as the kernel quantizes it: per row and group of
    group_size, dx = max |x| / 127, t = x / dx, h = t and l = (t - h) 256 rounded to nearest even,
    x = dx (h + l / 256); with one part x = dx h."""
    m, k = x.shape
    xg = x.float().view(m, k // w.group_size, w.group_size)
    amax = xg.abs().amax(-1, keepdim=True)
    # 127 / amax correctly rounded (torch's scalar / tensor is 127 * (1 / amax), rounded twice)
    inv = torch.where(amax > 0, torch.full_like(amax, 127) / amax, torch.zeros_like(amax))
    t = xg * inv
    h = torch.round(t)
    low = torch.round((t - h) * 256).clamp(-127, 127) * (0 if one_part else 1)
    parts = h.clamp(-127, 127).double() + low.double() / 256
    return (parts * (amax.double() / 127)).view(m, k) @ w.dequantize().double().T


CASES = [  # n, k, group size, bits, symmetric offset (None: mins)
    (40, 256, 32, 4, None), (40, 256, 32, 4, 8), (33, 192, 32, 5, 16), (50, 128, 32, 8, 128),
    (24, 256, 16, 7, 32), (17, 96, 16, 5, None), (40, 96, 32, 8, 128)]


@pytest.mark.parametrize("n,k,gs,bits,offset", CASES)
@pytest.mark.parametrize("m", [1, 5, 12, 16, 17, 20, 130])  # one block, the largest blocks, uneven blocks, two panels
@pytest.mark.parametrize("one_part", [False, True])
def test_int8_copy_matches_the_reference_of_its_quantized_x(n, k, gs, bits, offset, m, one_part) -> None:
    w = _weight(n, k, gs, bits, offset, seed=n * m)
    copy, got_offset = int8_copy_pack(w)
    assert got_offset == (-1 if offset is None else offset)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 3
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        ref = _reference(xd.float(), w, one_part)
        out = ops.int8_copy_linear(xd, copy, n, gs, got_offset, NONE, one_part=one_part)
        assert out.dtype == dtype and out.shape == (m, n)
        err = (out.double() - ref).abs()
        # float32 sums of exact integer dot products (relative ~1e-6), then bfloat16's half ulp
        bound = 1e-5 * ref.abs().max() + (ref.abs() * 2**-8 if dtype == torch.bfloat16 else 0)
        assert bool((err <= bound).all()), err.max().item()
    # x in two parts is closer to x than bfloat16 is: the products are nearer the exact ones than
    # those of x rounded to bfloat16 (the bfloat16 copy's); one part is further (llama.cpp's Q8
    # activations: a step of max |x| / 127 where bfloat16 rounds each value to 2^-8 of itself)
    exact = x.double() @ w.dequantize().double().T
    rounded = (x.bfloat16().double() @ w.dequantize().double().T - exact).abs().max()
    assert (_reference(x, w) - exact).abs().max() < 0.5 * rounded
    assert rounded < (_reference(x, w, one_part=True) - exact).abs().max() < 8 * rounded


@pytest.mark.parametrize("n,k,gs,bits,offset", CASES)
def test_float16_scales_are_kept_as_float16_and_give_the_same_bits(n, k, gs, bits, offset) -> None:
    """Scales (and mins) that are float16 values are packed as float16: 32 bytes less per group and
    field. The kernel reads the same values from them: every output equals the float32 layout's, on
    both paths, one part and two, at row counts of one block, the largest blocks and two panels."""
    fields = 1 if offset is not None else 2
    copy, off = int8_copy_pack(_weight(n, k, gs, bits, offset, seed=11, half=True))
    assert copy.shape[2] == 16 * gs + 32 * fields
    assert int8_copy_pack(_weight(n, k, gs, bits, offset, seed=11))[0].shape[2] == 16 * gs + 64 * fields
    wide = _widened(copy, gs)
    for m in (1, 5, 12, 20, 130):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16() * 3
        for one_part in (False, True):
            for path in (ops.KernelPath.FASTEST, ops.KernelPath.PORTABLE):
                half = ops.int8_copy_linear(x, copy, n, gs, off, NONE, one_part=one_part, path=path)
                assert torch.equal(half, ops.int8_copy_linear(x, wide, n, gs, off, NONE, one_part=one_part, path=path))


@needs_vnni
@pytest.mark.parametrize("n,k,gs,bits,offset", CASES)
@pytest.mark.parametrize("half", [False, True])
def test_int8_copy_vector_path_equals_the_portable_one(n, k, gs, bits, offset, half) -> None:
    w = _weight(n, k, gs, bits, offset, seed=7, half=half)
    copy, off = int8_copy_pack(w)
    for m in (1, 3, 12, 16, 29):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
        for one_part in (False, True):
            fast = ops.int8_copy_linear(x, copy, n, gs, off, NONE, one_part=one_part)
            portable = ops.int8_copy_linear(x, copy, n, gs, off, NONE, one_part=one_part,
                                            path=ops.KernelPath.PORTABLE)
            assert torch.equal(fast, portable)


def test_a_rows_result_does_not_depend_on_the_batch() -> None:
    """x is quantized row by row and rows are summed alike in every block: a row alone, or among
    17 others split into other blocks and panels, gives the same bits."""
    w = _weight(72, 256, 32, 5, 16, seed=3)
    copy, off = int8_copy_pack(w)
    x = torch.randn(150, 256, generator=torch.Generator().manual_seed(1)).bfloat16()
    full = ops.int8_copy_linear(x, copy, 72, 32, off, NONE)
    for rows in (slice(0, 1), slice(3, 20), slice(127, 150)):
        assert torch.equal(ops.int8_copy_linear(x[rows], copy, 72, 32, off, NONE), full[rows])


def test_bias_and_float32_outputs() -> None:
    """bias is added before the one rounding; out_float32 with bfloat16 x stores the bfloat16 values
    widened (logits read as float32)."""
    w = _weight(40, 128, 32, 8, 128, seed=5)
    copy, off = int8_copy_pack(w)
    x = torch.randn(6, 128, generator=torch.Generator().manual_seed(2)).bfloat16()
    bias = torch.randn(40)
    plain = ops.int8_copy_linear(x.float(), copy, 40, 32, off, NONE)
    with_bias = ops.int8_copy_linear(x.float(), copy, 40, 32, off, bias)
    torch.testing.assert_close(with_bias, plain + bias, rtol=0, atol=1e-5)
    rounded = ops.int8_copy_linear(x, copy, 40, 32, off, NONE)
    widened = ops.int8_copy_linear(x, copy, 40, 32, off, NONE, out_float32=True)
    assert widened.dtype == torch.float32 and torch.equal(widened, rounded.float())


def test_zero_rows_of_x_and_zero_weights_give_zero() -> None:
    """A group of x that is all zero quantizes with dx = 0 (no division by zero); padded rows (code,
    scale, min 0) are cut."""
    w = _weight(20, 64, 32, 4, None, seed=1)
    copy, off = int8_copy_pack(w)
    assert copy.shape == (2, 2, 16 * 32 + 128)  # 20 rows -> 2 tiles
    x = torch.zeros(3, 64).bfloat16()
    x[1, :32] = 1.0
    out = ops.int8_copy_linear(x, copy, 20, 32, off, NONE)
    assert out.shape == (3, 20) and torch.equal(out[0], torch.zeros(20).bfloat16())
    assert bool(torch.isfinite(out.float()).all())


def test_symmetric_offset_is_found_only_where_every_min_is_a_whole_offset_times_the_scale() -> None:
    assert symmetric_offset(_weight(16, 64, 32, 8, 128, seed=0)) == 128
    assert symmetric_offset(_weight(16, 64, 32, 4, None, seed=0)) == -1
    w = _weight(16, 64, 32, 4, 8, seed=0)
    w.min[3, 1] += 1e-3
    assert symmetric_offset(w) == -1
    mixed = _weight(16, 64, 32, 4, 8, seed=0)
    mixed.min[0] = -7 * mixed.scale[0]
    assert symmetric_offset(mixed) == -1


def test_bad_arguments_name_the_problem() -> None:
    w = _weight(16, 64, 32, 4, None, seed=0)
    copy, off = int8_copy_pack(w)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="groups of 32 do not make K"):
        ops.int8_copy_linear(torch.randn(2, 96), copy, 16, 32, off, NONE)
    with pytest.raises(RuntimeError, match="bytes per group"):
        ops.int8_copy_linear(x, copy, 16, 32, 8, NONE)  # a copy with mins read as symmetric
    with pytest.raises(RuntimeError, match="tiles do not hold"):
        ops.int8_copy_linear(x, copy, 40, 32, off, NONE)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.int8_copy_linear(x.half(), copy, 16, 32, off, NONE)
    with pytest.raises(RuntimeError, match="bias"):
        ops.int8_copy_linear(x, copy, 16, 32, off, torch.zeros(3))
