"""The front's ``/metrics`` for its replicas: routing decisions, each replica's prefix-cache hit rate,
queue and KV use (from its own reports), requests routed, retried and failed per replica."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from tokenmill.scaleout.remote import RemoteEngine


class ReplicaCollector(Collector):
    def __init__(self, engine: RemoteEngine, model: str) -> None:
        self.engine, self.model = engine, model

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        decisions, matched, reports = self.engine.ledger.snapshot()
        m = self.model
        family = CounterMetricFamily("tokenmill:router_decisions", "Requests the router sent to each replica, by why "
                                     "(prefix: it held the longest cached prefix; spread: power of two choices, "
                                     "no replica held any; balance: the holder was too busy; round_robin)",
                                     labels=["model_name", "replica", "reason"])
        for (replica, reason), value in sorted(decisions.items()):
            family.add_metric([m, replica, reason], value)
        yield family
        family = CounterMetricFamily("tokenmill:router_matched_blocks", "Cached prompt blocks the router expected "
                                     "the chosen replica to reuse", labels=["model_name", "replica"])
        for replica, value in sorted(matched.items()):
            family.add_metric([m, replica], value)
        yield family
        queries = CounterMetricFamily("tokenmill:replica_prefix_cache_queries", "Prompt blocks a replica looked up "
                                      "in its prefix cache (as of the last request it took)",
                                      labels=["model_name", "replica"])
        hits = CounterMetricFamily("tokenmill:replica_prefix_cache_hits", "Of those, blocks it found",
                                   labels=["model_name", "replica"])
        rate = GaugeMetricFamily("tokenmill:replica_prefix_cache_hit_rate", "A replica's prefix-cache hits over "
                                 "queries since it started", labels=["model_name", "replica"])
        queue = GaugeMetricFamily("tokenmill:replica_queue", "Requests running or waiting at a replica (as of the "
                                  "last request it took)", labels=["model_name", "replica"])
        kv = GaugeMetricFamily("tokenmill:replica_kv_cache_usage_perc", "A replica's KV pool in use (as of the last request "
                               "it took)", labels=["model_name", "replica"])
        for replica, report in sorted(reports.items()):
            q, h = report.get("prefix_queries", 0), report.get("prefix_hits", 0)
            queries.add_metric([m, replica], q)
            hits.add_metric([m, replica], h)
            rate.add_metric([m, replica], h / q if q else 0.0)
            queue.add_metric([m, replica], report.get("queue", 0))
            kv.add_metric([m, replica], report.get("kv_usage", 0.0))
        yield from (queries, hits, rate, queue, kv)
        events = CounterMetricFamily("tokenmill:replica_requests", "Engine requests the front sent to each "
                                     "replica, by outcome (routed; retried: the replica was lost before any of it "
                                     "reached the client, so it went to another; failed)",
                                     labels=["model_name", "replica", "event"])
        for (replica, event), value in sorted(self.engine.events.items()):
            events.add_metric([m, replica, event], value)
        yield events
        taken = CounterMetricFamily("tokenmill:version_requests", "Engine requests each version of the model took "
                                    "(rollout.py)", labels=["model_name", "version"])
        weight = GaugeMetricFamily("tokenmill:version_weight", "Share of new requests each version takes",
                                   labels=["model_name", "version"])
        for version in list(self.engine.versions.values()):
            taken.add_metric([m, version.name], version.requests)
            weight.add_metric([m, version.name], version.weight)
        yield from (taken, weight)
        transfers = dict(self.engine.transfers)
        if transfers:
            yield CounterMetricFamily("tokenmill:kv_transfer_requests", "Requests whose prompt KV a prefill replica "
                                      "handed to a decode replica", value=transfers.get("requests", 0))
            yield CounterMetricFamily("tokenmill:kv_transfer_bytes", "KV bytes handed from prefill to decode "
                                      "replicas", value=transfers.get("bytes", 0))
            seconds = CounterMetricFamily("tokenmill:kv_transfer_seconds", "Seconds spent exporting KV blocks (prefill "
                                          "replica) and importing them (decode replica)", labels=["phase"])
            for phase in ("export", "import"):
                seconds.add_metric([phase], transfers.get(phase, 0.0))
            yield seconds
