"""Prometheus metrics, one CollectorRegistry per app. Names follow vLLM's (``vllm:`` becomes ``tokenmill:``).

Engine gauges and counters come from the engine thread's snapshot after every loop iteration;
request histograms and token counters from each finished request; rejections from admission
and tenancy; per-tenant usage is read from Tenancy at scrape time. The tenant label names every
tenant, which is why /metrics (ops.py) needs an admin or metrics key when keys are configured.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from tokenmill.engine import EngineSnapshot
from tokenmill.models.moe_stats import MoEStepStats
from tokenmill.server.tenancy import Tenancy

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0, 640.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                         0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)


class _TenantUsage(Collector):
    def __init__(self, tenancy: Tenancy) -> None:
        self.tenancy = tenancy

    def collect(self) -> Iterator[CounterMetricFamily]:
        families = {name: CounterMetricFamily(f"tokenmill:tenant_{name}", f"{what} per tenant", labels=["tenant"])
                    for name, what in (("requests", "Finished requests"), ("prompt_tokens", "Prompt tokens"),
                                       ("cached_tokens", "Prompt tokens served from the prefix cache"),
                                       ("completion_tokens", "Generated tokens"))}
        for tenant, usage in list(self.tenancy.usage.items()):
            for name, family in families.items():
                family.add_metric([tenant], getattr(usage, name))
        yield from families.values()


class ServerMetrics:
    def __init__(self, model_name: str, tenancy: Tenancy) -> None:
        self.registry = registry = CollectorRegistry()
        labels = {"labelnames": ["model_name"], "registry": registry}
        self.running = Gauge("tokenmill:num_requests_running", "Sequences running in the engine", **labels)
        self.waiting = Gauge("tokenmill:num_requests_waiting",
                             "Requests waiting: in the admission queue or the engine's queue", **labels)
        self.kv_usage = Gauge("tokenmill:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1)", **labels)
        self.kv_blocks = Gauge("tokenmill:kv_cache_used_blocks", "KV cache blocks held by sequences", **labels)
        self.prefix_queries = Counter("tokenmill:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      **labels)
        self.prefix_hits = Counter("tokenmill:prefix_cache_hits", "Prompt tokens found in the prefix cache", **labels)
        self.preemptions = Counter("tokenmill:num_preemptions", "Sequences preempted (recomputed later)", **labels)
        self.spec_draft = Counter("tokenmill:spec_decode_num_draft_tokens",
                                  "Drafted tokens verified (speculative decoding)", **labels)
        self.spec_accepted = Counter("tokenmill:spec_decode_num_accepted_tokens",
                                     "Drafted tokens kept by verification", **labels)
        self.spec_drafts = Counter("tokenmill:spec_decode_num_drafts",
                                   "Verifications: one per drafting sequence and step", **labels)
        self.spec_per_pos = Counter("tokenmill:spec_decode_num_accepted_tokens_per_pos",
                                    "Drafted tokens kept, by position in the draft (0-based)",
                                    ["model_name", "position"], registry=registry)
        self.spec_rate = Gauge("tokenmill:spec_decode_acceptance_rate",
                               "Drafted tokens kept / drafted, since start", **labels)
        self.spec_length = Gauge("tokenmill:spec_decode_mean_accepted_length",
                                 "Tokens produced per verification (kept drafts + 1), since start", **labels)
        self.prompt_tokens = Counter("tokenmill:prompt_tokens", "Prompt tokens of finished requests", **labels)
        self.generation_tokens = Counter("tokenmill:generation_tokens", "Generated tokens", **labels)
        self.success = Counter("tokenmill:request_success", "Finished requests by finish reason",
                               ["model_name", "finished_reason"], registry=registry)
        self.rejected = Counter("tokenmill:request_rejected", "Requests refused or aborted by the server, by reason",
                                ["model_name", "reason"], registry=registry)
        self.ttft = Histogram("tokenmill:time_to_first_token_seconds", "Arrival to first token",
                              buckets=LATENCY_BUCKETS, **labels)
        self.tpot = Histogram("tokenmill:time_per_output_token_seconds", "Mean time per output token after the first",
                              buckets=TOKEN_LATENCY_BUCKETS, **labels)
        self.itl = Histogram("tokenmill:inter_token_latency_seconds", "Time between consecutive token updates",
                             buckets=TOKEN_LATENCY_BUCKETS, **labels)
        self.e2e = Histogram("tokenmill:e2e_request_latency_seconds", "Arrival to finish", buckets=LATENCY_BUCKETS,
                             **labels)
        self.lora_requests = Counter("tokenmill:lora_requests", "Finished requests per LoRA adapter",
                                     ["model_name", "lora_name"], registry=registry)
        self.lora_prompt_tokens = Counter("tokenmill:lora_prompt_tokens", "Prompt tokens per LoRA adapter",
                                          ["model_name", "lora_name"], registry=registry)
        self.lora_generation_tokens = Counter("tokenmill:lora_generation_tokens", "Generated tokens per LoRA adapter",
                                              ["model_name", "lora_name"], registry=registry)
        self.lora_running = Gauge("tokenmill:lora_running_adapters",
                                  "Distinct LoRA adapters among the running sequences", **labels)
        self.lora_loaded = Gauge("tokenmill:lora_loaded_adapters", "LoRA adapters registered (loaded by name)",
                                 **labels)
        self.moe_tokens = Counter("tokenmill:moe_expert_tokens",
                                  "MoE routing: assignments per layer and expert (a token counts once per chosen expert)",
                                  ["model_name", "layer", "expert"], registry=registry)
        self.moe_dropped = Counter("tokenmill:moe_dropped_tokens",
                                   "MoE assignments dropped by the capacity factor (0 in no-drop mode)", **labels)
        self.moe_entropy = Gauge("tokenmill:moe_router_entropy",
                                 "Mean entropy (nats) of the routers' distributions over experts, since start",
                                 **labels)
        self.queue_time = Histogram("tokenmill:request_queue_time_seconds", "Arrival to first scheduled",
                                    buckets=LATENCY_BUCKETS, **labels)
        registry.register(_TenantUsage(tenancy))
        self.model_name = model_name
        self._last = EngineSnapshot()
        self.queued_in_server = 0

    def observe_snapshot(self, snap: EngineSnapshot) -> None:
        """Called from the engine thread after every loop iteration (prometheus_client is thread-safe)."""
        m, last = self.model_name, self._last
        self.running.labels(m).set(snap.num_running)
        self.waiting.labels(m).set(snap.num_waiting + self.queued_in_server)
        self.kv_usage.labels(m).set(snap.kv_usage)
        self.kv_blocks.labels(m).set(snap.num_used_blocks)
        self.lora_running.labels(m).set(snap.num_running_adapters)
        self.lora_loaded.labels(m).set(snap.num_loaded_adapters)
        self.prefix_queries.labels(m).inc(snap.prefix_queries - last.prefix_queries)
        self.prefix_hits.labels(m).inc(snap.prefix_hits - last.prefix_hits)
        self.preemptions.labels(m).inc(snap.num_preemptions - last.num_preemptions)
        self.spec_draft.labels(m).inc(snap.spec_draft_tokens - last.spec_draft_tokens)
        self.spec_accepted.labels(m).inc(snap.spec_accepted_tokens - last.spec_accepted_tokens)
        if snap.spec_drafts:
            self.spec_drafts.labels(m).inc(snap.spec_drafts - last.spec_drafts)
            previous = last.spec_accepted_per_position
            for j, kept in enumerate(snap.spec_accepted_per_position):
                self.spec_per_pos.labels(m, str(j)).inc(kept - (previous[j] if j < len(previous) else 0))
            self.spec_rate.labels(m).set(snap.spec_accepted_tokens / max(snap.spec_draft_tokens, 1))
            self.spec_length.labels(m).set(1 + snap.spec_accepted_tokens / snap.spec_drafts)
        if snap.moe is not None and snap.moe is not last.moe:  # the totals object changes only when a step routes
            self._observe_moe(snap.moe, last.moe)
        self._last = snap

    def _observe_moe(self, now: MoEStepStats, before: MoEStepStats | None) -> None:
        m = self.model_name
        for layer, row in enumerate(now.tokens_per_expert):
            if not any(row):
                continue  # a dense layer
            for expert, count in enumerate(row):
                self.moe_tokens.labels(m, str(layer), str(expert)).inc(
                    count - (before.tokens_per_expert[layer][expert] if before else 0))
        self.moe_dropped.labels(m).inc(now.dropped - (before.dropped if before else 0))
        self.moe_entropy.labels(m).set(now.mean_entropy)

    def set_queued(self, queued_in_server: int, engine_waiting: int) -> None:
        self.queued_in_server = queued_in_server
        self.waiting.labels(self.model_name).set(engine_waiting + queued_in_server)

    def reject(self, reason: str) -> None:
        self.rejected.labels(self.model_name, reason).inc()

    def observe_request(self, arrival: float, scheduled: float | None, first_token: float | None,
                        finish: float, prompt_tokens: int, completion_tokens: int, finished_reason: str,
                        lora: str | None = None) -> None:
        """One engine request that ended; times are time.monotonic(), arrival at the HTTP server;
        ``lora``: the adapter it ran with."""
        m = self.model_name
        if lora is not None:
            self.lora_requests.labels(m, lora).inc()
            self.lora_prompt_tokens.labels(m, lora).inc(prompt_tokens)
            self.lora_generation_tokens.labels(m, lora).inc(completion_tokens)
        self.prompt_tokens.labels(m).inc(prompt_tokens)
        self.generation_tokens.labels(m).inc(completion_tokens)
        self.success.labels(m, finished_reason).inc()
        self.e2e.labels(m).observe(finish - arrival)
        if scheduled is not None:
            self.queue_time.labels(m).observe(max(scheduled - arrival, 0.0))
        if first_token is not None:
            self.ttft.labels(m).observe(first_token - arrival)
            if completion_tokens > 1:
                self.tpot.labels(m).observe((finish - first_token) / (completion_tokens - 1))

    def observe_inter_token(self, seconds: float) -> None:
        self.itl.labels(self.model_name).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
