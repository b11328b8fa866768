"""One replica: a model's engine behind an RPC surface, run by Ray Serve as a deployment replica.

::

    front (HTTP, auth, quotas, budgets)                    replica (this class, one per process)
    RemoteEngine.add ── handle.generate(ReplicaRequest) ──► AsyncEngine.add ─► engine thread steps
                     ◄── stream of ReplicaUpdate ─────────  one per EngineUpdate; the last carries
                                                            the request's measured cost
    Ray's controller ── record_routing_stats() ──────────►  cached block hashes, queue depth,
                                                            prefix-cache counters
    describe()                                              what the front needs to serve the model
                                                            without loading it: tokenizer, limits,
                                                            engine config, adapters, block size

The class is plain Python (tests drive it without Ray); ``app.py`` wraps it in
``serve.deployment``. A cancelled ``generate`` (the client left, the front aborted, the
replica is draining past its timeout) aborts its engine request, so its KV blocks are free within a
step. Times inside a delta are this process's ``time.monotonic()``; each update carries
``sent_at`` on the same clock, so the front can move them onto its own.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import torch

from tokenmill.engine import EngineConfig, KVBlocks, PromptLimits, export_blocks, import_blocks
from tokenmill.llm import LLM
from tokenmill.scaleout.autoscale import p90
from tokenmill.scaleout.policy import Decision
from tokenmill.loading.tokenizer import Tokenizer
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.async_engine import AsyncEngine, EngineUpdate
from tokenmill.server.cost import KINDS, CostLabels, CostMeter, CostRecord

logger = logging.getLogger("tokenmill.scaleout")


@dataclass
class ReplicaRequest:
    """One engine request, as the front sends it."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    timeout: float
    """Seconds left before its deadline (clocks differ between processes)."""
    labels: CostLabels | None
    priority: int = 0
    cache_salt: str | None = None
    lora: str | None = None
    block_hashes: list[int] = field(default_factory=list)
    """Its prompt's full blocks' hashes: what the request router matches (the replica ignores them)."""
    exclude: tuple[str, ...] = ()
    """Replicas not to route it to (ones that failed it before)."""
    decision: Decision | None = None
    """Set by the request router (in the front's process) when it routes the request."""
    prefilled_at: float | None = None
    """Set by the front (time.time()) at its first token: the router tracks its route
    (policy.RouteProgress) on this object, in the front's process."""
    finished_at: float | None = None
    """Set by the front (time.time()) when it ended, however it ended."""


@dataclass
class ReplicaUpdate:
    update: EngineUpdate | None
    """None on the first message: the replica took the request (the front learns which replica)."""
    replica_id: str
    sent_at: float
    """This process's time.monotonic() when sent."""
    cost: dict[str, float] | None = None
    """On the last update: the request's measured cost by kind (prompt, cached, completion)."""
    stats: dict[str, float] | None = None
    """On the first message: the replica's counters (prefix-cache queries and hits, queue, KV use)."""
    transfer: dict[str, float] | None = None
    """On the first message, when its KV came from a prefill replica: blocks taken, bytes, seconds."""


@dataclass
class ReplicaInfo:
    """What the front needs to serve a replica's model without loading it."""

    model_name: str
    source: str
    tokenizer: Tokenizer
    limits: PromptLimits
    config: EngineConfig
    block_size: int
    adapters: dict[str, str]
    """LoRA adapter name -> content hash (its prefix-cache salt)."""
    kv_cache_bytes: int
    warm_step_seconds: float


