"""Admin endpoints: models at runtime, and the chargeback export.

::

    GET    /admin/models          the served models: source, KV pool, cold start, load
    POST   /admin/models          load another model now (LoadModelRequest); its cold start
                                  (weights, engine, warm-up) is measured and exported; the
                                  other models wait while it loads (one engine thread)
    DELETE /admin/models/{name}   stop serving a model: its requests end with 503
                                  ``model_unloaded``, its KV pool returns to the budget
    GET    /admin/costs           measured costs grouped for chargeback:
                                  ?from=&to=        records that closed in [from, to): unix
                                                    seconds or ISO 8601 times
                                  ?group_by=tenant,model   any of tenant, model, key, adapter,
                                                    route, user, tag:NAME, or request_id (one
                                                    row per request)
                                  ?format=json|csv  ?include_open=true adds requests in flight

All need an admin key when keys are configured (403 otherwise).
"""

from __future__ import annotations

import csv
import io
import math
from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response

from tokenmill.errors import TokenmillError
from tokenmill.server.cost import GROUPS, KINDS, CostRecord
from tokenmill.server.errors import APIError
from tokenmill.server.protocol import LoadModelRequest, ServedModelInfo, ServedModelList
from tokenmill.server.state import ServedModel, ServerState, authenticate, get_state
from tokenmill.server.tenancy import TenantConfig

router = APIRouter()
Tenant = Annotated[TenantConfig, Depends(authenticate)]


def _admin(request: Request, tenant: TenantConfig) -> ServerState:
    if not tenant.admin:
        raise APIError(403, f"tenant {tenant.name!r} is not an admin", code="not_admin")
    return get_state(request)


def _info(state: ServerState, served: ServedModel) -> ServedModelInfo:
    snap = state.engine.snapshots.get(served.name)
    return ServedModelInfo(name=served.name, source=served.source, created=served.created,
                           max_model_len=served.max_model_len, kv_cache_memory=served.kv_cache_memory,
                           cold_start_seconds=served.cold_start, warming=served.warming,
                           running=snap.num_running if snap else 0, waiting=snap.num_waiting if snap else 0)


def _pools(state: ServerState) -> list[int]:
    return [m.kv_cache_memory for m in state.models.values()]


@router.get("/admin/models", response_model=ServedModelList)
async def list_served(request: Request, tenant: Tenant) -> ServedModelList:
    state = _admin(request, tenant)
    loader = state.loader
    return ServedModelList(data=[_info(state, m) for m in state.models.values()],
                           kv_cache_budget=loader.total if loader else None,
                           kv_cache_available=loader.available(_pools(state)) if loader else None)


@router.post("/admin/models", response_model=ServedModelInfo)
async def load_model(body: LoadModelRequest, request: Request, tenant: Tenant) -> ServedModelInfo:
    state = _admin(request, tenant)
    loader = state.loader
    if loader is None:
        raise APIError(400, "this server cannot load models at runtime (it was not started by `tokenmill serve`)",
                       code="model_loading_off")
    if body.name in state.models or body.name in state.routes or body.name in state.loading:
        raise APIError(409, f"the name {body.name!r} is already served or loading", param="name", code="name_taken")
    available = loader.available(_pools(state))
    kv = body.kv_cache_memory or available
    if kv > available or kv <= 0:
        raise APIError(409, f"the model needs {kv} bytes of KV pool but {available} of the server's "
                       f"{loader.total} are free: unload a model, pass a smaller kv_cache_memory, or start the server "
                       "with --spare-kv-cache-memory", param="kv_cache_memory", code="kv_budget_exhausted")
    state.loading.add(body.name)
    loaded = {}

    def build():
        loaded["llm"], loaded["seconds"] = loader.load(body.source, kv, **body.options)
        return loaded["llm"].engine

    try:
        seconds = await state.engine.attach(body.name, build)
    except TokenmillError as exc:
        raise APIError.from_tokenmill(exc) from None
    except TypeError as exc:  # an option of the wrong kind
        raise APIError(400, f"cannot load {body.source!r}: {exc}", param="options") from None
    finally:
        state.loading.discard(body.name)
    served = ServedModel.of(body.name, loaded["llm"], state.config)
    served.cold_start = seconds
    state.models = {**state.models, body.name: served}
    state.metrics.cold_start.labels(body.name).set(seconds)
    return _info(state, served)


