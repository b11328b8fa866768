"""ServerState: everything a handler needs, built once per app (no module globals).

Several models can be served at once (``tokenmill serve --model A=SOURCE --model B=SOURCE``); each
is a :class:`ServedModel` (its engine, tokenizer, limits, admission queue), and one
:class:`~tokenmill.server.async_engine.AsyncEngine` steps them all. A request's ``model`` becomes
a :class:`Target` (served model, LoRA adapter) in :meth:`ServerState.resolve_model`, the one
place that happens; a routed name (routing.py) becomes one there too, by the route's policy.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from fastapi import Request

from tokenmill.engine import LLMEngine, PromptLimits
from tokenmill.llm import LLM
from tokenmill.loading.tokenizer import Tokenizer
from tokenmill.server.admission import AdmissionController
from tokenmill.server.async_engine import AsyncEngine
from tokenmill.server.budgets import BudgetBook
from tokenmill.server.config import CostConfig, ServerConfig
from tokenmill.server.cost import CostMeter
from tokenmill.server.errors import APIError
from tokenmill.server.metrics import ServerMetrics
from tokenmill.server.tenancy import Tenancy, TenantConfig


@dataclass
class ServedModel:
    """One model the server serves by name."""

    name: str
    engine: LLMEngine
    """Stepped only by the AsyncEngine's thread; handlers read its limits and LoRA adapters."""
    tokenizer: Tokenizer
    admission: AdmissionController
    source: str
    """Where it was loaded from (a path, a registry name)."""
    kv_cache_memory: int
    """Bytes of the server's KV budget this model's pool was sized from."""
    created: int = field(default_factory=lambda: int(time.time()))
    cold_start: float | None = None
    """Seconds from the load starting to the model serving (weights, engine, warm-up); None when unknown."""
    warming: bool = False
    """True until the engine thread has warmed this model up (503 ``warming_up`` meanwhile)."""

    @classmethod
    def of(cls, name: str, llm: LLM, config: ServerConfig) -> ServedModel:
        """A loaded model as the server serves it, with an admission queue of its own."""
        engine = llm.engine
        admission = AdmissionController(engine.config.scheduler.max_num_seqs, config.max_queued_requests,
                                        config.max_queued_tokens, config.retry_after)
        return cls(name, engine, llm.tokenizer, admission, llm.model_name, engine.kv_cache_bytes)

    @property
    def limits(self) -> PromptLimits:
        return self.engine.limits

    @property
    def max_model_len(self) -> int:
        return self.engine.limits.max_model_len


@dataclass(frozen=True)
class Target:
    """What a request runs on: a served model, maybe with one of its LoRA adapters."""

    model: ServedModel
    adapter: str | None = None
    route: str | None = None
    """The routed name the client asked for, when a route chose this target."""

    @property
    def name(self) -> str:
        """The name responses report: the adapter's, or the served model's."""
        return self.adapter or self.model.name


@dataclass
class ServerState:
    config: ServerConfig
    engine: AsyncEngine
    models: dict[str, ServedModel]
    """The served models by name, in the order given (the first answers requests without ``model``)."""
    tenancy: Tenancy
    metrics: ServerMetrics
    cost: CostConfig
    meter: CostMeter
    budgets: BudgetBook
    created: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False
    in_flight: int = 0
    """HTTP requests being served (streams included)."""
    loader: object | None = None
    """Builds models for ``POST /admin/models`` (model_pool.ModelLoader); None: runtime loading is off."""
    routes: dict = field(default_factory=dict)
    """Routed model names (routing.py) by name."""
    loading: set[str] = field(default_factory=set)
    """Names of models being loaded at runtime (POST /admin/models)."""

    @property
    def default_model(self) -> ServedModel:
        return next(iter(self.models.values()))

    @property
    def warming(self) -> bool:
        return any(m.warming for m in self.models.values())

    def reservation_rates(self, model: str) -> tuple[float, float]:
        """(prompt, completion) price per 1k tokens a budget hold assumes for ``model``: the
        configured ones, else the model's measured rates times ``reserve_margin``; before any
        measurement, its warm-up's batch-of-one step time per token (a generous bound: batching
        only makes tokens cheaper)."""
        cost, measured = self.cost, self.meter.rates().get(model, {})
        warm = self.engine.warm_step_seconds.get(model, 0.0) * self.meter.price(model) * 1000
        prompt = measured.get("prompt", warm) * cost.reserve_margin
        completion = measured.get("completion", warm) * cost.reserve_margin
        return (cost.reserve_prompt_per_1k if cost.reserve_prompt_per_1k is not None else prompt,
                cost.reserve_completion_per_1k if cost.reserve_completion_per_1k is not None else completion)

    def resolve_model(self, model: str | None, tenant: TenantConfig) -> Target:
        """The target a request's ``model`` names: a served model, ``<served model>:<adapter>``, or an
        adapter's name (the first served model that has it); none: the first served model. 404
        ``model_not_found`` for a name the server does not serve, 403 ``model_not_allowed`` for one
        the tenant may not use.

        The one place a ``model`` string becomes (served model, adapter)."""
        served = self.default_model if model is None else self.models.get(model)
        adapter = None
        if served is None:
            base, sep, rest = model.partition(":")
            if sep and base in self.models and self._has_adapter(self.models[base], rest):
                served, adapter = self.models[base], rest
            else:
                served = next((m for m in self.models.values() if self._has_adapter(m, model)), None)
                adapter = model
        if served is None:
            raise APIError(404, f"the model {model!r} does not exist; this server serves "
                           f"{', '.join(map(repr, self.model_names()))}", param="model", code="model_not_found")
        if not tenant.may_use(adapter or served.name):
            raise APIError(403, f"tenant {tenant.name!r} may not use the model {model!r}", param="model",
                           code="model_not_allowed")
        return Target(served, adapter)

    @staticmethod
    def _has_adapter(served: ServedModel, name: str) -> bool:
        lora = served.engine.lora
        return lora is not None and name in lora

    def model_names(self) -> list[str]:
        """Every name a request may give: served models, their adapters, routes."""
        names = []
        for served in self.models.values():
            names.append(served.name)
            lora = served.engine.lora
            names += [info.name for info in lora.list()] if lora is not None else []
        return names + list(self.routes)


def get_state(request: Request) -> ServerState:
    return request.app.state.server


TENANT_SCOPE_KEY = "tokenmill.tenant"
"""Where ServingMiddleware leaves the tenant it authenticated (in ``scope["state"]``), before the body is read."""


def authenticate(request: Request) -> TenantConfig:
    """FastAPI dependency: the caller's tenant (401 without a valid key when keys are configured),
    as ServingMiddleware found it, or from the Authorization header on routes it does not check."""
    tenant = request.scope.get("state", {}).get(TENANT_SCOPE_KEY)
    if tenant is not None:
        return tenant
    return get_state(request).tenancy.authenticate(request.headers.get("authorization"))
