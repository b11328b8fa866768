"""The streaming client and the serve runner against a fake OpenAI-compatible server with
controlled timing: chunks of several tokens, a usage-only final chunk, failures by status,
concurrency caps, duration bounds, warm-up and multi-turn history."""

from __future__ import annotations

import asyncio
import math

import pytest

from tests.benchmark.fake_server import Behaviour, FakeOpenAIServer
from tokenmill.benchmark.client import ClientConfig, OpenAIClient, parse_sse_line
from tokenmill.benchmark.metrics import SLO, summarize
from tokenmill.benchmark.runner import (
    BenchmarkError,
    LoadConfig,
    ServeResult,
    run_serve,
)
from tokenmill.benchmark.workloads import Conversation, Turn
from tokenmill.errors import InvalidParameterError

SLACK = 0.15  # seconds a loaded 2-core machine may add to a timed gap


def words(text: str) -> int:
    return len(text.split())


def send_all(server: FakeOpenAIServer, backend: str, max_tokens: list[int], **cfg):
    async def go():
        async with OpenAIClient(ClientConfig(server.url, "fake-model", backend, **cfg)) as client:
            return [await client.send([{"role": "user", "content": "hi there"}], n, 2) for n in max_tokens]
    return asyncio.run(go())


def single(prompt: str = "a b c", output_len: int = 4) -> Conversation:
    return Conversation((Turn(prompt, words(prompt), output_len),))


def test_completions_stream_with_several_tokens_per_chunk_and_usage() -> None:
    # gaps long against a loaded machine's jitter; a gap measured from anything but the previous
    # chunk (the request's start, the first chunk) would be at least twice as long
    with FakeOpenAIServer(Behaviour(ttft_s=0.25, gap_s=0.25, tokens_per_chunk=3)) as server:
        (r,) = send_all(server, "completions", [7])
    assert r.success and r.text == "tok " * 7
    assert len(r.chunk_times) == 3  # 3 + 3 + 1 tokens
    assert r.usage == {"prompt_tokens": 2, "completion_tokens": 7, "total_tokens": 9}
    assert 0.25 <= r.ttft < 0.5
    assert all(0.25 <= gap < 0.5 for gap in r.itls)
    assert r.end >= r.chunk_times[-1]  # the finish chunk, not the usage chunk
    s = summarize([r], 1.0)
    assert s.total_output_tokens == 7 and s.itl.count == 2
    assert s.tpot.mean == pytest.approx((r.e2el - r.ttft) / 6 * 1000)
    body = server.bodies[0]
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    assert body["prompt"] == "hi there" and body["max_tokens"] == 7 and body["ignore_eos"] is True


def test_chat_stream_skips_the_role_chunk_for_ttft() -> None:
    with FakeOpenAIServer(Behaviour(ttft_s=0.1, gap_s=0.0)) as server:
        (r,) = send_all(server, "chat", [3], ignore_eos=False, extra_body={"top_k": 1})
    assert r.success and r.text == "tok tok tok " and len(r.chunk_times) == 3
    assert r.ttft >= 0.1  # the role chunk came at once and carried no text
    body = server.bodies[0]
    assert body["messages"] == [{"role": "user", "content": "hi there"}]
    assert "ignore_eos" not in body and body["top_k"] == 1


def test_one_token_reply_and_no_usage_falls_back_to_the_tokenizer() -> None:
    with FakeOpenAIServer(Behaviour(send_usage=False)) as server:
        one, five = send_all(server, "completions", [1, 5])
    assert one.usage is None and len(one.chunk_times) == 1
    s = summarize([one, five], 1.0, count_tokens=words)
    assert s.total_output_tokens == 6
    assert s.tpot.count == 1  # only the 5-token reply has a TPOT


