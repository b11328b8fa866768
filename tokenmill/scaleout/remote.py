"""The front's engine: AsyncEngine's interface to the server, its work done by Ray Serve replicas.

The HTTP server (tokenmill.server) does everything it does for one process (auth, quotas,
budgets, admission, tokenizing, usage, metrics) and hands each engine request to
:meth:`RemoteEngine.add`, exactly as it would to the local AsyncEngine. Here the request becomes a
:class:`~tokenmill.scaleout.replica.ReplicaRequest` carrying its prompt's block hashes (chained
with its tenant's salt and its adapter, as the replica's engine chains them) for the request
router, and a task streams the replica's updates into the handler's queue.

Failover::

    replica dies (or is unreachable) before any of the request's updates reached its handler
        -> sent again, to another replica (the failed one excluded), up to ``max_attempts``
    after some had (streamed bytes may have reached the client)
        -> the request ends with an 'engine' error update: the handler ends the stream with an
           error event, or answers 503/500

A request whose handler does not stream (``hold_updates``) has its updates held here until its
replica finished it, so a replica lost at any point before that costs a retry, not the request.

The replica's monotonic times in a delta are moved onto this process's clock with the offset of
each update's ``sent_at``; the request's measured cost arrives with its last update and closes
its CostRecord here (budgets settle from that).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable

from tokenmill.engine import BlockHasher, EngineSnapshot, RequestDelta, adapter_salt
from tokenmill.sampling_params import SamplingParams
from tokenmill.scaleout.policy import RoutingLedger
from tokenmill.scaleout.replica import ReplicaInfo, ReplicaRequest, ReplicaUpdate, cost_kinds
from tokenmill.server.async_engine import EngineUpdate
from tokenmill.server.cost import CostMeter, CostRecord
from tokenmill.server.errors import APIError

logger = logging.getLogger("tokenmill.scaleout")


def _replica_lost(exc: BaseException) -> bool:
    """Whether ``exc`` says the replica (its actor or its node) went away, not that the request was bad."""
    try:
        from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
    except ImportError:  # pragma: no cover - Ray is what this module drives
        return False
    return isinstance(exc, (ActorDiedError, ActorUnavailableError, RayActorError))


class RemoteAdapters:
    """The adapters every replica loaded (``--lora-modules``): what ``resolve_model`` looks up."""

    def __init__(self, adapters: dict[str, str]) -> None:
        self.adapters = dict(adapters)

    def __contains__(self, name: str) -> bool:
        return name in self.adapters

    def list(self) -> list:
        from types import SimpleNamespace

        return [SimpleNamespace(name=name, path="", content_hash=digest) for name, digest in self.adapters.items()]


class RemoteModel:
    """What handlers read of a served model's engine, for a model the replicas run."""

    def __init__(self, info: ReplicaInfo, replicas: int) -> None:
        self.limits = info.limits
        self.config = info.config
        self.lora = RemoteAdapters(info.adapters) if info.adapters else None
        self.kv_cache_bytes = info.kv_cache_bytes * replicas


