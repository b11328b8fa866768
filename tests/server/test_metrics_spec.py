"""The speculative-decoding counters in /metrics (vLLM's names, tokenmill's prefix), fed from the
engine snapshots the server observes after each loop iteration."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tokenmill.engine import EngineSnapshot
from tokenmill.server.metrics import ServerMetrics
from tokenmill.server.budgets import BudgetBook
from tokenmill.server.cost import CostMeter
from tokenmill.server.tenancy import Tenancy


def _samples(metrics: ServerMetrics) -> dict[str, float]:
    return {s.name: s.value for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples}


def test_drafted_and_accepted_tokens_are_counted_from_the_snapshots():
    metrics = ServerMetrics(Tenancy(), CostMeter(), BudgetBook([]))
    metrics.observe_snapshot("m", EngineSnapshot(spec_draft_tokens=8, spec_accepted_tokens=5))
    metrics.observe_snapshot("m", EngineSnapshot(spec_draft_tokens=12, spec_accepted_tokens=6))
    got = _samples(metrics)
    assert got["tokenmill:spec_decode_num_draft_tokens_total"] == 12
    assert got["tokenmill:spec_decode_num_accepted_tokens_total"] == 6


def test_drafts_acceptance_per_position_rate_and_mean_length():
    metrics = ServerMetrics(Tenancy(), CostMeter(), BudgetBook([]))
    metrics.observe_snapshot("m", EngineSnapshot(spec_draft_tokens=8, spec_accepted_tokens=5, spec_drafts=2,
                                            spec_accepted_per_position=(2, 2, 1, 0)))
    metrics.observe_snapshot("m", EngineSnapshot(spec_draft_tokens=12, spec_accepted_tokens=6, spec_drafts=3,
                                            spec_accepted_per_position=(3, 2, 1, 0)))
    got = _samples(metrics)
    assert got["tokenmill:spec_decode_num_drafts_total"] == 3
    per_pos = {s.labels["position"]: s.value for f in text_string_to_metric_families(metrics.render().decode())
               for s in f.samples if s.name == "tokenmill:spec_decode_num_accepted_tokens_per_pos_total"}
    assert per_pos == {"0": 3, "1": 2, "2": 1, "3": 0}
    assert got["tokenmill:spec_decode_acceptance_rate"] == 0.5
    assert got["tokenmill:spec_decode_mean_accepted_length"] == 3.0
