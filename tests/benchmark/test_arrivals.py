"""Arrival processes: mean rate, burstiness (coefficient of variation) and seeded reproducibility."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tokenmill.benchmark.arrivals import ArrivalProcess
from tokenmill.errors import InvalidParameterError

N = 20_000


@pytest.mark.parametrize("rate", [0.5, 4.0, 100.0])
def test_poisson_arrivals_have_the_requested_mean_rate_and_exponential_gaps(rate) -> None:
    gaps = np.diff(ArrivalProcess(rate, 1.0, seed=3).offsets(N))
    assert 1 / gaps.mean() == pytest.approx(rate, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV = 1
    assert (gaps > 0).all()


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_burstiness_keeps_the_rate_and_sets_the_coefficient_of_variation(burstiness) -> None:
    gaps = np.diff(ArrivalProcess(8.0, burstiness, seed=1).offsets(N))
    assert 1 / gaps.mean() == pytest.approx(8.0, rel=0.04)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.06)


def test_same_seed_same_arrivals_other_seed_other_arrivals() -> None:
    a, b = ArrivalProcess(2.0, 1.0, seed=7).offsets(500), ArrivalProcess(2.0, 1.0, seed=7).offsets(500)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, ArrivalProcess(2.0, 1.0, seed=8).offsets(500))
    assert a[0] == 0.0 and (np.diff(a) > 0).all()


def test_infinite_rate_sends_everything_at_once() -> None:
    assert ArrivalProcess().offsets(10).tolist() == [0.0] * 10


@pytest.mark.parametrize("rate, burstiness", [(0.0, 1.0), (-1.0, 1.0), (1.0, 0.0), (float("nan"), 1.0)])
def test_rejects_bad_parameters(rate, burstiness) -> None:
    with pytest.raises(InvalidParameterError):
        ArrivalProcess(rate, burstiness)
