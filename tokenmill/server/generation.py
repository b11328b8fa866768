"""One HTTP generation request, from limits to cleanup, shared by completions and chat.

::

    Generation.start()   tenant limits ─► budget hold ─► admission (the model's queue, priority,
                         deadline) ─► engine.add per prompt, each with a cost record
                         + a task that watches for the client going away
    next_update()        the next EngineUpdate (a RequestDelta) of any of its engine requests, folded
                         into that request's cumulative output; errors become APIError
    close()              abort what is unfinished, give back the admission slots, record usage,
                         metrics and SLO compliance, seal the budget hold (it settles when the
                         engine has closed every cost record); synchronous and idempotent, so it
                         is safe in any finally

Also here: turning request fields into SamplingParams, checking prompts against the context,
and the SSE framing.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import deque
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
from tokenmill.server.budgets import BudgetHold
from tokenmill.server.cost import CostLabels, CostRecord
from tokenmill.server.state import ServedModel, ServerState, Target
from tokenmill.server.tenancy import Reservation, TenantConfig

LARGE_TEXT = 20_000
"""Prompts longer than this many characters are tokenized (or rendered) off the event loop."""


class ClientDisconnected(Exception):
    """The client went away; its engine requests are aborted."""


def sse(data: Any) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return f"data: {payload}\n\n"


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


async def tokenize(served: ServedModel, text: str, add_special_tokens: bool = True, param: str = "prompt"
                   ) -> list[int]:
    """The token ids of one prompt text (``param`` names its field in errors); see :func:`tokenize_all`."""
    return (await tokenize_all(served, [text], add_special_tokens, param))[0]


async def tokenize_all(served: ServedModel, texts: list[str], add_special_tokens: bool = True,
                       param: str = "prompt") -> list[list[int]]:
    """The token ids of each of a request's prompt texts. A text too long to fit in any sequence is
    refused before anything is tokenized; when they are long together, they are tokenized in a
    worker thread, by the tokenizer's path that lets the event loop run meanwhile."""
    for text in texts:
        check_text_length(served, len(text), param)
    if sum(map(len, texts)) > LARGE_TEXT:
        encode = served.tokenizer.encode_releasing_gil
        return await asyncio.to_thread(lambda: [encode(text, add_special_tokens) for text in texts])
    return [served.tokenizer.encode(text, add_special_tokens) for text in texts]


def check_text_length(served: ServedModel, chars: int, param: str = "prompt") -> None:
    """400 ``context_length_exceeded`` for a text of more characters than the longest sequence can
    hold (each token covers at most ``max_token_chars`` of them), without tokenizing it."""
    max_seq, per_token = served.limits.max_seq_tokens, served.tokenizer.max_token_chars
    if chars > max_seq * per_token:
        raise APIError(400, f"{param!r} has {chars} characters, more than fit in the context: a sequence "
                       f"holds at most {max_seq} tokens and this model's longest token has {per_token} "
                       "characters; shorten it", param=param, code="context_length_exceeded")


def check_prompt(served: ServedModel, ids: list[int], max_tokens: int | None, param: str = "prompt") -> int:
    """Validate one prompt's token ids with the engine's own limits; return the max_tokens it may use
    (filled in when None). The engine checks again when it adds the request: the same function."""
    try:
        return served.limits.check(ids, max_tokens, param)
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


def usage_of(gen: Generation) -> Usage:
    """The response's usage; with a price configured, also ``cost``: what the request's engine
    work was measured to cost (cost.py), in the price's currency."""
    prompt, completion = gen.prompt_tokens, gen.completion_tokens
    usage = Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                  prompt_tokens_details=PromptTokensDetails(cached_tokens=gen.cached_tokens))
    if gen.state.cost.price_per_hour > 0:
        usage.cost = gen.cost
    return usage


