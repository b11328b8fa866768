"""Cost: the engine thread's wall time, priced, and shared by the requests that used it.

The meter keeps one timeline on the engine thread's clock. Every interval from :meth:`CostMeter.start`
is charged exactly once::

    start ─┬─ step of model A ─┬─ step of model B ─┬─ waiting (idle) ─┬─ loading model C ─┬─ ...
         mark               mark                mark               mark                mark

    a step's interval (from the previous mark to the step's end)
        -> the requests it ran, each by its share of the step's FLOPs (engine/work.py), split
           into prompt, cached and completion parts
    an interval with no step -> a line of its own: ``idle``, ``load:<model>``, or ``overhead``
                                (a step that ran no request's tokens)

so per-request costs plus the lines add up to the metered total, which the meter also keeps
apart: ``(now - start) x price`` from the clock alone (with per-model prices, a model's step
time at its own price). An aborted request pays for the steps it was in; a request's record
closes when it leaves the engine (finished, aborted, failed), in the engine thread, after which
nothing more is charged to it.

Records carry the labels chargeback groups by (tenant, API key, model, adapter, route, the
OpenAI ``user`` and ``metadata`` tags); closed ones stay in memory for ``/admin/costs`` (the newest
``max_records``) and, with ``cost_log``, are appended to a JSON-lines file as they close.

Cost per 1k tokens of each kind is derived from what was measured: a model's closed records'
prompt (uncached), cached and completion costs over their token counts.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tokenmill.engine import SequenceWork

logger = logging.getLogger("tokenmill.server")

KINDS = ("prompt", "cached", "completion")
IDLE, OVERHEAD = "idle", "overhead"


def load_line(model: str) -> str:
    return f"load:{model}"


@dataclass(frozen=True)
class CostLabels:
    """What a request's cost is attributed to."""

    tenant: str
    model: str
    """The served model that ran it."""
    key: str = ""
    """The first 12 hex digits of its API key's sha256 ('' without keys)."""
    adapter: str | None = None
    route: str | None = None
    """The routed model name the client asked for, when a route picked ``model``."""
    user: str | None = None
    """OpenAI's ``user`` field."""
    tags: tuple[tuple[str, str], ...] = ()
    """OpenAI's ``metadata`` and the ``X-Tokenmill-Tags`` header, as sorted (name, value) pairs."""

    def group(self, by: str) -> str:
        """The value of one grouping: a field name, or ``tag:NAME``."""
        if by.startswith("tag:"):
            return dict(self.tags).get(by[4:], "")
        value = getattr(self, by)
        return "" if value is None else str(value)


GROUPS = ("tenant", "model", "key", "adapter", "route", "user")
"""What ``group_by`` may name (and ``tag:NAME``)."""


@dataclass
class CostRecord:
    """One engine request's measured cost and usage."""

    request_id: str
    labels: CostLabels
    prompt_tokens: int
    opened: float = 0.0
    """Wall-clock time (time.time) it entered the engine."""
    closed: float | None = None
    cost: dict[str, float] = field(default_factory=lambda: dict.fromkeys(KINDS, 0.0))
    """Currency owed to each kind of token (engine/work.py)."""
    cached_tokens: int = 0
    completion_tokens: int = 0
    on_close: Callable[[CostRecord], None] | None = field(default=None, repr=False)
    """Called once in the engine thread when it closes (budgets settle there)."""

    @property
    def total(self) -> float:
        return sum(self.cost.values())

    def tokens(self, kind: str) -> int:
        return {"prompt": self.prompt_tokens - self.cached_tokens, "cached": self.cached_tokens,
                "completion": self.completion_tokens}[kind]

    def row(self) -> dict:
        """A flat dict for the JSON-lines log and exports."""
        labels = asdict(self.labels)
        labels["tags"] = dict(self.labels.tags)
        return {"request_id": self.request_id, **labels, "opened": self.opened, "closed": self.closed,
                "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "completion_tokens": self.completion_tokens, "cost": self.total,
                **{f"{kind}_cost": self.cost[kind] for kind in KINDS}}


@dataclass
class _ModelTotals:
    step_seconds: float = 0.0
    cost: dict[str, float] = field(default_factory=lambda: dict.fromkeys(KINDS, 0.0))
    """Closed records' costs by kind (the rates' numerators)."""
    tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))


