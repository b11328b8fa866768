"""The dashboard: GET /dashboard (a page, served to anyone) and GET /admin/dashboard/data (the JSON
the page polls every 2 s; an admin key when keys are configured, as for /admin/usage).

::

    registry.collect() ─► samples by sample name ─► summed per model / tenant / route ─► JSON
    page: polls the JSON ─► rates from counter deltas between two polls (the server's ``time``)
                         ─► series kept in the browser for the session ─► uPlot charts, tables, bars

The data comes from the app's Prometheus registry only, so the page shows what /metrics says.
Every figure is grouped by the label values that appear (several models, any tenants, routes),
and a section whose families have no samples is left out (null or empty). Latency percentiles are
estimated from the histogram buckets the way Prometheus' ``histogram_quantile`` does.

The page and its files (``static/``: the page's script and style, uPlot 1.6.32 from npm with its
MIT license) are package data; nothing is fetched from elsewhere, and a Content-Security-Policy
of ``'self'`` keeps it so.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from importlib.resources import files
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client.registry import CollectorRegistry
from prometheus_client.samples import Sample

from tokenmill.server.errors import APIError
from tokenmill.server.state import ServerState, authenticate, get_state
from tokenmill.server.tenancy import TenantConfig

router = APIRouter()

STATIC = files("tokenmill.server") / "static"
MEDIA_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
               ".css": "text/css; charset=utf-8"}
ASSETS = frozenset({"dashboard.js", "dashboard.css", "uPlot.iife.min.js", "uPlot.min.css"})
"""What /dashboard/static/ serves (the license stays in the package, beside the library)."""
CSP = "default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'; frame-ancestors 'none'"

QUANTILES = (0.5, 0.9, 0.99)
LATENCIES = {"ttft": "time_to_first_token_seconds", "tpot": "time_per_output_token_seconds",
             "e2e": "e2e_request_latency_seconds", "queue": "request_queue_time_seconds"}
"""The histograms the page shows, by its name for them (metric names without the prefix)."""
PREFIX = "tokenmill:"
COST_LINES = ("request", "metered", "idle", "other")
"""The cost counters ``tokenmill:<line>_cost_total``: charged to requests, the meter's whole wall time,
the time no model stepped, the rest (by its own labels)."""
BUDGET_FIELDS = {"limit": "budget_limit", "spent": "budget_spent", "held": "budget_held",
                 "overrun": "budget_overrun_total", "soft_limit_alerts": "budget_soft_limit_alerts_total"}


@router.get("/dashboard", include_in_schema=False)
async def dashboard_page() -> Response:
    """The page; it asks for an admin key itself when the data answers 401 or 403."""
    return _asset("dashboard.html")


@router.get("/dashboard/static/{name}", include_in_schema=False)
async def dashboard_asset(name: str) -> Response:
    if name not in ASSETS:
        raise APIError(404, f"no dashboard file {name!r}", code="not_found")
    return _asset(name)


def _asset(name: str) -> Response:
    media_type = MEDIA_TYPES[name[name.rindex("."):]]
    return Response((STATIC / name).read_bytes(), media_type=media_type,
                    headers={"content-security-policy": CSP, "cache-control": "no-cache"})


@router.get("/admin/dashboard/data")
async def data(request: Request, tenant: Annotated[TenantConfig, Depends(authenticate)]) -> JSONResponse:
    """The dashboard's figures (see :func:`dashboard_data`); needs an admin key when keys are configured."""
    if not tenant.admin:
        raise APIError(403, f"tenant {tenant.name!r} is not an admin", code="not_admin")
    return JSONResponse(dashboard_data(get_state(request)), headers={"cache-control": "no-store"})


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """The q-quantile (0 <= q <= 1) of a histogram given as (upper bound, cumulative count) pairs,
    the last bound +Inf; None when it counted nothing. As Prometheus estimates it: find the bucket
    that holds rank ``q * count`` and interpolate linearly inside it (from 0 for the first bucket);
    a rank in the +Inf bucket gives the highest finite bound.

    E.g. bounds (0.1, 0.2, +Inf) with counts (2, 6, 6): the median (rank 3) lies in (0.1, 0.2],
    one of its four observations in: 0.1 + 0.1 * 1/4 = 0.125.
    """
    buckets = sorted(buckets)
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if math.isinf(upper):
                return lower
            if count == below:  # rank 0 in an empty first bucket
                return lower
            return lower + (upper - lower) * (rank - below) / (count - below)
        lower, below = upper, count
    return lower