class RemoteEngine:
    """AsyncEngine's handler-facing interface over a Ray Serve deployment of EngineReplica."""

    def __init__(self, handle, info: ReplicaInfo, hasher: BlockHasher, meter: CostMeter | None = None,
                 max_attempts: int = 3, name: str | None = None) -> None:
        """``handle``: the deployment's handle; ``info``: what a replica described; ``hasher``: keyed
        as the replicas' engines are (``prefix_hash_key``); ``name``: the served model's name
        (default: the replicas' model name)."""
        self.handle = handle
        self.info = info
        self.name = name or info.model_name
        self.hasher = hasher
        self.meter = meter if meter is not None else CostMeter()
        self.max_attempts = max_attempts
        self.ledger = RoutingLedger()
        """The router's decisions and the replicas' counters (for /metrics)."""
        self.events: Counter = Counter()
        """(replica id, 'routed' | 'retried' | 'failed') -> requests: the front's side of routing."""
        self.warm_seconds = {self.name: 0.0}
        self.warm_step_seconds = {self.name: info.warm_step_seconds}
        self._tasks: dict[str, asyncio.Task] = {}
        self._stopped = threading.Event()
        self._started = False

    # ---- lifecycle, as AsyncEngine's ----------------------------------------------------------
    def start(self) -> None:
        self._started = True

    def will_run_here(self) -> None:
        pass

    def run_here(self) -> None:
        """Block until stop(): the replicas step the engines; the main thread only waits for signals."""
        self._started = True
        self._stopped.wait()

    def stop(self, timeout: float = 10.0) -> None:
        for task in list(self._tasks.values()):
            task.get_loop().call_soon_threadsafe(task.cancel)
        self._stopped.set()

    def warm_up_first(self, on_warming: Callable[[str, bool], None]) -> None:
        on_warming(self.name, False)  # replicas answer describe() only once warm

    @property
    def alive(self) -> bool:
        return not self._stopped.is_set()

    @property
    def snapshots(self) -> dict[str, EngineSnapshot]:
        return {self.name: EngineSnapshot(num_running=len(self._tasks))}

    async def call(self, fn: Callable[[], object]) -> object:
        raise APIError(400, "this server runs its model on replicas (--replicas); adapters and models are "
                       "loaded at startup there, not at runtime", code="not_supported_with_replicas")

    async def attach(self, name: str, build) -> float:
        return await self.call(build)

    async def detach(self, name: str) -> int:
        return await self.call(lambda: 0)

    # ---- requests -----------------------------------------------------------------------------
    def block_hashes(self, prompt_ids: list[int], params: SamplingParams, cache_salt: str | None,
                     lora: str | None) -> list[int]:
        """The prompt's full blocks' hashes as a replica's engine would compute them; [] when the
        request never reuses the cache (prompt logprobs)."""
        if params.prompt_logprobs is not None:
            return []
        salt = adapter_salt(cache_salt, self.info.adapters[lora]) if lora is not None else cache_salt
        return self.hasher.chain(prompt_ids, self.info.block_size, salt)

    def add(self, model: str, request_id: str, prompt_ids: list[int], params: SamplingParams, queue: asyncio.Queue,
            deadline: float, priority: int = 0, cache_salt: str | None = None, lora: str | None = None,
            record: CostRecord | None = None, hold_updates: bool = False) -> None:
        request = ReplicaRequest(request_id, prompt_ids, params, 0.0,
                                 record.labels if record is not None else None, priority, cache_salt, lora,
                                 self.block_hashes(prompt_ids, params, cache_salt, lora))
        task = asyncio.create_task(self._run(request, queue, deadline, record, hold_updates))
        self._tasks[request_id] = task
        task.add_done_callback(lambda _: self._tasks.pop(request_id, None))

    def abort(self, request_id: str) -> None:
        task = self._tasks.pop(request_id, None)
        if task is not None:
            task.cancel()

    async def _run(self, request: ReplicaRequest, queue: asyncio.Queue, deadline: float,
                   record: CostRecord | None, hold: bool) -> None:
        if record is not None:
            self.meter.open(record)
        delivered, excluded, held = False, [], []
        try:
            for attempt in range(1, self.max_attempts + 1):
                replica = None
                request.timeout = deadline - time.monotonic()
                request.exclude = tuple(excluded)
                if request.timeout <= 0:
                    queue.put_nowait(EngineUpdate(request.request_id, None, True, error="deadline",
                                                  message="the request passed its deadline and was aborted"))
                    return
                stream = self.handle.options(stream=True).generate.remote(request)
                try:
                    async for item in stream:
                        item: ReplicaUpdate
                        replica = item.replica_id
                        if item.update is None:
                            self.events[(replica, "routed")] += 1
                            self.ledger.report(replica, item.stats or {})
                            if request.decision is not None:
                                self.ledger.record(request.decision)
                                request.decision = None
                            continue
                        update = _on_our_clock(item)
                        if record is not None:
                            _account(record, update, item.cost)
                        if hold and not update.finished:
                            held.append(update)
                            continue
                        for earlier in held:
                            queue.put_nowait(earlier)
                        held.clear()
                        queue.put_nowait(update)
                        delivered = True
                    return
                except asyncio.CancelledError:
                    stream.cancel()
                    raise
                except Exception as exc:  # noqa: BLE001 - a lost replica is retried, anything else ends it
                    lost = _replica_lost(exc)
                    if delivered or not lost or attempt == self.max_attempts:
                        self.events[(replica or "unknown", "failed")] += 1
                        logger.warning("request %s failed on replica %s: %s", request.request_id, replica, exc)
                        message = (f"the replica serving this request failed: {type(exc).__name__}" if lost
                                   else f"{type(exc).__name__}: {exc}")
                        queue.put_nowait(EngineUpdate(request.request_id, None, True, error="engine",
                                                      message=message))
                        return
                    held.clear()
                    if record is not None:
                        record.completion_tokens, record.cached_tokens = 0, 0
                    if replica is not None:
                        excluded.append(replica)
                    self.events[(replica or "unknown", "retried")] += 1
                    logger.warning("replica %s lost request %s before it reached the client; retrying (%d/%d)",
                                   replica, request.request_id, attempt, self.max_attempts)
        finally:
            if record is not None:
                self.meter.close(request.request_id)


def _on_our_clock(item: ReplicaUpdate) -> EngineUpdate:
    """The update with its delta's times moved from the replica's monotonic clock to ours."""
    update, delta = item.update, item.update.delta
    if delta is None:
        return update
    offset = time.monotonic() - item.sent_at

    def shift(t: float | None) -> float | None:
        return None if t is None else t + offset
    moved: RequestDelta = dataclasses.replace(delta, arrival_time=delta.arrival_time + offset,
                                              scheduled_time=shift(delta.scheduled_time),
                                              first_token_time=shift(delta.first_token_time),
                                              finish_time=shift(delta.finish_time))
    return dataclasses.replace(update, delta=moved)


def _account(record: CostRecord, update: EngineUpdate, cost: dict[str, float] | None) -> None:
    if update.delta is not None:
        record.cached_tokens = update.delta.num_cached_tokens
        record.completion_tokens += update.delta.num_new_tokens
    if update.finished:
        record.cost = cost_kinds(cost)
