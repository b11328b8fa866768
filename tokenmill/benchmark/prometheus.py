"""The server's own latency histograms beside the client's figures.

A Prometheus server (tokenmill's ``tokenmill:*``, vLLM's ``vllm:*``) exposes histograms such as
``<prefix>:time_to_first_token_seconds``. Scraping ``/metrics`` before and after the measured
requests, the difference of each histogram's ``_sum`` and ``_count`` (all label sets together)
is the server's mean over exactly those requests, to set against the client's mean.
"""

from __future__ import annotations

import re

SERVER_HISTOGRAMS = {"ttft": "time_to_first_token_seconds", "tpot": "time_per_output_token_seconds",
                     "itl": "inter_token_latency_seconds", "e2el": "e2e_request_latency_seconds"}
"""Our metric name -> the histogram name's suffix after the server's prefix."""

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)_(sum|count)(?:\{[^}]*\})?\s+(\S+)")


def histogram_totals(text: str) -> dict[str, tuple[float, float]]:
    """``{histogram name: (sum, count)}`` over every label set, from Prometheus text exposition."""
    totals: dict[str, list[float]] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if not match:
            continue
        name, kind, value = match.groups()
        entry = totals.setdefault(name, [0.0, 0.0])
        entry[0 if kind == "sum" else 1] += float(value)
    return {name: (s, c) for name, (s, c) in totals.items()}


def server_means(before: str, after: str) -> dict[str, dict]:
    """Per metric of SERVER_HISTOGRAMS the server exposes: ``{"histogram", "count", "mean_ms"}`` of
    the observations made between the two scrapes."""
    old, new = histogram_totals(before), histogram_totals(after)
    out = {}
    for metric, suffix in SERVER_HISTOGRAMS.items():
        name = next((n for n in new if n.endswith(":" + suffix) or n == suffix), None)
        if name is None:
            continue
        s0, c0 = old.get(name, (0.0, 0.0))
        s1, c1 = new[name]
        count = c1 - c0
        out[metric] = {"histogram": name, "count": int(count),
                       "mean_ms": (s1 - s0) / count * 1000 if count > 0 else None}
    return out


def agreement(server: dict[str, dict], client_means_ms: dict[str, float | None]) -> dict[str, dict]:
    """Server mean beside client mean, with ``client / server`` for each metric both have."""
    out = {}
    for metric, entry in server.items():
        client = client_means_ms.get(metric)
        ratio = client / entry["mean_ms"] if client is not None and entry["mean_ms"] else None
        out[metric] = {**entry, "client_mean_ms": client, "client_over_server": ratio}
    return out
