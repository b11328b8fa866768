"""Price the measurements and find the frontier and the pick.

For each configuration, from its offline run over the whole workload:

    cost per 1M output tokens  = price per hour * duration (h) / output tokens * 10^6
    cost per 1k requests       = price per hour * duration (h) / requests * 10^3
    meets the SLO              p90 TTFT <= slo_ttft and p90 TPOT <= slo_tpot

The duration is the run's wall time, the machine doing nothing else: at an unbounded request
rate (the default) the machine is kept busy, so the cost is what its throughput costs; at a finite
rate its idle time is paid for too. The frontier is over (cost per 1M tokens, p90 TPOT); see
pareto.py. Perplexity (when measured) changes the pick in no way: it is shown beside the cost.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from tokenmill.benchmark.hardware import HardwareCeilings
from tokenmill.benchmark.offline import OfflineConfig
from tokenmill.costplan.config import Candidate, Objectives, SearchSpace
from tokenmill.costplan.measure import Measurement
from tokenmill.costplan.pareto import cheapest_meeting, pareto_frontier


@dataclass(frozen=True)
class PlanPoint:
    """One configuration, measured and priced."""

    candidate: Candidate
    duration_s: float
    """Wall time of the whole workload."""
    requests: int
    output_tokens: int
    output_tok_s: float
    ttft_p90_s: float
    tpot_p90_s: float
    cost_per_1m_tokens: float
    """Per million output tokens."""
    cost_per_1k_requests: float
    meets_slo: bool
    on_frontier: bool = False
    perplexity: float | None = None
    loaded: dict = field(default_factory=dict)
    """What ran: the model's name, compute dtype, device, weight bytes (the offline run's ``model``)."""
    summary: dict = field(default_factory=dict)
    """The offline run's summary (latency distributions in ms, MBU, MFU, step counts)."""

    @property
    def tradeoff(self) -> tuple[float, float]:
        """(cost, latency): the point on the frontier's axes."""
        return self.cost_per_1m_tokens, self.tpot_p90_s

    def to_dict(self) -> dict:
        data = asdict(self)
        return {"label": self.candidate.label, **data.pop("candidate"), **data}


@dataclass
class CostPlan:
    """The priced configurations (in measuring order) and the cheapest one that meets the SLO."""

    points: list[PlanPoint]
    cheapest: int | None
    """Index into ``points``; None when no configuration meets the SLO."""
    objectives: Objectives
    space: SearchSpace
    workload: OfflineConfig
    hardware: HardwareCeilings | None = None

    @property
    def frontier(self) -> list[PlanPoint]:
        """The frontier's points, cheapest first."""
        return sorted((p for p in self.points if p.on_frontier), key=lambda p: p.tradeoff)

    def to_dict(self) -> dict:
        pick = None if self.cheapest is None else self.points[self.cheapest].candidate.label
        return {"kind": "cost_plan", "objectives": asdict(self.objectives), "space": asdict(self.space),
                "workload": asdict(self.workload), "hardware": asdict(self.hardware) if self.hardware else None,
                "cheapest_meeting_slo": pick, "frontier": [p.candidate.label for p in self.frontier],
                "points": [p.to_dict() for p in self.points]}


def price(measurement: Measurement, objectives: Objectives) -> PlanPoint:
    """A measurement's cost and SLO verdict (not yet placed against the others)."""
    s = measurement.run["summary"]
    seconds, tokens, requests = s["duration_s"], s["total_output_tokens"], s["requests"]
    ttft, tpot = s["ttft"]["percentiles"]["p90"] / 1000, s["tpot"]["percentiles"]["p90"] / 1000
    return PlanPoint(measurement.candidate, seconds, requests, tokens, tokens / seconds, ttft, tpot,
                     objectives.cost(seconds, tokens, 10**6), objectives.cost(seconds, requests, 10**3),
                     objectives.meets(ttft, tpot), perplexity=measurement.perplexity,
                     loaded=measurement.run["model"], summary=s)


def make_plan(measurements: list[Measurement], objectives: Objectives, space: SearchSpace, workload: OfflineConfig,
              hardware: HardwareCeilings | None = None) -> CostPlan:
    """Price every measurement, mark the frontier and pick the cheapest that meets the SLO."""
    points = [price(m, objectives) for m in measurements]
    on_frontier = pareto_frontier([p.tradeoff for p in points])
    points = [replace(p, on_frontier=flag) for p, flag in zip(points, on_frontier)]
    cheapest = cheapest_meeting([p.tradeoff for p in points], [p.meets_slo for p in points])
    return CostPlan(points, cheapest, objectives, space, workload, hardware)