class CostMeter:
    def __init__(self, price_per_hour: float = 0.0, model_prices: dict[str, float] | None = None,
                 cost_log: str | Path | None = None, max_records: int = 1_000_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.price_per_hour = price_per_hour
        self.model_prices = dict(model_prices or {})
        self.clock = clock
        self._lock = threading.Lock()
        self._start: float | None = None
        self._mark = 0.0
        self._open: dict[str, CostRecord] = {}
        self.closed: deque[CostRecord] = deque(maxlen=max_records)
        self.lines: dict[str, float] = {}
        """Currency charged to intervals without a request: idle, overhead, load:<model>."""
        self.by_model_tenant: dict[tuple[str, str], float] = {}
        """Currency charged so far per (model, tenant), open requests included (what /metrics shows)."""
        self._models: dict[str, _ModelTotals] = {}
        self._closed_total = 0.0
        self._cost_log = Path(cost_log) if cost_log else None
        self._cost_log_file = None
        """The log, opened on the first record and kept open (one write per record, in the engine thread)."""

    def price(self, model: str | None = None) -> float:
        """Currency per second of ``model``'s steps (the server's price for None or no override)."""
        return self.model_prices.get(model, self.price_per_hour) / 3600.0

    # ---- the engine thread ------------------------------------------------------------------------
    def start(self, now: float | None = None) -> None:
        """Start the timeline (once the engine thread is warm); later calls do nothing."""
        with self._lock:
            if self._start is None:
                self._start = self._mark = self.clock() if now is None else now

    def open(self, record: CostRecord) -> None:
        record.opened = time.time()
        with self._lock:
            self._open[record.request_id] = record

    def close(self, request_id: str) -> CostRecord | None:
        """Close a request's record (it left the engine): nothing more is charged to it."""
        with self._lock:
            record = self._open.pop(request_id, None)
            if record is None:
                return None
            record.closed = time.time()
            self.closed.append(record)
            self._closed_total += record.total
            totals = self._models.setdefault(record.labels.model, _ModelTotals())
            for kind in KINDS:
                totals.cost[kind] += record.cost[kind]
                totals.tokens[kind] += record.tokens(kind)
        if record.on_close is not None:
            try:
                record.on_close(record)
            except Exception:
                logger.exception("settling the cost of %s failed", request_id)
        if self._cost_log is not None:
            try:
                if self._cost_log_file is None:
                    self._cost_log_file = self._cost_log.open("a", buffering=1)  # line-buffered: whole records
                self._cost_log_file.write(json.dumps(record.row()) + "\n")
            except OSError:
                logger.exception("cannot append to the cost log %s", self._cost_log)
        return record

    def record(self, request_id: str) -> CostRecord | None:
        return self._open.get(request_id)

    def charge_step(self, model: str, work: Iterable[SequenceWork], now: float | None = None) -> None:
        """Charge the interval since the last mark to the requests of a step of ``model``, by their
        share of its FLOPs (to ``overhead`` when it ran none)."""
        with self._lock:
            seconds = self._advance(now)
            if seconds is None:
                return
            self._models.setdefault(model, _ModelTotals()).step_seconds += seconds
            amount = seconds * self.price(model)
            items = [(w, self._open.get(w.request_id)) for w in work]
            items = [(w, r) for w, r in items if r is not None and w.total > 0]
            flops = sum(w.total for w, _ in items)
            if not flops:
                self.lines[OVERHEAD] = self.lines.get(OVERHEAD, 0.0) + amount
                return
            share = amount / flops
            for w, record in items:
                for kind in KINDS:
                    record.cost[kind] += share * getattr(w, kind)
                key = (record.labels.model, record.labels.tenant)
                self.by_model_tenant[key] = self.by_model_tenant.get(key, 0.0) + share * w.total

    def charge_line(self, line: str, now: float | None = None) -> None:
        """Charge the interval since the last mark to ``line`` (idle, load:<model>, ...)."""
        with self._lock:
            seconds = self._advance(now)
            if seconds is not None:
                self.lines[line] = self.lines.get(line, 0.0) + seconds * self.price()

    def _advance(self, now: float | None) -> float | None:
        """Move the mark to ``now`` -> the seconds since the last one (None before start); under the lock."""
        if self._start is None:
            return None
        now = self.clock() if now is None else now
        seconds = max(now - self._mark, 0.0)
        self._mark = now
        return seconds

    # ---- readers (any thread) -------------------------------------------------------------------
    @property
    def started(self) -> bool:
        return self._start is not None

    def metered(self, now: float | None = None) -> float:
        """The meter's own total: wall time since start x price, each model's step time at its own
        price when it has one; computed from the clock, not from what was attributed."""
        with self._lock:
            if self._start is None:
                return 0.0
            now = self.clock() if now is None else now
            extra = sum(t.step_seconds * (self.price(m) - self.price()) for m, t in self._models.items())
            return (now - self._start) * self.price() + extra

    def summary(self) -> dict:
        """Totals now: ``metered`` (the clock's), what was attributed to ``requests`` (open and
        closed) and to each line, and ``in_progress``: the interval since the last mark, not yet
        attributed (a step running, or the wait going on). requests + lines + in_progress = metered."""
        now = self.clock()
        with self._lock:
            mark = self._mark
            requests = self._closed_total + sum(r.total for r in self._open.values())
            lines = dict(self.lines)
        metered = self.metered(now)
        return {"metered": metered, "requests": requests, "lines": lines,
                "in_progress": metered - self.metered(mark) if self.started else 0.0,
                "open_requests": len(self._open), "price_per_hour": self.price_per_hour}

    def rates(self) -> dict[str, dict[str, float]]:
        """Per model, measured currency per 1k tokens of each kind (kinds with no tokens yet left out)."""
        with self._lock:
            return {model: {kind: 1000 * t.cost[kind] / t.tokens[kind] for kind in KINDS if t.tokens[kind]}
                    for model, t in self._models.items()}

    def records(self, since: float | None = None, until: float | None = None,
                include_open: bool = True) -> list[CostRecord]:
        """Records that closed in [since, until) (wall-clock seconds), then the open ones if asked."""
        with self._lock:
            closed = [r for r in self.closed if (since is None or r.closed >= since)
                      and (until is None or r.closed < until)]
            return closed + (list(self._open.values()) if include_open else [])
