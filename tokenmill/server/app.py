"""The FastAPI app: ``build_app(state)``, and ``create_state(models, config)`` to wire loaded models.

::

    HTTP ─► ServingMiddleware (draining: 503; API key: 401; body too large: 413, counted as it
            arrives; counts requests in flight; hands the app the body it read)
         ─► routers: completions, chat, models (+tokenize), lora (adapters at runtime), ops (health,
            ready, metrics, usage), admin (models at runtime, costs), dashboard
         ─► routing (a routed name: rule, cascade, learned) ─► Generation (tenant limits, budget
            hold, the model's admission queue, AsyncEngine) ─► engine thread, every model's steps
"""

from __future__ import annotations

import json
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.routing import APIRoute

from tokenmill.llm import LLM
from tokenmill.server import admin, chat, completions, dashboard, lora, models, ops
from tokenmill.server.async_engine import AsyncEngine
from tokenmill.server.budgets import BudgetBook
from tokenmill.server.config import CostConfig, ServerConfig
from tokenmill.server.cost import CostMeter
from tokenmill.server.errors import APIError, install_error_handlers
from tokenmill.server.metrics import ServerMetrics
from tokenmill.server.model_pool import ModelLoader
from tokenmill.server.routing import load_routes
from tokenmill.server.state import TENANT_SCOPE_KEY, ServedModel, ServerState, authenticate
from tokenmill.server.tenancy import Tenancy

EXEMPT_FROM_DRAIN = {"/health", "/ready", "/metrics"}


def create_state(models: LLM | dict[str, LLM], config: ServerConfig, cost: CostConfig | None = None,
                 loader: ModelLoader | None = None, load_seconds: dict[str, float] | None = None) -> ServerState:
    """Wire loaded models to the server's parts: ``models`` by the names clients give (one LLM:
    named ``served_model_name`` or its own name). The engine thread starts with the app and warms
    every model up first (each is ``warming`` until then). ``loader``: what loads models at runtime
    (POST /admin/models; None: off); ``load_seconds``: how long each startup model took to load
    (its cold start, with its warm-up)."""
    if isinstance(models, LLM):
        models = {config.served_model_name or models.model_name: models}
    cost = cost or CostConfig()
    for adapter, path in config.lora_module_paths():
        next(iter(models.values())).load_lora(adapter, path)
    served = {name: ServedModel.of(name, llm, config) for name, llm in models.items()}
    for name, seconds in (load_seconds or {}).items():
        served[name].cold_start = seconds

    def engine_of(meter: CostMeter, metrics: ServerMetrics) -> AsyncEngine:
        return AsyncEngine({name: m.engine for name, m in served.items()}, on_snapshot=metrics.observe_snapshot,
                           meter=meter)
    return assemble_state(served, engine_of, config, cost, loader)


def assemble_state(served: dict[str, ServedModel], engine_of, config: ServerConfig, cost: CostConfig,
                   loader: ModelLoader | None = None) -> ServerState:
    """The state around served models and their engine: ``engine_of(meter, metrics)`` builds the
    engine (the local AsyncEngine, or a scale-out front's RemoteEngine) once the tenants, cost
    meter, budgets and metrics exist. Every model is ``warming`` until the engine says otherwise."""
    tenancy = Tenancy.load(config.api_keys)
    meter = CostMeter(cost.price_per_hour, cost.model_price_map(), cost.cost_log)
    budgets = BudgetBook(tenancy.tenants)
    if cost.cost_log:
        budgets.restore(cost.cost_log)
    metrics = ServerMetrics(tenancy, meter, budgets)
    engine = engine_of(meter, metrics)
    routes = load_routes(config.routes, list(served)) if config.routes else {}
    state = ServerState(config, engine, served, tenancy, metrics, cost, meter, budgets, loader=loader, routes=routes)

    def on_warming(name: str, warming: bool) -> None:
        model = state.models[name]
        model.warming = warming
        if not warming:
            model.cold_start = (model.cold_start or 0.0) + engine.warm_seconds.get(name, 0.0)
            metrics.cold_start.labels(name).set(model.cold_start)
    engine.warm_up_first(on_warming)
    return state


