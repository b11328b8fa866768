"""Rolling out a new version of the served model: canary and blue-green, by traffic split.

::

    GET    /admin/rollout               the versions: source, weight, replicas, requests taken
    POST   /admin/rollout               deploy a new version beside the others, taking ``weight`` of
                                        new requests (canary: 0.05; blue-green: 0, then PUT)
    PUT    /admin/rollout               set every version's weight ({"weights": {"v2": 1.0}}: the
                                        blue-green switch, or a canary's promotion)
    DELETE /admin/rollout/{version}     retire a version: no new requests; Ray Serve drains its
                                        replicas (their requests finish) and removes them

Every version is a Ray Serve application of its own (deploy.Fleet), with the first version's engine
options and block-hash key; a new one must have the same tokenizer vocabulary and limits (requests
are checked and tokenized once, in the front). A request goes to a version by a hash of its id,
so the split holds to the weights; per-version counts are in the GET and in ``/metrics``
(``tokenmill:version_requests_total``). All need an admin key when keys are configured.
"""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field

from tokenmill.scaleout.remote import RemoteEngine
from tokenmill.server.admin import _admin
from tokenmill.server.errors import APIError
from tokenmill.server.state import authenticate
from tokenmill.server.tenancy import TenantConfig

Tenant = Annotated[TenantConfig, Depends(authenticate)]


class NewVersion(BaseModel):
    model_config = ConfigDict(extra="forbid")

    source: str = Field(description="the new version's model: a known name, GGUF file or directory")
    weight: float = Field(0.0, ge=0.0, le=1.0, description="share of new requests it takes at once")
    replicas: int | None = Field(None, ge=1, description="its replicas (default: the first version's)")
    name: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="its name (default: tokenmill-vN)")


class Weights(BaseModel):
    model_config = ConfigDict(extra="forbid")

    weights: dict[str, float]


def rollout_router(fleet, engine: RemoteEngine) -> APIRouter:
    """The rollout endpoints over ``fleet`` (deploy.Fleet) and the front's engine."""
    router = APIRouter()
    lock = asyncio.Lock()  # one change at a time
    sources = {name: version.info.source for name, version in engine.versions.items()}

    def status() -> dict:
        return {"versions": [{"name": v.name, "source": sources.get(v.name, v.info.source), "weight": v.weight,
                              "requests": v.requests} for v in engine.versions.values()]}

    @router.get("/admin/rollout")
    async def get_rollout(request: Request, tenant: Tenant) -> dict:
        _admin(request, tenant)
        return status()

    @router.post("/admin/rollout")
    async def new_version(body: NewVersion, request: Request, tenant: Tenant) -> dict:
        _admin(request, tenant)
        async with lock:
            name = body.name or f"tokenmill-v{len(fleet.apps) + 1}"
            if name in engine.versions or name in fleet.apps:
                raise APIError(409, f"a version named {name!r} exists", param="name", code="version_exists")
            try:
                handle, info = await asyncio.to_thread(fleet.deploy, name, body.source, body.replicas)
            except Exception as exc:  # noqa: BLE001 - a source that does not load is the caller's error
                await _forget(fleet, name)
                raise APIError(400, f"could not deploy {body.source!r}: {type(exc).__name__}: {exc}",
                               param="source", code="deploy_failed") from None
            try:
                engine.add_version(name, handle, info, body.weight)
            except ValueError as exc:
                await _forget(fleet, name)
                raise APIError(400, str(exc), param="source", code="incompatible_version") from None
            sources[name] = body.source
            return status()

    @router.put("/admin/rollout")
    async def set_weights(body: Weights, request: Request, tenant: Tenant) -> dict:
        _admin(request, tenant)
        try:
            engine.set_weights(body.weights)
        except ValueError as exc:
            raise APIError(400, str(exc), param="weights") from None
        return status()

    @router.delete("/admin/rollout/{name}")
    async def retire(name: str, request: Request, tenant: Tenant) -> dict:
        _admin(request, tenant)
        async with lock:
            try:
                engine.remove_version(name)
            except ValueError as exc:
                code = 404 if name not in engine.versions else 400
                raise APIError(code, str(exc), param="name", code="version_not_found" if code == 404 else None) \
                    from None
            await asyncio.to_thread(fleet.delete, name)  # drains: its running requests finish first
            return status()

    return router


async def _forget(fleet, name: str) -> None:
    if name in fleet.apps:
        await asyncio.to_thread(fleet.delete, name)
