"""Readable tables and JSON files for benchmark results."""

from __future__ import annotations

import json
import math
from datetime import datetime
from pathlib import Path

from tokenmill.benchmark.metrics import LATENCY_METRICS, Summary

METRIC_NAMES = {"ttft": "Time to first token", "tpot": "Time per output token (excl. 1st)",
                "itl": "Inter-token latency (per chunk)", "e2el": "End-to-end latency"}


def default_out(kind: str, directory: str | Path = "bench/results") -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path(directory) / f"{kind}-{stamp}.json"


def write_json(data: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_finite(data), indent=2, allow_nan=False) + "\n", encoding="utf-8")
    return path


def read_json(path: str | Path) -> dict:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def _finite(value):
    """Strict JSON: an infinite float (an unbounded request rate) becomes the string "inf"."""
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def save_figure(fig, path: str | Path, dpi: int = 110) -> Path:
    """Lay out a matplotlib figure, write it to ``path`` (folders made) and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def table(rows: list[tuple[str, str]], title: str = "") -> str:
    """Two aligned columns under an optional title rule."""
    width = max(len(k) for k, _ in rows)
    vwidth = max(len(v) for _, v in rows)
    lines = [f"{title:=^{width + vwidth + 2}}"] if title else []
    lines += [f"{k:<{width}}  {v:>{vwidth}}" for k, v in rows]
    return "\n".join(lines)


def grid(header: list[str], rows: list[list[str]], title: str = "") -> str:
    """Aligned columns under a header (the first column left-aligned, the others right), with an optional title rule."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(row: list[str]) -> str:
        return "  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(row, widths)))

    total = sum(widths) + 2 * (len(widths) - 1)
    return "\n".join(([f"{title:=^{total}}"] if title else []) + [line(header), "-" * total] + [line(r) for r in rows])


def summary_rows(s: Summary) -> list[tuple[str, str]]:
    rows = [("Successful requests", str(s.completed)), ("Failed requests", str(s.failed))]
    rows += [(f"  failed with {status}", str(n)) for status, n in sorted(s.failures.items())]
    rows += [("Benchmark duration (s)", fmt(s.duration_s)),
             ("Total input tokens", str(s.total_input_tokens)),
             ("Total generated tokens", str(s.total_output_tokens)),
             ("Request throughput (req/s)", fmt(s.request_throughput)),
             ("Output token throughput (tok/s)", fmt(s.output_throughput)),
             ("Total token throughput (tok/s)", fmt(s.total_token_throughput))]
    if s.request_goodput is not None:
        rows.append(("Request goodput (req/s)", fmt(s.request_goodput)))
    for name in LATENCY_METRICS:
        d = getattr(s, name)
        rows += [(f"{METRIC_NAMES[name]} (ms)", f"n={d.count}"), ("  mean", fmt(d.mean)), ("  median", fmt(d.median))]
        rows += [(f"  {p}", fmt(v)) for p, v in d.percentiles.items() if p != "p50"]
    return rows


def format_summary(s: Summary, title: str = " Serving Benchmark Result ") -> str:
    return table(summary_rows(s), title)


def format_server_metrics(server: dict) -> str:
    """The server's own means beside the client's (``ServeResult.server_metrics``)."""
    if "error" in server:
        return f"server metrics: {server['error']}"
    rows = []
    for name, e in server.items():
        ratio = e["client_over_server"]
        rows.append((f"{METRIC_NAMES[name]} mean (ms)", (f"server {fmt(e['mean_ms'])} (n={e['count']}), client "
                     f"{fmt(e['client_mean_ms'])}, client/server {'-' if ratio is None else f'{ratio:.3f}'}")))
    return table(rows, " Server-side histograms ") if rows else "server metrics: no known latency histogram"


def format_speculative(spec: dict) -> str:
    """The server's speculative decoding over the run (``ServeResult.speculative``)."""
    pct = lambda v: "-" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    rows = [("Drafts (verifications)", str(spec["drafts"])), ("Drafted tokens", str(spec["draft_tokens"])),
            ("Accepted tokens", str(spec["accepted_tokens"])), ("Acceptance rate", pct(spec["acceptance_rate"])),
            ("Mean accepted length", fmt(spec["mean_accepted_length"])),
            ("Acceptance per position", " ".join(pct(v) for v in spec["acceptance_per_position"]) or "-")]
    return table(rows, " Speculative decoding (server) ")


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)
