"""Which replica serves a request: prefix-aware routing, and the round-robin it is measured against.

A replica reports the hashes of the KV blocks its prefix cache holds (``LLMEngine.
cached_block_hashes``, the same hashes its engine looks up, made equal across processes by a
shared ``prefix_hash_key``) and its queue depth. A request's hashes are its prompt's full blocks,
chained with its tenant's cache salt and its adapter (``BlockHasher.chain``), so a match is a
block the replica would really reuse for this tenant and adapter, never another's::

    request   h0 h1 h2 h3 h4            replica A holds h0 h1 h2 ..   -> 3 blocks match
                                        replica B holds h0 ..         -> 1
                                        replica C holds nothing       -> 0

:meth:`PrefixAwarePolicy.choose`:

1. each replica's match is the leading run of the request's hashes it holds;
2. no replica holds any block: power of two choices, two replicas at random, the one with less
   prefill queued (below) wins -> ``spread`` (random pairs, not the single least loaded: routers working from reports
   a moment old would all herd onto the same idle replica);
3. else, among replicas whose queue is at most ``max_imbalance`` longer than the shortest, the
   one where the first token should come soonest: the fewest blocks to prefill before it, the
   blocks the replica last reported it had left to prefill, plus the uncached blocks of the
   requests routed there since (PrefixIndex), plus this request's blocks less its match
   (ties: the longer match, then the shorter queue) -> ``prefix`` when that is a longest match,
   ``balance`` when a replica holding more of it was passed over for its queue.

A cached prefix is worth exactly the prefill it saves; it is not worth waiting behind other
requests' prefills for longer than that.

:class:`PrefixIndex` keeps what each replica reported, plus the requests routed to it since
(their blocks will be there once prefilled): a burst of requests sharing a new prefix follows
the first one before the replica's next report. A request whose progress the caller tracks (the
front marks its first token and its end) leaves the replica's prefill work and queue as it
happens, and its blocks count until a report taken after its prefill shows whether they are
still there; an untracked one's blocks count for ``optimistic_ttl`` seconds. Either way, after a
replica evicts a prefix, routing follows its reports.

Pure: no Ray, no clocks of its own (times are passed in); the Ray request router
(ray_router.py) and the simulator (simulate.py) both run it.
"""

from __future__ import annotations

import random
import threading
from collections import Counter
from collections.abc import Container, Sequence
from dataclasses import dataclass, field
from typing import Protocol

REASONS = ("prefix", "balance", "spread", "round_robin")


@dataclass(frozen=True)
class ReplicaView:
    """What the router knows of one replica when it routes a request."""

    replica_id: str
    queue: int
    """Requests at the replica (running or waiting), as last known."""
    cached: Container[int] = frozenset()
    """Block hashes it holds (reported, plus routed since): anything ``in`` answers."""
    work_ahead: float | None = None
    """Blocks still to prefill there, as the router estimates (None: ``queue`` x a typical request's)."""


@dataclass(frozen=True)
class Decision:
    replica_id: str
    reason: str
    """One of REASONS."""
    matched_blocks: int
    """Leading blocks of the request the chosen replica holds."""


def matched_blocks(hashes: Sequence[int], cached: Container[int]) -> int:
    """How many of ``hashes``, from the first, ``cached`` holds (a chain: the first miss ends it)."""
    n = 0
    for h in hashes:
        if h not in cached:
            break
        n += 1
    return n


class PrefixAwarePolicy:
    """The replica where this request's first token comes soonest, by the blocks each holds and the
    work queued there; power of two choices when none holds any of it."""

    name = "prefix"

    def __init__(self, max_imbalance: int = 8, seed: int | None = None) -> None:
        if max_imbalance < 0:
            raise ValueError(f"max_imbalance must be >= 0, got {max_imbalance}")
        self.max_imbalance = max_imbalance
        self._rng = random.Random(seed)
        self.work_per_request = 0.0
        """Moving average of the uncached blocks of the requests routed (the work one queued request adds)."""

    def choose(self, hashes: Sequence[int], replicas: Sequence[ReplicaView]) -> Decision:
        if not replicas:
            raise ValueError("no replica to route to")
        shortest = min(r.queue for r in replicas)
        matches = {r.replica_id: matched_blocks(hashes, r.cached) for r in replicas}
        longest = max(matches.values())
        own = len(hashes) + 1  # the request's blocks (the last one partial)
        typical = self.work_per_request or own

        def ahead(r: ReplicaView) -> float:
            return r.work_ahead if r.work_ahead is not None else r.queue * typical
        if longest == 0:
            pair = self._rng.sample(list(replicas), min(2, len(replicas)))
            pick = min(pair, key=lambda r: (ahead(r), r.queue))
            decision = Decision(pick.replica_id, "spread", 0)
        else:
            def estimate(r: ReplicaView) -> tuple[float, int, int, float]:
                """Blocks to prefill there before this request's first token: the queue's, then its own
                (ties: the longer match, the shorter queue, then at random, so that replicas holding
                the same prefix share its requests)."""
                return ahead(r) + own - matches[r.replica_id], -matches[r.replica_id], r.queue, self._rng.random()
            eligible = [r for r in replicas if r.queue - shortest <= self.max_imbalance]
            pick = min(eligible, key=estimate)
            matched = matches[pick.replica_id]
            decision = Decision(pick.replica_id, "prefix" if matched == longest else "balance", matched)
        uncached = uncached_blocks(hashes, decision)
        self.work_per_request = 0.9 * self.work_per_request + 0.1 * uncached if self.work_per_request else uncached
        return decision


