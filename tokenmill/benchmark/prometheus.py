"""The server's own latency histograms beside the client's figures, and its speculative-decoding counters.

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


_COUNTER = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*?)(?:_total)?(\{[^}]*\})?\s+(\S+)')
_POSITION = re.compile(r'position="(\d+)"')


def _spec_counters(text: str) -> dict[str, float]:
    """``spec_decode_*`` counters by the name after the prefix (``num_drafts``, ..., ``per_pos:J``)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        match = _COUNTER.match(line)
        if not match or ":spec_decode_num_" not in match.group(1):
            continue
        name, labels, value = match.groups()
        key = name.split(":spec_decode_", 1)[1]
        if key == "num_accepted_tokens_per_pos":
            pos = _POSITION.search(labels or "")
            if pos is None:
                continue
            key = f"per_pos:{pos.group(1)}"
        out[key] = out.get(key, 0.0) + float(value)
    return out


def speculative_stats(before: str, after: str) -> dict | None:
    """The server's speculative decoding over the measured requests (vLLM's counter names under any
    prefix): drafts, drafted and kept tokens, acceptance rate, mean accepted length (tokens per
    verification) and acceptance per draft position. None when the server counts no drafts."""
    old, new = _spec_counters(before), _spec_counters(after)
    delta = {k: v - old.get(k, 0.0) for k, v in new.items()}
    drafts, drafted, kept = (delta.get(k, 0.0) for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"))
    if "num_draft_tokens" not in new:
        return None
    positions = sorted(int(k.split(":")[1]) for k in delta if k.startswith("per_pos:"))
    return {"drafts": int(drafts), "draft_tokens": int(drafted), "accepted_tokens": int(kept),
            "acceptance_rate": kept / drafted if drafted else None,
            "mean_accepted_length": 1 + kept / drafts if drafts else None,
            "acceptance_per_position": [delta[f"per_pos:{j}"] / drafts if drafts else None for j in positions]}
