"""Attacks on the HTTP layer (issue 14: 1, 2, 9, 10): huge and chunked bodies, lone surrogates,
connections that never finish their headers or come in crowds, unauthenticated bodies, bad UTF-8
and tool options. Each test reproduces the probe that found the defect."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import MODEL, live_server
from tokenmill.server.tenancy import hash_key

LIMIT = 8 * 2**20


def rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text[:500]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def test_health_answers_while_huge_bodies_arrive(tiny_llm) -> None:
    """An 8 MB prompt (within the body limit), 700 prompts that each might fit, and a 40 MB chunked
    body, sent at once: /health answers within 100 ms throughout, the long prompt gets 400 without
    being tokenized, the many are tokenized off the event loop, the chunked body gets 413 as soon as
    it passes the limit, and the server's memory does not jump."""
    prompt_body = json.dumps({"model": MODEL, "prompt": "a" * (LIMIT - 100)}).encode()
    assert len(prompt_body) <= LIMIT
    longest = tiny_llm.tokenizer.max_token_chars * tiny_llm.engine.limits.max_seq_tokens  # might fit
    many_body = json.dumps({"model": MODEL, "prompt": ["b" * longest] * 700}).encode()
    piece = b"a" * 2**16

    def chunked():
        yield b'{"model": "' + MODEL.encode() + b'", "prompt": "'
        for _ in range(40 * 2**20 // len(piece)):
            yield piece
        yield b'"}'

    results: dict[str, object] = {}

    def post(name: str, content) -> None:
        try:
            results[name] = httpx.post(url + "/v1/completions", content=content, timeout=60,
                                       headers={"content-type": "application/json"})
        except httpx.HTTPError as exc:
            results[name] = exc

    with live_server(tiny_llm) as server, httpx.Client(base_url=server.url, timeout=10) as probe:
        url = server.url
        baseline = []
        for _ in range(10):
            start = time.perf_counter()
            assert probe.get("/health").status_code == 200
            baseline.append(time.perf_counter() - start)
        rss_before = rss_bytes()
        threads = [threading.Thread(target=post, args=("prompt", prompt_body)),
                   threading.Thread(target=post, args=("many", many_body)),
                   threading.Thread(target=post, args=("chunked", chunked()))]
        for t in threads:
            t.start()
        latencies, rss_peak = [], rss_before
        deadline = time.monotonic() + 60
        while any(t.is_alive() for t in threads) or len(latencies) < 5:
            assert time.monotonic() < deadline, "the bodies were not answered within 60 s"
            start = time.perf_counter()
            assert probe.get("/health").status_code == 200
            latencies.append(time.perf_counter() - start)
            rss_peak = max(rss_peak, rss_bytes())
            time.sleep(0.005)
        for t in threads:
            t.join()
        server.wait_idle()

    prompt = results["prompt"]
    assert isinstance(prompt, httpx.Response), prompt
    error = error_of(prompt, 400)
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt", error
    many = results["many"]
    assert isinstance(many, httpx.Response), many
    assert error_of(many, 400)["code"] == "context_length_exceeded"  # once tokenized: 256+ tokens each
    chunked_reply = results["chunked"]
    assert isinstance(chunked_reply, httpx.Response), chunked_reply
    assert error_of(chunked_reply, 413)["code"] == "request_too_large"
    # p99 under 100 ms (unless this machine is slower than that when idle): every probe but the
    # slowest; that one may meet a scheduler hiccup of the shared 2-core host, but not a blocked loop
    # (tokenizing the 700 prompts on it takes seconds)
    allowed = max(0.1, 3 * max(baseline))
    slowest = sorted(latencies)
    assert slowest[-2] < allowed and slowest[-1] < 3 * allowed, (slowest[-5:], len(latencies), baseline)
    # the client's own bodies live in this process too (8 MB + 64 KB); tokenizing 10 M tokens took GBs
    assert rss_peak - rss_before < 200 * 2**20, (rss_peak - rss_before) / 2**20


def test_chunked_body_over_the_limit_is_refused_without_reading_it(tiny_llm) -> None:
    """Over a raw socket: 413 arrives while the client is still sending, and the server closes."""
    with live_server(tiny_llm, max_request_bytes=2**20) as server:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n")
            chunk = b"%x\r\n%s\r\n" % (2**16, b"a" * 2**16)
            sent = 0
            sock.settimeout(0.05)
            reply = b""
            while sent < 64 * 2**20 and not reply:  # at most 64 MB; the server answers after 1 MB
                try:
                    sock.sendall(chunk)
                    sent += 2**16
                except OSError:  # the server closed its side
                    break
                try:
                    reply = sock.recv(65536)
                except (TimeoutError, socket.timeout):
                    pass
            assert reply.startswith(b"HTTP/1.1 413"), (sent, reply[:200])
            assert sent < 8 * 2**20, f"the server read {sent} bytes before answering"
            sock.settimeout(5)
            try:
                while chunk := sock.recv(65536):  # the rest of the answer, then the server closes
                    reply += chunk
            except ConnectionResetError:  # it closed with our unread chunks in its buffer
                pass
            assert b"connection: close" in reply.lower() and b"request_too_large" in reply


SURROGATE_CASES = [
    # (path, raw JSON body with a lone surrogate, the param named)
    ("/v1/completions", b'{"prompt": "x\\ud800"}', "prompt"),
    ("/v1/completions", b'{"prompt": ["fine", "x\\udfff y"]}', "prompt"),
    ("/v1/completions", b'{"prompt": "x\xed\xa0\x80"}', "prompt"),  # the surrogate as raw (CESU) bytes
    ("/v1/completions", b'{"prompt": "x", "stop": ["\\ud800"]}', "stop"),
    ("/v1/completions", b'{"prompt": "x", "cache_salt": "\\ud800"}', "cache_salt"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x\\ud800"}]}', "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
     "messages"),
    ("/tokenize", b'{"prompt": "x\\ud800"}', "prompt"),
    ("/tokenize", b'{"messages": [{"role": "user", "content": "x\\ud800"}]}', "messages"),
]


def test_lone_surrogate_is_400_and_keeps_the_connection(tiny_llm) -> None:
    with live_server(tiny_llm) as server, httpx.Client(base_url=server.url, timeout=30) as client:
        def local_port(response: httpx.Response) -> int:
            return response.extensions["network_stream"].get_extra_info("client_addr")[1]

        good = client.post("/tokenize", json={"prompt": "hello"})
        assert good.status_code == 200
        port = local_port(good)
        for path, body, param in SURROGATE_CASES:
            bad = client.post(path, content=body, headers={"content-type": "application/json"})
            error = error_of(bad, 400)
            assert error["code"] == "invalid_unicode" and error["param"] == param, (path, body, error)
            assert "surrogate" in error["message"], error
            good = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
            assert good.status_code == 200, good.text
            assert local_port(bad) == port and local_port(good) == port, "the keep-alive connection was dropped"
        # a field name with a lone surrogate
        error = error_of(client.post("/v1/completions", content=b'{"prompt": "x", "\\ud800": 1}',
                                     headers={"content-type": "application/json"}), 400)
        assert error["code"] == "invalid_unicode", error
        server.wait_idle()


def header_closed_after(port: int, first: bytes, timeout: float = 10) -> tuple[float, bytes]:
    """Seconds until the server closes a connection that sent ``first`` and then nothing, and what it sent."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        start = time.monotonic()
        if first:
            sock.sendall(first)
        data = b""
        try:
            while chunk := sock.recv(65536):
                data += chunk
        except ConnectionResetError:
            pass
        except (TimeoutError, socket.timeout):
            pytest.fail(f"the connection that sent {first!r} was still open after {timeout} s")
        return time.monotonic() - start, data


def test_unfinished_headers_are_closed_after_header_timeout(tiny_llm) -> None:
    with live_server(tiny_llm, header_timeout=0.5) as server:
        for first in (b"", b"GET /hea", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"):
            elapsed, data = header_closed_after(server.port, first)
            assert 0.4 < elapsed < 2.0 and data == b"", (first, elapsed, data)
        # a keep-alive connection: the first request is served, a half-sent second one is closed
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            reply = b""
            while b'"ok"' not in reply:
                reply += sock.recv(65536)
            assert reply.startswith(b"HTTP/1.1 200")
            time.sleep(0.7)  # longer than header_timeout: idle keep-alive is uvicorn's own (5 s) business
            sock.sendall(b"GET /health HTTP/1.1\r\n")
            start = time.monotonic()
            assert sock.recv(65536) == b""
            assert time.monotonic() - start < 2.0
        # requests whose head arrives in time, streaming ones and keep-alive, still work
        with httpx.Client(base_url=server.url, timeout=30) as client:
            for _ in range(2):
                with client.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 4,
                                                                    "stream": True}) as stream:
                    assert stream.status_code == 200
                    assert list(stream.iter_lines())[-2:] == ["data: [DONE]", ""]
                time.sleep(0.7)
        server.wait_idle()


def test_connections_per_client_are_capped(tiny_llm) -> None:
    cap = 4
    with live_server(tiny_llm, max_connections_per_client=cap, header_timeout=30) as server:
        held = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(cap)]
        try:
            with socket.create_connection(("127.0.0.1", server.port), timeout=5) as extra:
                reply = b""
                try:
                    while chunk := extra.recv(65536):
                        reply += chunk
                except (TimeoutError, socket.timeout):
                    pytest.fail(f"connection {cap + 1} from one client was accepted")
            head, _, body = reply.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in head.lower(), reply
            assert json.loads(body)["error"]["code"] == "too_many_connections"
            for sock in held:  # the first ones still work
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                assert sock.recv(65536).startswith(b"HTTP/1.1 200")
            held.pop().close()
            deadline = time.monotonic() + 5
            while True:  # once the server saw it go, a new one is accepted
                with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
                    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                    if sock.recv(65536).startswith(b"HTTP/1.1 200"):
                        break
                assert time.monotonic() < deadline, "a closed connection still counts against the cap"
                time.sleep(0.05)
        finally:
            for sock in held:
                sock.close()


def test_key_checked_before_the_body_is_parsed(tiny_llm, tmp_path) -> None:
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"tenants": [{"name": "alice", "key_sha256": hash_key("alice-key")}]}))
    with live_server(tiny_llm, api_keys=str(keys)) as server, httpx.Client(base_url=server.url, timeout=30) as c:
        json_headers = {"content-type": "application/json"}
        for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
            error = error_of(c.post(path, content=b"{not json", headers=json_headers), 401)
            assert error["code"] == "invalid_api_key", error
        huge = (b"a" * 2**16 for _ in range(200))  # 12.5 MB, chunked: refused before any of it is read
        assert error_of(httpx.post(server.url + "/v1/completions", content=huge, headers=json_headers,
                                   timeout=30), 401)["code"] == "invalid_api_key"
        keyed = {**json_headers, "authorization": "Bearer alice-key"}
        assert error_of(c.post("/v1/completions", content=b"{not json", headers=keyed), 400)["code"] == "invalid_json"
        ok = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers=keyed)
        assert ok.status_code == 200, ok.text
        assert c.get("/health").status_code == 200
        assert server.state.tenancy.usage["alice"].requests == 1


def test_invalid_utf8_body_and_tool_options(tiny_llm) -> None:
    with live_server(tiny_llm) as server, httpx.Client(base_url=server.url, timeout=30) as client:
        error = error_of(client.post("/v1/completions", content=b'{"prompt": "x\xff"}',
                                     headers={"content-type": "application/json"}), 400)
        assert error["code"] == "invalid_utf8" and "UTF-8" in error["message"], error
        chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
        for value in (True, False):
            error = error_of(client.post("/v1/chat/completions", json={**chat, "parallel_tool_calls": value}), 400)
            assert error["param"] == "parallel_tool_calls" and "tools" in error["message"], error
        assert client.post("/v1/chat/completions", json={**chat, "parallel_tool_calls": None}).status_code == 200
        server.wait_idle()