class EngineReplica:
    """A model's engine stepping in its own thread, answering the front's requests."""

    def __init__(self, source: str, options: dict[str, Any], replica_id: str | None = None,
                 lora_modules: list[tuple[str, str]] | None = None, price_per_hour: float = 0.0,
                 threads: int | None = None) -> None:
        if threads:
            torch.set_num_threads(threads)
        self.replica_id = replica_id or _ray_replica_id() or "replica"
        self.source = source
        self.llm = LLM(source, **options)
        for name, path in lora_modules or []:
            self.llm.load_lora(name, path)
        self.name = self.llm.model_name
        self.meter = CostMeter(price_per_hour)
        self.engine = AsyncEngine({self.name: self.llm.engine}, meter=self.meter)
        self.engine.warm_up_first(lambda name, warming: None)
        self.engine.start()
        self.requests = 0
        self._reports = 0
        self._ttfts: deque[float] = deque(maxlen=64)
        """The last requests' times to first token here (seconds), for autoscaling."""
        logger.info("replica %s serving %s", self.replica_id, self.name)

    def info(self) -> ReplicaInfo:
        engine = self.llm.engine
        adapters = {a.name: engine.lora.get(a.name).content_hash for a in engine.lora.list()} \
            if engine.lora is not None else {}
        return ReplicaInfo(self.name, self.source, self.llm.tokenizer, engine.limits, engine.config,
                           engine.config.cache.block_size, adapters, engine.kv_cache_bytes,
                           self.engine.warm_step_seconds.get(self.name, 0.0))

    async def describe(self) -> ReplicaInfo:
        await self.engine.call(lambda: None)  # answers once warm: the engine thread warms up first
        return self.info()

    async def prefill(self, request: ReplicaRequest) -> KVBlocks:
        """Disaggregated prefill: compute the prompt (and one token), hand over its full blocks' KV
        (kv_transfer.py); a decode replica's ``generate`` takes them."""
        queue: asyncio.Queue = asyncio.Queue()
        rid = f"prefill-{request.request_id}"
        self.requests += 1
        self.engine.add(self.name, rid, request.prompt_ids, SamplingParams(max_tokens=1), queue,
                        time.monotonic() + request.timeout, request.priority, request.cache_salt, request.lora)
        try:
            while True:
                update: EngineUpdate = await queue.get()
                if update.error is not None:
                    raise RuntimeError(f"prefill failed: {update.error}: {update.message}")
                if update.finished:
                    break
        except BaseException:
            self.engine.abort(rid)
            raise
        engine = self.llm.engine
        return await self.engine.call(lambda: export_blocks(engine, request.block_hashes))

    async def generate(self, request: ReplicaRequest, kv: KVBlocks | None = None) -> AsyncIterator[ReplicaUpdate]:
        """Run one request; yield its updates as the engine produces them (cancelling aborts it).
        ``kv``: its prompt's blocks, prefilled elsewhere (entered into the prefix cache first)."""
        transfer = None
        if kv is not None:
            engine = self.llm.engine
            imported = await self.engine.call(lambda: import_blocks(engine, kv))
            transfer = {"blocks": imported, "bytes": kv.nbytes, **kv.timings}
        queue: asyncio.Queue = asyncio.Queue()
        labels = request.labels if request.labels is not None else CostLabels("", self.name)
        record = CostRecord(request.request_id, labels, len(request.prompt_ids))
        self.requests += 1
        self.engine.add(self.name, request.request_id, request.prompt_ids, request.params, queue,
                        time.monotonic() + request.timeout, request.priority, request.cache_salt, request.lora,
                        record)
        finished = first_token = False
        try:
            yield ReplicaUpdate(None, self.replica_id, time.monotonic(), stats=self.counters(), transfer=transfer)
            while not finished:
                update: EngineUpdate = await queue.get()
                finished = update.finished
                delta = update.delta
                if delta is not None and delta.first_token_time is not None and not first_token:
                    first_token = True
                    self._ttfts.append(delta.first_token_time - delta.arrival_time)
                cost = dict(record.cost) if finished else None
                yield ReplicaUpdate(update, self.replica_id, time.monotonic(), cost)
        finally:
            if not finished:
                self.engine.abort(request.request_id)

    def counters(self) -> dict[str, float]:
        snap = self.engine.snapshots.get(self.name)
        if snap is None:
            return {"requests": self.requests}
        return {"queue": snap.num_running + snap.num_waiting, "prefix_queries": snap.prefix_queries,
                "prefix_hits": snap.prefix_hits, "kv_usage": snap.kv_usage, "requests": self.requests}

    async def record_routing_stats(self) -> dict[str, Any]:
        """Ray Serve polls this for the request router: the prefix cache's block hashes, the queue."""
        engine = self.llm.engine
        self._reports += 1

        def read() -> dict[str, Any]:
            snap = engine.snapshot()
            return {"report": self._reports, "taken": time.time(), "hashes": engine.cached_block_hashes(),
                    "queue": snap.num_running + snap.num_waiting,
                    "prefill_blocks": engine.prompt_tokens_left() / engine.config.cache.block_size}
        return await self.engine.call(read)

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Ray Serve's custom autoscaling metrics (autoscale.py): the engine's queue, recent TTFT p90."""
        snap = self.engine.snapshots.get(self.name)
        queue = snap.num_running + snap.num_waiting if snap is not None else 0
        return {"queue": float(queue), "ttft_p90": p90(list(self._ttfts))}

    def check_health(self) -> None:
        """Ray Serve restarts a replica whose engine loop died."""
        if not self.engine.alive:
            raise RuntimeError(f"replica {self.replica_id}: the engine loop is not running")

    def shutdown(self) -> None:
        self.engine.stop()

    def __del__(self) -> None:  # Ray Serve drops the object when it stops the replica
        try:
            self.engine.stop(timeout=1.0)
        except Exception:  # noqa: BLE001 - interpreter teardown
            pass


def _ray_replica_id() -> str | None:
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - not inside a Ray Serve replica
        return None


def cost_kinds(cost: dict[str, float] | None) -> dict[str, float]:
    return {kind: (cost or {}).get(kind, 0.0) for kind in KINDS}
