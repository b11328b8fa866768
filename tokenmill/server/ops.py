"""Operations: GET /health, GET /ready, GET /metrics, GET /admin/usage."""

from __future__ import annotations

from dataclasses import asdict
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from tokenmill.server.errors import APIError
from tokenmill.server.state import authenticate, get_state
from tokenmill.server.tenancy import TenantConfig

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 while the engine thread runs (even while draining); 503 once it died."""
    if not get_state(request).engine.alive:
        raise APIError(503, "the engine loop is not running", code="engine_dead")
    return JSONResponse({"status": "ok"})


@router.get("/ready")
async def ready(request: Request) -> JSONResponse:
    """200 when new requests are accepted; 503 ``not_ready`` while draining or without an engine,
    503 ``warming_up`` while the engine thread warms up (kernels, a first step)."""
    from tokenmill.server.warmup import check_warm

    state = get_state(request)
    if state.draining or not state.engine.alive:
        raise APIError(503, "not ready: " + ("draining" if state.draining else "the engine loop is not running"),
                       code="not_ready", retry_after=state.config.retry_after)
    check_warm(state)
    return JSONResponse({"status": "ready"})


@router.get("/metrics")
async def metrics(request: Request, tenant: Annotated[TenantConfig, Depends(authenticate)]) -> Response:
    """Prometheus text; it names every tenant and its usage, so with keys configured it needs the key
    of an admin or a ``metrics`` tenant (401 without a key, 403 for others). Open without keys."""
    if not (tenant.admin or tenant.metrics):
        raise APIError(403, f"tenant {tenant.name!r} may not read /metrics (it needs \"admin\" or "
                       "\"metrics\" in the keys file)", code="metrics_not_allowed")
    return Response(get_state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/admin/usage")
async def usage(request: Request, tenant: Annotated[TenantConfig, Depends(authenticate)]) -> JSONResponse:
    """Per-tenant usage counters; needs an admin key when keys are configured."""
    if not tenant.admin:
        raise APIError(403, f"tenant {tenant.name!r} is not an admin", code="not_admin")
    state = get_state(request)
    return JSONResponse({"tenants": {name: asdict(u) for name, u in state.tenancy.usage.items()},
                         "adapters": {name: asdict(u) for name, u in state.tenancy.adapter_usage.items()}})
