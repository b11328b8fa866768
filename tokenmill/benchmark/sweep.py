"""``tokenmill bench sweep``: the serve benchmark at rising request rates or concurrencies.

Each load level runs on fresh prompts (the workload seed moves with the level, so a server's
prefix cache cannot serve a level from the previous one). From the points:

* the throughput-latency curve (output tok/s against TTFT, TPOT and E2E latency);
* the saturation point: the first level whose output throughput rises less than ``min_gain``
  over the best lower level, or whose median E2E latency exceeds ``latency_factor`` times the
  lowest level's; the level before it is the highest unsaturated load;
* the best goodput: the level with the most requests per second meeting the SLO.

Writes a JSON file, a PNG of the curves and a markdown report beside it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenmill.benchmark.client import ClientConfig
from tokenmill.benchmark.metrics import SLO, Summary
from tokenmill.benchmark.report import fmt, markdown_table, save_figure
from tokenmill.benchmark.runner import LoadConfig, run_serve
from tokenmill.benchmark.workloads import Conversation
from tokenmill.errors import InvalidParameterError

MODES = ("rate", "concurrency")


@dataclass
class SweepPoint:
    load: float
    """Request rate (req/s, may be inf) or max concurrency of this level."""
    summary: Summary


@dataclass(frozen=True)
class Saturation:
    index: int
    """Index of the first saturated level."""
    load: float
    reason: str
    last_unsaturated_load: float | None


@dataclass
class SweepResult:
    mode: str
    points: list[SweepPoint]
    client: dict
    workload: dict
    slo: dict | None
    saturation: Saturation | None = None
    best_goodput: dict | None = None

    def to_dict(self) -> dict:
        return {"kind": "sweep", "mode": self.mode, "client": self.client, "workload": self.workload, "slo": self.slo,
                "points": [{"load": p.load, "summary": p.summary.to_dict()} for p in self.points],
                "saturation": dataclasses.asdict(self.saturation) if self.saturation else None,
                "best_goodput": self.best_goodput}

    @classmethod
    def from_dict(cls, data: dict) -> SweepResult:
        points = [SweepPoint(float(p["load"]), Summary.from_dict(p["summary"])) for p in data["points"]]
        sat = Saturation(**data["saturation"]) if data.get("saturation") else None
        return cls(data["mode"], points, data["client"], data["workload"], data.get("slo"), sat,
                   data.get("best_goodput"))


def parse_loads(text: str) -> list[float]:
    """``"1,2,4,8,inf"`` -> rising loads."""
    try:
        loads = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InvalidParameterError(f"bad loads {text!r}: use comma-separated numbers (inf allowed)") from None
    if not loads or any(x <= 0 for x in loads) or loads != sorted(set(loads)):
        raise InvalidParameterError(f"bad loads {text!r}: need positive, strictly rising values")
    return loads


def find_saturation(points: Sequence[SweepPoint], min_gain: float = 0.05,
                    latency_factor: float = 3.0) -> Saturation | None:
    """The first level where throughput stops rising or latency explodes (see the module docstring)."""
    if not points:
        return None
    base_latency = points[0].summary.e2el.median
    best = points[0].summary.output_throughput
    for i, point in enumerate(points[1:], 1):
        s, prev = point.summary, points[i - 1].load
        if s.output_throughput < best * (1 + min_gain):
            gain = s.output_throughput / best - 1 if best else 0.0
            return Saturation(i, point.load, f"output throughput rose {gain:+.1%} over the best lower load "
                                             f"(< {min_gain:.0%})", prev)
        if base_latency and s.e2el.median is not None and s.e2el.median > latency_factor * base_latency:
            return Saturation(i, point.load, f"median E2E latency {s.e2el.median / base_latency:.1f}x the lowest "
                                             f"load's (> {latency_factor:g}x)", prev)
        best = max(best, s.output_throughput)
    return None


def best_goodput(points: Sequence[SweepPoint]) -> dict | None:
    scored = [p for p in points if p.summary.request_goodput is not None]
    if not scored:
        return None
    top = max(scored, key=lambda p: p.summary.request_goodput)
    return {"load": top.load, "request_goodput": top.summary.request_goodput,
            "fraction_of_completed": top.summary.request_goodput / top.summary.request_throughput
            if top.summary.request_throughput else 0.0}


def run_sweep(client: ClientConfig, base: LoadConfig, mode: str, loads: Sequence[float],
              make_workload: Callable[[int], list[Conversation]], count_tokens: Callable[[str], int],
              slo: SLO | None = None, workload: dict | None = None, min_gain: float = 0.05,
              latency_factor: float = 3.0, on_point: Callable[[SweepPoint], None] | None = None) -> SweepResult:
    """Run one serve benchmark per load; ``make_workload(level)`` draws the level's conversations."""
    if mode not in MODES:
        raise InvalidParameterError(f"unknown sweep mode {mode!r}; use rate or concurrency")
    points = []
    for level, load in enumerate(loads):
        if mode == "rate":
            cfg = dataclasses.replace(base, request_rate=load, seed=base.seed + level)
        else:
            if math.isinf(load) or load != int(load):
                raise InvalidParameterError(f"concurrency must be a whole number, got {load}")
            cfg = dataclasses.replace(base, max_concurrency=int(load), seed=base.seed + level)
        result = run_serve(client, cfg, make_workload(level), count_tokens, slo, workload)
        points.append(SweepPoint(load, result.summary))
        if on_point:
            on_point(points[-1])
    return SweepResult(mode, points, dataclasses.asdict(client), workload or {},
                       dataclasses.asdict(slo) if slo else None, find_saturation(points, min_gain, latency_factor),
                       best_goodput(points))