def dashboard_data(state: ServerState) -> dict:
    """The dashboard's figures from ``state.metrics.registry`` (what /metrics renders)::

        time       the server's clock (seconds since the epoch): the page's rates divide by its deltas
        models     {model: {requests, finished {reason: n}, rejected {reason: n}, prompt_tokens,
                    generation_tokens, running, waiting, kv_cache_usage (0-1), kv_cache_used_blocks,
                    prefix_cache_hit_rate, preemptions, cold_start_seconds, cost, cost_per_1k_tokens {kind: price},
                    latency {ttft|tpot|e2e|queue: {count, mean_ms, p50_ms, p90_ms, p99_ms}},
                    speculation (null without drafts) {drafts, draft_tokens, accepted_tokens,
                    acceptance_rate, mean_accepted_length, accepted_per_position [n]}}}
        tenants    {tenant: {requests, prompt_tokens, cached_tokens, completion_tokens}}
        cost       null, or {request, metered, idle, other (totals, null when absent), by_model {m: c},
                    by_tenant {t: c}, by_tenant_model [{tenant, model_name, cost}],
                    metered_by / idle_by / other_by [{labels, value}] (the samples of that counter)}
        slo        {tenant: {met, missed, compliance}}
        routing    {route: {requests, by_model {m: n}, escalations, escalation_rate}}
        budgets    {tenant: {limit, spent, held, overrun, soft_limit_alerts, share (spent / limit)}}

    A figure absent from the registry is null (a model's), and a section without samples empty;
    so is a value that is not finite (JSON has no infinity: an unlimited budget, say).
    Milliseconds are rounded to 2 decimals, which is what the page shows.
    """
    samples = _by_name(state.metrics.registry)
    return _finite({"time": time.time(), "models": _models(samples), "tenants": _tenants(samples),
                    "cost": _cost(samples), "slo": _slo(samples), "routing": _routing(samples),
                    "budgets": _budgets(samples)})


Samples = dict[str, list[Sample]]


def _by_name(registry: CollectorRegistry) -> Samples:
    """Every sample, by sample name (a counter's ``x_total``, a histogram's ``x_bucket``); ``_created`` left out."""
    out: Samples = defaultdict(list)
    for family in registry.collect():
        for sample in family.samples:
            if not sample.name.endswith("_created"):
                out[sample.name].append(sample)
    return out


def _sum_by(samples: Samples, name: str, *labels: str) -> dict:
    """The samples of ``name`` summed over every label but ``labels``: keyed by that label's value
    (one label) or by the tuple of values (several); a sample without one of them counts under ''."""
    out: dict = defaultdict(float)
    for sample in samples.get(PREFIX + name, ()):
        key = tuple(sample.labels.get(label, "") for label in labels)
        out[key[0] if len(key) == 1 else key] += sample.value
    return dict(out)


def _total(samples: Samples, name: str) -> float | None:
    found = samples.get(PREFIX + name)
    return sum(s.value for s in found) if found else None


def _ratio(part: float | None, whole: float | None) -> float | None:
    return part / whole if part is not None and whole else None


def _models(samples: Samples) -> dict[str, dict]:
    def per_model(name: str) -> dict[str, float]:
        return _sum_by(samples, name, "model_name")

    def two_level(name: str, label: str) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = defaultdict(dict)
        for (model, value), n in _sum_by(samples, name, "model_name", label).items():
            out[model][value] = n
        return out

    fields = {"prompt_tokens": per_model("prompt_tokens_total"),
              "generation_tokens": per_model("generation_tokens_total"),
              "running": per_model("num_requests_running"), "waiting": per_model("num_requests_waiting"),
              "kv_cache_usage": per_model("kv_cache_usage_perc"), "kv_cache_used_blocks": per_model("kv_cache_used_blocks"),
              "preemptions": per_model("num_preemptions_total"),
              "cold_start_seconds": per_model("model_cold_start_seconds"),
              "cost": per_model("request_cost_total")}
    finished, rejected = two_level("request_success_total", "finished_reason"), two_level("request_rejected_total", "reason")
    prices = two_level("cost_per_1k_tokens", "kind")
    queries, hits = per_model("prefix_cache_queries_total"), per_model("prefix_cache_hits_total")
    latency = {kind: _histograms(samples, name) for kind, name in LATENCIES.items()}
    speculation = _speculation(samples)
    names = {s.labels["model_name"] for found in samples.values() for s in found if "model_name" in s.labels}
    models = {}
    for model in sorted(names):
        entry = {field: values.get(model) for field, values in fields.items()}
        entry["requests"] = sum(finished[model].values()) if model in finished else None
        entry["finished"], entry["rejected"] = finished.get(model, {}), rejected.get(model, {})
        entry["cost_per_1k_tokens"] = prices.get(model, {})
        entry["prefix_cache_hit_rate"] = _ratio(hits.get(model), queries.get(model))
        entry["latency"] = {kind: by_model.get(model, _latency_entry([], 0.0)) for kind, by_model in latency.items()}
        entry["speculation"] = speculation.get(model)
        models[model] = entry
    return models