class ServingMiddleware:
    """Plain ASGI (no buffering of responses): refuse work while draining, check the API key of
    routes that need a tenant before any of the body is read, read the body counting its bytes
    (413 as soon as it passes ``max_request_bytes``, chunked or not, the rest left unread), and
    count requests in flight for the drain."""

    def __init__(self, app, state: ServerState, tenant_paths: frozenset[str] = frozenset()) -> None:
        self.app, self.state, self.tenant_paths = app, state, tenant_paths

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = self.state
        headers: dict[bytes, bytes] = {}
        for name, value in scope["headers"]:
            headers.setdefault(name, value)  # the first of repeated headers, as Starlette reads them
        length = headers.get(b"content-length")
        has_body = (length is not None and length != b"0") or b"transfer-encoding" in headers
        if state.draining and scope["path"] not in EXEMPT_FROM_DRAIN:
            state.metrics.reject(state.default_model.name, "draining")
            await _send_error(send, APIError(503, "the server is shutting down; retry on another instance",
                                             code="shutting_down", retry_after=state.config.retry_after), has_body)
            return
        if scope["path"] in self.tenant_paths:
            try:
                tenant = state.tenancy.authenticate(headers.get(b"authorization", b"").decode("latin-1") or None)
            except APIError as exc:
                await _send_error(send, exc, has_body)
                return
            scope["state"] = {**scope.get("state", {}), TENANT_SCOPE_KEY: tenant}
        limit = state.config.max_request_bytes
        if length is not None and (not length.isdigit() or int(length) > limit):
            await _send_error(send, _too_large(limit), has_body)
            return
        state.in_flight += 1
        try:
            body = await _read_body(receive, limit)
            if body is _TOO_LARGE:
                await _send_error(send, _too_large(limit), close=True)
            elif body is not _GONE:
                await self.app(scope, _replay(body, receive), send)
        finally:
            state.in_flight -= 1


_TOO_LARGE, _GONE = object(), object()


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")


async def _read_body(receive, limit: int):
    """The request body, read whole; ``_TOO_LARGE`` as soon as it passes ``limit`` bytes (the
    rest is never read), ``_GONE`` when the client disconnected first."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return _GONE
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return _TOO_LARGE
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive):
    """An ASGI receive that gives the body already read as one message, then the client's own
    (disconnect) messages."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed():
        return pending.pop() if pending else await receive()
    return replayed


async def _send_error(send, error: APIError, close: bool = False) -> None:
    """The error as a whole response; ``close``: end the connection after it (a body not read)."""
    body = json.dumps({"error": {"message": error.message, "type": error.type, "param": error.param,
                                 "code": error.code}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if error.retry_after is not None:
        headers.append((b"retry-after", str(max(1, round(error.retry_after))).encode()))
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def tenant_paths(routers) -> frozenset[str]:
    """Paths of the routes that depend on :func:`authenticate` (the ops routes aside: their access
    is ops.py's business); ServingMiddleware checks their key before reading the body."""
    def uses(dependant) -> bool:
        return any(d.call is authenticate or uses(d) for d in dependant.dependencies)
    return frozenset(route.path for router in routers for route in router.routes
                     if isinstance(route, APIRoute) and uses(route.dependant)) - EXEMPT_FROM_DRAIN


def build_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.engine.start()
        yield
        state.engine.stop()

    app = FastAPI(title="tokenmill", description="OpenAI-compatible LLM server", lifespan=lifespan)
    app.state.server = state
    routers = [module.router for module in (completions, chat, models, lora, ops, admin, dashboard)]
    for router in routers:
        app.include_router(router)
    install_error_handlers(app)
    app.add_middleware(ServingMiddleware, state=state, tenant_paths=tenant_paths(routers))
    return app
