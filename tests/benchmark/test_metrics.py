"""The metric math on hand-built timelines: every expected figure is worked out by hand here."""

from __future__ import annotations

import pytest

from tokenmill.benchmark.metrics import (
    SLO,
    Distribution,
    RequestRecord,
    Summary,
    summarize,
)
from tokenmill.errors import InvalidParameterError


def record(start, chunks, end=None, usage=None, text="", prompt_len=10, status="ok") -> RequestRecord:
    return RequestRecord(start=start, prompt_len=prompt_len, chunk_times=list(chunks), text=text,
                         end=end if end is not None else (chunks[-1] if chunks else None), usage=usage, status=status)


def test_several_tokens_in_one_chunk_count_once_for_itl_but_fully_for_tpot() -> None:
    # 3 chunks at 0.5, 0.7, 1.5 s; the last chunk carries 4 tokens: 6 tokens in all (from usage)
    r = record(0.0, [0.5, 0.7, 1.5], usage={"prompt_tokens": 12, "completion_tokens": 6})
    s = summarize([r], duration_s=2.0)
    assert s.ttft.mean == pytest.approx(500.0)
    assert s.itl.count == 2
    assert s.itl.median == pytest.approx(500.0)  # median of 200 and 800
    assert s.itl.mean == pytest.approx(500.0)
    assert s.tpot.mean == pytest.approx((1500 - 500) / 5)  # 200 ms: (e2e - ttft) / (6 - 1)
    assert s.e2el.mean == pytest.approx(1500.0)
    assert s.total_output_tokens == 6 and s.total_input_tokens == 12  # usage wins over prompt_len=10
    assert s.output_throughput == pytest.approx(3.0)
    assert s.total_token_throughput == pytest.approx(9.0)


def test_usage_only_final_chunk_sets_counts_without_moving_the_end() -> None:
    # the response ended with its last choices chunk at 0.9; the usage chunk came later and has no time
    r = record(0.1, [0.3, 0.5, 0.7], end=0.9, usage={"completion_tokens": 3})
    s = summarize([r], duration_s=1.0)
    assert s.e2el.mean == pytest.approx(800.0)
    assert s.ttft.mean == pytest.approx(200.0)
    assert s.tpot.mean == pytest.approx((800 - 200) / 2)
    assert s.total_output_tokens == 3


def test_without_usage_the_tokenizer_counts_the_text_else_the_chunks() -> None:
    r = record(0.0, [0.1, 0.2], text="a b c d")
    by_words = summarize([r], 1.0, count_tokens=lambda t: len(t.split()))
    assert by_words.total_output_tokens == 4
    assert by_words.tpot.mean == pytest.approx((200 - 100) / 3)
    by_chunks = summarize([r], 1.0)
    assert by_chunks.total_output_tokens == 2
    assert by_chunks.total_input_tokens == 10  # no usage: the workload's prompt_len


def test_one_output_token_has_ttft_and_e2e_but_no_tpot_or_itl() -> None:
    r = record(0.0, [0.25], usage={"completion_tokens": 1})
    s = summarize([r], 1.0)
    assert s.ttft.mean == pytest.approx(250.0) and s.e2el.mean == pytest.approx(250.0)
    assert s.tpot.count == 0 and s.tpot.mean is None and s.tpot.percentiles["p99"] is None
    assert s.itl.count == 0 and s.itl.median is None
    assert s.completed == 1 and s.total_output_tokens == 1


def test_failed_requests_are_counted_by_status_and_left_out_of_every_latency() -> None:
    ok = record(0.0, [0.1, 0.3], usage={"completion_tokens": 2, "prompt_tokens": 5})
    rate_limited = [RequestRecord(start=0.0, prompt_len=50, status="429", error="slow down") for _ in range(2)]
    refused = RequestRecord(start=0.0, prompt_len=50, status="ClientConnectorError")
    died = record(0.0, [0.05], status="stream_error", usage={"completion_tokens": 99})
    s = summarize([ok, *rate_limited, refused, died], duration_s=2.0)
    assert (s.completed, s.failed) == (1, 4)
    assert s.failures == {"429": 2, "ClientConnectorError": 1, "stream_error": 1}
    assert s.total_input_tokens == 5 and s.total_output_tokens == 2
    assert s.ttft.count == 1 and s.ttft.mean == pytest.approx(100.0)
    assert s.itl.count == 1 and s.itl.mean == pytest.approx(200.0)
    assert s.request_throughput == pytest.approx(0.5)


