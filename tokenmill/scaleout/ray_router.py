"""The Ray Serve request router that runs policy.py on the replicas' reported block hashes.

Ray Serve builds one of these in every process that holds a handle to the engine deployment
(the front) and asks it, per request, for replicas ranked best first
(:meth:`PrefixRequestRouter.choose_replicas`); Ray then takes the first ranked replica whose
queue has room (``max_ongoing_requests``), so an overloaded choice spills to the next rank.

What it reads: ``RunningReplica.routing_stats``, the dict each replica's
``record_routing_stats`` returned when Ray's controller last polled it
(``request_routing_stats_period_s``): its cached block hashes, its queue, its prefill work, when
it was taken. A request's hashes travel in its :class:`~tokenmill.scaleout.replica.ReplicaRequest`,
on which the front marks its first token and its end: the index learns of a finished prefill or
request at once, not at the replica's next report (which a loaded machine can delay by seconds).
Calls other than ``generate`` (``describe``) are ranked as Ray's own router would, all at once.

Ray instantiates this class itself, so the front cannot hand it objects: the decision is left on
the request (``ReplicaRequest.decision``; the router runs in the front's process, on the object the
front passed to ``handle.generate``), where the front reads it for ``/metrics``.
"""

from __future__ import annotations

import time

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from tokenmill.scaleout.policy import PrefixIndex, make_policy, uncached_blocks
from tokenmill.scaleout.replica import ReplicaRequest


class PrefixRequestRouter(RequestRouter):
    def initialize_state(self, policy: str = "prefix", max_imbalance: int = 8, optimistic_ttl: float = 5.0,
                         **_: object) -> None:
        self.policy = make_policy(policy, max_imbalance=max_imbalance) if policy == "prefix" else make_policy(policy)
        self.index = PrefixIndex(optimistic_ttl)
        self._seen: dict[str, int] = {}
        """replica id -> the report number last read into the index."""

    def _read_reports(self, replicas: list[RunningReplica]) -> None:
        for replica in replicas:
            rid = replica.replica_id.unique_id
            stats = replica.routing_stats or {}
            seq = stats.get("report")
            if seq is not None and self._seen.get(rid) != seq:
                self._seen[rid] = seq
                self.index.report(rid, stats.get("hashes", ()), stats.get("queue", 0), time.monotonic(),
                                  stats.get("prefill_blocks"), stats.get("taken"))

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        request = _replica_request(pending_request)
        if request is None or not candidate_replicas:
            return [candidate_replicas]
        self._read_reports(candidate_replicas)
        usable = [r for r in candidate_replicas if r.replica_id.unique_id not in request.exclude] \
            or candidate_replicas
        by_id = {r.replica_id.unique_id: r for r in usable}
        now = time.monotonic()
        decision = self.policy.choose(request.block_hashes, self.index.views(list(by_id), now))
        # noted as decided: Ray tells routers where a request went only under its strict
        # max_ongoing_requests mode; the front learns where each really ran from the replica. Tracked
        # on the request itself: the front marks its first token and its end on this object
        self.index.routed(decision.replica_id, request.block_hashes, now,
                          uncached_blocks(request.block_hashes, decision), progress=request)
        request.decision = decision  # the front's own object (this process): its metrics read it
        chosen = by_id[decision.replica_id]
        return [[chosen], [r for r in usable if r is not chosen]]

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        self.index.forget(replica_id.unique_id)


def _replica_request(pending_request: PendingRequest | None) -> ReplicaRequest | None:
    if pending_request is None or not pending_request.args:
        return None
    first = pending_request.args[0]
    return first if isinstance(first, ReplicaRequest) else None
