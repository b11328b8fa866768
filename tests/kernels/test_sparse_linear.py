"""tokenmill's sparse bfloat16 CPU linear (sparse_linear.cpp): its layout, and outputs bit-identical
to the dense packed kernel's vector path (bf16_linear.cpp; AMX hosts run dense on tiles) on the same
zero-containing weight, for every register
block, partial tiles, every sparsity from none to all, bias and float32 output."""

from __future__ import annotations

import pytest
import torch

from tests.kernel_utils import require_kernels
from tokenmill.pruning.sparse_linear import pack, unpack

kernels = require_kernels()
pytestmark = pytest.mark.skipif(not kernels.sparse_linear_fast(),
                                reason="no AVX-512 BF16 + VBMI2 on this CPU: the sparse kernel has no fast path here")


def _pruned(n: int, k: int, sparsity: str, seed: int = 0) -> torch.Tensor:
    """A bfloat16 [n, k] weight with zeros: "0", "0.5" / "0.9" random, "2:4", or "tile" (rows 16-31
    all zero, the rest half zero). Pruned as magnitude pruning does (w *= keep), so that negative
    pruned weights are -0.0."""
    g = torch.Generator().manual_seed(seed + n + k)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).bfloat16()
    if sparsity == "2:4":
        scores = torch.rand(n, k // 4, 4, generator=g)
        keep = torch.zeros_like(scores, dtype=torch.bool).scatter_(2, scores.topk(2, dim=2).indices, True)
        keep = keep.view(n, k)
    elif sparsity == "tile":
        keep = torch.rand(n, k, generator=g) >= 0.5
        keep[16:32] = False
    else:
        keep = torch.rand(n, k, generator=g) >= float(sparsity)
    return w * keep.bfloat16()


def _bits(t: torch.Tensor) -> torch.Tensor:
    """bfloat16 as its bits (torch.equal holds -0.0 == +0.0); other dtypes as they are."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def _x(m: int, k: int) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(m * 31 + k)).bfloat16()


SPARSITIES = ["0", "0.5", "2:4", "0.9", "tile"]


@pytest.mark.parametrize("sparsity", SPARSITIES)
@pytest.mark.parametrize("n,k", [(40, 64), (1000, 576), (48, 1536)])
@pytest.mark.parametrize("m", [1, 3, 5, 12, 13, 17, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_bit_identical_to_the_dense_kernel(m, n, k, sparsity, bias):
    """M 1, 3, 5: 4 tiles at once (the dense kernel: 8, 8, 4), one block of rows; 12, 13, 17, 64: 2 tiles
    at once, 12 rows a block: one block, then a partial one and several; N 40, 1000: tiles left
    over one by one (and a partial last tile)."""
    w = _pruned(n, k, sparsity)
    b = torch.randn(n, generator=torch.Generator().manual_seed(n)).bfloat16() if bias else None
    x = _x(m, k)
    dense = kernels.bf16_packed_linear(x, kernels.bf16_pack(w), n, torch.empty(0) if b is None else b,
                                       path=kernels.KernelPath.VECTOR)
    values, masks, offsets = kernels.sparse_bf16_pack(w)
    got = kernels.sparse_bf16_linear(x, values, masks, offsets, b, n)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    assert torch.equal(_bits(got), _bits(dense))
    # and a correct product at all (not only the same as the dense kernel): float64 reference
    expected = x.double() @ w.double().T + (0 if b is None else b.double())
    assert (got.double() - expected).abs().max() <= 0.02 * expected.abs().max() + 1e-3


@pytest.mark.parametrize("m", [1, 7, 30])
def test_float32_out_is_the_dense_kernels(m):
    w, b = _pruned(300, 576, "0.5"), torch.randn(300).bfloat16()
    x = _x(m, 576)
    got = kernels.sparse_bf16_linear(x, *kernels.sparse_bf16_pack(w), b, 300, out_float32=True)
    want = kernels.bf16_packed_linear(x, kernels.bf16_pack(w), 300, b, out_float32=True,
                                      path=kernels.KernelPath.VECTOR)
    assert got.dtype == torch.float32 and torch.equal(got, want)


def test_layout_matches_the_reference_pack_and_stores_only_nonzeros():
    w = _pruned(1000, 576, "0.5")
    values, masks, offsets = kernels.sparse_bf16_pack(w)
    ref = pack(w)
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip((values, masks, offsets), ref))
    nonzero = int((w != 0).sum())  # -0.0 counts as zero: it is not stored
    assert masks.shape == (63, 288) and offsets.shape == (64,) and int(offsets[-1]) == nonzero
    assert values.numel() == nonzero + 32 and (values[nonzero:] == 0).all()
    assert (values[:nonzero] != 0).all()
    dense = unpack(values, masks, offsets, 1000)
    assert torch.equal(dense, w) and not torch.signbit(dense[dense == 0]).any()


def test_rows_do_not_depend_on_the_batch_nor_the_threads():
    w = _pruned(300, 576, "2:4")
    sparse = kernels.sparse_bf16_pack(w)
    x = _x(37, 576)
    together = kernels.sparse_bf16_linear(x, *sparse, None, 300)
    for i in (0, 5, 36):
        assert torch.equal(kernels.sparse_bf16_linear(x[i:i + 1], *sparse, None, 300)[0], together[i])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(kernels.sparse_bf16_linear(x, *sparse, None, 300), together)
    finally:
        torch.set_num_threads(threads)


def test_bad_input_is_rejected():
    values, masks, offsets = kernels.sparse_bf16_pack(_pruned(40, 64, "0.5"))
    with pytest.raises(RuntimeError, match="even"):
        kernels.sparse_bf16_pack(torch.zeros(16, 47, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="bfloat16"):
        kernels.sparse_bf16_pack(torch.zeros(16, 48))
    with pytest.raises(RuntimeError, match="do not match"):
        kernels.sparse_bf16_linear(torch.zeros(1, 66, dtype=torch.bfloat16), values, masks, offsets, None, 40)
    with pytest.raises(RuntimeError, match="offsets"):
        kernels.sparse_bf16_linear(torch.zeros(1, 64, dtype=torch.bfloat16), values[:8], masks, offsets, None, 40)
    with pytest.raises(RuntimeError, match="bias"):
        kernels.sparse_bf16_linear(torch.zeros(1, 64, dtype=torch.bfloat16), values, masks, offsets,
                                   torch.zeros(3), 40)
