"""``tokenmill bench compare a.json b.json``: ratios of b over a, regressions flagged.

Both files are serve results, sweep results (compared level by level, at the loads both have) or
offline results. A metric regresses when b is worse than a by more than ``threshold``: a
throughput ratio below ``1 - threshold``, a latency ratio above ``1 + threshold``.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.benchmark.report import fmt, markdown_table
from tokenmill.errors import InvalidParameterError

HIGHER_IS_BETTER = ("request_throughput", "output_throughput", "total_token_throughput", "request_goodput",
                    "output_tok_s", "total_tok_s", "requests_per_s", "mbu", "mfu")
LOWER_IS_BETTER_STATS = ("mean", "median", "p90", "p99")
LATENCIES = ("ttft", "tpot", "itl", "e2el", "decode_step", "prefill_step")


@dataclass(frozen=True)
class Comparison:
    metric: str
    a: float
    b: float
    ratio: float | None
    """b / a; None when a is 0."""
    higher_is_better: bool
    regression: bool


def flatten(result: dict) -> dict[str, tuple[float, bool]]:
    """``{"4/ttft.p99": (value, higher_is_better)}`` of every comparable metric in a result file."""
    kind = result.get("kind")
    if kind == "sweep":
        out = {}
        for point in result["points"]:
            for name, entry in _summary_metrics(point["summary"]).items():
                out[f"{float(point['load']):g}/{name}"] = entry
        return out
    if kind in ("serve", "offline"):
        return _summary_metrics(result["summary"])
    raise InvalidParameterError(f"not a tokenmill bench result (kind={kind!r})")


def _summary_metrics(summary: dict) -> dict[str, tuple[float, bool]]:
    out: dict[str, tuple[float, bool]] = {}
    for name in HIGHER_IS_BETTER:
        if summary.get(name) is not None:
            out[name] = (float(summary[name]), True)
    for name in LATENCIES:
        dist = summary.get(name)
        if not isinstance(dist, dict):
            continue
        values = {"mean": dist.get("mean"), "median": dist.get("median"), **dist.get("percentiles", {})}
        for stat in LOWER_IS_BETTER_STATS:
            if values.get(stat) is not None:
                out[f"{name}.{stat}"] = (float(values[stat]), False)
    return out


def compare(a: dict, b: dict, threshold: float = 0.05) -> list[Comparison]:
    if a.get("kind") != b.get("kind"):
        raise InvalidParameterError(f"cannot compare a {a.get('kind')} result with a {b.get('kind')} result")
    fa, fb = flatten(a), flatten(b)
    rows = []
    for metric in (m for m in fa if m in fb):
        (va, higher), (vb, _) = fa[metric], fb[metric]
        ratio = vb / va if va else None
        if ratio is None:
            worse = False
        elif higher:
            worse = ratio < 1 - threshold
        else:
            worse = ratio > 1 + threshold
        rows.append(Comparison(metric, va, vb, ratio, higher, worse))
    if not rows:
        raise InvalidParameterError("the two results share no metric (different loads?)")
    return rows


def format_comparison(rows: list[Comparison], name_a: str, name_b: str, threshold: float) -> str:
    table = markdown_table(
        ["metric", name_a, name_b, "b/a", "better", "flag"],
        [[r.metric, fmt(r.a), fmt(r.b), "-" if r.ratio is None else f"{r.ratio:.3f}",
          "higher" if r.higher_is_better else "lower", "REGRESSION" if r.regression else ""] for r in rows])
    n = sum(r.regression for r in rows)
    return f"{table}\n\n{n} regression(s) beyond {threshold:.0%} of {len(rows)} metrics."
