"""One HTTP generation request, from limits to cleanup, shared by completions and chat.

::

    Generation.start()   tenant limits ─► admission (queue, priority, deadline) ─► engine.add per prompt
                         + a task that watches for the client going away
    next_update()        the next EngineUpdate (a RequestDelta) of any of its engine requests, folded
                         into that request's cumulative output; errors become APIError
    close()              abort what is unfinished, give back the admission slots, record usage
                         and metrics; synchronous and idempotent, so it is safe in any finally

Also here: turning request fields into SamplingParams, checking prompts against the context,
and the SSE framing.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask

from tokenmill.engine import OutputAccumulator, RequestDelta, RequestOutput
from tokenmill.errors import InvalidParameterError, TokenmillError
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.admission import Rejected, Ticket
from tokenmill.server.async_engine import EngineUpdate
from tokenmill.server.errors import APIError, param_from_message
from tokenmill.server.protocol import PromptTokensDetails, SamplingFields, Usage
from tokenmill.server.state import ServerState
from tokenmill.server.tenancy import Reservation, TenantConfig

LARGE_TEXT = 20_000
"""Prompts longer than this many characters are tokenized (or rendered) off the event loop."""


class ClientDisconnected(Exception):
    """The client went away; its engine requests are aborted."""


def sse(data: Any) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return f"data: {payload}\n\n"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def rejected_error(exc: Rejected) -> APIError:
    return APIError(exc.status, exc.message, code=exc.reason, retry_after=exc.retry_after)


def deadline_of(state: ServerState, request: Request, arrival: float) -> float:
    """The request's deadline: the server's request_timeout, or less if ``X-Request-Timeout`` asks."""
    timeout = state.config.request_timeout
    asked = request.headers.get("x-request-timeout")
    if asked is not None:
        try:
            value = float(asked)
        except ValueError:
            value = float("nan")
        if not 0 < value < float("inf"):
            raise APIError(400, f"X-Request-Timeout must be a positive number of seconds, got {asked!r}",
                           param="X-Request-Timeout")
        timeout = min(timeout, value)
    return arrival + timeout


async def tokenize(state: ServerState, text: str, add_special_tokens: bool = True, param: str = "prompt"
                   ) -> list[int]:
    """The token ids of one prompt text (``param`` names its field in errors); see :func:`tokenize_all`."""
    return (await tokenize_all(state, [text], add_special_tokens, param))[0]


async def tokenize_all(state: ServerState, texts: list[str], add_special_tokens: bool = True,
                       param: str = "prompt") -> list[list[int]]:
    """The token ids of each of a request's prompt texts. A text too long to fit in any sequence is
    refused before anything is tokenized; when they are long together, they are tokenized in a
    worker thread, by the tokenizer's path that lets the event loop run meanwhile."""
    for text in texts:
        check_text_length(state, len(text), param)
    if sum(map(len, texts)) > LARGE_TEXT:
        encode = state.tokenizer.encode_releasing_gil
        return await asyncio.to_thread(lambda: [encode(text, add_special_tokens) for text in texts])
    return [state.tokenizer.encode(text, add_special_tokens) for text in texts]


def check_text_length(state: ServerState, chars: int, param: str = "prompt") -> None:
    """400 ``context_length_exceeded`` for a text of more characters than the longest sequence can
    hold (each token covers at most ``max_token_chars`` of them), without tokenizing it."""
    max_seq, per_token = state.limits.max_seq_tokens, state.tokenizer.max_token_chars
    if chars > max_seq * per_token:
        raise APIError(400, f"{param!r} has {chars} characters, more than fit in the context: a sequence "
                       f"holds at most {max_seq} tokens and this model's longest token has {per_token} "
                       "characters; shorten it", param=param, code="context_length_exceeded")


def check_prompt(state: ServerState, ids: list[int], max_tokens: int | None, param: str = "prompt") -> int:
    """Validate one prompt's token ids with the engine's own limits; return the max_tokens it may use
    (filled in when None). The engine checks again when it adds the request: the same function."""
    try:
        return state.limits.check(ids, max_tokens, param)
    except TokenmillError as exc:
        raise APIError.from_tokenmill(exc) from None


