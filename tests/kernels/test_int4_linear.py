"""tokenmill's CPU weight-only int4 linear kernel against a float64 reference, its portable path,
and batch invariance; the layout built by int4_cpu_pack."""

from __future__ import annotations

import pytest
import torch

from tests.kernel_utils import require_kernels
from tokenmill.kernels.linear_spec import LinearKind
from tokenmill.quantization import kernels as qk
from tokenmill.quantization.linear import Int4Linear

ops = require_kernels()
pytestmark = pytest.mark.skipif(not ops.int4_linear_fast(),
                                reason="no AVX-512 BF16 on this CPU: the int4 kernel has no fast path here")


def _linear(n: int, k: int, group_size: int, dtype: torch.dtype, seed: int) -> Int4Linear:
    g = torch.Generator().manual_seed(seed)
    return Int4Linear.from_float(torch.randn(n, k, generator=g), None, dtype, group_size)


@pytest.mark.parametrize("n,k,group_size", [(960, 576, 32), (48, 64, 32), (3072, 576, 64), (576, 1536, 128),
                                            (32, 112, 32)])
@pytest.mark.parametrize("m", [1, 3, 4, 9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("path", ["FASTEST", "PORTABLE"], ids=["avx512", "portable"])
def test_matches_float64_reference(path, dtype, m, n, k, group_size):
    lin = _linear(n, k, group_size, dtype, n + k + m)
    x = torch.randn(m, lin.padded_in, generator=torch.Generator().manual_seed(m)).to(dtype)
    x[:, k:] = 0  # the padded columns of a K that is not a whole number of groups
    expected = x.double() @ torch.nn.functional.pad(lin.dequantize().double(), (0, lin.padded_in - k)).T
    spec = lin.cpu_kernel_spec()
    got = ops.int4_weight_linear(x, spec.weight, spec.scales, group_size, path=ops.KernelPath[path])
    assert got.dtype == dtype and got.shape == (m, n)
    rel = ((got.double() - expected).abs().max() / expected.abs().max()).item()
    # float32: x kept to about 16 bits (bfloat16 high + low parts); bfloat16: the output's rounding
    assert rel <= (5e-5 if dtype == torch.float32 else 8e-3)


def test_module_forward_uses_it_and_matches_dequantized_weights():
    lin = _linear(100, 112, 32, torch.bfloat16, 0)  # N padded to 112 rows, K to 128 columns
    spec = lin.cpu_kernel_spec()
    assert spec is not None and spec.kind is LinearKind.INT4 and spec.weight.shape == (7, 32, 32)
    assert (spec.out_features, spec.in_features, spec.group_size) == (100, 128, 32)
    x = torch.randn(5, 112).bfloat16()
    expected = x.double() @ lin.dequantize().double().T
    got = lin(x)
    assert got.shape == (5, 100)
    assert ((got.double() - expected).abs().max() / expected.abs().max()).item() <= 8e-3


def test_rows_do_not_depend_on_the_batch_or_threads():
    lin = _linear(300 // 16 * 16, 576, 32, torch.bfloat16, 1)
    x = torch.randn(9, 576).bfloat16()
    spec = lin.cpu_kernel_spec()
    vector = ops.KernelPath.VECTOR  # AMX hosts run 9 rows on tiles, 1 row on vectors (test_group_linear)
    together = ops.int4_weight_linear(x, spec.weight, spec.scales, 32, path=vector)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for i in range(9):
            alone = ops.int4_weight_linear(x[i:i + 1], spec.weight, spec.scales, 32, path=vector)
            assert torch.equal(alone[0], together[i])
    finally:
        torch.set_num_threads(threads)


def test_pack_layout():
    """Chunk c of tile t, byte 2r + j: q[16t + r, 4c + j] low nibble, q[16t + r, 4c + 2 + j] high."""
    q = torch.randint(0, 16, (32, 64), generator=torch.Generator().manual_seed(3))
    scale, zero = torch.rand(32, 2).bfloat16(), torch.rand(32, 2).bfloat16()
    weight, sz = qk.int4_cpu_pack(qk.pack_nibbles(q), scale, zero)
    assert weight.shape == (2, 16, 32) and sz.shape == (2, 2, 2, 16) and sz.dtype == torch.bfloat16
    for t, c, r, j in [(0, 0, 0, 0), (1, 5, 7, 1), (1, 15, 15, 0), (0, 9, 3, 1)]:
        byte = int(weight[t, c, 2 * r + j])
        assert byte & 15 == q[16 * t + r, 4 * c + j] and byte >> 4 == q[16 * t + r, 4 * c + 2 + j]
    assert torch.equal(sz[1, 0, 0], scale[16:, 0]) and torch.equal(sz[0, 1, 1], zero[:16, 1])


def test_bad_input_is_rejected():
    lin = _linear(16, 64, 32, torch.bfloat16, 2)
    spec = lin.cpu_kernel_spec()
    w, sz = spec.weight, spec.scales
    with pytest.raises(RuntimeError, match="columns"):
        ops.int4_weight_linear(torch.zeros(1, 32).bfloat16(), w, sz, 32)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.int4_weight_linear(torch.zeros(1, 64, dtype=torch.float16), w, sz, 32)
    with pytest.raises(RuntimeError, match="scales_zeros"):
        ops.int4_weight_linear(torch.zeros(1, 64).bfloat16(), w, sz, 16)