def request_tags(http: Request, metadata: dict[str, str] | None) -> dict[str, str]:
    """What a request's cost is tagged with beyond its tenant and model: OpenAI's ``metadata``, and
    the header ``X-Tokenmill-Tags: team=search,project=ranker`` (the header wins on a clash)."""
    tags = dict(metadata or {})
    header = http.headers.get("x-tokenmill-tags")
    for item in (header or "").split(","):
        if not item.strip():
            continue
        name, sep, value = item.strip().partition("=")
        if not sep or not name.strip():
            raise APIError(400, f"X-Tokenmill-Tags: expected NAME=VALUE,..., got {item.strip()!r}",
                           param="X-Tokenmill-Tags")
        tags[name.strip()] = value.strip()
    return tags


_GONE = object()


class Generation:
    def __init__(self, state: ServerState, target: Target, http: Request, tenant: TenantConfig,
                 prompts: list[list[int]], params: SamplingParams, priority: int, cache_salt: str | None,
                 arrival: float, user: str | None = None, tags: dict[str, str] | None = None,
                 stream: bool = False) -> None:
        """``user``, ``tags``: what its cost is attributed to beside tenant and model; ``stream``:
        its response streams (else nothing reaches the client before it finished, so the engine
        may hold its updates and retry it elsewhere: scale-out's RemoteEngine). It takes its own
        budget hold in start() and settles it from close(), unless use_hold() hands it one."""
        self.stream = stream
        self.state, self.target, self.http, self.tenant = state, target, http, tenant
        self.model = target.model
        self.lora = target.adapter
        """The LoRA adapter its requests run with (``ServerState.resolve_model``), None for the base model."""
        self.labels = CostLabels(tenant.name, self.model.name, tenant.key_sha256[:12].lower(), target.adapter,
                                 target.route, user, tuple(sorted((tags or {}).items())))
        self.hold: BudgetHold | None = None
        self._own_hold = True
        self.records: list[CostRecord] = []
        self.prompts, self.params, self.priority = prompts, params, priority
        self.arrival = arrival
        self.deadline = deadline_of(state, http, arrival)
        self.cache_salt = state.tenancy.cache_salt(tenant, cache_salt)
        """The engine's prefix-cache salt: the tenant's cache_group and the request's cache_salt, hashed."""
        self.uid = uuid.uuid4().hex
        """Its engine requests are ``req-<uid>-<i>``; its response's id is ``<prefix>-<uid>``."""
        self.request_ids = [f"req-{self.uid}-{i}" for i in range(len(prompts))]
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
        self.history: list[EngineUpdate] | None = None
        """Every update received, when set to a list before start() (a cascade's first attempt)."""
        self._replay: deque[EngineUpdate] = deque()
        self._watcher: asyncio.Task | None = None
        self._endings: list[tuple[str, float | None, float, int]] = []
        """(reason, first token time, finish time, tokens of the longest sample) of each engine request, from close()."""
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
            room = asked if asked is not None else max(self.model.limits.max_seq_tokens - len(ids), 0)
            total += len(ids) + self.params.n * room
        return total

    def hold_amount(self) -> float:
        """The stated upper bound of its cost, held against a budget: every prompt, and max_tokens
        for each of its samples, at the model's reservation rates (ServerState.reservation_rates)."""
        prompt_rate, completion_rate = self.state.reservation_rates(self.model.name)
        asked, total = self.params.max_tokens, 0.0
        for ids in self.prompts:
            room = asked if asked is not None else max(self.model.limits.max_seq_tokens - len(ids), 0)
            total += (len(ids) * prompt_rate + self.params.n * room * completion_rate) / 1000
        return total

    @property
    def cost(self) -> float:
        """Measured cost so far (final once every engine request has finished)."""
        return sum(record.total for record in self.records)

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
        return not self.unfinished and not self._replay

    def use_hold(self, hold: BudgetHold | None) -> None:
        """Run under a budget hold its caller took (and seals or cancels), before start()."""
        self.hold, self._own_hold = hold, False

    def replay(self) -> None:
        """Hand out again, through next_update, every update of a finished generation kept in
        ``history`` (a cascade's accepted answer streamed after it was judged)."""
        self._replay = deque(self.history or [])

    async def start(self) -> None:
        state, model, name = self.state, self.model, self.model.name
        admission = model.admission
        num_seqs = len(self.prompts) * self.params.n
        if num_seqs > admission.capacity:
            raise APIError(400, f"{len(self.prompts)} prompt(s) times n={self.params.n} is {num_seqs} sequences; "
                           f"the server runs at most {admission.capacity} at once", param="n")
        try:
            try:
                self.reservation = state.tenancy.start(self.tenant, self.reserved_tokens)
            except APIError as exc:  # the reservation alone is over the tenant's limit
                state.metrics.reject(name, exc.code or "tenant_tokens_exceeded")
                raise
            if self._own_hold:
                self.hold = state.budgets.hold(self.tenant, self.hold_amount())
            self.ticket = Ticket(self.priority, num_seqs, self.prompt_tokens, self.deadline)
            waiting = state.engine.snapshots.get(name)
            try:
                state.metrics.set_queued(name, admission.num_queued + 1, waiting.num_waiting if waiting else 0)
                await admission.admit(self.ticket)
            finally:
                state.metrics.set_queued(name, admission.num_queued, waiting.num_waiting if waiting else 0)
        except Rejected as exc:
            state.metrics.reject(name, exc.reason)
            self.close()
            raise rejected_error(exc) from None
        except BaseException:
            self.close()
            raise
        self._added = True
        for request_id, ids in zip(self.request_ids, self.prompts):
            record = CostRecord(request_id, self.labels, len(ids))
            if self.hold is not None:
                self.hold.open_part()
                record.on_close = lambda r, hold=self.hold: hold.close_part(r.total)
            self.records.append(record)
            state.engine.add(name, request_id, ids, self.params, self.queue, self.deadline, self.priority,
                             self.cache_salt, self.lora, record, hold_updates=not self.stream)
            self.unfinished.add(request_id)
        self._watcher = asyncio.create_task(self._watch_disconnect())

    async def _watch_disconnect(self) -> None:
        while True:
            message = await self.http.receive()
            if message["type"] == "http.disconnect":
                if self.unfinished:
                    self.state.metrics.reject(self.model.name, "client_disconnected")
                self._abort_unfinished()
                self.queue.put_nowait(_GONE)
                return

    async def next_update(self) -> EngineUpdate:
        """The next update; APIError when the engine ended it with an error, ClientDisconnected."""
        if self._replay:
            return self._replay.popleft()
        grace = max(self.deadline - time.monotonic(), 0) + 5.0  # the engine thread enforces the deadline
        try:
            item = await asyncio.wait_for(self.queue.get(), grace)
        except asyncio.TimeoutError:
            raise APIError(503, "the engine did not answer in time", code="engine_unavailable",
                           retry_after=self.state.config.retry_after) from None
        if item is _GONE:
            raise ClientDisconnected()
        self._record(item)
        if self.history is not None:
            self.history.append(item)
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
                self.state.metrics.observe_inter_token(self.model.name, now - last)
            self._last_token_time[update.request_id] = now

    def _error_of(self, update: EngineUpdate) -> APIError:
        retry = self.state.config.retry_after
        self.state.metrics.reject(self.model.name, update.error)
        if update.error == "invalid":
            return APIError(400, update.message, param=param_from_message(update.message))
        if update.error == "model_not_found":
            return APIError(404, update.message, param="model", code="model_not_found")
        if update.error == "deadline":
            return APIError(503, update.message, code="deadline_exceeded", retry_after=retry)
        if update.error == "shutdown":
            return APIError(503, update.message, code="shutting_down", retry_after=retry)
        if update.error == "model_unloaded":
            return APIError(503, update.message, code="model_unloaded", retry_after=retry)
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
            self.model.admission.release(self.ticket)
        if self.reservation is not None:  # settle to what was used; all of it back if it never ran
            if self._added:
                state.tenancy.finish(self.reservation, self.prompt_tokens, self.cached_tokens,
                                     self.completion_tokens, self.lora)
            else:
                state.tenancy.cancel(self.reservation)
        if self.hold is not None and self._own_hold:  # settles once the engine closed every record
            self.hold.seal() if self._added else state.budgets.cancel(self.hold)
        now = time.monotonic()
        for request_id, ids in zip(self.request_ids, self.prompts):
            delta = self.latest.get(request_id)
            error = self.errors.get(request_id)
            if delta is None and error is None and request_id not in aborted:
                continue
            outputs = self.output(request_id).outputs
            reason = ("abort" if request_id in aborted else error) or (outputs[0].finish_reason or "abort")
            first_token = delta.first_token_time if delta else None
            finish = delta.finish_time if delta and delta.finish_time else now
            completion = sum(len(o.token_ids) for o in outputs)
            state.metrics.observe_request(self.model.name, self.arrival, delta.scheduled_time if delta else None,
                                          first_token, finish, len(ids), completion, reason, self.lora)
            self._endings.append((reason, first_token, finish, max((len(o.token_ids) for o in outputs), default=0)))
        if self.history is None:  # a cascade's first attempt counts only if it is shown (observe_slo)
            for ending in self._endings:
                self._observe_slo(*ending)

    def observe_slo(self, shown_at: float) -> None:
        """Count a cascade's accepted first attempt in SLO compliance as its client saw it: the
        first token when the answer was judged and shown (``shown_at``), the engine's pace after."""
        for reason, first_token, finish, tokens in self._endings:
            delay = shown_at - first_token if first_token is not None else 0.0
            self._observe_slo(reason, first_token and shown_at, finish + delay, tokens)

    def _observe_slo(self, reason: str, first_token: float | None, finish: float, tokens: int) -> None:
        """Count the request in its tenant's SLO compliance: finished ones by their TTFT and TPOT
        against the objectives, ones the server failed (deadline, KV, engine) as missed; ones
        the client ended are left out."""
        slo_ttft, slo_tpot = self.state.cost.slo_ttft, self.state.cost.slo_tpot
        if (slo_ttft is None and slo_tpot is None) or reason in ("abort", "invalid", "model_not_found"):
            return
        met = reason in ("stop", "length") and first_token is not None
        if met and slo_ttft is not None:
            met = first_token - self.arrival <= slo_ttft
        if met and slo_tpot is not None and tokens > 1:
            met = (finish - first_token) / (tokens - 1) <= slo_tpot
        self.state.metrics.observe_slo(self.tenant.name, met)