def test_only_failures_gives_no_latency_and_zero_throughput() -> None:
    s = summarize([RequestRecord(start=0.0, prompt_len=5, status="500")], 1.0, slo=SLO(ttft=100))
    assert s.completed == 0 and s.request_throughput == 0 and s.request_goodput == 0
    assert s.e2el.mean is None


def test_goodput_counts_requests_meeting_every_slo() -> None:
    # ttft / tpot / e2el in ms: a = 100/40/300, b = 300/20/400, c = 100/100/600, d = 50/-/50 (1 token)
    a = record(0.0, [0.1, 0.3], usage={"completion_tokens": 6})    # tpot = 200/5 = 40
    b = record(0.0, [0.3, 0.4], usage={"completion_tokens": 6})    # tpot = 100/5 = 20
    c = record(0.0, [0.1, 0.6], usage={"completion_tokens": 6})    # tpot = 500/5 = 100
    d = record(0.0, [0.05], usage={"completion_tokens": 1})         # tpot counts as 0
    records = [a, b, c, d]
    assert summarize(records, 2.0, SLO(ttft=200)).request_goodput == pytest.approx(3 / 2)   # a c d
    assert summarize(records, 2.0, SLO(tpot=45)).request_goodput == pytest.approx(3 / 2)    # a b d
    assert summarize(records, 2.0, SLO(ttft=200, tpot=45)).request_goodput == pytest.approx(2 / 2)  # a d
    assert summarize(records, 2.0, SLO(e2el=450)).request_goodput == pytest.approx(3 / 2)   # a b d
    assert summarize(records, 2.0, SLO(ttft=200, tpot=45, e2el=250)).request_goodput == pytest.approx(1 / 2)  # d
    assert summarize(records, 2.0, SLO(ttft=40)).request_goodput == 0
    assert summarize(records, 2.0).request_goodput is None


def test_percentiles_interpolate_like_numpy() -> None:
    d = Distribution.of([0.001 * x for x in (1, 2, 3, 4, 10)], percentiles=(50, 90, 99))
    assert d.median == pytest.approx(3.0)
    assert d.mean == pytest.approx(4.0)
    assert d.percentiles["p90"] == pytest.approx(4 + 0.6 * 6)    # rank 3.6 between 4 and 10
    assert d.percentiles["p99"] == pytest.approx(4 + 0.96 * 6)
    assert d.std == pytest.approx((((1 - 4) ** 2 + 4 + 1 + 0 + 36) / 5) ** 0.5)


def test_summary_round_trips_through_a_dict() -> None:
    s = summarize([record(0.0, [0.1, 0.2, 0.4], usage={"completion_tokens": 3})], 1.0, SLO(ttft=500),
                  percentiles=(50, 95))
    again = Summary.from_dict(s.to_dict())
    assert again == s
    assert set(again.tpot.percentiles) == {"p50", "p95"}


@pytest.mark.parametrize("text, expected", [
    ("ttft=500", SLO(ttft=500)), ("ttft=500,tpot=50,e2el=10000", SLO(500, 50, 10000)), (" tpot = 25 ,", SLO(tpot=25)),
])
def test_slo_parse(text, expected) -> None:
    assert SLO.parse(text) == expected


@pytest.mark.parametrize("text", ["", "ttft", "latency=3", "ttft=fast", "tpot=-1"])
def test_slo_parse_rejects(text) -> None:
    with pytest.raises(InvalidParameterError):
        SLO.parse(text)


def test_duration_must_be_positive() -> None:
    with pytest.raises(InvalidParameterError):
        summarize([], 0.0)
