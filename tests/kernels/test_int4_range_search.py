"""int4_range_search (int4_search.cpp), the CPU form of int4_search_params: on heavy-tailed weights
it picks the parameters PyTorch's search picks (the same candidates, sums in another order: only
near-ties may go the other way), with and without importance, for each output dtype."""

from __future__ import annotations

import pytest
import torch

from tests.kernel_utils import require_kernels
from tests.quantization.test_int4_search import heavy_tailed_groups
from tokenmill.quantization import linear

ops = require_kernels()


def pytorch_search(w, dtype, importance, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(linear.dispatch, "for_tensors", lambda *tensors: None)
        return linear.int4_search_params(w, dtype, importance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("size", [32, 64, 100])
@pytest.mark.parametrize("weighted", [False, True])
def test_kernel_picks_what_pytorch_picks(dtype, size, weighted, monkeypatch):
    w = heavy_tailed_groups(96, 8, size, seed=size)
    importance = torch.rand(1, 8, size, generator=torch.Generator().manual_seed(1)) ** 4 if weighted else None
    scale, zero = linear.int4_search_params(w, dtype, importance)
    assert scale.dtype == zero.dtype == dtype and scale.shape == zero.shape == (96, 8)
    want_scale, want_zero = pytorch_search(w, dtype, importance, monkeypatch)
    got = linear.int4_group_error(w, scale, zero, importance)
    want = linear.int4_group_error(w, want_scale, want_zero, importance)
    plain = linear.int4_group_error(w, *linear.int4_group_params(w, dtype), importance)
    assert (got <= plain).all()  # min-max stays a candidate
    assert torch.allclose(got.sum(), want.sum(), rtol=1e-4)
    if dtype != torch.float32:  # a refit rounded to 16 bits lands on the same value whichever way it was summed
        same = ((scale == want_scale) & (zero == want_zero)).float().mean().item()
        assert same >= 0.99, same


def test_importance_per_row_and_constant_groups():
    """importance with w's own shape (not broadcast) weights each row by its own columns; a constant
    group keeps its value exactly."""
    w = heavy_tailed_groups(4, 2, 32, seed=3)
    w[0, 0] = 0.25
    importance = torch.ones_like(w)
    importance[1, :, :16] = 1e-6  # row 1 cares only about its second half
    scale, zero = linear.int4_search_params(w, torch.float32, importance)
    assert linear.int4_group_error(w[0, 0], scale[0, 0], zero[0, 0]).item() < 1e-12
    unweighted = linear.int4_search_params(w, torch.float32)
    half = importance[1:2].clone()
    half[..., 16:] = 1.0
    assert (linear.int4_group_error(w[1:2], scale[1:2], zero[1:2], half)
            <= linear.int4_group_error(w[1:2], unweighted[0][1:2], unweighted[1][1:2], half) * (1 + 1e-5)).all()


def test_bad_arguments_are_named():
    trims = torch.tensor(linear.RANGE_TRIMS)
    with pytest.raises(RuntimeError, match="float32 \\[groups, group_size\\]"):
        ops.int4_range_search(torch.zeros(4, 8, dtype=torch.float64), None, trims, 0)
    with pytest.raises(RuntimeError, match="importance must be float32 of w's shape"):
        ops.int4_range_search(torch.zeros(4, 8), torch.zeros(1, 8), trims, 0)
    with pytest.raises(RuntimeError, match="dtype must be 0"):
        ops.int4_range_search(torch.zeros(4, 8), None, trims, 3)
