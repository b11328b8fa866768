"""Clients that go away: 20 streaming clients killed mid-stream and non-streaming clients that hang
up are all aborted, and every KV block is free again, with speculation off and with n-gram
speculation drafting (the slots its verification steps allocate included)."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest

from tests.server.conftest import MODEL, live_server
from tokenmill import LLM

CLIENTS = 20
MAX_TOKENS = 200


@pytest.fixture(scope="module", params=["plain", "ngram"])
def wide_llm(request, tiny_dir) -> LLM:
    """Room for all 20 streams at once; "ngram" drafts at every step (the adaptive rule off)."""
    if request.param == "plain":
        return LLM(str(tiny_dir), dtype="float32", device="cpu", max_num_seqs=24)
    return LLM(str(tiny_dir), dtype="float32", device="cpu", max_num_seqs=24,
               speculative={"method": "ngram", "num_speculative_tokens": 3, "adaptive": False})


def drafted(llm: LLM) -> int | None:
    """Draft tokens proposed so far; None without speculation."""
    return None if llm.engine.drafter is None else llm.engine.drafter.counters.num_draft_tokens


def assert_drafted_since(llm: LLM, before: int | None) -> None:
    """A speculating server's requests drafted before they were cut (else the case tests nothing new)."""
    if before is not None:
        assert drafted(llm) > before


def request_bytes(port: int, body: dict) -> bytes:
    payload = json.dumps(body).encode()
    return (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n").encode() + payload


async def stream_then_vanish(port: int, i: int) -> int:
    """Read the stream until two events arrived, then drop the connection (RST, no goodbye)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request_bytes(port, {"model": MODEL, "prompt": f"client {i}", "max_tokens": MAX_TOKENS,
                                      "temperature": 0, "ignore_eos": True, "stream": True}))
    await writer.drain()
    seen = b""
    while seen.count(b"data: ") < 2:
        chunk = await asyncio.wait_for(reader.read(4096), 30)
        assert chunk, "the server closed the stream early"
        seen += chunk
    assert b" 200 OK" in seen.split(b"\r\n", 1)[0]
    writer.transport.abort()
    return seen.count(b"data: ")


def test_twenty_streaming_clients_killed_mid_stream(wide_llm) -> None:
    before = drafted(wide_llm)
    with live_server(wide_llm) as server:
        async def run() -> list[int]:
            return await asyncio.gather(*(stream_then_vanish(server.port, i) for i in range(CLIENTS)))

        assert all(n >= 2 for n in asyncio.run(run()))
        server.wait_idle(timeout=10)
        assert_drafted_since(wide_llm, before)
        m = server.metrics()
        label = f'{{model_name="{MODEL}",reason="client_disconnected"}}'
        assert m[f"tokenmill:request_rejected_total{label}"] == CLIENTS
        generated = m[f'tokenmill:generation_tokens_total{{model_name="{MODEL}"}}']
        assert generated < CLIENTS * MAX_TOKENS / 2, "the streams were not cut short"
        assert m[f'tokenmill:request_success_total{{finished_reason="abort",model_name="{MODEL}"}}'] == CLIENTS


def test_non_streaming_clients_that_hang_up_are_aborted(wide_llm) -> None:
    before = drafted(wide_llm)
    with live_server(wide_llm) as server:
        socks = []
        for i in range(5):
            sock = socket.create_connection(("127.0.0.1", server.port))
            sock.sendall(request_bytes(server.port, {"model": MODEL, "prompt": f"quiet {i}", "max_tokens": 240,
                                                     "temperature": 0, "ignore_eos": True}))
            socks.append(sock)
        deadline = time.monotonic() + 10
        while server.state.engine.snapshots[MODEL].num_running < 5:  # all five are generating
            assert time.monotonic() < deadline
            time.sleep(0.005)
        for sock in socks:
            sock.close()
        server.wait_idle(timeout=10)
        assert_drafted_since(wide_llm, before)
        m = server.metrics()
        assert m[f'tokenmill:request_rejected_total{{model_name="{MODEL}",reason="client_disconnected"}}'] == 5
        assert m[f'tokenmill:generation_tokens_total{{model_name="{MODEL}"}}'] < 5 * 240
