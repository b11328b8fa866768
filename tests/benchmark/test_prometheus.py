"""Server-side means from two Prometheus scrapes: sums and counts over all label sets."""

from __future__ import annotations

import pytest

from tokenmill.benchmark.prometheus import agreement, histogram_totals, server_means

BEFORE = """# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 1.0
vllm:time_to_first_token_seconds_sum{model_name="m"} 0.5
vllm:time_to_first_token_seconds_count{model_name="m"} 2.0
vllm:num_requests_running{model_name="m"} 0.0
"""
AFTER = """vllm:time_to_first_token_seconds_sum{model_name="m"} 2.5
vllm:time_to_first_token_seconds_count{model_name="m"} 10.0
vllm:time_to_first_token_seconds_sum{model_name="other"} 1.0
vllm:time_to_first_token_seconds_count{model_name="other"} 2.0
tokenmill:time_per_output_token_seconds_sum{model_name="m"} 0.3
tokenmill:time_per_output_token_seconds_count{model_name="m"} 10
"""


def test_totals_add_up_label_sets_and_skip_other_lines() -> None:
    totals = histogram_totals(AFTER)
    assert totals["vllm:time_to_first_token_seconds"] == (3.5, 12.0)
    assert "vllm:num_requests_running" not in histogram_totals(BEFORE)


def test_means_over_the_requests_between_the_scrapes() -> None:
    means = server_means(BEFORE, AFTER)
    assert means["ttft"]["count"] == 10 and means["ttft"]["mean_ms"] == pytest.approx(3000 / 10)
    assert means["tpot"]["mean_ms"] == pytest.approx(30.0)  # absent before: counted from zero
    assert "e2el" not in means
    both = agreement(means, {"ttft": 330.0, "tpot": None})
    assert both["ttft"]["client_over_server"] == pytest.approx(1.1)
    assert both["tpot"]["client_over_server"] is None


def test_no_new_observations_gives_no_mean() -> None:
    assert server_means(BEFORE, BEFORE)["ttft"] == {"histogram": "vllm:time_to_first_token_seconds", "count": 0,
                                                    "mean_ms": None}
