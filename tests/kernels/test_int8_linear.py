"""tokenmill's CPU weight-only int8 linear kernel against a float64 reference and PyTorch's."""

from __future__ import annotations

import pytest
import torch

from tests.kernel_utils import require_kernels

kernels = require_kernels()


@pytest.mark.parametrize("n,k", [(100, 48), (1536, 576), (37, 1536), (16, 16)])
@pytest.mark.parametrize("m", [1, 5, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", ["FASTEST", "PORTABLE"], ids=["avx512", "portable"])
def test_matches_float64_reference(path, dtype, m, n, k):
    g = torch.Generator().manual_seed(n + m)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    scale = (torch.rand(n, generator=g) * 0.02 + 1e-3).to(dtype)
    x = torch.randn(m, k, generator=g).to(dtype)
    expected = x.double() @ (w.double() * scale.double()[:, None]).T
    got = kernels.int8_weight_linear(x, w, scale, path=kernels.KernelPath[path])
    assert got.dtype == dtype and got.shape == (m, n)
    rel = (got.double() - expected).abs().max() / expected.abs().max()
    assert rel <= (1e-6 if dtype == torch.float32 else 8e-3)  # bf16: the output's own rounding (2^-8)


def test_rows_do_not_depend_on_the_batch():
    """Each row's result is the same alone or among others (batch invariance of decode)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randint(-127, 128, (300, 576), dtype=torch.int8, generator=g)
    scale = torch.rand(300, generator=g).bfloat16()
    x = torch.randn(9, 576, generator=g).bfloat16()
    together = kernels.int8_weight_linear(x, w, scale)
    for i in range(9):
        assert torch.equal(kernels.int8_weight_linear(x[i:i + 1], w, scale)[0], together[i])


def test_bad_input_is_rejected():
    w = torch.zeros(16, 48, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        kernels.int8_weight_linear(torch.zeros(1, 40), torch.zeros(16, 40, dtype=torch.int8), torch.ones(16))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernels.int8_weight_linear(torch.zeros(1, 48), w, torch.ones(16, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="int8"):
        kernels.int8_weight_linear(torch.zeros(1, 48), w.float(), torch.ones(16))
