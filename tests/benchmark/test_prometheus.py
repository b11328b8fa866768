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


def test_speculative_counters_between_the_scrapes_under_any_prefix() -> None:
    from tokenmill.benchmark.prometheus import speculative_stats

    def scrape(prefix: str, drafts: int, drafted: int, kept: int, per_pos: list[int]) -> str:
        lines = [f'{prefix}:spec_decode_num_drafts_total{{model_name="m"}} {drafts}',
                 f'{prefix}:spec_decode_num_draft_tokens_total{{model_name="m"}} {drafted}',
                 f'{prefix}:spec_decode_num_accepted_tokens_total{{model_name="m"}} {kept}',
                 f'{prefix}:spec_decode_num_accepted_tokens_created{{model_name="m"}} 1.7e9']
        lines += [f'{prefix}:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="{j}"}} {v}'
                  for j, v in enumerate(per_pos)]
        return "\n".join(lines)

    for prefix in ("tokenmill", "vllm"):
        got = speculative_stats(scrape(prefix, 10, 40, 20, [8, 6, 4, 2]), scrape(prefix, 30, 120, 50, [28, 12, 8, 2]))
        assert got == {"drafts": 20, "draft_tokens": 80, "accepted_tokens": 30, "acceptance_rate": 0.375,
                       "mean_accepted_length": 2.5, "acceptance_per_position": [1.0, 0.3, 0.2, 0.0]}
    assert speculative_stats("tokenmill:num_preemptions_total 3", "tokenmill:num_preemptions_total 4") is None