class RoundRobinPolicy:
    """Each replica in turn, whatever it holds: the baseline prefix-aware routing is measured against."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, hashes: Sequence[int], replicas: Sequence[ReplicaView]) -> Decision:
        if not replicas:
            raise ValueError("no replica to route to")
        ordered = sorted(replicas, key=lambda r: r.replica_id)
        pick = ordered[self._next % len(ordered)]
        self._next += 1
        return Decision(pick.replica_id, "round_robin", matched_blocks(hashes, pick.cached))


POLICIES = {"prefix": PrefixAwarePolicy, "round_robin": RoundRobinPolicy}


def make_policy(name: str, **kwargs) -> PrefixAwarePolicy | RoundRobinPolicy:
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICIES)}")
    return POLICIES[name](**kwargs) if name == "prefix" else POLICIES[name]()


class RouteProgress(Protocol):
    """A routed request's progress as the router's caller sees it, in the clock of the replicas'
    reports (``PrefixIndex.report(taken=)``): each None until it happens."""

    prefilled_at: float | None
    """When its first token came back: its blocks are cached at the replica, its prefill done."""
    finished_at: float | None
    """When it ended (done, failed or aborted): it left the replica's queue."""


@dataclass(eq=False)
class _Route:
    """A request routed to a replica, kept until the replica's reports account for it."""

    hashes: tuple[int, ...]
    work: float
    """Its uncached blocks when routed (what it adds to the replica's prefill queue)."""
    at: float
    """When it was routed (the router's clock)."""
    progress: RouteProgress | None = None
    """Tracked: its progress. Untracked (None): its blocks count for ``optimistic_ttl`` seconds, its
    work and its place in the queue until the replica's next report."""
    seen: bool = False
    """A report came after it was routed: the reported queue counts it."""
    in_work: bool = False
    """The last report of prefill work counts its work (it was not prefilled when that was taken)."""
    confirmed: bool = False
    """Tracked: a report taken after its prefill says whether its blocks are still there."""


@dataclass
class _Replica:
    reported: frozenset[int] = frozenset()
    queue: int = 0
    reported_work: float = 0.0
    """Blocks it had left to prefill at its last report."""
    routes: list[_Route] = field(default_factory=list)


class _Held:
    """What a replica holds, as the router believes: its report, plus its routes' blocks."""

    __slots__ = ("reported", "routed")

    def __init__(self, reported: frozenset[int], routed: set[int]) -> None:
        self.reported, self.routed = reported, routed

    def __contains__(self, h: int) -> bool:
        return h in self.reported or h in self.routed