def check_unsupported(body: SamplingFields, **extra: Any) -> None:
    """OpenAI features accepted only at their no-op values."""
    if body.logit_bias:
        raise APIError(400, "logit_bias is not supported", param="logit_bias")
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options is only allowed with stream=true", param="stream_options")
    for name, (value, ok) in extra.items():
        if not ok:
            raise APIError(400, f"{name}={value!r} is not supported", param=name)


def sampling_params(body: SamplingFields, max_tokens: int | None, logprobs: int | None,
                    prompt_logprobs: int | None = None) -> SamplingParams:
    fields = {
        "n": body.n, "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p, "top_k": body.top_k or 0, "min_p": body.min_p or 0.0,
        "repetition_penalty": body.repetition_penalty or 1.0, "presence_penalty": body.presence_penalty or 0.0,
        "frequency_penalty": body.frequency_penalty or 0.0,
        # the engine derives per-sample seeds from the seed; keep it in a range torch accepts
        "seed": None if body.seed is None else body.seed % 2**32, "max_tokens": max_tokens,
        "min_tokens": body.min_tokens, "stop": body.stop or [], "stop_token_ids": body.stop_token_ids or [],
        "include_stop_str_in_output": body.include_stop_str_in_output, "ignore_eos": body.ignore_eos,
        "logprobs": logprobs, "prompt_logprobs": prompt_logprobs, "skip_special_tokens": body.skip_special_tokens,
        "speculative": body.speculative}
    try:
        return SamplingParams(**fields)
    except InvalidParameterError as exc:
        raise APIError(400, str(exc), param=param_from_message(str(exc))) from exc


