"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter: LoRA adapters at runtime, vLLM's bodies.

Admin only when API keys are configured (the path names a file on the server). Loading reads and
checks the adapter in a worker thread, then registers it in the engine thread between two steps,
so decoding pauses only for the registration. Unloading makes the name unknown to new requests;
requests already running on it finish on its weights (see ``tokenmill.lora.manager``).
"""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Depends, Request

from tokenmill.errors import TokenmillError
from tokenmill.lora.manager import LoRAManager, UnknownAdapterError
from tokenmill.server.errors import APIError
from tokenmill.server.protocol import LoadLoRAAdapterRequest, LoRAAdapterResponse, UnloadLoRAAdapterRequest
from tokenmill.server.state import ServerState, authenticate, get_state
from tokenmill.server.tenancy import TenantConfig

router = APIRouter()
Tenant = Annotated[TenantConfig, Depends(authenticate)]


def _manager(state: ServerState, tenant: TenantConfig, base: str | None) -> LoRAManager:
    """The LoRA adapters of served model ``base`` (None: the first)."""
    if not tenant.admin:
        raise APIError(403, f"tenant {tenant.name!r} may not load or unload adapters (it needs \"admin\")",
                       code="not_admin")
    served = state.default_model if base is None else state.models.get(base)
    if served is None:
        raise APIError(404, f"base_model_name {base!r} is not served", param="base_model_name",
                       code="model_not_found")
    manager = served.engine.lora
    if manager is None:
        raise APIError(400, "this server serves no LoRA adapters: start it with --enable-lora", code="lora_disabled")
    return manager


@router.post("/v1/load_lora_adapter", response_model=LoRAAdapterResponse)
async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request, tenant: Tenant) -> LoRAAdapterResponse:
    state = get_state(request)
    manager = _manager(state, tenant, body.base_model_name)
    if body.lora_name in state.models or body.lora_name in state.routes:
        raise APIError(400, f"{body.lora_name!r} is the name of a served model or route", param="lora_name")
    try:
        manager.check_name(body.lora_name, body.load_inplace)
        adapter = await asyncio.to_thread(manager.read, body.lora_name, body.lora_path)
        await state.engine.call(lambda: manager.add(adapter, body.load_inplace))
    except TokenmillError as exc:
        raise APIError.from_tokenmill(exc) from None
    return LoRAAdapterResponse(lora_name=body.lora_name, status="loaded",
                               message=f"Success: LoRA adapter {body.lora_name!r} added successfully "
                                       f"(rank {adapter.rank}, {adapter.nbytes / 2**20:.1f} MiB).")


@router.post("/v1/unload_lora_adapter", response_model=LoRAAdapterResponse)
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request,
                              tenant: Tenant) -> LoRAAdapterResponse:
    manager = _manager(get_state(request), tenant, body.base_model_name)
    try:
        in_use = await get_state(request).engine.call(lambda: manager.unload(body.lora_name))
    except UnknownAdapterError as exc:
        raise APIError(404, str(exc), param="lora_name", code="lora_not_found") from None
    note = f"; {in_use} running request(s) finish on its weights" if in_use else ""
    return LoRAAdapterResponse(lora_name=body.lora_name, status="unloaded", in_use=in_use,
                               message=f"Success: LoRA adapter {body.lora_name!r} removed successfully{note}.")
