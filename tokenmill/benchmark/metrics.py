"""Serving metrics over per-request records, with vLLM's benchmark definitions.

One :class:`RequestRecord` per request holds what the client saw: when it sent the request, when
each chunk carrying generated text arrived, the text, the server's usage and how it failed. The
summary is a pure function of the records and the wall-clock duration of the run:

    TTFT   first content chunk - request start                      (successful requests)
    ITL    gap between successive content chunks, one per chunk     (several tokens in a chunk: one gap)
    TPOT   (E2E - TTFT) / (output tokens - 1)                       (requests with > 1 output token)
    E2E    end of the response - request start                      (end = last chunk with choices)
    output tokens   the server's usage.completion_tokens, else the tokenizer's count of the text
    throughput      completed requests, output tokens, input + output tokens per second of duration
    goodput         completed requests per second meeting every SLO (TPOT of a 1-token request is 0)

Latencies are reported in milliseconds: mean, median, std and the requested percentiles
(numpy's linear interpolation). A metric with no samples reports None, never 0.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from tokenmill.errors import InvalidParameterError

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
SLO_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class RequestRecord:
    """What the client observed for one request. Times are ``time.perf_counter()`` seconds."""

    start: float
    """When the request was sent."""
    prompt_len: int
    """Prompt tokens as the workload counted them (the server's usage.prompt_tokens wins when given)."""
    chunk_times: list[float] = field(default_factory=list)
    """Arrival time of every chunk that carried generated text, in order."""
    text: str = ""
    """The generated text, all chunks joined."""
    end: float | None = None
    """When the response ended: the last chunk with choices (a usage-only chunk does not count)."""
    usage: dict | None = None
    """The server's usage object (prompt_tokens, completion_tokens), if it sent one."""
    status: str = "ok"
    """'ok', an HTTP status code ('429', '500') or an error class ('ClientConnectorError', 'stream_error')."""
    error: str = ""

    @property
    def success(self) -> bool:
        return self.status == "ok"

    @property
    def ttft(self) -> float:
        first = self.chunk_times[0] if self.chunk_times else self.end
        return first - self.start

    @property
    def e2el(self) -> float:
        return self.end - self.start

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    def input_tokens(self) -> int:
        if self.usage and self.usage.get("prompt_tokens") is not None:
            return int(self.usage["prompt_tokens"])
        return self.prompt_len

    def output_tokens(self, count_tokens: Callable[[str], int] | None = None) -> int:
        """usage.completion_tokens, else the tokenizer's count, else one token per content chunk."""
        if self.usage and self.usage.get("completion_tokens") is not None:
            return int(self.usage["completion_tokens"])
        if count_tokens is not None:
            return count_tokens(self.text)
        return len(self.chunk_times)

    def tpot(self, output_tokens: int) -> float | None:
        if output_tokens <= 1:
            return None
        return (self.e2el - self.ttft) / (output_tokens - 1)


@dataclass(frozen=True)
class SLO:
    """Service-level objectives in milliseconds; None means unconstrained."""

    ttft: float | None = None
    tpot: float | None = None
    e2el: float | None = None

    @classmethod
    def parse(cls, text: str) -> SLO:
        """``"ttft=500,tpot=50,e2el=10000"`` (milliseconds)."""
        values: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = part.partition("=")
            if not sep or key.strip() not in SLO_METRICS:
                raise InvalidParameterError(f"bad SLO {part!r}: use name=milliseconds with name in {SLO_METRICS}")
            try:
                values[key.strip()] = float(value)
            except ValueError:
                raise InvalidParameterError(f"bad SLO {part!r}: {value!r} is not a number") from None
            if values[key.strip()] <= 0:
                raise InvalidParameterError(f"bad SLO {part!r}: must be positive")
        if not values:
            raise InvalidParameterError("empty SLO: give at least one of ttft=, tpot=, e2el= (ms)")
        return cls(**values)

    def met(self, ttft_ms: float, tpot_ms: float, e2el_ms: float) -> bool:
        return all(limit is None or value <= limit
                   for limit, value in ((self.ttft, ttft_ms), (self.tpot, tpot_ms), (self.e2el, e2el_ms)))


@dataclass
class Distribution:
    """Summary statistics of one latency metric, in milliseconds."""

    count: int
    mean: float | None
    median: float | None
    std: float | None
    percentiles: dict[str, float | None]
    """'p90' -> value."""

    @classmethod
    def of(cls, seconds: Sequence[float], percentiles: Sequence[float]) -> Distribution:
        if len(seconds) == 0:
            return cls(0, None, None, None, {_pname(p): None for p in percentiles})
        ms = np.asarray(seconds, dtype=np.float64) * 1000.0
        return cls(len(ms), float(ms.mean()), float(np.median(ms)), float(ms.std()),
                   {_pname(p): float(np.percentile(ms, p)) for p in percentiles})


def _pname(p: float) -> str:
    return f"p{p:g}"


@dataclass
class Summary:
    """The benchmark's result over all records of one run."""

    duration_s: float
    completed: int
    failed: int
    failures: dict[str, int]
    """Failed requests by status ('429', 'ClientConnectorError', ...)."""
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    """Completed requests per second."""
    output_throughput: float
    """Output tokens per second."""
    total_token_throughput: float
    """Input + output tokens per second."""
    request_goodput: float | None
    """Completed requests per second meeting every SLO; None without an SLO."""
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2el: Distribution

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Summary:
        dists = {name: Distribution(**data[name]) for name in LATENCY_METRICS}
        rest = {k: v for k, v in data.items() if k not in LATENCY_METRICS}
        return cls(**rest, **dists)


def summarize(records: Sequence[RequestRecord], duration_s: float, slo: SLO | None = None,
              count_tokens: Callable[[str], int] | None = None,
              percentiles: Sequence[float] = (50, 90, 99)) -> Summary:
    """Aggregate the records of one run that lasted ``duration_s`` seconds of wall-clock time."""
    if duration_s <= 0:
        raise InvalidParameterError(f"duration must be positive, got {duration_s}")
    ok = [r for r in records if r.success]
    failures = Counter(r.status for r in records if not r.success)
    outputs = [r.output_tokens(count_tokens) for r in ok]
    inputs = [r.input_tokens() for r in ok]
    ttfts = [r.ttft for r in ok]
    e2els = [r.e2el for r in ok]
    tpots = [r.tpot(n) for r, n in zip(ok, outputs)]
    itls = [gap for r in ok for gap in r.itls]
    goodput = None
    if slo is not None:
        good = sum(slo.met(t * 1e3, (p or 0.0) * 1e3, e * 1e3) for t, p, e in zip(ttfts, tpots, e2els))
        goodput = good / duration_s
    return Summary(
        duration_s=duration_s, completed=len(ok), failed=len(records) - len(ok), failures=dict(failures),
        total_input_tokens=sum(inputs), total_output_tokens=sum(outputs),
        request_throughput=len(ok) / duration_s, output_throughput=sum(outputs) / duration_s,
        total_token_throughput=(sum(inputs) + sum(outputs)) / duration_s, request_goodput=goodput,
        ttft=Distribution.of(ttfts, percentiles), tpot=Distribution.of([t for t in tpots if t is not None], percentiles),
        itl=Distribution.of(itls, percentiles), e2el=Distribution.of(e2els, percentiles))
