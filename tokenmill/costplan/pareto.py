"""The cost-latency trade-off: which configurations are worth considering, and which one to pick.

A point is a (cost, latency) pair; lower is better on both axes. Point ``a`` dominates ``b`` when
it is no worse on either axis and better on at least one:

    a.cost <= b.cost and a.latency <= b.latency and (a.cost < b.cost or a.latency < b.latency)

The Pareto frontier is every point no other point dominates. Two identical points do not dominate
each other, so both are on the frontier or neither is. Every point off the frontier has a point
on it that is at least as cheap and at least as fast, so only the frontier is worth a decision.

The configuration to pick is the cheapest that meets the SLO; among equally cheap ones the faster,
then the first given. It need not lie on the (cost, TPOT) frontier: a point dominating it may
miss the TTFT objective.
"""

from __future__ import annotations

from collections.abc import Sequence


def dominates(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Whether ``a`` is no worse than ``b`` on both axes and better on one."""
    return a[0] <= b[0] and a[1] <= b[1] and a != b


def pareto_frontier(points: Sequence[tuple[float, float]]) -> list[bool]:
    """For each (cost, latency) point, whether no other point dominates it."""
    return [not any(dominates(other, point) for other in points) for point in points]


def cheapest_meeting(points: Sequence[tuple[float, float]], meets: Sequence[bool]) -> int | None:
    """Index of the cheapest point that meets the SLO (ties: lower latency, then lower index); None if none does."""
    if len(points) != len(meets):
        raise ValueError(f"{len(points)} points but {len(meets)} SLO verdicts")
    eligible = [i for i, ok in enumerate(meets) if ok]
    return min(eligible, key=lambda i: (points[i][0], points[i][1], i)) if eligible else None
