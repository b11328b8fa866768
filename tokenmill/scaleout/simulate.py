"""Replay a prefix-sharing workload through the router and a queueing model of the replicas.

The router is the real one (policy.py: the same PrefixAwarePolicy, RoundRobinPolicy and
PrefixIndex the Ray request router runs, fed reports every ``report_period`` seconds and the
requests routed since, and when each finished); the replicas are a model, with service times measured on this machine::

    replica:  ``slots`` requests at once (max_num_seqs), the rest wait in FIFO order
              a prefix cache of ``cache_blocks`` blocks, least recently used evicted first
              prefill is compute-bound: one prompt at a time (a CPU replica's threads work on
              one chunk); decode batches: running requests decode side by side
    request:  takes a slot when one frees; its hit is the leading run of its blocks the cache
              holds at that moment; it then holds (and refreshes) all its full blocks
              prefill starts when the replica's previous prefill ends
              TTFT   = that wait + uncached prompt tokens x prefill_per_token
              finish = TTFT + output tokens x decode_per_token

Workload: ``num_prompts`` system prompts of ``system_tokens`` tokens, each request one of them
(uniformly, or Zipf-skewed) plus a question of its own; Poisson arrivals at ``rate``.

What it leaves out (docs/scale-out.md): batching's effect on per-token times (one measured figure
per phase), preemption, the time a report takes to travel, and network delays between router
and replica.
"""

from __future__ import annotations

import heapq
import random
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass, field

from tokenmill.scaleout.policy import PrefixIndex, make_policy, uncached_blocks


@dataclass(frozen=True)
class ServiceTimes:
    """Per-token seconds of one replica, measured (bench/scaleout.py) or given."""

    prefill_per_token: float
    decode_per_token: float


@dataclass(frozen=True)
class Workload:
    num_prompts: int
    system_tokens: int
    question_tokens: int
    output_tokens: int
    num_requests: int
    rate: float
    """Requests per second (Poisson)."""
    zipf: float = 0.0
    """0: system prompts equally likely; s > 0: the k-th is chosen with weight 1 / k**s."""
    seed: int = 0


@dataclass
class SimResult:
    policy: str
    replicas: int
    hit_rate: float
    """Prompt tokens served from the prefix cache over prompt tokens."""
    ttft_p50: float
    ttft_p99: float
    mean_wait: float
    requests: int
    per_replica_requests: list[int] = field(default_factory=list)


@dataclass
class _Request:
    arrival: float
    system: int
    hashes: list[int]
    prompt_tokens: int
    output_tokens: int
    prefilled_at: float | None = None
    finished_at: float | None = None
    """Set as they happen: the router tracks its route (policy.RouteProgress), as the front's."""


class _Replica:
    def __init__(self, slots: int, cache_blocks: int) -> None:
        self.slots, self.cache_blocks = slots, cache_blocks
        self.running = 0
        self.waiting: deque[_Request] = deque()
        self.cache: OrderedDict[int, None] = OrderedDict()
        self.served = 0
        self.prefill_free_at = 0.0

    @property
    def queue(self) -> int:
        return self.running + len(self.waiting)

    def take(self, hashes: list[int]) -> int:
        """The leading run of ``hashes`` cached; then every block cached and refreshed, LRU evicting."""
        hit = 0
        for h in hashes:
            if h not in self.cache:
                break
            hit += 1
        for h in hashes:
            self.cache[h] = None
            self.cache.move_to_end(h)
        while len(self.cache) > self.cache_blocks:
            self.cache.popitem(last=False)
        return hit


