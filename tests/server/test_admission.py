"""AdmissionController on its own (queue bounds, priority order, shedding, deadlines), then a live
overload: 10x the concurrency the server can hold gets only successes and 429/503 with Retry-After,
the server stays up, and afterwards nothing runs or waits and every KV block is free."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.server.conftest import MODEL, live_server
from tokenmill import LLM
from tokenmill.server.admission import AdmissionController, Rejected, Ticket


def ticket(priority: int = 0, seqs: int = 1, tokens: int = 10, deadline: float = 60.0) -> Ticket:
    return Ticket(priority, seqs, tokens, time.monotonic() + deadline)


async def started(coro) -> asyncio.Task:
    task = asyncio.ensure_future(coro)
    await asyncio.sleep(0)
    return task


def test_queue_bounds_priority_order_and_shedding() -> None:
    async def scenario() -> None:
        ac = AdmissionController(capacity=2, max_queued_requests=2, max_queued_tokens=1000, retry_after=3)
        running = [ticket(), ticket()]
        for t in running:
            await ac.admit(t)
        assert ac.in_engine == 2
        low, high = ticket(priority=5), ticket(priority=1)
        low_task, high_task = await started(ac.admit(low)), await started(ac.admit(high))
        assert ac.num_queued == 2
        with pytest.raises(Rejected) as full:  # same priority as the worst queued: this one is refused
            await ac.admit(ticket(priority=5))
        assert full.value.status == 429 and full.value.reason == "queue_full" and full.value.retry_after == 3
        urgent = ticket(priority=0)
        urgent_task = await started(ac.admit(urgent))  # sheds the lowest priority queued request
        with pytest.raises(Rejected) as shed:
            await low_task
        assert shed.value.reason == "shed" and shed.value.status == 429
        ac.release(running[0])  # the most important queued request goes first
        assert urgent.admitted and not high.admitted
        await urgent_task
        ac.release(running[1])
        await high_task
        assert ac.in_engine == 2 and ac.num_queued == 0
        ac.release(urgent)
        ac.release(high)
        ac.release(high)  # idempotent
        assert ac.in_engine == 0

    asyncio.run(scenario())


def test_token_bound_deadline_and_cancel() -> None:
    async def scenario() -> None:
        ac = AdmissionController(capacity=1, max_queued_requests=10, max_queued_tokens=100, retry_after=1)
        holder = ticket()
        await ac.admit(holder)
        big = await started(ac.admit(ticket(tokens=80)))
        with pytest.raises(Rejected) as tokens:
            await ac.admit(ticket(tokens=30))
        assert tokens.value.reason == "queue_tokens"
        with pytest.raises(Rejected) as late:
            await ac.admit(ticket(tokens=10, deadline=0.05))
        assert late.value.status == 503 and late.value.reason == "deadline"
        big.cancel()  # a client that goes away leaves the queue
        await asyncio.gather(big, return_exceptions=True)
        assert ac.num_queued == 0
        ac.release(holder)
        assert ac.in_engine == 0

    asyncio.run(scenario())


@pytest.fixture(scope="module")
def small_llm(tiny_dir) -> LLM:
    """Two sequences at once."""
    return LLM(str(tiny_dir), dtype="float32", device="cpu", max_num_seqs=2, policy="priority")


def test_overload_gets_429_or_503_and_leaves_nothing_behind(small_llm) -> None:
    capacity, queue = 2, 2
    clients = 10 * (capacity + queue)

    async def one(client: httpx.AsyncClient, i: int) -> httpx.Response:
        body = {"model": MODEL, "prompt": f"request {i} " * 3, "max_tokens": 40, "temperature": 0,
                "ignore_eos": True, "priority": i % 3, "stream": i % 2 == 0}
        return await client.post("/v1/completions", json=body)

    async def storm(url: str) -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=clients + 5)
        async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
            return await asyncio.gather(*(one(client, i) for i in range(clients)))

    with live_server(small_llm, max_queued_requests=queue) as server:
        responses = asyncio.run(storm(server.url))
        codes = [r.status_code for r in responses]
        assert set(codes) <= {200, 429, 503}, codes
        assert codes.count(200) >= capacity + queue and codes.count(429) > 0
        for r in responses:
            if r.status_code != 200:
                assert int(r.headers["retry-after"]) >= 1
                assert set(r.json()["error"]) == {"message", "type", "param", "code"}
            elif "data: [DONE]" not in r.text:
                assert r.json()["usage"]["completion_tokens"] == 40
        server.wait_idle()
        assert httpx.get(server.url + "/health").status_code == 200
        rejected = sum(v for k, v in server.metrics().items() if k.startswith("tokenmill:request_rejected_total"))
        assert rejected == codes.count(429) + codes.count(503)
        ok = httpx.post(server.url + "/v1/completions", json={"prompt": "still up", "max_tokens": 2})
        assert ok.status_code == 200
