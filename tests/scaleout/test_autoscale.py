"""The autoscaling policy Ray Serve's controller runs (autoscale.py), on contexts as Ray builds them."""

from __future__ import annotations

from types import SimpleNamespace

from tokenmill.scaleout.autoscale import p90, queue_and_ttft_policy


def ctx(queues: dict, ttfts: dict | None = None, current: int = 2, low: int = 1, high: int = 4):
    metrics = {"queue": queues, **({"ttft_p90": ttfts} if ttfts is not None else {})}
    return SimpleNamespace(aggregated_metrics=metrics, current_num_replicas=current, total_num_requests=0,
                           capacity_adjusted_min_replicas=low, capacity_adjusted_max_replicas=high)


def test_replicas_follow_the_engines_queues_within_bounds() -> None:
    assert queue_and_ttft_policy(ctx({"a": 6, "b": 6}), target_queue=4)[0] == 3
    assert queue_and_ttft_policy(ctx({"a": 30, "b": 30}), target_queue=4)[0] == 4  # max
    assert queue_and_ttft_policy(ctx({"a": 0, "b": 1}), target_queue=4)[0] == 1
    assert queue_and_ttft_policy(ctx({"a": 0, "b": 0}), target_queue=4)[0] == 1  # min, never 0 here
    assert queue_and_ttft_policy(ctx({}, current=1, low=0), target_queue=4)[0] == 0


def test_a_slow_first_token_asks_for_one_more_replica_even_with_short_queues() -> None:
    slow = ctx({"a": 1, "b": 1}, {"a": 0.2, "b": 3.5})
    assert queue_and_ttft_policy(slow, target_queue=4, slo_ttft=2.0) == (3, {"queue": 2, "ttft_over_slo": True})
    assert queue_and_ttft_policy(slow, target_queue=4, slo_ttft=5.0)[0] == 1
    assert queue_and_ttft_policy(slow, target_queue=4)[0] == 1


def test_p90() -> None:
    assert p90([]) == 0.0
    assert p90([float(i) for i in range(1, 11)]) == 10.0
    assert p90([float(i) for i in range(100)]) == 90.0