@router.delete("/admin/models/{name}")
async def unload_model(name: str, request: Request, tenant: Tenant) -> JSONResponse:
    state = _admin(request, tenant)
    if name not in state.models:
        raise APIError(404, f"the model {name!r} is not served", code="model_not_found")
    if len(state.models) == 1:
        raise APIError(409, f"{name!r} is the only model served; load another first", code="last_model")
    using = [r.name for r in state.routes.values() if any(m.partition(":")[0] == name for m in r.models)]
    if using:
        raise APIError(409, f"route(s) {', '.join(map(repr, using))} answer with {name!r}", code="model_in_route")
    freed = state.models[name].kv_cache_memory
    state.models = {n: m for n, m in state.models.items() if n != name}  # new requests: 404 from here
    ended = await state.engine.detach(name)
    state.metrics.forget(name)
    return JSONResponse({"name": name, "status": "unloaded", "ended_requests": ended, "kv_cache_freed": freed})


def _time(value: str | None, param: str) -> float | None:
    if value is None or value == "":
        return None
    try:
        seconds = float(value)
    except ValueError:
        pass
    else:
        if not math.isfinite(seconds):
            raise APIError(400, f"{param} must be a finite time, got {value!r}", param=param)
        return seconds
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        raise APIError(400, f"{param} must be unix seconds or an ISO 8601 time, got {value!r}", param=param) from None


def group_rows(records: list[CostRecord], group_by: list[str]) -> list[dict]:
    """One row per distinct value of the grouping fields: requests, tokens, cost (by kind)."""
    rows: dict[tuple, dict] = {}
    for record in records:
        key = tuple(record.request_id if g == "request_id" else record.labels.group(g) for g in group_by)
        row = rows.get(key)
        if row is None:
            row = rows[key] = {**dict(zip(group_by, key)), "requests": 0, "prompt_tokens": 0, "cached_tokens": 0,
                               "completion_tokens": 0, "cost": 0.0, **{f"{k}_cost": 0.0 for k in KINDS}}
        row["requests"] += 1
        row["prompt_tokens"] += record.prompt_tokens
        row["cached_tokens"] += record.cached_tokens
        row["completion_tokens"] += record.completion_tokens
        row["cost"] += record.total
        for kind in KINDS:
            row[f"{kind}_cost"] += record.cost[kind]
    return sorted(rows.values(), key=lambda r: -r["cost"])


@router.get("/admin/costs")
async def costs(request: Request, tenant: Tenant, since: Annotated[str | None, Query(alias="from")] = None,
                until: Annotated[str | None, Query(alias="to")] = None, group_by: str = "tenant",
                format: str = "json", include_open: bool = False) -> Response:
    state = _admin(request, tenant)
    groups = [g.strip() for g in group_by.split(",") if g.strip()]
    bad = [g for g in groups if g not in GROUPS and g != "request_id" and not (g.startswith("tag:") and len(g) > 4)]
    if bad or not groups:
        raise APIError(400, f"group_by: unknown {', '.join(map(repr, bad)) or 'nothing'}; use {', '.join(GROUPS)}, "
                       "request_id or tag:NAME, comma-separated", param="group_by")
    if format not in ("json", "csv"):
        raise APIError(400, f"format must be json or csv, got {format!r}", param="format")
    start, end = _time(since, "from"), _time(until, "to")
    rows = group_rows(state.meter.records(start, end, include_open), groups)
    if format == "csv":
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=[*groups, "requests", "prompt_tokens", "cached_tokens",
                                                 "completion_tokens", "cost", *(f"{k}_cost" for k in KINDS)])
        writer.writeheader()
        writer.writerows(rows)
        return Response(out.getvalue(), media_type="text/csv",
                        headers={"Content-Disposition": 'attachment; filename="tokenmill-costs.csv"'})
    summary = state.meter.summary()
    return JSONResponse({"from": start, "to": end, "group_by": groups, "price_per_hour": state.cost.price_per_hour,
                         "groups": rows, "since_start": {"metered": summary["metered"],
                                                         "requests": summary["requests"],
                                                         "lines": summary["lines"],
                                                         "in_progress": summary["in_progress"],
                                                         "open_requests": summary["open_requests"]},
                         "rates_per_1k_tokens": state.meter.rates()})
