"""The FastAPI app: ``build_app(state)``, and ``create_state(llm, config)`` to wire a loaded model.

::

    HTTP ─► ServingMiddleware (draining: 503; body too large: 413; counts requests in flight)
         ─► routers: completions, chat, models (+tokenize), ops (health, ready, metrics, admin)
         ─► Generation (tenant limits, admission, AsyncEngine) ─► engine thread
"""

from __future__ import annotations

import json
from contextlib import asynccontextmanager

from fastapi import FastAPI

from tokenmill.llm import LLM
from tokenmill.server import chat, completions, models, ops
from tokenmill.server.admission import AdmissionController
from tokenmill.server.async_engine import AsyncEngine
from tokenmill.server.config import ServerConfig
from tokenmill.server.errors import install_error_handlers
from tokenmill.server.metrics import ServerMetrics
from tokenmill.server.state import ServerState
from tokenmill.server.tenancy import Tenancy

EXEMPT_FROM_DRAIN = {"/health", "/ready", "/metrics"}


def create_state(llm: LLM, config: ServerConfig) -> ServerState:
    """Wire a loaded model to the server's parts; the engine thread starts with the app."""
    engine = llm.engine
    name = config.served_model_name or llm.model_name
    tenancy = Tenancy.load(config.api_keys)
    metrics = ServerMetrics(name, tenancy)
    admission = AdmissionController(engine.config.scheduler.max_num_seqs, config.max_queued_requests,
                                    config.max_queued_tokens, config.retry_after)
    return ServerState(config, AsyncEngine(engine, on_snapshot=metrics.observe_snapshot), llm.tokenizer, name,
                       engine.limits, admission, tenancy, metrics)


class ServingMiddleware:
    """Plain ASGI (no buffering of streams): refuse work while draining, refuse oversized bodies,
    and count requests in flight for the drain."""

    def __init__(self, app, state: ServerState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = self.state
        if state.draining and scope["path"] not in EXEMPT_FROM_DRAIN:
            state.metrics.reject("draining")
            await _send_error(send, 503, "the server is shutting down; retry on another instance",
                              "service_unavailable_error", "shutting_down", state.config.retry_after)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > state.config.max_request_bytes):
            await _send_error(send, 413, f"the request body is larger than {state.config.max_request_bytes} "
                              "bytes", "invalid_request_error", "request_too_large")
            return
        state.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            state.in_flight -= 1


async def _send_error(send, status: int, message: str, type: str, code: str, retry_after: int | None = None) -> None:
    body = json.dumps({"error": {"message": message, "type": type, "param": None, "code": code}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if retry_after is not None:
        headers.append((b"retry-after", str(retry_after).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def build_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.engine.start()
        yield
        state.engine.stop()

    app = FastAPI(title="tokenmill", description="OpenAI-compatible LLM server", lifespan=lifespan)
    app.state.server = state
    for module in (completions, chat, models, ops):
        app.include_router(module.router)
    install_error_handlers(app)
    app.add_middleware(ServingMiddleware, state=state)
    return app
