"""GET /v1/models, POST /tokenize, POST /detokenize."""

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
    """The served model and its LoRA adapters (``parent``: the served model, ``root``: where the
    adapter was loaded from), those the tenant may use."""
    state = get_state(request)
    cards = [ModelCard(id=state.model_name, created=state.created, max_model_len=state.max_model_len,
                       root=state.model_name)]
    lora = state.engine.engine.lora
    for info in lora.list() if lora is not None else []:
        cards.append(ModelCard(id=info.name, created=info.created, max_model_len=state.max_model_len, root=info.path,
                               parent=state.model_name))
    return ModelList(data=[card for card in cards if tenant.may_use(card.id)])


@router.post("/tokenize", response_model=TokenizeResponse)
async def tokenize(body: TokenizePromptRequest | TokenizeChatRequest, request: Request,
                   tenant: Tenant) -> TokenizeResponse:
    state = get_state(request)
    state.resolve_model(body.model, tenant)
    if isinstance(body, TokenizeChatRequest):
        ids = await render_messages(state, body.messages, body.add_generation_prompt)
    else:
        ids = await encode(state, body.prompt, body.add_special_tokens)
    return TokenizeResponse(count=len(ids), max_model_len=state.max_model_len, tokens=ids)


@router.post("/detokenize", response_model=DetokenizeResponse)
async def detokenize(body: DetokenizeRequest, request: Request, tenant: Tenant) -> DetokenizeResponse:
    state = get_state(request)
    state.resolve_model(body.model, tenant)
    bad = next((t for t in body.tokens if not 0 <= t < state.limits.vocab_size), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is outside the vocabulary [0, {state.limits.vocab_size})", param="tokens")
    return DetokenizeResponse(prompt=state.tokenizer.decode(body.tokens))
