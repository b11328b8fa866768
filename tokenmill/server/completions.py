"""POST /v1/completions: prompts as text, token ids or lists of either; streaming and not."""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from tokenmill.server.async_engine import EngineUpdate
from tokenmill.server.generation import (
    usage_event,
    engine_headers,
    run_to_end,
    streaming_response,
    Generation,
    check_prompt,
    check_unsupported,
    sampling_params,
    sse,
    tokenize_all,
    request_tags,
    usage_of,
)
from tokenmill.server.logprobs import TokenText, completion_logprobs, echo_items, items
from tokenmill.server.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
)
from tokenmill.server.routing import run_request
from tokenmill.server.state import ServedModel, Target, authenticate, get_state
from tokenmill.server.tenancy import TenantConfig
from tokenmill.server.warmup import check_warm

router = APIRouter()


async def _prompts(served: ServedModel, prompt) -> tuple[list[str | None], list[list[int]]]:
    """(text or None, token ids) per prompt."""
    if isinstance(prompt, str) or prompt and isinstance(prompt[0], int):
        prompt = [prompt]
    texts = [p if isinstance(p, str) else None for p in prompt]
    encoded = iter(await tokenize_all(served, [t for t in texts if t is not None]))
    return texts, [next(encoded) if t is not None else list(p) for t, p in zip(texts, prompt)]


class CompletionStream:
    """SSE chunks from deltas: each chunk carries a sample's new text and the logprobs of its new
    tokens (tokens whose text is still held back wait for the chunk that shows it)."""

    def __init__(self, gen: Generation, body: CompletionRequest, tokens: TokenText, echo_texts: list[str],
                 response_id: str, created: int, model: str) -> None:
        self.gen, self.body, self.tokens, self.echo_texts = gen, body, tokens, echo_texts
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        self.head = {"id": response_id, "object": "text_completion", "created": created, "model": model}
        self.index_of = {rid: i for i, rid in enumerate(gen.request_ids)}
        self.started: set[tuple[str, int]] = set()
        self.pending: dict[tuple[str, int], list] = {}  # logprobs of tokens not shown yet

    def events(self, update: EngineUpdate) -> list[str]:
        events = []
        prompt_index = self.index_of[update.request_id]
        for out in update.delta.samples:
            key = (update.request_id, out.index)
            pending = self.pending.setdefault(key, [])
            pending.extend(out.logprobs or [])
            if not out.text and not out.finished:
                continue
            text = out.text
            first = key not in self.started
            if first and self.body.echo:
                text = self.echo_texts[prompt_index] + text
            logprobs = None
            if self.body.logprobs is not None:
                entries = items(pending)
                if first and self.body.echo:
                    prompt_logprobs = self.gen.output(update.request_id).prompt_logprobs
                    entries = echo_items(self.gen.prompts[prompt_index], prompt_logprobs) + entries
                logprobs = completion_logprobs(self.tokens, entries).model_dump()
            pending.clear()
            self.started.add(key)
            choice = {"index": prompt_index * self.body.n + out.index, "text": text, "logprobs": logprobs,
                      "finish_reason": out.finish_reason}
            chunk = {**self.head, "choices": [choice]}
            if self.include_usage:
                chunk["usage"] = None
            events.append(sse(chunk))
        return events

    def usage_event(self, gen: Generation) -> str:
        return usage_event(self.head, gen)


@router.post("/v1/completions", response_model=CompletionResponse)
async def create_completion(body: CompletionRequest, request: Request,
                            tenant: Annotated[TenantConfig, Depends(authenticate)]) -> Response:
    arrival = time.monotonic()
    state = get_state(request)
    check_unsupported(body, suffix=(body.suffix, not body.suffix),
                      best_of=(body.best_of, body.best_of in (None, body.n)))
    tags = request_tags(request, None)
    echo_logprobs = body.logprobs if body.echo and body.logprobs is not None else None
    prepared: dict[str, tuple[list[str | None], list[list[int]]]] = {}

    async def prepare(target: Target, route_logprobs: int | None = None) -> Generation:
        served = target.model
        check_warm(state, served)
        texts, prompts = prepared[served.name] = await _prompts(served, body.prompt)
        allowed = [check_prompt(served, ids, body.max_tokens) for ids in prompts]
        max_tokens = body.max_tokens if body.max_tokens is not None else min(allowed)
        logprobs = body.logprobs if route_logprobs is None else max(body.logprobs or 0, route_logprobs)
        params = sampling_params(body, max_tokens, logprobs, prompt_logprobs=echo_logprobs)
        return Generation(state, target, request, tenant, prompts, params, body.priority, body.cache_salt, arrival,
                          body.user, tags, stream=bool(body.stream))

    async def respond(gen: Generation) -> Response:
        texts, prompts = prepared[gen.model.name]
        model = gen.target.name if gen.target.route or body.model is None else body.model
        tokens = TokenText(gen.model.tokenizer)
        echo_texts = [t if t is not None else gen.model.tokenizer.decode(ids, skip_special_tokens=False)
                      for t, ids in zip(texts, prompts)] if body.echo else []
        response_id, created = f"cmpl-{gen.uid}", int(time.time())
        if body.stream:
            stream = CompletionStream(gen, body, tokens, echo_texts, response_id, created, model)
            return await streaming_response(gen, stream, response_id)
        if not await run_to_end(gen):
            return Response(status_code=499)
        choices = []
        for i, (request_id, ids) in enumerate(zip(gen.request_ids, prompts)):
            output = gen.output(request_id)
            for out in output.outputs:
                text = (echo_texts[i] if body.echo else "") + out.text
                logprobs = None
                if body.logprobs is not None:
                    entries = echo_items(ids, output.prompt_logprobs) if body.echo else []
                    logprobs = completion_logprobs(tokens, entries + items(out.logprobs))
                choices.append(CompletionChoice(index=i * body.n + out.index, text=text, logprobs=logprobs,
                                                finish_reason=out.finish_reason))
        response = CompletionResponse(id=response_id, created=created, model=model, choices=choices,
                                      usage=usage_of(gen))
        return JSONResponse(response.model_dump(), headers=engine_headers(gen, response_id))

    return await run_request(state, body.model, tenant, prepare, respond)