def _load_label(mode: str) -> str:
    return "request rate (req/s)" if mode == "rate" else "max concurrency"


def plot_sweep(result: SweepResult, path: str | Path) -> Path:
    """Three panels: throughput vs load, latency vs load, and the throughput-latency curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = result.points
    finite = [p.load for p in pts if not math.isinf(p.load)]
    inf_at = (max(finite) * 2 if finite else 1.0)
    x = [inf_at if math.isinf(p.load) else p.load for p in pts]
    thr = [p.summary.output_throughput for p in pts]
    series = {"TTFT p50": [p.summary.ttft.median for p in pts],
              "TTFT p99": [p.summary.ttft.percentiles.get("p99") for p in pts],
              "TPOT p50": [p.summary.tpot.median for p in pts],
              "E2E p50": [p.summary.e2el.median for p in pts]}
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    axes[0].plot(x, thr, "o-")
    axes[0].set(xlabel=_load_label(result.mode), ylabel="output tok/s", title="throughput")
    for name, ys in series.items():
        axes[1].plot(x, [y if y is not None else float("nan") for y in ys], "o-", label=name)
    axes[1].set(xlabel=_load_label(result.mode), ylabel="ms", yscale="log", title="latency")
    axes[1].legend()
    for name in ("TPOT p50", "E2E p50"):
        ys = [y if y is not None else float("nan") for y in series[name]]
        axes[2].plot(thr, ys, "o-", label=name)
        for p, tx, ty in zip(pts, thr, ys):
            axes[2].annotate(f"{p.load:g}", (tx, ty), textcoords="offset points", xytext=(3, 3), fontsize=7)
    axes[2].set(xlabel="output tok/s", ylabel="ms", yscale="log", title="throughput-latency")
    axes[2].legend()
    if result.saturation:
        for ax in axes[:2]:
            ax.axvline(x[result.saturation.index], color="red", linestyle="--", label="saturation")
    if any(math.isinf(p.load) for p in pts):
        axes[0].annotate("inf", (inf_at, thr[-1]))
    for ax in axes[:2]:
        ax.set_xscale("log")
    return save_figure(fig, path)


def sweep_rows(result: SweepResult) -> tuple[list[str], list[list[str]]]:
    header = [_load_label(result.mode), "ok", "failed", "req/s", "out tok/s", "goodput req/s",
              "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "ITL p50", "E2E p50", "E2E p99"]
    rows = []
    for p in result.points:
        s = p.summary
        rows.append([f"{p.load:g}", str(s.completed), str(s.failed), fmt(s.request_throughput),
                     fmt(s.output_throughput, 1), fmt(s.request_goodput), fmt(s.ttft.median, 1),
                     fmt(s.ttft.percentiles.get("p99"), 1), fmt(s.tpot.median, 1), fmt(s.tpot.percentiles.get("p99"), 1),
                     fmt(s.itl.median, 1), fmt(s.e2el.median, 1), fmt(s.e2el.percentiles.get("p99"), 1)])
    return header, rows


def findings(result: SweepResult) -> list[str]:
    lines = []
    peak = max(result.points, key=lambda p: p.summary.output_throughput)
    lines.append(f"Peak output throughput: {peak.summary.output_throughput:,.1f} tok/s at {peak.load:g}.")
    sat = result.saturation
    if sat:
        before = f"; highest unsaturated load {sat.last_unsaturated_load:g}" if sat.last_unsaturated_load else ""
        lines.append(f"Saturation at {sat.load:g}: {sat.reason}{before}.")
    else:
        lines.append("No saturation within the swept loads.")
    if result.best_goodput:
        g = result.best_goodput
        lines.append(f"Best goodput under the SLO {_slo_text(result.slo)}: {g['request_goodput']:.2f} req/s at "
                     f"{g['load']:g} ({g['fraction_of_completed']:.0%} of completed requests).")
    return lines


def _slo_text(slo: dict | None) -> str:
    return ", ".join(f"{k} <= {v:g} ms" for k, v in (slo or {}).items() if v is not None) or "(none)"


def markdown_report(result: SweepResult, plot_path: str | Path | None) -> str:
    header, rows = sweep_rows(result)
    parts = [f"# Sweep over {_load_label(result.mode)}", "",
             (f"Server: `{result.client.get('base_url')}` ({result.client.get('backend')}), model "
              f"`{result.client.get('model')}`; workload: `{result.workload}`. Latencies in ms."), "",
             markdown_table(header, rows), "", *[f"- {line}" for line in findings(result)]]
    if plot_path:
        parts += ["", f"![sweep]({Path(plot_path).name})"]
    return "\n".join(parts) + "\n"
