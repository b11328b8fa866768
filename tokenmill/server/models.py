"""GET /v1/models, POST /tokenize, POST /detokenize (a routed name tokenizes with neither: 404)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request

from tokenmill.server.chat import render_messages
from tokenmill.server.errors import APIError
from tokenmill.server.generation import tokenize as encode
from tokenmill.server.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizePromptRequest,
    TokenizeResponse,
)
from tokenmill.server.state import authenticate, get_state
from tokenmill.server.tenancy import TenantConfig

router = APIRouter()
Tenant = Annotated[TenantConfig, Depends(authenticate)]


@router.get("/v1/models", response_model=ModelList)
async def list_models(request: Request, tenant: Tenant) -> ModelList:
    """The served models, their LoRA adapters (``parent``: the model, ``root``: where the adapter
    was loaded from) and the routed names (``route``: the models they answer with), those the
    tenant may use."""
    state = get_state(request)
    cards = []
    for served in state.models.values():
        cards.append(ModelCard(id=served.name, created=served.created, max_model_len=served.max_model_len,
                               root=served.source))
        lora = served.engine.lora
        for info in lora.list() if lora is not None else []:
            cards.append(ModelCard(id=info.name, created=info.created, max_model_len=served.max_model_len,
                                   root=info.path, parent=served.name))
    for route in state.routes.values():
        lengths = [state.resolve_model(m, TenantConfig("route")).model.max_model_len for m in route.models]
        cards.append(ModelCard(id=route.name, created=state.created, max_model_len=min(lengths), route=route.models))
    return ModelList(data=[card for card in cards if tenant.may_use(card.id)])


@router.post("/tokenize", response_model=TokenizeResponse)
async def tokenize(body: TokenizePromptRequest | TokenizeChatRequest, request: Request,
                   tenant: Tenant) -> TokenizeResponse:
    served = get_state(request).resolve_model(body.model, tenant).model
    if isinstance(body, TokenizeChatRequest):
        ids = await render_messages(served, body.messages, body.add_generation_prompt)
    else:
        ids = await encode(served, body.prompt, body.add_special_tokens)
    return TokenizeResponse(count=len(ids), max_model_len=served.max_model_len, tokens=ids)


@router.post("/detokenize", response_model=DetokenizeResponse)
async def detokenize(body: DetokenizeRequest, request: Request, tenant: Tenant) -> DetokenizeResponse:
    served = get_state(request).resolve_model(body.model, tenant).model
    bad = next((t for t in body.tokens if not 0 <= t < served.limits.vocab_size), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is outside the vocabulary [0, {served.limits.vocab_size})",
                       param="tokens")
    return DetokenizeResponse(prompt=served.tokenizer.decode(body.tokens))