def usage_of(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Usage:
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


_GONE = object()


class Generation:
    def __init__(self, state: ServerState, http: Request, tenant: TenantConfig, prompts: list[list[int]],
                 params: SamplingParams, priority: int, cache_salt: str | None, arrival: float,
                 lora: str | None = None) -> None:
        self.state, self.http, self.tenant = state, http, tenant
        self.lora = lora
        """The LoRA adapter its requests run with (``ServerState.resolve_model``), None for the base model."""
        self.prompts, self.params, self.priority = prompts, params, priority
        self.arrival = arrival
        self.deadline = deadline_of(state, http, arrival)
        self.cache_salt = state.tenancy.cache_salt(tenant, cache_salt)
        """The engine's prefix-cache salt: the tenant's cache_group and the request's cache_salt, hashed."""
        base = new_id("req")
        self.request_ids = [f"{base}-{i}" for i in range(len(prompts))]
        self.outputs = {rid: OutputAccumulator(rid, None, ids, params.n, params.logprobs is not None,
                                               params.prompt_logprobs is not None)
                        for rid, ids in zip(self.request_ids, prompts)}
        """The cumulative output of each engine request, from the deltas received so far."""
        self.latest: dict[str, RequestDelta] = {}
        """Each engine request's latest delta (its timings)."""
        self.errors: dict[str, str] = {}
        self.unfinished: set[str] = set()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.ticket: Ticket | None = None
        self.reservation: Reservation | None = None
        """The tenant's hold on its limits (reserved_tokens), settled or cancelled by close()."""
        self._added = False
        self._watcher: asyncio.Task | None = None
        self._last_token_time: dict[str, float] = {}
        self._closed = False

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def reserved_tokens(self) -> int:
        """What tokens_per_minute holds at admission: every prompt, plus max_tokens for each of its n
        samples (the handlers fill max_tokens in; without it, the rest of the context)."""
        asked, total = self.params.max_tokens, 0
        for ids in self.prompts:
            room = asked if asked is not None else max(self.state.limits.max_seq_tokens - len(ids), 0)
            total += len(ids) + self.params.n * room
        return total

    @property
    def cached_tokens(self) -> int:
        return sum(d.num_cached_tokens for d in self.latest.values())

    @property
    def completion_tokens(self) -> int:
        return sum(len(o.token_ids) for acc in self.outputs.values() for o in acc.output.outputs)

    def output(self, request_id: str) -> RequestOutput:
        """Everything one engine request has produced so far."""
        return self.outputs[request_id].output

    @property
    def done(self) -> bool:
        return not self.unfinished

    async def start(self) -> None:
        state = self.state
        num_seqs = len(self.prompts) * self.params.n
        if num_seqs > state.admission.capacity:
            raise APIError(400, f"{len(self.prompts)} prompt(s) times n={self.params.n} is {num_seqs} sequences; "
                           f"the server runs at most {state.admission.capacity} at once", param="n")
        try:
            try:
                self.reservation = state.tenancy.start(self.tenant, self.reserved_tokens)
            except APIError as exc:  # the reservation alone is over the tenant's limit
                state.metrics.reject(exc.code or "tenant_tokens_exceeded")
                raise
            self.ticket = Ticket(self.priority, num_seqs, self.prompt_tokens, self.deadline)
            try:
                state.metrics.set_queued(state.admission.num_queued + 1, state.engine.snapshot.num_waiting)
                await state.admission.admit(self.ticket)
            finally:
                state.metrics.set_queued(state.admission.num_queued, state.engine.snapshot.num_waiting)
        except Rejected as exc:
            state.metrics.reject(exc.reason)
            self.close()
            raise rejected_error(exc) from None
        except BaseException:
            self.close()
            raise
        self._added = True
        for request_id, ids in zip(self.request_ids, self.prompts):
            state.engine.add(request_id, ids, self.params, self.queue, self.deadline, self.priority,
                             self.cache_salt, self.lora)
            self.unfinished.add(request_id)
        self._watcher = asyncio.create_task(self._watch_disconnect())

    async def _watch_disconnect(self) -> None:
        while True:
            message = await self.http.receive()
            if message["type"] == "http.disconnect":
                if self.unfinished:
                    self.state.metrics.reject("client_disconnected")
                self._abort_unfinished()
                self.queue.put_nowait(_GONE)
                return

    async def next_update(self) -> EngineUpdate:
        """The next update; APIError when the engine ended it with an error, ClientDisconnected."""
        grace = max(self.deadline - time.monotonic(), 0) + 5.0  # the engine thread enforces the deadline
        try:
            item = await asyncio.wait_for(self.queue.get(), grace)
        except asyncio.TimeoutError:
            raise APIError(503, "the engine did not answer in time", code="engine_unavailable",
                           retry_after=self.state.config.retry_after) from None
        if item is _GONE:
            raise ClientDisconnected()
        self._record(item)
        if item.error is not None:
            raise self._error_of(item)
        if item.delta is not None and any(o.finish_reason == "error" for o in item.delta.samples):
            raise APIError(503, "the KV cache cannot hold this request now", code="kv_cache_exhausted",
                           retry_after=self.state.config.retry_after)
        return item

    def _record(self, update: EngineUpdate) -> None:
        if update.finished:
            self.unfinished.discard(update.request_id)
        if update.error is not None:
            self.errors[update.request_id] = update.error
        delta = update.delta
        if delta is None:
            return
        self.latest[update.request_id] = delta
        self.outputs[update.request_id].add(delta)
        if any(s.token_ids for s in delta.samples if s.index == 0):
            now = time.monotonic()
            last = self._last_token_time.get(update.request_id)
            if last is not None:
                self.state.metrics.observe_inter_token(now - last)
            self._last_token_time[update.request_id] = now

    def _error_of(self, update: EngineUpdate) -> APIError:
        retry = self.state.config.retry_after
        self.state.metrics.reject(update.error)
        if update.error == "invalid":
            return APIError(400, update.message, param=param_from_message(update.message))
        if update.error == "model_not_found":
            return APIError(404, update.message, param="model", code="model_not_found")
        if update.error == "deadline":
            return APIError(503, update.message, code="deadline_exceeded", retry_after=retry)
        if update.error == "shutdown":
            return APIError(503, update.message, code="shutting_down", retry_after=retry)
        return APIError(500, update.message, type="server_error", code="engine_error")

    def _abort_unfinished(self) -> None:
        for request_id in list(self.unfinished):
            self.state.engine.abort(request_id)
        self.unfinished.clear()

    def close(self) -> None:
        """Abort anything unfinished, release the slots, record usage and metrics. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._watcher is not None:
            self._watcher.cancel()
        aborted = set(self.unfinished)
        self._abort_unfinished()
        state = self.state
        if self.ticket is not None:
            state.admission.release(self.ticket)
        if self.reservation is not None:  # settle to what was used; all of it back if it never ran
            if self._added:
                state.tenancy.finish(self.reservation, self.prompt_tokens, self.cached_tokens,
                                     self.completion_tokens, self.lora)
            else:
                state.tenancy.cancel(self.reservation)
        now = time.monotonic()
        for request_id, ids in zip(self.request_ids, self.prompts):
            delta = self.latest.get(request_id)
            error = self.errors.get(request_id)
            if delta is None and error is None and request_id not in aborted:
                continue
            outputs = self.output(request_id).outputs
            reason = ("abort" if request_id in aborted else error) or (outputs[0].finish_reason or "abort")
            state.metrics.observe_request(self.arrival, delta.scheduled_time if delta else None,
                                          delta.first_token_time if delta else None,
                                          delta.finish_time if delta and delta.finish_time else now, len(ids),
                                          sum(len(o.token_ids) for o in outputs), reason, self.lora)


def usage_event(head: dict, gen: Generation) -> str:
    """The usage-only chunk that ends a stream when ``stream_options.include_usage`` asks for it."""
    usage = usage_of(gen.prompt_tokens, gen.completion_tokens, gen.cached_tokens)
    return sse({**head, "choices": [], "usage": usage.model_dump()})


class StreamFormatter(Protocol):
    """Turns updates into SSE events; completions and chat each implement one."""

    include_usage: bool

    def events(self, update: EngineUpdate) -> list[str]: ...

    def usage_event(self, gen: Generation) -> str: ...


async def first_events(gen: Generation, formatter: StreamFormatter) -> tuple[list[str], EngineUpdate | None]:
    """Wait for the first event worth sending (the first token's text, or the end), before the
    response starts: errors up to here still get their own status code."""
    while not gen.done:
        update = await gen.next_update()
        events = formatter.events(update)
        if events:
            return events, update
    return [], None


async def sse_stream(gen: Generation, formatter: StreamFormatter, first: list[str]):
    """The rest of the stream; an error after the response started becomes an error event."""
    try:
        for event in first:
            yield event
        failed = False
        while not gen.done:
            try:
                update = await gen.next_update()
            except ClientDisconnected:
                return
            except APIError as exc:
                yield sse({"error": {"message": exc.message, "type": exc.type, "param": exc.param,
                                     "code": exc.code}})
                failed = True
                break
            for event in formatter.events(update):
                yield event
        if formatter.include_usage and not failed:
            yield formatter.usage_event(gen)
        yield "data: [DONE]\n\n"
    finally:
        gen.close()


def engine_headers(delta: RequestDelta | None, request_id: str) -> dict[str, str]:
    """X-Engine-TTFT: the engine's own time to first token (arrival in the engine to first token)."""
    headers = {"X-Request-Id": request_id}
    if delta is not None and delta.first_token_time is not None:
        headers["X-Engine-TTFT"] = f"{delta.first_token_time - delta.arrival_time:.6f}"
    return headers


async def streaming_response(gen: Generation, formatter: StreamFormatter, response_id: str) -> Response:
    """The SSE response, once the first event is ready (499 when the client left before it)."""
    try:
        first, update = await first_events(gen, formatter)
    except ClientDisconnected:
        gen.close()
        return Response(status_code=499)
    except BaseException:
        gen.close()
        raise
    return StreamingResponse(sse_stream(gen, formatter, first), media_type="text/event-stream",
                             headers=engine_headers(update.delta if update else None, response_id),
                             background=BackgroundTask(gen.close))


async def run_to_end(gen: Generation) -> bool:
    """Wait for a non-streaming generation to finish; False when the client went away first."""
    try:
        while not gen.done:
            await gen.next_update()
    except ClientDisconnected:
        return False
    finally:
        gen.close()
    return True
