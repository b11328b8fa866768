"""ServerState: everything a handler needs, built once per app (no module globals)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from fastapi import Request

from tokenmill.engine import PromptLimits
from tokenmill.loading.tokenizer import Tokenizer
from tokenmill.server.admission import AdmissionController
from tokenmill.server.async_engine import AsyncEngine
from tokenmill.server.config import ServerConfig
from tokenmill.server.errors import APIError
from tokenmill.server.metrics import ServerMetrics
from tokenmill.server.tenancy import Tenancy, TenantConfig


@dataclass
class ServerState:
    config: ServerConfig
    engine: AsyncEngine
    tokenizer: Tokenizer
    model_name: str
    limits: PromptLimits
    """The engine's prompt limits (vocabulary, context window, KV pool), checked before admission."""
    admission: AdmissionController
    tenancy: Tenancy
    metrics: ServerMetrics
    created: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False
    in_flight: int = 0
    """HTTP requests being served (streams included)."""
    warming: bool = False
    """True from construction until the engine thread has warmed up (kernels built or loaded, one
    tiny generation run): set and cleared through ``AsyncEngine.warm_up_first`` (create_state);
    meanwhile /ready and generation requests answer 503 ``warming_up`` (server/warmup.py)."""

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len

    def resolve_model(self, model: str | None, tenant: TenantConfig) -> str | None:
        """The LoRA adapter a request's ``model`` names, None for the served model itself (or no
        ``model``): an adapter's name, or ``<served model>:<adapter>``. 404 ``model_not_found`` for
        a name the server does not serve, 403 ``model_not_allowed`` for one the tenant may not use.

        The one place a ``model`` string becomes (base, adapter)."""
        name = self.model_name if model is None else model
        adapter = None
        if name != self.model_name:
            base, sep, rest = name.partition(":")
            adapter = rest if sep and base == self.model_name else name
            lora = self.engine.engine.lora
            if lora is None or adapter not in lora:
                served = [self.model_name] + ([info.name for info in lora.list()] if lora is not None else [])
                raise APIError(404, f"the model {model!r} does not exist; this server serves "
                               f"{', '.join(map(repr, served))}", param="model", code="model_not_found")
        if not tenant.may_use(adapter or self.model_name):
            raise APIError(403, f"tenant {tenant.name!r} may not use the model {model!r}", param="model",
                           code="model_not_allowed")
        return adapter


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
