"""compare: b/a ratios per metric, direction-aware regression flags, sweeps level by level."""

from __future__ import annotations

import pytest

from tokenmill.benchmark.compare import compare, flatten, format_comparison
from tokenmill.benchmark.metrics import RequestRecord, summarize
from tokenmill.errors import InvalidParameterError


def serve_result(tpot_gap: float, n_requests: int, duration: float) -> dict:
    """n requests of 5 tokens, TTFT 100 ms, chunks every ``tpot_gap`` s."""
    records = [RequestRecord(0.0, 10, [0.1 + k * tpot_gap for k in range(5)], end=0.1 + 4 * tpot_gap,
                             usage={"completion_tokens": 5}) for _ in range(n_requests)]
    return {"kind": "serve", "summary": summarize(records, duration).to_dict()}


def by_metric(rows):
    return {r.metric: r for r in rows}


def test_ratios_and_regressions_follow_each_metric_direction() -> None:
    a = serve_result(tpot_gap=0.02, n_requests=10, duration=2.0)
    b = serve_result(tpot_gap=0.03, n_requests=10, duration=1.0)  # twice the throughput, 1.5x the TPOT
    rows = by_metric(compare(a, b, threshold=0.05))
    assert rows["request_throughput"].ratio == pytest.approx(2.0) and not rows["request_throughput"].regression
    assert rows["tpot.median"].ratio == pytest.approx(1.5) and rows["tpot.median"].regression
    assert rows["ttft.p99"].ratio == pytest.approx(1.0) and not rows["ttft.p99"].regression
    text = format_comparison(list(rows.values()), "a", "b", 0.05)
    assert "REGRESSION" in text and "regression(s) beyond 5%" in text


def test_threshold_decides_what_counts_as_a_regression() -> None:
    a = serve_result(0.02, 10, 1.00)
    b = serve_result(0.02, 10, 1.04)  # 3.8% slower
    assert not any(r.regression for r in compare(a, b, threshold=0.05))
    assert by_metric(compare(a, b, threshold=0.03))["output_throughput"].regression


def test_sweeps_compare_at_shared_loads() -> None:
    s1, s2 = serve_result(0.02, 10, 1.0)["summary"], serve_result(0.02, 10, 2.0)["summary"]
    a = {"kind": "sweep", "points": [{"load": 1, "summary": s1}, {"load": 2, "summary": s1}]}
    b = {"kind": "sweep", "points": [{"load": 2, "summary": s2}, {"load": 4, "summary": s2}]}
    rows = by_metric(compare(a, b))
    assert all(m.startswith("2/") for m in rows)
    assert rows["2/request_throughput"].ratio == pytest.approx(0.5) and rows["2/request_throughput"].regression


def test_offline_results_compare_their_throughput_and_utilization() -> None:
    a = {"kind": "offline", "summary": {"output_tok_s": 100.0, "mbu": 0.5, "decode_step": {"median": 10.0,
                                                                                         "percentiles": {}}}}
    b = {"kind": "offline", "summary": {"output_tok_s": 90.0, "mbu": 0.45, "decode_step": {"median": 11.0,
                                                                                         "percentiles": {}}}}
    rows = by_metric(compare(a, b))
    assert set(rows) == {"output_tok_s", "mbu", "decode_step.median"}
    assert all(r.regression for r in rows.values())
    assert flatten(a)["mbu"] == (0.5, True)


def test_mismatched_or_foreign_files_are_rejected() -> None:
    with pytest.raises(InvalidParameterError, match="cannot compare"):
        compare(serve_result(0.02, 1, 1.0), {"kind": "sweep", "points": []})
    with pytest.raises(InvalidParameterError, match="not a tokenmill bench result"):
        compare({"foo": 1}, {"foo": 2})