def _workload(w: Workload, block_size: int) -> list[_Request]:
    rng = random.Random(w.seed)
    weights = [1.0 / (k + 1) ** w.zipf for k in range(w.num_prompts)] if w.zipf else None
    sys_blocks = w.system_tokens // block_size
    total_blocks = (w.system_tokens + w.question_tokens) // block_size
    requests, t = [], 0.0
    for i in range(w.num_requests):
        t += rng.expovariate(w.rate)
        system = rng.choices(range(w.num_prompts), weights)[0] if weights else rng.randrange(w.num_prompts)
        # a block's identity: the system prompt's blocks are shared, the rest are this request's own
        hashes = [hash(("sys", system, b)) for b in range(sys_blocks)]
        hashes += [hash(("req", i, b)) for b in range(sys_blocks, total_blocks)]
        requests.append(_Request(t, system, hashes, w.system_tokens + w.question_tokens, w.output_tokens))
    return requests


def simulate(policy_name: str, replicas: int, workload: Workload, times: ServiceTimes, slots: int,
             cache_blocks: int, block_size: int = 16, report_period: float = 0.5, optimistic_ttl: float = 2.0,
             max_imbalance: int = 8, seed: int = 0) -> SimResult:
    """One run: every request of ``workload`` routed by ``policy_name`` over ``replicas`` modelled replicas."""
    policy = make_policy(policy_name, max_imbalance=max_imbalance, seed=seed) if policy_name == "prefix" \
        else make_policy(policy_name)
    index = PrefixIndex(optimistic_ttl)
    ids = [f"r{i}" for i in range(replicas)]
    nodes = {rid: _Replica(slots, cache_blocks) for rid in ids}
    events: list[tuple[float, int, str, object]] = []
    seq = 0

    def push(t: float, kind: str, payload: object) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, payload))

    for request in _workload(workload, block_size):
        push(request.arrival, "arrive", request)
    push(0.0, "report", None)
    ttfts, waits = [], []
    hit_tokens = prompt_tokens = 0
    remaining = workload.num_requests

    def start(rid: str, node: _Replica, request: _Request, now: float) -> None:
        nonlocal hit_tokens, prompt_tokens
        node.running += 1
        hit = node.take(request.hashes) * block_size
        uncached = request.prompt_tokens - hit
        prefill_start = max(now, node.prefill_free_at)
        node.prefill_free_at = prefill_start + uncached * times.prefill_per_token
        ttfts.append(node.prefill_free_at - request.arrival)
        waits.append(prefill_start - request.arrival)
        hit_tokens += hit
        prompt_tokens += request.prompt_tokens
        push(node.prefill_free_at, "prefilled", request)
        push(node.prefill_free_at + request.output_tokens * times.decode_per_token, "finish", (rid, request))

    while events and remaining:
        now, _, kind, payload = heapq.heappop(events)
        if kind == "report":
            for rid, node in nodes.items():
                backlog = max(node.prefill_free_at - now, 0.0) / times.prefill_per_token / block_size
                backlog += sum(len(r.hashes) + 1 for r in node.waiting)  # not started: counted uncached
                index.report(rid, frozenset(node.cache), node.queue, now, backlog, taken=now)
            push(now + report_period, "report", None)
        elif kind == "arrive":
            request: _Request = payload
            decision = policy.choose(request.hashes, index.views(ids, now))
            index.routed(decision.replica_id, request.hashes, now, uncached_blocks(request.hashes, decision),
                         progress=request)
            node = nodes[decision.replica_id]
            node.served += 1
            if node.running < node.slots:
                start(decision.replica_id, node, request, now)
            else:
                node.waiting.append(request)
        elif kind == "prefilled":
            payload.prefilled_at = now
        else:  # finish
            remaining -= 1
            rid, done = payload
            done.finished_at = now
            node = nodes[rid]
            node.running -= 1
            if node.waiting:
                start(rid, node, node.waiting.popleft(), now)
    ttfts.sort()
    return SimResult(policy_name, replicas, hit_tokens / max(prompt_tokens, 1), _quantile(ttfts, 0.5),
                     _quantile(ttfts, 0.99), sum(waits) / max(len(waits), 1), len(ttfts),
                     [nodes[rid].served for rid in ids])


def _quantile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    return sorted_values[min(int(q * len(sorted_values)), len(sorted_values) - 1)]


def result_row(result: SimResult) -> dict:
    row = asdict(result)
    row.pop("per_replica_requests")
    return row