def test_http_failures_are_recorded_by_status() -> None:
    with FakeOpenAIServer(Behaviour(fail={1: 429, 2: 503})) as server:
        records = send_all(server, "completions", [2, 2, 2, 2])
    assert [r.status for r in records] == ["ok", "429", "503", "ok"]
    assert "rate limited" in records[1].error
    s = summarize(records, 1.0)
    assert s.failures == {"429": 1, "503": 1} and s.completed == 2


def test_error_event_inside_the_stream_fails_the_request() -> None:
    with FakeOpenAIServer(Behaviour(error_event_at={0})) as server:
        (r,) = send_all(server, "completions", [4])
    assert r.status == "stream_error" and "engine died" in r.error


def test_unreachable_server_is_a_failed_request_not_a_crash() -> None:
    with FakeOpenAIServer() as server:
        url = server.url
    async def go():
        async with OpenAIClient(ClientConfig(url, "m")) as client:
            return await client.send([{"role": "user", "content": "x"}], 2, 1)
    r = asyncio.run(go())
    assert not r.success and r.status == "ClientConnectorError"


def test_sse_parsing() -> None:
    assert parse_sse_line(b'data: {"a": 1}\n') == {"a": 1}
    assert parse_sse_line(b"data:[DONE]") == "[DONE]"
    assert parse_sse_line(b": keep-alive\n") is None
    assert parse_sse_line(b"\n") is None
    assert parse_sse_line("event: message") is None


def test_runner_caps_concurrency_and_summarizes() -> None:
    with FakeOpenAIServer(Behaviour(ttft_s=0.05, gap_s=0.01)) as server:
        result = run_serve(ClientConfig(server.url, "fake-model"), LoadConfig(max_concurrency=2),
                           [single() for _ in range(8)], words, SLO(ttft=5000), progress=False)
        assert server.max_in_flight == 2
    s = result.summary
    assert s.completed == 8 and s.failed == 0 and s.total_output_tokens == 32
    assert s.request_goodput == pytest.approx(s.request_throughput)
    assert s.duration_s >= 4 * 0.08  # four waves of two requests, each >= 50 + 3 * 10 ms
    data = result.to_dict(with_records=True)
    assert len(data["records"]) == 8 and data["load"]["max_concurrency"] == 2
    again = ServeResult.from_dict(data)
    assert again.summary == s and again.records == result.records


def test_runner_paces_arrivals_at_the_request_rate() -> None:
    with FakeOpenAIServer() as server:
        result = run_serve(ClientConfig(server.url, "fake-model"), LoadConfig(request_rate=20.0, seed=1),
                           [single(output_len=1) for _ in range(20)], words, progress=False)
    starts = sorted(r.start for r in result.records)
    span = starts[-1] - starts[0]
    assert 0.4 < span < 2.5  # 19 exponential gaps of mean 50 ms: ~0.95 s
    assert result.summary.completed == 20


def test_runner_stops_dispatching_after_the_duration() -> None:
    with FakeOpenAIServer(Behaviour(ttft_s=0.05)) as server:
        result = run_serve(ClientConfig(server.url, "fake-model"), LoadConfig(max_concurrency=2, duration_s=0.5),
                           [single(output_len=1)], words, progress=False)
    n = result.summary.completed
    assert 6 <= n <= 22  # about 2 in flight x 0.5 s / 0.05 s = 20, the single conversation repeated
    assert 0.5 <= result.summary.duration_s < 0.5 + 0.05 + SLACK + 0.3


def test_warmup_requests_are_sent_but_not_recorded() -> None:
    with FakeOpenAIServer() as server:
        result = run_serve(ClientConfig(server.url, "fake-model"), LoadConfig(warmup=2),
                           [single() for _ in range(3)], words, progress=False)
        assert len(server.bodies) == 5
    assert len(result.records) == 3


def test_all_warmup_requests_failing_aborts_the_run() -> None:
    with FakeOpenAIServer(Behaviour(fail={0: 500, 1: 500})) as server, pytest.raises(BenchmarkError, match="500"):
        run_serve(ClientConfig(server.url, "fake-model"), LoadConfig(warmup=2), [single()] * 3, words, progress=False)


