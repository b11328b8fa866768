"""A small OpenAI-compatible streaming server for client tests, with controlled timing.

Each request streams ``max_tokens`` tokens (the word ``tok`` followed by a space) in chunks of
``tokens_per_chunk`` after ``ttft_s`` and then one chunk every ``gap_s``; then a chunk with
``finish_reason`` and empty text, a usage-only chunk when ``stream_options.include_usage`` is set
(and ``send_usage``), and ``data: [DONE]``. Chat responses open with a role-only chunk at once.
Requests whose index (0-based, in arrival order) is in ``fail`` get that HTTP status instead.
``/metrics`` exposes the server's own TTFT, TPOT and E2E histograms (sum and count), timed from
the moment the handler saw the request, as a real server's Prometheus endpoint does.
The server runs on its own event loop in a thread, so sync and async tests can both use it.
"""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass, field

from aiohttp import web


@dataclass
class Behaviour:
    ttft_s: float = 0.0
    gap_s: float = 0.0
    tokens_per_chunk: int = 1
    send_usage: bool = True
    fail: dict[int, int] = field(default_factory=dict)
    """request index -> HTTP status to answer with."""
    error_event_at: set[int] = field(default_factory=set)
    """request indices that get an error event after their first chunk."""


class FakeOpenAIServer:
    def __init__(self, behaviour: Behaviour | None = None, model: str = "fake-model") -> None:
        self.behaviour = behaviour or Behaviour()
        self.model = model
        self.bodies: list[dict] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.arrivals: list[float] = []
        self.observed: dict[str, list[float]] = {"time_to_first_token_seconds": [],
                                                 "time_per_output_token_seconds": [], "e2e_request_latency_seconds": []}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=10)
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/v1/chat/completions", self._complete)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    async def _metrics(self, request: web.Request) -> web.Response:
        lines = []
        for name, values in self.observed.items():
            full = f"fake:{name}"
            lines += [f"# TYPE {full} histogram", f'{full}_bucket{{le="+Inf",model_name="{self.model}"}} {len(values)}',
                      f'{full}_sum{{model_name="{self.model}"}} {sum(values)}',
                      f'{full}_count{{model_name="{self.model}"}} {len(values)}']
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        arrival = asyncio.get_running_loop().time()
        body = await request.json()
        index = len(self.bodies)
        self.bodies.append(body)
        self.arrivals.append(arrival)
        b = self.behaviour
        if index in b.fail:
            return web.json_response({"error": {"message": "rate limited", "code": b.fail[index]}},
                                     status=b.fail[index])
        chat = request.path.endswith("chat/completions")
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return await self._stream(request, body, chat, index)
        finally:
            self.in_flight -= 1

    async def _stream(self, request: web.Request, body: dict, chat: bool, index: int) -> web.StreamResponse:
        b = self.behaviour
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def send(payload) -> None:
            data = payload if isinstance(payload, str) else json.dumps(payload)
            await resp.write(f"data: {data}\n\n".encode())

        def choice(text: str, finish: str | None = None) -> dict:
            if chat:
                return {"index": 0, "delta": {"content": text}, "finish_reason": finish}
            return {"index": 0, "text": text, "finish_reason": finish}

        if chat:
            await send({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        n = body["max_tokens"]
        clock = asyncio.get_running_loop().time
        await asyncio.sleep(b.ttft_s)
        sent, first = 0, None
        while sent < n:
            k = min(b.tokens_per_chunk, n - sent)
            await send({"choices": [choice("tok " * k)]})
            first = first or clock()
            sent += k
            if index in b.error_event_at:
                await send({"error": {"message": "engine died", "code": 500}})
                return resp
            if sent < n:
                await asyncio.sleep(b.gap_s)
        await send({"choices": [choice("", "length")]})
        done = clock()
        self.observed["time_to_first_token_seconds"].append(first - self.arrivals[index])
        self.observed["e2e_request_latency_seconds"].append(done - self.arrivals[index])
        if n > 1:
            self.observed["time_per_output_token_seconds"].append((done - first) / (n - 1))
        if b.send_usage and (body.get("stream_options") or {}).get("include_usage"):
            prompt = body.get("prompt") or " ".join(m["content"] for m in body.get("messages", []))
            await send({"choices": [], "usage": {"prompt_tokens": len(prompt.split()), "completion_tokens": n,
                                                 "total_tokens": len(prompt.split()) + n}})
        await send("[DONE]")
        await resp.write_eof()
        return resp