def usage_event(head: dict, gen: Generation) -> str:
    """The usage-only chunk that ends a stream when ``stream_options.include_usage`` asks for it."""
    return sse({**head, "choices": [], "usage": usage_of(gen).model_dump()})


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


def engine_headers(gen: Generation, request_id: str) -> dict[str, str]:
    """X-Engine-TTFT: the engine's own time to first token (arrival in the engine to first token);
    X-Tokenmill-Model: the served model (and adapter) that answered; X-Request-Cost: the measured
    cost, when a price is configured and the request has finished."""
    delta = gen.latest.get(gen.request_ids[0])
    headers = {"X-Request-Id": request_id, "X-Tokenmill-Model": gen.target.name}
    if gen.target.route is not None:
        headers["X-Tokenmill-Route"] = gen.target.route
    if delta is not None and delta.first_token_time is not None:
        headers["X-Engine-TTFT"] = f"{delta.first_token_time - delta.arrival_time:.6f}"
    if gen.done and gen.state.cost.price_per_hour > 0:
        headers["X-Request-Cost"] = f"{gen.cost:.9g}"
    return headers


async def streaming_response(gen: Generation, formatter: StreamFormatter, response_id: str) -> Response:
    """The SSE response, once the first event is ready (499 when the client left before it)."""
    try:
        first, _ = await first_events(gen, formatter)
    except ClientDisconnected:
        gen.close()
        return Response(status_code=499)
    except BaseException:
        gen.close()
        raise
    return StreamingResponse(sse_stream(gen, formatter, first), media_type="text/event-stream",
                             headers=engine_headers(gen, response_id),
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
