"""Autoscaling on what an LLM replica's load really is: its queue of sequences and its TTFT.

Ray Serve's default policy scales on ongoing requests per replica, which fits LLMs badly (a
request can be 10 tokens or 10,000; ray-llm#133). Each replica reports, through Ray Serve's
custom autoscaling metrics (``EngineReplica.record_autoscaling_stats``):

    queue      sequences running or waiting in its engine
    ttft_p90   the 90th percentile time to first token of its last 64 requests (seconds)

and :func:`queue_and_ttft_policy` (Ray's controller runs it; Ray applies the min/max bounds and
the upscale/downscale delays around it) asks for

    ceil(total queue / target_queue) replicas, and one more than now while any replica's TTFT
    p90 is over ``slo_ttft`` (a queue can look short while its prompts are long)

Scale-down drains: Ray Serve stops routing to a replica it removes and waits for its ongoing
requests up to ``graceful_shutdown_timeout_s`` (the server's ``--drain-timeout``).
"""

from __future__ import annotations

import math
from typing import Any


def queue_and_ttft_policy(ctx: Any, target_queue: float = 4.0, slo_ttft: float | None = None
                          ) -> tuple[int, dict[str, Any]]:
    """Ray Serve custom autoscaling policy: ``ctx`` is ray.serve.config.AutoscalingContext."""
    metrics = ctx.aggregated_metrics or {}
    current = max(ctx.current_num_replicas, 1)
    queues = metrics.get("queue") or {}
    queue = sum(queues.values()) if queues else float(ctx.total_num_requests or 0)
    desired = math.ceil(queue / target_queue) if queue > 0 else 0
    ttfts = metrics.get("ttft_p90") or {}
    slow = slo_ttft is not None and any(value > slo_ttft for value in ttfts.values())
    if slow:
        desired = max(desired, current + 1)
    desired = min(max(desired, ctx.capacity_adjusted_min_replicas), ctx.capacity_adjusted_max_replicas)
    return desired, {"queue": queue, "ttft_over_slo": slow}


def p90(values: list[float]) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(int(0.9 * len(ordered)), len(ordered) - 1)]
