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
import hashlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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


@dataclass
class Version:
    """One deployment of the served model (its own Ray Serve application): what a rollout splits
    traffic between (rollout.py)."""

    name: str
    """The Ray Serve application's name."""
    handle: Any
    info: ReplicaInfo
    weight: float
    """Share of new requests it takes (the versions' weights sum to 1)."""
    requests: int = 0


class RemoteEngine:
    """AsyncEngine's handler-facing interface over Ray Serve deployments of EngineReplica (one, or
    during a rollout, several versions splitting the traffic by weight)."""

    def __init__(self, handle, info: ReplicaInfo, hasher: BlockHasher, meter: CostMeter | None = None,
                 max_attempts: int = 3, name: str | None = None, version: str = "tokenmill",
                 on_snapshot: Callable[[str, EngineSnapshot], None] | None = None) -> None:
        """``handle``: the deployment's handle; ``info``: what a replica described; ``hasher``: keyed
        as the replicas' engines are (``prefix_hash_key``); ``name``: the served model's name
        (default: the replicas' model name); ``version``: its application's name; ``on_snapshot``:
        hears the fleet's state as one engine's (the server's model-level gauges and counters):
        engine requests at the replicas as running, their mean KV use, their prefix-cache counters
        summed (as of each replica's latest answer)."""
        self.on_snapshot = on_snapshot
        self._counted: dict[str, tuple[int, int]] = {}
        """replica id -> (prefix queries, hits) it last reported."""
        self._prefix = [0, 0]
        """Prefix-cache queries and hits over every replica since the front started (monotonic)."""
        self._snapshot = EngineSnapshot()
        self.versions: dict[str, Version] = {version: Version(version, handle, info, 1.0)}
        self.prefill: Version | None = None
        """Disaggregated prefill/decode (prototype): the prefill replicas' deployment, when set."""
        self.transfers: Counter = Counter()
        """KV handed from prefill to decode replicas: 'requests', 'blocks', 'bytes', 'export' and
        'import' seconds."""
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
        return {self.name: self._snapshot}

    def _observe(self, replica: str, stats: dict) -> None:
        """A replica's counters: its prefix-cache deltas are added to the fleet's (a restarted
        replica counts from 0 again)."""
        queries, hits = int(stats.get("prefix_queries", 0)), int(stats.get("prefix_hits", 0))
        last_q, last_h = self._counted.get(replica, (0, 0))
        self._prefix[0] += queries - last_q if queries >= last_q else queries
        self._prefix[1] += hits - last_h if hits >= last_h else hits
        self._counted[replica] = (queries, hits)

    def _publish(self) -> None:
        reports = self.ledger.snapshot()[2]
        usage = [r.get("kv_usage", 0.0) for r in reports.values()]
        self._snapshot = EngineSnapshot(num_running=len(self._tasks), kv_usage=sum(usage) / len(usage) if usage else 0.0,
                                        prefix_queries=self._prefix[0], prefix_hits=self._prefix[1])
        if self.on_snapshot is not None:
            self.on_snapshot(self.name, self._snapshot)

    async def call(self, fn: Callable[[], object]) -> object:
        raise APIError(400, "this server runs its model on replicas (--replicas); adapters and models are "
                       "loaded at startup there, not at runtime", code="not_supported_with_replicas")

    async def attach(self, name: str, build) -> float:
        return await self.call(build)

    async def detach(self, name: str) -> int:
        return await self.call(lambda: 0)

    # ---- versions -----------------------------------------------------------------------------
    @property
    def info(self) -> ReplicaInfo:
        """The first version's description (what the front's model limits came from)."""
        return next(iter(self.versions.values())).info

    def add_version(self, name: str, handle, info: ReplicaInfo, weight: float) -> None:
        """Serve another version beside the others, taking ``weight`` of new requests (the others
        keep their proportions in the rest). Its tokenizer and limits must be the first version's:
        requests were checked and tokenized against those."""
        first = self.info
        if name in self.versions:
            raise ValueError(f"a version named {name!r} is already served")
        if info.tokenizer.vocab_size != first.tokenizer.vocab_size or info.limits != first.limits:
            raise ValueError(f"{info.source!r} does not fit the served model: its vocabulary "
                             f"({info.tokenizer.vocab_size}) and limits ({info.limits}) must equal "
                             f"{first.tokenizer.vocab_size} and {first.limits}")
        if not 0 <= weight <= 1:
            raise ValueError(f"weight must be in [0, 1], got {weight}")
        for version in self.versions.values():
            version.weight *= 1 - weight
        self.versions[name] = Version(name, handle, info, weight)

    def set_weights(self, weights: dict[str, float]) -> None:
        """Each named version's share of new requests (normalised; unnamed versions get 0)."""
        unknown = set(weights) - set(self.versions)
        if unknown:
            raise ValueError(f"no version named {', '.join(sorted(unknown))}; versions: {', '.join(self.versions)}")
        total = sum(weights.values())
        if any(w < 0 for w in weights.values()) or total <= 0:
            raise ValueError(f"weights must be >= 0 with a positive sum, got {weights}")
        for name, version in self.versions.items():
            version.weight = weights.get(name, 0.0) / total

    def remove_version(self, name: str) -> Version:
        """Stop sending it new requests (those it runs finish there) -> it; its weight goes to the others."""
        if name not in self.versions:
            raise ValueError(f"no version named {name!r}")
        if len(self.versions) == 1:
            raise ValueError("the only version cannot be removed")
        gone = self.versions.pop(name)
        rest = sum(v.weight for v in self.versions.values())
        for version in self.versions.values():
            version.weight = version.weight / rest if rest > 0 else 1 / len(self.versions)
        return gone

    def pick(self, request_id: str) -> Version:
        """The version a request goes to: by weight, from a hash of its id (reproducible)."""
        u = int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "little") / 2**64
        acc = 0.0
        versions = [v for v in self.versions.values() if v.weight > 0] or list(self.versions.values())
        for version in versions:
            acc += version.weight
            if u < acc:
                return version
        return versions[-1]

    # ---- requests -----------------------------------------------------------------------------
    def block_hashes(self, prompt_ids: list[int], params: SamplingParams, cache_salt: str | None,
                     lora: str | None, info: ReplicaInfo | None = None) -> list[int]:
        """The prompt's full blocks' hashes as a replica's engine would compute them (``info``: its
        version's; default the first); [] when the request never reuses the cache (prompt logprobs)."""
        info = info or self.info
        if params.prompt_logprobs is not None:
            return []
        salt = adapter_salt(cache_salt, info.adapters[lora]) if lora is not None else cache_salt
        return self.hasher.chain(prompt_ids, info.block_size, salt)

    def add(self, model: str, request_id: str, prompt_ids: list[int], params: SamplingParams, queue: asyncio.Queue,
            deadline: float, priority: int = 0, cache_salt: str | None = None, lora: str | None = None,
            record: CostRecord | None = None, hold_updates: bool = False) -> None:
        version = self.pick(request_id)
        version.requests += 1
        request = ReplicaRequest(request_id, prompt_ids, params, 0.0,
                                 record.labels if record is not None else None, priority, cache_salt, lora,
                                 self.block_hashes(prompt_ids, params, cache_salt, lora, version.info))
        task = asyncio.create_task(self._run(version, request, queue, deadline, record, hold_updates))
        self._tasks[request_id] = task

        def done(_) -> None:
            self._tasks.pop(request_id, None)
            self._publish()
        task.add_done_callback(done)

    def abort(self, request_id: str) -> None:
        task = self._tasks.pop(request_id, None)
        if task is not None:
            task.cancel()

    async def _run(self, version: Version, request: ReplicaRequest, queue: asyncio.Queue, deadline: float,
                   record: CostRecord | None, hold: bool) -> None:
        if record is not None:
            self.meter.open(record)
        delivered, excluded, held = False, [], []
        try:
            for attempt in range(1, self.max_attempts + 1):
                replica = None
                request.timeout = deadline - time.monotonic()
                request.exclude = tuple(excluded)
                request.prefilled_at = None  # the router's record of this attempt (policy.RouteProgress)
                if request.timeout <= 0:
                    queue.put_nowait(EngineUpdate(request.request_id, None, True, error="deadline",
                                                  message="the request passed its deadline and was aborted"))
                    return
                if self.prefill is not None:  # the prefill replica's KV goes by Ray's object store
                    kv = self.prefill.handle.prefill.remote(request)
                    stream = version.handle.options(stream=True).generate.remote(request, kv)
                else:
                    stream = version.handle.options(stream=True).generate.remote(request)
                try:
                    async for item in stream:
                        item: ReplicaUpdate
                        replica = item.replica_id
                        if item.update is None:
                            self.events[(replica, "routed")] += 1
                            self.ledger.report(replica, item.stats or {})
                            self._observe(replica, item.stats or {})
                            self._publish()
                            if item.transfer is not None:
                                self.transfers.update({"requests": 1, **item.transfer})
                            if request.decision is not None:
                                self.ledger.record(request.decision)
                                request.decision = None
                            continue
                        if request.prefilled_at is None:
                            request.prefilled_at = time.time()
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
            now = time.time()
            request.prefilled_at, request.finished_at = request.prefilled_at or now, now
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
