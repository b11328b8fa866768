"""POST /v1/chat/completions: the model's chat template, then generation as for completions."""

from __future__ import annotations

import asyncio
import time
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from tokenmill.errors import InvalidParameterError
from tokenmill.server.async_engine import EngineUpdate
from tokenmill.server.errors import APIError
from tokenmill.server.generation import (
    LARGE_TEXT,
    check_text_length,
    usage_event,
    engine_headers,
    run_to_end,
    streaming_response,
    Generation,
    check_prompt,
    check_unsupported,
    sampling_params,
    sse,
    tokenize,
    request_tags,
    usage_of,
)
from tokenmill.server.logprobs import TokenText, chat_logprobs
from tokenmill.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
)
from tokenmill.server.routing import run_request
from tokenmill.server.state import ServedModel, Target, authenticate, get_state
from tokenmill.server.tenancy import TenantConfig
from tokenmill.server.warmup import check_warm

router = APIRouter()


async def render_messages(served: ServedModel, messages: list[ChatMessage], add_generation_prompt: bool = True
                          ) -> list[int]:
    """Token ids of the conversation through the chat template (as LLM.render_chat)."""
    plain = []
    for m in messages:
        content = m.content if isinstance(m.content, str) else "\n".join(p.text for p in m.content or [])
        plain.append({"role": "system" if m.role == "developer" else m.role, "content": content})
    chars = sum(len(m["content"]) for m in plain)
    check_text_length(served, chars, param="messages")  # the rendered text is longer still
    try:
        if chars > LARGE_TEXT:
            text = await asyncio.to_thread(served.tokenizer.apply_chat_template, plain,
                                           add_generation_prompt=add_generation_prompt)
        else:
            text = served.tokenizer.apply_chat_template(plain, add_generation_prompt=add_generation_prompt)
    except InvalidParameterError as exc:
        raise APIError(400, str(exc), param="messages") from exc
    return await tokenize(served, text, add_special_tokens=False, param="messages")


def _num_top(body: ChatCompletionRequest) -> int | None:
    """Engine logprobs for the request: None without logprobs, else top_logprobs (0..20)."""
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
    if not body.logprobs:
        return None
    top = body.top_logprobs or 0
    if not 0 <= top <= 20:
        raise APIError(400, f"top_logprobs must be in [0, 20], got {top}", param="top_logprobs")
    return top


class ChatStream:
    """SSE chunks from deltas: each carries a sample's new text and the logprobs of its new tokens
    (tokens whose text is still held back wait for the chunk that shows it)."""

    def __init__(self, body: ChatCompletionRequest, tokens: TokenText, num_top: int | None, response_id: str,
                 created: int, model: str) -> None:
        self.body, self.tokens, self.num_top = body, tokens, num_top
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        self.head = {"id": response_id, "object": "chat.completion.chunk", "created": created, "model": model}
        self.started: set[int] = set()
        self.pending: dict[int, list] = {}  # sample index -> logprobs of tokens not shown yet

    def events(self, update: EngineUpdate) -> list[str]:
        events = []
        for out in update.delta.samples:
            pending = self.pending.setdefault(out.index, [])
            pending.extend(out.logprobs or [])
            if not out.text and not out.finished:
                continue
            first = out.index not in self.started
            message = {"role": "assistant", "content": out.text} if first else (
                {"content": out.text} if out.text else {})
            logprobs = None
            if self.num_top is not None:
                logprobs = chat_logprobs(self.tokens, pending, self.num_top).model_dump()
            pending.clear()
            self.started.add(out.index)
            choice = {"index": out.index, "delta": message, "logprobs": logprobs, "finish_reason": out.finish_reason}
            chunk = {**self.head, "choices": [choice]}
            if self.include_usage:
                chunk["usage"] = None
            events.append(sse(chunk))
        return events

    def usage_event(self, gen: Generation) -> str:
        return usage_event(self.head, gen)


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse)
async def create_chat_completion(body: ChatCompletionRequest, request: Request,
                                 tenant: Annotated[TenantConfig, Depends(authenticate)]) -> Response:
    arrival = time.monotonic()
    state = get_state(request)
    check_unsupported(body)
    num_top = _num_top(body)
    tags = request_tags(request, body.metadata)
    asked = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens

    async def prepare(target: Target, route_logprobs: int | None = None) -> Generation:
        served = target.model
        check_warm(state, served)
        ids = await render_messages(served, body.messages, body.add_generation_prompt)
        max_tokens = check_prompt(served, ids, asked, param="messages")
        logprobs = num_top if route_logprobs is None else max(num_top or 0, route_logprobs)
        params = sampling_params(body, max_tokens, logprobs)
        return Generation(state, target, request, tenant, [ids], params, body.priority, body.cache_salt, arrival,
                          body.user, tags, stream=bool(body.stream))

    async def respond(gen: Generation) -> Response:
        model = gen.target.name if gen.target.route or body.model is None else body.model
        tokens = TokenText(gen.model.tokenizer)
        response_id, created = f"chatcmpl-{gen.uid}", int(time.time())
        if body.stream:
            stream = ChatStream(body, tokens, num_top, response_id, created, model)
            return await streaming_response(gen, stream, response_id)
        if not await run_to_end(gen):
            return Response(status_code=499)
        request_id = gen.request_ids[0]
        choices = [ChatChoice(index=out.index, message=AssistantMessage(content=out.text),
                              logprobs=chat_logprobs(tokens, out.logprobs or [], num_top) if num_top is not None
                              else None, finish_reason=out.finish_reason)
                   for out in gen.output(request_id).outputs]
        response = ChatCompletionResponse(id=response_id, created=created, model=model, choices=choices,
                                          usage=usage_of(gen))
        return JSONResponse(response.model_dump(), headers=engine_headers(gen, response_id))

    return await run_request(state, body.model, tenant, prepare, respond)