def _histograms(samples: Samples, name: str) -> dict[str, dict]:
    """{model: latency entry} of one histogram family (buckets of equal bounds summed across other labels)."""
    buckets = _sum_by(samples, name + "_bucket", "model_name", "le")
    sums = _sum_by(samples, name + "_sum", "model_name")
    by_model: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for (model, le), count in buckets.items():
        by_model[model].append((float(le), count))
    return {model: _latency_entry(pairs, sums.get(model, 0.0)) for model, pairs in by_model.items()}


def _latency_entry(buckets: list[tuple[float, float]], seconds: float) -> dict:
    count = int(max((c for _, c in buckets), default=0))
    entry: dict = {"count": count, "mean_ms": _ms(seconds / count) if count else None}
    for q in QUANTILES:
        entry[f"p{round(q * 100)}_ms"] = _ms(histogram_quantile(q, buckets))
    return entry


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


def _speculation(samples: Samples) -> dict[str, dict]:
    """{model: figures} for the models that verified drafts (the counters exist at 0 for all)."""
    drafts = _sum_by(samples, "spec_decode_num_drafts_total", "model_name")
    drafted = _sum_by(samples, "spec_decode_num_draft_tokens_total", "model_name")
    accepted = _sum_by(samples, "spec_decode_num_accepted_tokens_total", "model_name")
    per_position = _sum_by(samples, "spec_decode_num_accepted_tokens_per_pos_total", "model_name", "position")
    out = {}
    for model, n in drafts.items():
        if not n:
            continue
        positions = sorted((int(pos), kept) for (m, pos), kept in per_position.items() if m == model and pos.isdigit())
        kept = accepted.get(model, 0.0)
        out[model] = {"drafts": n, "draft_tokens": drafted.get(model, 0.0), "accepted_tokens": kept,
                      "acceptance_rate": _ratio(kept, drafted.get(model)), "mean_accepted_length": 1 + kept / n,
                      "accepted_per_position": [k for _, k in positions]}
    return out


def _tenants(samples: Samples) -> dict[str, dict]:
    fields = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens")
    values = {field: _sum_by(samples, f"tenant_{field}_total", "tenant") for field in fields}
    names = sorted(set().union(*values.values()))
    return {tenant: {field: values[field].get(tenant, 0.0) for field in fields} for tenant in names}


def _cost(samples: Samples) -> dict | None:
    lines = [line for line in COST_LINES if PREFIX + f"{line}_cost_total" in samples]
    if not lines:
        return None
    by_pair = _sum_by(samples, "request_cost_total", "tenant", "model_name")
    out = {line: _total(samples, f"{line}_cost_total") for line in COST_LINES}
    out.update({f"{line}_by": _labelled(samples.get(PREFIX + f"{line}_cost_total", ())) for line in COST_LINES[1:]})
    return {**out, "by_model": _sum_by(samples, "request_cost_total", "model_name"),
            "by_tenant": _sum_by(samples, "request_cost_total", "tenant"),
            "by_tenant_model": [{"tenant": t, "model_name": m, "cost": c} for (t, m), c in sorted(by_pair.items())]}


def _labelled(samples: Iterable[Sample]) -> list[dict]:
    return [{"labels": dict(s.labels), "value": s.value} for s in samples]


def _slo(samples: Samples) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for (tenant, met), n in sorted(_sum_by(samples, "slo_requests_total", "tenant", "met").items()):
        entry = out.setdefault(tenant, {"met": 0.0, "missed": 0.0})
        entry["met" if met == "true" else "missed"] += n
    for entry in out.values():
        entry["compliance"] = _ratio(entry["met"], entry["met"] + entry["missed"])
    return out


def _routing(samples: Samples) -> dict[str, dict]:
    requests = _sum_by(samples, "route_requests_total", "route", "model_name")
    escalations = _sum_by(samples, "route_escalations_total", "route")
    out: dict[str, dict] = {}
    for route in sorted({r for r, _ in requests} | set(escalations)):
        by_model = {m: n for (r, m), n in sorted(requests.items()) if r == route}
        total = sum(by_model.values())
        out[route] = {"requests": total, "by_model": by_model, "escalations": escalations.get(route, 0.0),
                      "escalation_rate": _ratio(escalations.get(route, 0.0), total)}
    return out


def _finite(value):
    """``value`` with every float that is not finite (inf, nan) replaced by None, through dicts and lists."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _budgets(samples: Samples) -> dict[str, dict]:
    values = {field: _sum_by(samples, name, "tenant") for field, name in BUDGET_FIELDS.items()}
    out = {}
    for tenant in sorted(set().union(*values.values())):
        entry = out[tenant] = {field: by_tenant.get(tenant) for field, by_tenant in values.items()}
        entry["share"] = _ratio(entry["spent"], entry["limit"])  # a limit of 0: no budget
    return out