class PrefixIndex:
    """Per replica: the block hashes, queue and prefill work it last reported, plus the requests
    routed to it that its reports have not accounted for yet.

    A tracked route (``routed(..., progress=)``) leaves the replica's prefill work when its first
    token comes and its queue when it ends, at once, before any report says so; its blocks count
    as held until a report taken after its prefill shows whether they still are, however late
    reports come. An untracked route's blocks count for ``optimistic_ttl`` seconds, its work and
    its place in the queue until the replica's next report."""

    def __init__(self, optimistic_ttl: float = 2.0) -> None:
        self.optimistic_ttl = optimistic_ttl
        self._replicas: dict[str, _Replica] = {}

    def report(self, replica_id: str, hashes: Sequence[int] | frozenset[int], queue: int,
               now: float | None = None, work: float | None = None, taken: float | None = None) -> None:
        """A replica's own report replaces what it held (evicted blocks drop out), its queue and,
        when given, the blocks it has left to prefill (``work``; without it the routes since its last
        report leave the estimate oldest first, down to its queue). ``now``: also drop untracked
        routes older than the ttl. ``taken``: when it was taken, in the tracked routes' clock (None:
        what they did before it was read counts as before it was taken)."""
        replica = self._replicas.setdefault(replica_id, _Replica())
        replica.reported = hashes if isinstance(hashes, frozenset) else frozenset(hashes)
        replica.queue = queue
        if work is not None:
            replica.reported_work = work
        horizon = now - self.optimistic_ttl if now is not None else None

        def by_then(t: float | None) -> bool:
            return t is not None and (taken is None or t <= taken)
        kept, unreported, running = [], [], []
        for route in replica.routes:
            progress = route.progress
            if progress is None:
                if horizon is not None and route.at <= horizon:
                    continue
                prefilled = False
            else:
                if by_then(progress.finished_at):  # the report's queue and blocks already show it
                    continue
                prefilled = by_then(progress.prefilled_at)
                route.confirmed = route.confirmed or prefilled
                if route.seen and progress.finished_at is None:
                    running.append(route)
            if work is not None:
                route.in_work = not prefilled
            elif not route.in_work and not prefilled:
                unreported.append(route)
            route.seen = True
            kept.append(route)
        for route in unreported[:max(0, len(unreported) - queue)]:  # no work figure: the oldest done first
            route.work = 0.0
        # its queue bounds the tracked routes still there (of those routed before the last report: a
        # newer one may not have reached it): more means some ended unmarked, the oldest go
        lost = {id(route) for route in running[:max(0, len(running) - queue)]}
        replica.routes = [route for route in kept if id(route) not in lost]

    def routed(self, replica_id: str, hashes: Sequence[int], now: float, work: float = 0.0,
               progress: RouteProgress | None = None) -> None:
        """A request went to ``replica_id``: its blocks will be there; ``work``: its uncached blocks;
        ``progress``: the request's, to track it."""
        replica = self._replicas.setdefault(replica_id, _Replica())
        replica.routes.append(_Route(tuple(hashes), work, now, progress))

    def forget(self, replica_id: str) -> None:
        self._replicas.pop(replica_id, None)

    def views(self, replica_ids: Sequence[str], now: float) -> list[ReplicaView]:
        horizon = now - self.optimistic_ttl
        views = []
        for rid in replica_ids:
            replica = self._replicas.get(rid)
            if replica is None:
                replica = self._replicas[rid] = _Replica()
            queue, work, held = replica.queue, replica.reported_work, set()
            for route in replica.routes:
                progress = route.progress
                finished = progress is not None and progress.finished_at is not None
                prefilled = progress is not None and progress.prefilled_at is not None
                queue += (-1 if route.seen else 0) if finished else (0 if route.seen else 1)
                if route.in_work == prefilled:  # counted by the report and done since, or not counted and not done
                    work += -route.work if prefilled else route.work
                if (route.at > horizon) if progress is None else not route.confirmed:
                    held.update(route.hashes)
            views.append(ReplicaView(rid, max(0, queue), _Held(replica.reported, held), max(0.0, work)))
        return views


@dataclass
class RoutingLedger:
    """The front's record of routing: what the router decided, and what each replica last said of
    itself (prefix-cache counters, queue, KV use), for ``/metrics``."""

    decisions: Counter = field(default_factory=Counter)
    """(replica id, reason) -> requests routed."""
    matched_blocks: Counter = field(default_factory=Counter)
    """replica id -> blocks of routed requests the router expected it to hold."""
    reports: dict[str, dict] = field(default_factory=dict)
    """replica id -> its latest counters."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, decision: Decision) -> None:
        with self.lock:
            self.decisions[(decision.replica_id, decision.reason)] += 1
            self.matched_blocks[decision.replica_id] += decision.matched_blocks

    def report(self, replica_id: str, stats: dict) -> None:
        with self.lock:
            self.reports[replica_id] = dict(stats)

    def snapshot(self) -> tuple[dict, dict, dict]:
        with self.lock:
            return dict(self.decisions), dict(self.matched_blocks), {k: dict(v) for k, v in self.reports.items()}


def uncached_blocks(hashes: Sequence[int], decision: Decision) -> int:
    """The blocks a routed request still prefills where it went (its last block is partial)."""
    return len(hashes) + 1 - decision.matched_blocks
