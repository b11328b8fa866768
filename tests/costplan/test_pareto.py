"""The frontier and the pick on synthetic points: exact membership, ties, and no point meeting the SLO;
then the same through make_plan, with costs that follow from the measured time and tokens."""

from __future__ import annotations

import pytest

from tokenmill.benchmark.offline import OfflineConfig
from tokenmill.costplan.config import Candidate, Objectives, SearchSpace
from tokenmill.costplan.measure import Measurement
from tokenmill.costplan.pareto import cheapest_meeting, dominates, pareto_frontier
from tokenmill.costplan.plan import make_plan


def test_dominance_needs_one_strict_improvement() -> None:
    assert dominates((1, 1), (2, 2)) and dominates((1, 2), (1, 3)) and dominates((1, 2), (2, 2))
    assert not dominates((1, 1), (1, 1))  # identical: neither dominates
    assert not dominates((1, 3), (2, 2)) and not dominates((2, 2), (1, 3))  # a trade-off


def test_frontier_membership_is_exact() -> None:
    #        0       1       2       3       4       5       6
    points = [(1, 9), (2, 5), (3, 6), (4, 2), (5, 2), (6, 1), (7, 7)]
    # 2 is beaten by 1 on both axes, 4 by 3 on cost at equal latency, 6 by everything cheaper and faster
    assert pareto_frontier(points) == [True, True, False, True, False, True, False]


def test_ties() -> None:
    # identical points are both on the frontier; equal cost keeps the faster, equal latency the cheaper
    assert pareto_frontier([(2, 3), (2, 3), (2, 4), (5, 3), (1, 8)]) == [True, True, False, False, True]
    assert pareto_frontier([(1.0, 1.0)]) == [True]
    assert pareto_frontier([]) == []


def test_cheapest_meeting_the_slo() -> None:
    points = [(3, 1), (1, 9), (2, 4), (2, 3), (2, 3)]
    assert cheapest_meeting(points, [True, False, True, True, True]) == 3  # cost tie: faster, then first
    assert cheapest_meeting(points, [True, False, True, False, False]) == 2
    assert cheapest_meeting(points, [True, True, True, True, True]) == 1
    assert cheapest_meeting(points, [False] * 5) is None
    with pytest.raises(ValueError):
        cheapest_meeting(points, [True])


def _measurement(seqs: int, seconds: float, tokens: int, ttft_ms: float, tpot_ms: float) -> Measurement:
    dist = lambda ms: {"percentiles": {"p90": ms}}  # noqa: E731
    summary = {"duration_s": seconds, "total_output_tokens": tokens, "requests": 10, "ttft": dist(ttft_ms),
               "tpot": dist(tpot_ms)}
    return Measurement(Candidate("m", "native", seqs, "off"), {"summary": summary, "model": {"name": "m"}})


def test_plan_prices_marks_the_frontier_and_picks() -> None:
    objectives = Objectives(slo_ttft=0.5, slo_tpot=0.05, price_per_hour=3.6)
    # 3.6 per hour is 0.001 per second: 100 s for 1000 tokens is 100 per 1M tokens
    measurements = [_measurement(1, 100.0, 1000, 200, 20),   # 100: on the frontier, meets
                    _measurement(2, 50.0, 1000, 400, 40),    # 50: meets, the pick, but dominated by the next
                    _measurement(4, 20.0, 1000, 900, 30),    # 20: dominates 2 and 8 but misses the TTFT objective
                    _measurement(8, 60.0, 1000, 100, 45)]    # 60: dominated by 2 (and 4), meets
    plan = make_plan(measurements, objectives, SearchSpace(), OfflineConfig())
    assert [p.cost_per_1m_tokens for p in plan.points] == pytest.approx([100, 50, 20, 60])
    assert [p.cost_per_1k_requests for p in plan.points] == pytest.approx([10, 5, 2, 6])
    assert [p.meets_slo for p in plan.points] == [True, True, False, True]
    assert [p.on_frontier for p in plan.points] == [True, False, True, False]
    assert plan.cheapest == 1 and not plan.points[1].on_frontier  # the pick is dominated by a point missing TTFT
    assert [p.candidate.max_num_seqs for p in plan.frontier] == [4, 1]
    data = plan.to_dict()
    assert data["cheapest_meeting_slo"] == "m native seqs=2" and data["frontier"] == ["m native seqs=4", "m native seqs=1"]


def test_plan_with_no_point_meeting_the_slo() -> None:
    plan = make_plan([_measurement(1, 10.0, 100, 900, 90)], Objectives(0.5, 0.05, 1.0), SearchSpace(), OfflineConfig())
    assert plan.cheapest is None and plan.points[0].on_frontier and plan.to_dict()["cheapest_meeting_slo"] is None
