"""tokenmill's CPU kernel for grouped codes (group_linear.cpp, w = code * scale + min: the form of
GGUF's Q4_0 .. Q8_0 and K-quants) against a float64 reference on both paths and both schedules
(few rows, many rows); batch and thread invariance; group_cpu_pack's layout; bad shapes; the
decode stack's GROUPED Linear."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.kernel_utils import cpu_flags, require_kernels
from tokenmill.kernels import dispatch
from tokenmill.kernels.linear_spec import CpuLinearSpec, LinearKind
from tokenmill.quantization import kernels as qk

ops = require_kernels()
LARGEST = {4: 15, 5: 31, 7: 127, 8: 255}


def _weights(n: int, k: int, group_size: int, bits: int, seed: int):
    """Random codes over the full range, scales and mins of both signs (mins of the size of
    code * scale, as the K-quants' and Q4_1's are)."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, LARGEST[bits] + 1, (n, k), generator=g, dtype=torch.uint8)
    scale = torch.randn(n, k // group_size, generator=g) * 0.02
    mins = torch.randn(n, k // group_size, generator=g) * 0.02 * LARGEST[bits] / 2
    return codes, scale, mins


def _dequantized(codes, scale, mins, group_size: int) -> torch.Tensor:
    n, k = codes.shape
    w = codes.double().view(n, -1, group_size) * scale.double()[..., None] + mins.double()[..., None]
    return w.view(n, k)


def _dequantizes(m: int, dtype: torch.dtype, path: str = "FASTEST", k: int = 32) -> bool:
    """Whether a call of m rows runs the bfloat16 GEMM over weights rounded to bfloat16 (tiles_dequant)."""
    rows = ops.dequant_rows()
    return path == "FASTEST" and dtype == torch.bfloat16 and rows > 0 and m >= rows and k % 32 == 0


def _as_called(w: torch.Tensor, m: int, dtype: torch.dtype, path: str = "FASTEST") -> torch.Tensor:
    """The float64 weights a call of m rows multiplies by: w itself, or rounded to bfloat16 (via
    float32, as the kernel's fma rounds code * scale + min) where the call dequantizes."""
    return w.float().bfloat16().double() if _dequantizes(m, dtype, path, w.shape[1]) else w


def _check(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    if dtype == torch.float32:
        # x kept to about 16 bits (bfloat16 high + low parts: |x - h - l| <= 2^-18 |x|), float32 sums
        rel = ((got.double() - expected).abs().max() / expected.abs().max()).item()
        assert rel <= 5e-5
    else:
        # bfloat16 x is exact in the products; the float32 sum (relative error ~1e-6 here) is rounded
        # once to bfloat16, at most half an ulp = 2^-8 of the value
        err = (got.double() - expected).abs()
        assert (err <= 2 ** -8 * expected.abs() + 1e-4 * expected.abs().max()).all()


MS = [1, 2, 3, 4, 5, 8, 17, 33, 64, 257]


@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("bits,group_size", [(4, 32), (4, 16), (5, 32), (5, 16), (7, 32), (7, 16), (8, 32), (8, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("path", ["FASTEST", "VECTOR", "PORTABLE"], ids=["fastest", "avx512", "portable"])
def test_matches_float64_reference(path, dtype, bits, group_size, m):
    n, k = 48, 128  # 3 tiles: a strip of 2 and one alone; 257 rows: blocks of 12 and a remainder
    codes, scale, mins = _weights(n, k, group_size, bits, seed=bits + group_size + m)
    packed, sz = qk.group_cpu_pack(codes, scale, mins, bits)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    expected = x.double() @ _as_called(_dequantized(codes, scale, mins, group_size), m, dtype, path).T
    got = ops.group_weight_linear(x, packed, sz, group_size, bits, path=ops.KernelPath[path])
    assert got.dtype == dtype and got.shape == (m, n)
    _check(got, expected, dtype)


@pytest.mark.parametrize("path", ["FASTEST", "VECTOR", "PORTABLE"], ids=["fastest", "avx512", "portable"])
@pytest.mark.parametrize("m", [1, 5, 40])
def test_float32_out_holds_the_bfloat16_outputs_exactly(m, path):
    """out_float32 with bfloat16 x (logits): the very values of the bfloat16 output, widened."""
    n, k, group_size = 48, 128, 32
    codes, scale, mins = _weights(n, k, group_size, 8, seed=m)
    packed, sz = qk.group_cpu_pack(codes, scale, mins, 8)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
    kernel_path = ops.KernelPath[path]
    wide = ops.group_weight_linear(x, packed, sz, group_size, 8, out_float32=True, path=kernel_path)
    assert wide.dtype == torch.float32
    assert torch.equal(wide, ops.group_weight_linear(x, packed, sz, group_size, 8, path=kernel_path).float())


@pytest.mark.parametrize("bits", [4, 5, 7, 8])
def test_larger_shape_and_the_python_entry_point(bits):
    n, k, group_size = 320, 576, 32
    codes, scale, mins = _weights(n, k, group_size, bits, seed=5)
    packed, sz = qk.group_cpu_pack(codes, scale, mins, bits)
    for m in (1, 40):
        x = torch.randn(m, k).bfloat16()
        got = qk.group_weight_mm(x, packed, sz, group_size, bits)
        w = _as_called(_dequantized(codes, scale, mins, group_size), m, torch.bfloat16)
        _check(got, x.double() @ w.T, torch.bfloat16)


@pytest.mark.parametrize("bits", [4, 5, 8])
def test_symmetric_mins_take_the_same_sums(bits):
    """min = -offset * scale (Q4_0, Q5_0, Q8_0): the many-rows schedule skips the zero folded
    minimum; results stay those of the few-rows one."""
    n, k, group_size = 64, 256, 32
    codes, scale, _ = _weights(n, k, group_size, bits, seed=9)
    mins = -scale * qk.CODE_OFFSETS[bits]
    packed, sz = qk.group_cpu_pack(codes, scale, mins, bits)
    x = torch.randn(40, k).bfloat16()
    together = ops.group_weight_linear(x, packed, sz, group_size, bits)
    w = _as_called(_dequantized(codes, scale, mins, group_size), 40, torch.bfloat16)
    _check(together, x.double() @ w.T, torch.bfloat16)
    vector = ops.KernelPath.VECTOR  # the two vector schedules (40 rows: dequantized weights, AMX tiles)
    together = ops.group_weight_linear(x, packed, sz, group_size, bits, path=vector)
    for i in (0, 17, 39):
        assert torch.equal(ops.group_weight_linear(x[i:i + 1], packed, sz, group_size, bits, path=vector)[0],
                           together[i])


@pytest.mark.parametrize("m", [1, 3, 4, 5, 12, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("path", ["FASTEST", "VECTOR", "PORTABLE"], ids=["fastest", "avx512", "portable"])
@pytest.mark.parametrize("bits", [4, 5, 8])
def test_scales_alone_give_the_same_bits(bits, path, dtype, m):
    """A symmetric type's sz as scales alone ([..., 1, 16], mn 0: scales_alone) gives the very outputs
    of its (scale, min) layout, on every schedule (fixed point, few rows, tiles, many rows)."""
    n, k, group_size = 48, 256, 32
    codes, scale, _ = _weights(n, k, group_size, bits, seed=bits + m)
    packed, sz = qk.group_cpu_pack(codes, scale, -scale * qk.CODE_OFFSETS[bits], bits)
    alone = qk.scales_alone(sz, bits)
    assert alone.shape == (3, k // group_size, 1, 16) and torch.equal(alone[:, :, 0], sz[:, :, 0])
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    kernel_path = ops.KernelPath[path]
    assert torch.equal(ops.group_weight_linear(x, packed, alone, group_size, bits, path=kernel_path),
                       ops.group_weight_linear(x, packed, sz, group_size, bits, path=kernel_path))


def test_scales_alone_only_where_every_min_cancels():
    """An asymmetric weight (Q4_1), or one min off by one ulp, keeps its (scale, min) layout."""
    codes, scale, mins = _weights(32, 64, 32, 4, seed=1)
    _, sz = qk.group_cpu_pack(codes, scale, mins, 4)
    assert qk.scales_alone(sz, 4) is sz
    mins = -8 * scale
    mins[3, 1] = torch.nextafter(mins[3, 1], torch.tensor(1.0))
    _, sz = qk.group_cpu_pack(codes, scale, mins, 4)
    assert qk.scales_alone(sz, 4) is sz
    _, sz = qk.group_cpu_pack(codes, scale, -8 * scale, 8)  # the offset of bits 8 is 128, not 8
    assert qk.scales_alone(sz, 8) is sz


@pytest.mark.parametrize("path", ["FASTEST", "VECTOR"], ids=["fastest", "avx512"])
@pytest.mark.parametrize("bits,group_size", [(4, 32), (5, 32), (7, 32), (7, 16), (8, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_rows_do_not_depend_on_the_batch_nor_the_threads(dtype, bits, group_size, path):
    """On both paths: a row's result is the same alone, in any batch (the vector schedules' blocks,
    AMX row tiles of 16 and their tails) and on any number of threads. On the fastest path,
    bfloat16 calls of fewer than fixed_point_rows() rows take integer products (the same in every
    such call), calls of dequant_rows() rows or more the bfloat16 GEMM over dequantized weights
    (the same in every such call), and where there are AMX tiles, calls of amx_min_rows() rows or
    more and fewer than dequant_rows() run on them (the same in every such call); other calls take
    the vector schedules."""
    n, k = 80, 192
    codes, scale, mins = _weights(n, k, group_size, bits, seed=11)
    packed, sz = qk.group_cpu_pack(codes, scale, mins, bits)
    x = torch.randn(300, k, generator=torch.Generator().manual_seed(1)).to(dtype)

    def mm(rows, kernel_path=ops.KernelPath[path]):
        return ops.group_weight_linear(rows, packed, sz, group_size, bits, path=kernel_path)

    together = mm(x)
    fastest_bf16 = path == "FASTEST" and dtype == torch.bfloat16
    fixed = ops.fixed_point_rows() if fastest_bf16 else 0
    tiles = fastest_bf16 and ops.amx_tiles()
    dequant = ops.dequant_rows() if fastest_bf16 else 0
    few = mm(x, ops.KernelPath.VECTOR) if tiles or dequant else together
    mid = torch.cat([mm(x[i:i + 20]) for i in range(0, 300, 20)]) if tiles else few  # calls of 20 rows
    singles = torch.cat([mm(x[i:i + 1]) for i in range(300)]) if fixed else None

    def want(m):
        if m < fixed:
            return singles
        if dequant and m >= dequant:
            return together
        return mid if tiles and m >= ops.amx_min_rows() else few

    for i in range(0, 300, 13):
        assert torch.equal(mm(x[i:i + 1])[0], want(1)[i])
    for m in (2, 3, 4, 5, 6, 7, 8, 15, 16, 17, 23, 24, 25, 31, 32, 33):  # block sizes, row tiles of 16 and tails
        assert torch.equal(mm(x[:m]), want(m)[:m])
        assert torch.equal(mm(x[m:2 * m]), want(m)[m:2 * m])
    three, five = mm(x[:3]), mm(x[:5])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(mm(x), together)
        assert torch.equal(mm(x[:3]), three)
        assert torch.equal(mm(x[:5]), five)
    finally:
        torch.set_num_threads(threads)


def _fixed_point(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """x as the fixed-point products see it: per group, 2^-s round(x 2^s), s = 13 - the exponent
    of the group's largest |x| (so that its 8 bits fit and |round(x 2^s)| <= 2^14)."""
    m, k = x.shape
    xg = x.double().view(m, k // group_size, group_size)
    amax = xg.abs().amax(-1, keepdim=True)
    e = torch.where(amax > 0, torch.floor(torch.log2(amax)), torch.zeros_like(amax))
    s = (13 - e).clamp(-126, 126)
    return (torch.round(xg * 2.0 ** s) * 2.0 ** -s).view(m, k)  # torch.round: to nearest even


@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("bits,group_size", [(4, 32), (5, 32), (5, 16), (7, 16), (8, 32)])
def test_fixed_point_products_round_x_as_documented(bits, group_size, m):
    """Few bfloat16 rows on the fastest path: x in 16-bit fixed point per group, exact integer sums.
    The result is the float64 product with that x, rounded once to bfloat16; against the exact
    x the difference is within 2^-14 of each group's largest |x| (groups here with one x 1000x
    the others, where bfloat16 products would keep the small ones exactly)."""
    if not ops.fixed_point_rows():
        pytest.skip("no AVX-512 VNNI in this build: fewer-row calls keep the bfloat16 products")
    n, k = 48, 256
    codes, scale, mins = _weights(n, k, group_size, bits, seed=bits * m)
    packed, sz = qk.group_cpu_pack(codes, scale, mins, bits)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    x[:, ::group_size * 2] *= 1000  # every other group: one large value
    x = x.bfloat16()
    w = _dequantized(codes, scale, mins, group_size)
    got = ops.group_weight_linear(x, packed, sz, group_size, bits, out_float32=True).double()
    rounded = _fixed_point(x, group_size) @ w.T
    assert not torch.equal(_fixed_point(x, group_size), x.double())  # the small ones were rounded
    err = (got - rounded).abs()
    assert (err <= 2 ** -8 * rounded.abs() + 1e-5 * rounded.abs().max()).all()
    exact = x.double() @ w.T
    amax = x.double().view(m, -1, group_size).abs().amax(-1)  # [m, G]
    bound = (amax[:, None, :] * 2.0 ** -14 * w.abs().view(n, -1, group_size).sum(-1)[None]).sum(-1)
    assert ((got - exact).abs() <= bound + 2 ** -8 * exact.abs() + 1e-5 * exact.abs().max()).all()


def test_fixed_point_products_run_where_the_cpu_has_vnni():
    """The build is -march=native: a host whose CPU flags name AVX-512 VNNI (and BF16, for the
    vector kernels at all) takes integer products for bfloat16 calls of 1-4 rows (unless
    TOKENMILL_FIXED_ROWS moves the line)."""
    flags = cpu_flags()
    has = ops.group_linear_fast() and {"avx512_vnni", "avx512_bf16"} <= flags
    assert ops.fixed_point_rows() == (int(os.environ.get("TOKENMILL_FIXED_ROWS", 7)) if has else 0)


def test_tokenmill_fixed_rows_moves_the_line():
    """TOKENMILL_FIXED_ROWS (read once per process): 0 keeps the float products at every row count,
    n takes integer products below n rows."""
    code = "from tests.kernel_utils import require_kernels; print(require_kernels().fixed_point_rows())"
    for value in ("0", "9"):
        env = {**os.environ, "TOKENMILL_FIXED_ROWS": value}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip().splitlines()[-1] == (value if ops.fixed_point_rows() or value == "0" else "0")


def test_fixed_point_products_keep_nan_and_inf():
    """A NaN or infinity in x gives NaN outputs, as the float products do, not silent zeros."""
    if not ops.fixed_point_rows():
        pytest.skip("no AVX-512 VNNI in this build: fewer-row calls keep the bfloat16 products")
    n, k, group_size = 32, 64, 32
    codes, scale, mins = _weights(n, k, group_size, 4, seed=2)
    packed, sz = qk.group_cpu_pack(codes, scale, mins, 4)
    for bad in (float("nan"), float("inf")):
        x = torch.randn(2, k).bfloat16()
        x[1, 40] = bad
        got = ops.group_weight_linear(x, packed, sz, group_size, 4)
        assert torch.isfinite(got[0]).all() and torch.isnan(got[1]).all()


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_int4_shares_the_kernel_and_its_invariance(scale_dtype):
    """int4_weight_linear's w = (q - 8) * scale + zero is the grouped w = q * scale + (zero - 8 scale),
    on both schedules, scales and zeros float32 or kept bfloat16."""
    n, k, group_size = 48, 128, 32
    codes, scale, zero = _weights(n, k, group_size, 4, seed=3)
    scale, zero = scale.to(scale_dtype), zero.to(scale_dtype)
    packed, sz = qk.int4_cpu_pack(qk.pack_nibbles(codes), scale, zero)
    assert sz.dtype == scale_dtype
    x = torch.randn(40, k).bfloat16()
    w = _dequantized(codes, scale, zero.double() - 8 * scale.double(), group_size)
    _check(ops.int4_weight_linear(x, packed, sz, group_size), x.double() @ _as_called(w, 40, torch.bfloat16).T,
           torch.bfloat16)
    vector = ops.KernelPath.VECTOR  # both schedules of the vector path (40 rows: dequantized weights, AMX tiles)
    together = ops.int4_weight_linear(x, packed, sz, group_size, path=vector)
    _check(together, x.double() @ w.T, torch.bfloat16)
    for i in (0, 21, 39):
        assert torch.equal(ops.int4_weight_linear(x[i:i + 1], packed, sz, group_size, path=vector)[0], together[i])


def test_five_bit_layout_round_trips_and_keeps_the_file_size():
    """bits 5: nibble chunks and, after every 4, a chunk of fifth bits: 5/8 of a byte per code."""
    from tokenmill.quantization.grouped import unpack_grouped

    n, k, group_size = 48, 128, 32
    codes, scale, mins = _weights(n, k, group_size, 5, seed=12)
    packed, sz = qk.group_cpu_pack(codes, scale, mins, 5)
    assert packed.shape == (3, 5 * k // 16, 32) and packed.numel() == n * k * 5 // 8
    back = unpack_grouped(packed, sz, n, 5)
    assert torch.equal(back.codes, codes) and torch.equal(back.scale, scale) and back.group_size == group_size
    with pytest.raises(ValueError, match="bits 5 needs K a multiple of 16"):
        qk.group_cpu_pack(codes[:, :120], torch.zeros(n, 15), torch.zeros(n, 15), 5)


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_layout_round_trip(bits):
    n, k, group_size = 32, 64, 16
    codes, scale, mins = _weights(n, k, group_size, bits, seed=4)
    packed, sz = qk.group_cpu_pack(codes, scale, mins, bits)
    assert packed.dtype == torch.uint8 and sz.dtype == torch.float32 and sz.shape == (2, 4, 2, 16)
    if bits == 4:
        assert packed.shape == (2, 16, 32)
        # chunk c of tile t, byte 2r + j: code[16t + r, 4c + j] low nibble, code[16t + r, 4c + 2 + j] high
        q = torch.stack((packed & 15, packed >> 4), dim=-1).view(2, 16, 16, 2, 2)  # t, c, r, j, nibble
        back = q.permute(0, 2, 1, 4, 3).reshape(n, k)
    else:
        assert packed.shape == (2, 32, 32)
        # chunk c of tile t, byte 2r + j: code[16t + r, 2c + j]
        back = packed.view(2, 32, 16, 2).permute(0, 2, 1, 3).reshape(n, k)
    assert torch.equal(back, codes)
    assert torch.equal(sz[1, 2, 0], scale[16:, 2]) and torch.equal(sz[0, 3, 1], mins[:16, 3])
    assert torch.equal(qk.group_cpu_pack(codes, scale, mins, bits)[0], packed)  # deterministic


def test_bad_shapes_are_rejected():
    codes, scale, mins = _weights(16, 64, 32, 8, seed=6)
    packed, sz = qk.group_cpu_pack(codes, scale, mins, 8)
    x = torch.zeros(1, 64).bfloat16()
    with pytest.raises(RuntimeError, match="bits must be 4, 5, 7 or 8"):
        ops.group_weight_linear(x, packed, sz, 32, 6)
    with pytest.raises(RuntimeError, match="columns"):
        ops.group_weight_linear(torch.zeros(1, 32).bfloat16(), packed, sz, 32, 8)
    with pytest.raises(RuntimeError, match="columns"):  # an 8-bit weight read as 4-bit
        ops.group_weight_linear(x, packed, sz, 32, 4)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.group_weight_linear(torch.zeros(1, 64, dtype=torch.float16), packed, sz, 32, 8)
    with pytest.raises(RuntimeError, match="whole number of groups"):
        ops.group_weight_linear(x, packed, sz, 48, 8)
    with pytest.raises(RuntimeError, match="group_size must be a positive multiple of 2"):
        ops.group_weight_linear(x, packed, sz, 0, 8)
    with pytest.raises(RuntimeError, match=r"scales and mins must be \[N / 16, K / group_size, 2, 16\]"):
        ops.group_weight_linear(x, packed, sz, 16, 8)
    with pytest.raises(RuntimeError, match="scales and mins must be float32"):
        ops.group_weight_linear(x, packed, sz.bfloat16(), 32, 8)
    with pytest.raises(RuntimeError, match="packed weight must be uint8"):
        ops.group_weight_linear(x, packed.view(torch.int8), sz, 32, 8)
    with pytest.raises(ValueError, match="multiple of 16"):
        qk.group_cpu_pack(codes[:8], scale[:8], mins[:8], 8)
    with pytest.raises(ValueError, match=r"in 0\.\.15"):
        qk.group_cpu_pack(codes, scale, mins, 4)
    with pytest.raises(ValueError, match=r"bits 7 codes must be in 0\.\.127"):
        qk.group_cpu_pack(codes | 128, scale, mins, 7)
    with pytest.raises(ValueError, match="bits must be 4, 5, 7 or 8"):
        qk.group_cpu_pack(codes, scale, mins, 6)
    with pytest.raises(ValueError, match="groups of a multiple of 4"):
        qk.group_cpu_pack(codes & 15, torch.zeros(16, 32), torch.zeros(16, 32), 4)  # group_size 2
    with pytest.raises(ValueError, match="both be"):
        qk.group_cpu_pack(codes, scale, mins[:, :1], 8)


def test_group_weight_mm_needs_the_kernels(monkeypatch):
    codes, scale, mins = _weights(16, 64, 32, 4, seed=7)
    packed, sz = qk.group_cpu_pack(codes, scale, mins, 4)
    monkeypatch.setattr(dispatch, "cpu_ops", lambda: None)
    with pytest.raises(RuntimeError, match="CPU kernels"):
        qk.group_weight_mm(torch.zeros(1, 64), packed, sz, 32, 4)


@pytest.mark.parametrize("bits", [4, 5, 7, 8])
@pytest.mark.parametrize("m", [1, 3, 20])
def test_decode_stack_linear_matches_group_weight_mm(m, bits):
    """A GROUPED Linear (what DecodeStack.run multiplies by) pads x to in_features, cuts the padded
    rows and adds the bias, around the very same kernel call."""
    out_features, k, group_size = 40, 96, 32  # N padded to 48 rows; x given 90 columns, padded to 96
    codes, scale, mins = _weights(48, k, group_size, bits, seed=m)
    codes[out_features:], scale[out_features:], mins[out_features:] = 0, 0, 0
    packed, sz = qk.group_cpu_pack(codes, scale, mins, bits)
    bias = torch.randn(out_features).bfloat16()
    spec = CpuLinearSpec(kind=LinearKind.GROUPED, weight=packed, out_features=out_features, in_features=k,
                         scales=sz, bias=bias, group_size=group_size, bits=bits)
    native = spec.native(ops)
    assert native.kind == ops.LinearKind.GROUPED and (native.bits, native.group_size) == (bits, group_size)
    x = torch.randn(m, 90).bfloat16()
    expected = qk.group_weight_mm(torch.nn.functional.pad(x, (0, k - 90)), packed, sz, group_size, bits)
    assert torch.equal(native(x), expected[:, :out_features] + bias)


def test_grouped_linear_checks_its_fields():
    codes, scale, mins = _weights(16, 64, 32, 8, seed=8)
    packed, sz = qk.group_cpu_pack(codes, scale, mins, 8)
    kw = dict(kind=ops.LinearKind.GROUPED, weight=packed, out_features=16, in_features=64)
    with pytest.raises(RuntimeError, match="bits 4, 5, 7 or 8"):
        ops.Linear(**kw, scales=sz, group_size=32)
    with pytest.raises(RuntimeError, match="scales"):
        ops.Linear(**kw, group_size=32, bits=8)
    with pytest.raises(RuntimeError, match="group_size"):
        ops.Linear(**kw, scales=sz, group_size=48, bits=8)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m", [1, 5, 33])
def test_float16_scales_where_exact_give_the_same_bits(m, bits):
    """Scales and mins that are all float16 values (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0's d and m) are
    packed as float16, half the bytes per group; the products are the very same float32 sums."""
    n, k, group_size = 48, 128, 32
    codes, scale, mins = _weights(n, k, group_size, bits, seed=11)
    scale, mins = scale.half().float(), mins.half().float()  # every value a float16 exactly
    packed, sz = qk.group_cpu_pack(codes, scale, mins, bits)
    assert sz.dtype == torch.float16
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(12)).to(torch.bfloat16)
    got = qk.group_weight_mm(x, packed, sz, group_size, bits)
    assert torch.equal(got, qk.group_weight_mm(x, packed, sz.float(), group_size, bits))
    _check(got, x.double() @ _as_called(_dequantized(codes, scale, mins, group_size), m, torch.bfloat16).T,
           torch.bfloat16)
    inexact = scale.clone()
    inexact[0, 0] += 2 ** -20  # one value off the float16 grid: all kept in float32
    assert qk.group_cpu_pack(codes, inexact, mins, bits)[1].dtype == torch.float32


def _gguf_like(n: int, k: int, bits: int, symmetric: bool, seed: int):
    """Codes with float16 scales and mins (Q4_0 .. Q8_0's d and m), min -o * scale where symmetric."""
    codes, scale, mins = _weights(n, k, 32, bits, seed)
    scale = scale.half().float()
    mins = -qk.CODE_OFFSETS[bits] * scale if symmetric else mins.half().float()
    return codes, scale, mins


@pytest.mark.parametrize("symmetric", [False, True], ids=["asymmetric", "symmetric"])
@pytest.mark.parametrize("bits", [4, 5, 7, 8])
def test_many_rows_are_the_bfloat16_gemm_over_the_dequantized_weights(bits, symmetric):
    """Calls of dequant_rows() rows or more (bfloat16 x, fastest path): bit for bit bf16_packed_linear
    over the weights dequantized in float32 and rounded to bfloat16 (what `--dtype bfloat16` serves
    from the same file), for every layout (scales alone too) and the float32 output of logits;
    within bfloat16 weight rounding of the exact product."""
    n, k = 80, 256  # 5 output tiles: pairs and one alone
    codes, scale, mins = _gguf_like(n, k, bits, symmetric, seed=bits)
    packed, sz = qk.group_cpu_pack(codes, scale, mins, bits)
    w = (codes.float() * scale.repeat_interleave(32, 1) + mins.repeat_interleave(32, 1)).bfloat16()
    dense = ops.bf16_pack(w)
    layouts = [sz, qk.scales_alone(sz, bits)] if symmetric else [sz]
    assert layouts[-1].shape[2] == (1 if symmetric else 2)
    for m in (ops.dequant_rows(), 40, 257):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
        want = ops.bf16_packed_linear(x, dense, n, torch.empty(0))
        for layout in layouts:
            assert torch.equal(ops.group_weight_linear(x, packed, layout, 32, bits), want)
            wide = ops.group_weight_linear(x, packed, layout, 32, bits, out_float32=True)
            assert wide.dtype == torch.float32 and torch.equal(wide, want.float())
        _check(want, x.double() @ w.double().T, torch.bfloat16)


@pytest.mark.parametrize("group_size", [16, 64, 256])
@pytest.mark.parametrize("bits", [4, 5, 7, 8])
def test_many_rows_any_group_size(bits, group_size):
    """Groups of 16 (Q6_K), 64 (tokenmill's int4 default) or a whole row (int8's one scale per
    channel): the weights are made group by group, also when a pair's share is made between the
    previous pair's products; still bf16_packed_linear's bits."""
    n, k = 112, 256
    codes, scale, mins = _weights(n, k, group_size, bits, seed=group_size)
    packed, sz = qk.group_cpu_pack(codes, scale, mins, bits)
    w = (codes.float() * scale.repeat_interleave(group_size, 1) + mins.repeat_interleave(group_size, 1)).bfloat16()
    for m in (ops.dequant_rows(), 100):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
        assert torch.equal(ops.group_weight_linear(x, packed, sz, group_size, bits),
                           ops.bf16_packed_linear(x, ops.bf16_pack(w), n, torch.empty(0)))


@pytest.mark.parametrize("m,k,n", [(2100, 256, 1040), (600, 1024, 272), (24, 512, 20480), (300, 2048, 2080)])
def test_many_rows_past_l2_go_in_row_chunks_and_weight_panels(m, k, n):
    """x past L2's share (over 1 MB): rows in chunks of 128 over the panel's tile pairs; a thread's
    weights past 8 MB (the last two): panels of a few tile pairs, one after another; a short last
    row tile: still bf16_packed_linear's bits."""
    codes, scale, mins = _gguf_like(n, k, 4, False, seed=m)
    packed, sz = qk.group_cpu_pack(codes, scale, mins, 4)
    w = (codes.float() * scale.repeat_interleave(32, 1) + mins.repeat_interleave(32, 1)).bfloat16()
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(0)).bfloat16()
    assert torch.equal(ops.group_weight_linear(x, packed, sz, 32, 4),
                       ops.bf16_packed_linear(x, ops.bf16_pack(w), n, torch.empty(0)))


def test_int4_many_rows_are_the_bfloat16_gemm_over_its_weights():
    """int4_weight_linear's w = (q - 8) * scale + zero (bfloat16 scales), dequantized the same way."""
    n, k = 48, 256
    codes, scale, zero = _weights(n, k, 32, 4, seed=4)
    scale, zero = scale.bfloat16(), zero.bfloat16()
    packed, sz = qk.int4_cpu_pack(qk.pack_nibbles(codes), scale, zero)
    w = ((codes.float() - 8) * scale.float().repeat_interleave(32, 1) + zero.float().repeat_interleave(32, 1))
    x = torch.randn(64, k).bfloat16()
    want = ops.bf16_packed_linear(x, ops.bf16_pack(w.bfloat16()), n, torch.empty(0))
    assert torch.equal(ops.int4_weight_linear(x, packed, sz, 32), want)


def test_dequantized_many_rows_on_every_fast_build():
    """Every build with the fast path dequantizes from 24 rows (unless TOKENMILL_DEQUANT_ROWS moves
    the line): the speed of many-row calls does not hang on a host having AMX."""
    want = int(os.environ.get("TOKENMILL_DEQUANT_ROWS", 24)) if ops.group_linear_fast() else 0
    assert ops.dequant_rows() == want


_VECTOR_CHILD = """
import torch
from tests.kernel_utils import require_kernels
from tokenmill.quantization import kernels as qk
ops = require_kernels()
g = torch.Generator().manual_seed(0)
codes = torch.randint(0, 16, (48, 128), generator=g, dtype=torch.uint8)
scale = (torch.rand(48, 4, generator=g) * 0.02).half().float()
mins = (torch.randn(48, 4, generator=g) * 0.1).half().float()
packed, sz = qk.group_cpu_pack(codes, scale, mins, 4)
w = (codes.float() * scale.repeat_interleave(32, 1) + mins.repeat_interleave(32, 1)).bfloat16()
x = torch.randn(30, 128, generator=g).bfloat16()
same = torch.equal(ops.group_weight_linear(x, packed, sz, 32, 4),
                   ops.bf16_packed_linear(x, ops.bf16_pack(w), 48, torch.empty(0)))
print(ops.amx_tiles(), ops.dequant_rows(), same)
"""


@pytest.mark.parametrize("env,want", [({"TOKENMILL_AMX": "0"}, "False 24 True"),
                                      ({"TOKENMILL_DEQUANT_ROWS": "0"}, "0 False"),
                                      ({"TOKENMILL_DEQUANT_ROWS": "31"}, "31 False")])
def test_dequantized_rows_on_vectors_and_tokenmill_dequant_rows(env, want):
    """Without AMX tiles (TOKENMILL_AMX=0 here: the arithmetic of hosts without them) the dequantized
    weights go through bf16_linear.cpp's vector GEMM, again bit for bit; TOKENMILL_DEQUANT_ROWS (read
    once per process) moves the line, 0 turns it off (30 rows then keep the group-by-group sums)."""
    if not ops.group_linear_fast():
        pytest.skip("no AVX-512 BF16 fast path in this build: nothing is dequantized")
    child_env = {k: v for k, v in os.environ.items() if k not in ("TOKENMILL_AMX", "TOKENMILL_DEQUANT_ROWS")}
    out = subprocess.run([sys.executable, "-c", _VECTOR_CHILD], env={**child_env, **env}, capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip().splitlines()[-1].endswith(want)
