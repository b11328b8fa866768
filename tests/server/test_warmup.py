"""Warm-up before /ready (issue 14, item 7): while the engine thread builds or loads the kernels
and runs its first tiny generation, /health is 200, /ready is 503 ``warming_up`` and generation
requests are refused at once with 503 ``warming_up`` and Retry-After (a request's deadline is
never spent behind a compile); afterwards the server serves, and the warm-up left nothing behind."""

from __future__ import annotations

import logging
import threading
import time

import httpx
import pytest

from tests.server.conftest import MODEL, LiveServer, live_server
from tokenmill import SamplingParams
from tokenmill.server.config import ServerConfig


class StartedServer(LiveServer):
    """A live server that is entered as soon as its socket listens, warm or not."""

    wait_for_ready = False


def _wait_ready(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while httpx.get(url + "/ready", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, "the server never became ready"
        time.sleep(0.02)


def _assert_warming_up(response: httpx.Response) -> None:
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "warming_up"
    assert response.json()["error"]["type"] == "service_unavailable_error"
    assert int(response.headers["retry-after"]) >= 1


def test_requests_are_refused_at_once_while_warming_up_then_served(tiny_llm, monkeypatch, caplog):
    engine = tiny_llm.engine
    gate, entered = threading.Event(), threading.Event()
    real_warm_up = engine.warm_up

    def slow_warm_up():  # a compile that takes as long as the test wants
        entered.set()
        assert gate.wait(30)
        return real_warm_up()

    monkeypatch.setattr(engine, "warm_up", slow_warm_up)
    caplog.set_level(logging.INFO, logger="tokenmill.server")
    with StartedServer(tiny_llm, ServerConfig(served_model_name=MODEL)) as server:
        try:
            assert entered.wait(30) and server.state.warming
            assert httpx.get(server.url + "/health", timeout=10).status_code == 200
            _assert_warming_up(httpx.get(server.url + "/ready", timeout=10))
            start = time.monotonic()
            response = httpx.post(server.url + "/v1/completions", headers={"X-Request-Timeout": "2"}, timeout=30,
                                  json={"model": MODEL, "prompt": "hello", "max_tokens": 4})
            assert time.monotonic() - start < 1.5  # not engine_unavailable after the deadline plus 5 s
            _assert_warming_up(response)
            _assert_warming_up(httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}))
            assert not engine.has_unfinished_requests()  # refused before reaching the engine
        finally:
            gate.set()
        _wait_ready(server.url)
        assert not server.state.warming
        assert engine.num_used_blocks == 0 and not engine.has_unfinished_requests()
        assert engine.WARM_UP_REQUEST_ID not in engine.requests
        response = httpx.post(server.url + "/v1/completions", headers={"X-Request-Timeout": "20"}, timeout=30,
                              json={"model": MODEL, "prompt": "hello", "max_tokens": 4, "temperature": 0})
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] >= 1
        assert engine.num_used_blocks == 0 and not engine.has_unfinished_requests()
    logged = [r.getMessage() for r in caplog.records if r.name == "tokenmill.server"]
    assert any(m.startswith(f"warming up {MODEL}: kernels ") and "first step" in m for m in logged), logged


def test_the_live_server_fixture_waits_for_ready(tiny_llm, monkeypatch):
    real_warm_up = tiny_llm.engine.warm_up

    def slow_warm_up():
        time.sleep(0.5)
        return real_warm_up()

    monkeypatch.setattr(tiny_llm.engine, "warm_up", slow_warm_up)
    with live_server(tiny_llm) as server:
        assert not server.state.warming
        assert httpx.get(server.url + "/ready", timeout=10).status_code == 200


def test_a_failed_warm_up_is_logged_and_the_server_serves(tiny_llm, monkeypatch, caplog):
    def broken_warm_up():
        raise RuntimeError("injected warm-up failure")

    monkeypatch.setattr(tiny_llm.engine, "warm_up", broken_warm_up)
    caplog.set_level(logging.INFO, logger="tokenmill.server")
    with live_server(tiny_llm) as server:
        response = httpx.post(server.url + "/v1/completions", timeout=30,
                              json={"model": MODEL, "prompt": "hello", "max_tokens": 3})
        assert response.status_code == 200, response.text
    failures = [r for r in caplog.records if r.name == "tokenmill.server" and "warm-up failed" in r.getMessage()]
    assert failures and failures[0].levelname == "ERROR"


def test_warm_up_runs_a_prefill_and_a_decode_and_leaves_nothing(tiny_llm):
    engine = tiny_llm.engine
    before = list(engine.stats)
    snapshot = engine.snapshot()
    steps = engine.warm_up()
    assert [s.num_batched_tokens for s in steps] == [2, 1] and all(s.seconds > 0 for s in steps)
    assert list(engine.stats) == before  # its steps are kept out of the engine's statistics
    assert engine.num_used_blocks == 0 and not engine.has_unfinished_requests() and not engine.requests
    after = engine.snapshot()
    assert (after.num_running, after.num_waiting, after.num_used_blocks, after.num_preemptions) == (
        snapshot.num_running, snapshot.num_waiting, 0, snapshot.num_preemptions)


def test_warm_up_frees_its_request_when_a_step_fails(tiny_llm, monkeypatch):
    engine = tiny_llm.engine

    def boom(*args, **kwargs):
        raise RuntimeError("injected model failure")

    monkeypatch.setattr(engine.runner, "execute", boom)
    before = list(engine.stats)
    with pytest.raises(RuntimeError, match="injected model failure"):
        engine.warm_up()
    assert engine.num_used_blocks == 0 and not engine.has_unfinished_requests() and not engine.requests
    assert list(engine.stats) == before


def test_warm_up_refuses_a_busy_engine(tiny_llm):
    engine = tiny_llm.engine
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=2), request_id="busy")
    try:
        with pytest.raises(RuntimeError, match="idle engine"):
            engine.warm_up()
        assert "busy" in engine.requests and engine.WARM_UP_REQUEST_ID not in engine.requests
    finally:
        engine.abort("busy")
    assert engine.num_used_blocks == 0 and not engine.has_unfinished_requests()