def test_multi_turn_sends_the_history_with_each_turn() -> None:
    conv = Conversation((Turn("one", 1, 2), Turn("two", 1, 3), Turn("three", 1, 1)), system="sys", system_len=1)
    with FakeOpenAIServer() as server:
        result = run_serve(ClientConfig(server.url, "fake-model", "chat"), LoadConfig(), [conv], words, progress=False)
        bodies = server.bodies
    assert len(result.records) == 3
    assert [m["content"] for m in bodies[2]["messages"]] == ["sys", "one", "tok tok ", "two", "tok tok tok ", "three"]
    assert [m["role"] for m in bodies[1]["messages"]] == ["system", "user", "assistant", "user"]


def test_multi_turn_on_completions_joins_the_history_into_the_prompt() -> None:
    conv = Conversation((Turn("one", 1, 2), Turn("two", 1, 1)))
    with FakeOpenAIServer() as server:
        run_serve(ClientConfig(server.url, "fake-model"), LoadConfig(), [conv], words, progress=False)
        assert server.bodies[1]["prompt"] == "one\n\ntok tok \n\ntwo"


def test_a_failed_turn_ends_its_conversation() -> None:
    conv = Conversation((Turn("one", 1, 2), Turn("two", 1, 3), Turn("three", 1, 1)))
    with FakeOpenAIServer(Behaviour(fail={1: 429})) as server:
        result = run_serve(ClientConfig(server.url, "fake-model"), LoadConfig(), [conv], words, progress=False)
    assert [r.status for r in result.records] == ["ok", "429"]


@pytest.mark.parametrize("kwargs", [{"max_concurrency": 0}, {"duration_s": 1.0}, {"request_rate": 0.0},
                                    {"warmup": -1}, {"duration_s": -1, "max_concurrency": 1}])
def test_load_config_rejects(kwargs) -> None:
    with pytest.raises(InvalidParameterError):
        LoadConfig(**{"request_rate": math.inf, **kwargs})


def test_server_histograms_agree_with_the_client_within_ten_percent() -> None:
    """The acceptance check's machinery: /metrics scraped after warm-up and at the end; the fake
    server times TTFT/TPOT/E2E itself, the client's means must agree within 10%. The fake's delays
    are long enough that the client's own overhead (up to ~15 ms on a loaded 2-core CI host) stays
    well inside the 10%."""
    convs = [single(output_len=6) for _ in range(8)]
    with FakeOpenAIServer(Behaviour(ttft_s=0.3, gap_s=0.05)) as server:
        result = run_serve(ClientConfig(server.url, "fake-model"), LoadConfig(max_concurrency=4, warmup=2), convs,
                           words, progress=False, scrape_metrics=True)
    sm = result.server_metrics
    assert set(sm) == {"ttft", "tpot", "e2el"}  # the fake server has no ITL histogram
    assert all(e["count"] == 8 for e in sm.values())  # the warm-up requests are not in the difference
    assert sm["ttft"]["histogram"] == "fake:time_to_first_token_seconds"
    for metric in ("ttft", "tpot", "e2el"):
        assert sm[metric]["client_over_server"] == pytest.approx(1.0, abs=0.10), (metric, sm[metric])
    assert result.to_dict()["server_metrics"] == sm


def test_a_server_without_metrics_still_gets_its_benchmark() -> None:
    class NoMetrics(FakeOpenAIServer):
        async def _metrics(self, request):
            from aiohttp import web
            raise web.HTTPNotFound()

    with NoMetrics() as server:
        result = run_serve(ClientConfig(server.url, "fake-model"), LoadConfig(), [single()], words, progress=False,
                           scrape_metrics=True)
    assert result.summary.completed == 1 and "404" in result.server_metrics["error"]
