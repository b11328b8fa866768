"""Prometheus metrics, one CollectorRegistry per app. Names follow vLLM's (``vllm:`` becomes ``tokenmill:``).

Every engine figure carries a ``model_name`` label (several models can be served at once).
Engine gauges and counters come from the engine thread's snapshots after every loop iteration;
request histograms and token counters from each finished request; rejections from admission
and tenancy; per-tenant usage, costs (cost.py) and budgets (budgets.py) are read at scrape time.
The tenant label names every tenant, which is why /metrics (ops.py) needs an admin or metrics
key when keys are configured.
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
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from tokenmill.engine import EngineSnapshot
from tokenmill.models.moe_stats import MoEStepStats
from tokenmill.server.budgets import BudgetBook
from tokenmill.server.cost import IDLE, KINDS, CostMeter
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


class _Costs(Collector):
    """The cost meter's totals and rates, and the budgets, at scrape time."""

    def __init__(self, meter: CostMeter, budgets: BudgetBook) -> None:
        self.meter, self.budgets = meter, budgets

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        summary = self.meter.summary()
        yield CounterMetricFamily("tokenmill:metered_cost", "Wall time of the engine thread since start x the price "
                                  "(the meter's own total)", value=summary["metered"])
        yield CounterMetricFamily("tokenmill:idle_cost", "Cost of the time no model stepped",
                                  value=summary["lines"].get(IDLE, 0.0))
        other = CounterMetricFamily("tokenmill:other_cost", "Cost of time charged to no request and not idle "
                                    "(loading a model, steps that ran no request's tokens)", labels=["line"])
        for line, value in summary["lines"].items():
            if line != IDLE:
                other.add_metric([line], value)
        yield other
        per_request = CounterMetricFamily("tokenmill:request_cost", "Cost charged to requests (their share of the "
                                          "steps they ran in)", labels=["model_name", "tenant"])
        for (model, tenant), value in list(self.meter.by_model_tenant.items()):
            per_request.add_metric([model, tenant], value)
        yield per_request
        rates = GaugeMetricFamily("tokenmill:cost_per_1k_tokens", "Measured cost per 1000 tokens of each kind "
                                  "(prompt: computed prompt tokens; cached: from the prefix cache)",
                                  labels=["model_name", "kind"])
        for model, by_kind in self.meter.rates().items():
            for kind in KINDS:
                if kind in by_kind:
                    rates.add_metric([model, kind], by_kind[kind])
        yield rates
        families = {name: (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(
            f"tokenmill:budget_{name}", what, labels=["tenant"]) for name, kind, what in (
            ("limit", "gauge", "A tenant's budget"), ("spent", "gauge", "Charged to the tenant so far"),
            ("held", "gauge", "Held for the tenant's requests in flight (their stated upper bounds)"),
            ("overrun", "counter", "Measured cost above the holds it settled against (not charged)"),
            ("soft_limit_alerts", "counter", "Times the tenant's spending passed its soft limit"))}
        for tenant, budget in self.budgets.snapshot().items():
            for name, family in families.items():
                family.add_metric([tenant], getattr(budget, name))
        yield from families.values()


class ServerMetrics:
    def __init__(self, tenancy: Tenancy, meter: CostMeter, budgets: BudgetBook) -> None:
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
        self.slo = Counter("tokenmill:slo_requests", "Finished requests per tenant, by whether they met the TTFT "
                           "and TPOT objectives (--slo-ttft, --slo-tpot)", ["tenant", "met"], registry=registry)
        self.route_requests = Counter("tokenmill:route_requests", "Requests to a routed model name, by the model "
                                      "that answered", ["route", "model_name"], registry=registry)
        self.route_escalations = Counter("tokenmill:route_escalations", "Cascade requests the cheaper model's "
                                         "answer was not confident enough for", ["route"], registry=registry)
        self.cold_start = Gauge("tokenmill:model_cold_start_seconds", "Seconds from loading a model to serving it "
                                "(weights, engine, warm-up)", **labels)
        registry.register(_TenantUsage(tenancy))
        registry.register(_Costs(meter, budgets))
        self._last: dict[str, EngineSnapshot] = {}
        self.queued_in_server: dict[str, int] = {}

    def observe_snapshot(self, m: str, snap: EngineSnapshot) -> None:
        """Model ``m``'s snapshot, from the engine thread after every loop iteration (prometheus_client
        is thread-safe)."""
        last = self._last.get(m, EngineSnapshot())
        self.running.labels(m).set(snap.num_running)
        self.waiting.labels(m).set(snap.num_waiting + self.queued_in_server.get(m, 0))
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
            self._observe_moe(m, snap.moe, last.moe)
        self._last[m] = snap

    def forget(self, m: str) -> None:
        """Model ``m`` was unloaded: its gauges go (its counters stay, as Prometheus expects)."""
        for gauge in (self.running, self.waiting, self.kv_usage, self.kv_blocks, self.lora_running, self.lora_loaded):
            try:
                gauge.remove(m)
            except KeyError:
                pass
        self._last.pop(m, None)

    def _observe_moe(self, m: str, now: MoEStepStats, before: MoEStepStats | None) -> None:
        for layer, row in enumerate(now.tokens_per_expert):
            if not any(row):
                continue  # a dense layer
            for expert, count in enumerate(row):
                self.moe_tokens.labels(m, str(layer), str(expert)).inc(
                    count - (before.tokens_per_expert[layer][expert] if before else 0))
        self.moe_dropped.labels(m).inc(now.dropped - (before.dropped if before else 0))
        self.moe_entropy.labels(m).set(now.mean_entropy)

    def set_queued(self, m: str, queued_in_server: int, engine_waiting: int) -> None:
        self.queued_in_server[m] = queued_in_server
        self.waiting.labels(m).set(engine_waiting + queued_in_server)

    def reject(self, m: str, reason: str) -> None:
        self.rejected.labels(m, reason).inc()

    def observe_request(self, m: str, arrival: float, scheduled: float | None, first_token: float | None,
                        finish: float, prompt_tokens: int, completion_tokens: int, finished_reason: str,
                        lora: str | None = None) -> None:
        """One engine request of model ``m`` that ended; times are time.monotonic(), arrival at the
        HTTP server; ``lora``: the adapter it ran with."""
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

    def observe_inter_token(self, m: str, seconds: float) -> None:
        self.itl.labels(m).observe(seconds)

    def observe_slo(self, tenant: str, met: bool) -> None:
        self.slo.labels(tenant, "true" if met else "false").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
