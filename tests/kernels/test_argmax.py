"""argmax_rows (argmax.cpp), greedy sampling's argmax: torch.argmax(x, -1)'s index on every row,
ties, NaN, infinities and signed zeros included, on both paths; the sampler uses it."""

from __future__ import annotations

import pytest
import torch

from tests.kernel_utils import require_kernels
from tokenmill.engine import sampler

ops = require_kernels()
PATHS = ["FASTEST", "PORTABLE"]


def _check(x: torch.Tensor) -> None:
    want = x.argmax(-1)
    for path in PATHS:
        got = ops.argmax_rows(x, path=ops.KernelPath[path])
        assert got.dtype == torch.int64 and torch.equal(got, want), path


@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 100, 49152, 262144 + 5])
def test_random_rows_match_torch(vocab):
    _check(torch.randn(5, vocab, generator=torch.Generator().manual_seed(vocab)))


def test_ties_nan_infinities_and_zeros_as_torch():
    v = 70
    x = torch.randn(10, v, generator=torch.Generator().manual_seed(0))
    x[0, [3, 40, 69]] = 9.0                        # ties: the lowest index
    x[1, 50] = float("nan")                        # NaN beats every number
    x[2, [20, 60]] = float("nan")                  # the first NaN
    x[2, 10] = float("inf")
    x[3] = float("-inf")                           # all -inf: index 0
    x[4] = -1.0
    x[4, 33] = float("inf")
    x[5] = torch.where(torch.arange(v) % 2 == 0, torch.tensor(-0.0), torch.tensor(-1.0))
    x[5, 17] = 0.0                                 # -0.0 == 0.0: the first zero (index 0)
    x[6, 65] = float("nan")                        # a NaN in the tail of 16
    x[7, -1] = 100.0                               # the maximum last
    x[8] = float("-inf")
    x[8, 68] = -1e30
    _check(x)


def test_one_row_split_among_threads_finds_the_first_of_equals_and_the_first_nan():
    """A single row (a batch-1 step) is searched in parts, one per thread: ties and NaNs that fall
    in different parts, and a largest value only in the last part's short tail, as torch finds them."""
    v = 262144 + 37
    x = torch.randn(1, v, generator=torch.Generator().manual_seed(1))
    for where in ([5, v // 2 + 3], [v // 2 + 3, v - 1], [v - 1], [0], [v // 2 - 1, v // 2]):
        row = x.clone()
        row[0, where] = 50.0
        _check(row)
    for where in ([v - 2], [7, v - 2], [v // 2 + 1]):
        row = x.clone()
        row[0, where] = float("nan")
        row[0, 3] = float("inf")
        _check(row)
    _check(torch.full((1, v), float("-inf")))
    for row in torch.randn(4, 8200, generator=torch.Generator().manual_seed(2)):
        _check(row[None])


def test_non_contiguous_rows_and_bad_input():
    x = torch.randn(6, 64)[::2]
    _check(x)
    _check(torch.empty(0, 64))  # a step that samples nothing
    with pytest.raises(RuntimeError, match="float32"):
        ops.argmax_rows(torch.randn(2, 8).bfloat16())
    with pytest.raises(RuntimeError, match="float32"):
        ops.argmax_rows(torch.randn(8))
    with pytest.raises(RuntimeError, match="no columns"):
        ops.argmax_rows(torch.empty(2, 0))


def test_the_sampler_takes_the_kernel(monkeypatch):
    """Greedy rows go through argmax_rows (same index as torch.argmax)."""
    calls = []
    real = ops.argmax_rows
    monkeypatch.setattr(sampler.dispatch, "for_tensors", lambda *t: _Spy(real, calls))
    x = torch.randn(3, 1000)
    assert torch.equal(sampler.argmax_rows(x), x.argmax(-1))
    assert len(calls) == 1
    assert torch.equal(sampler.argmax_rows(x.bfloat16()), x.bfloat16().argmax(-1))  # PyTorch's
    assert len(calls) == 1


class _Spy:
    def __init__(self, real, calls):
        self.real, self.calls = real, calls

    def argmax_rows(self, x):
        self.calls.append(x.shape)
        return self.real(x)
