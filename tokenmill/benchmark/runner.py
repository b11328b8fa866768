"""``tokenmill bench serve``: drive a server with a workload and summarize what the client saw.

    warm-up       the first ``warmup`` conversations' first turns, not recorded; all failing aborts
    dispatch      conversations leave at the arrival process's times, at most ``max_concurrency``
                  in flight; with ``duration_s`` the workload repeats until that much time passed
    conversation  its turns in order, each after the previous reply, with the history in front
    summary       metrics.summarize over every turn's record; duration = first send to last reply
    server side   optionally /metrics scraped after warm-up and at the end: the server's own mean
                  TTFT, TPOT, ITL and E2E over the measured requests, beside the client's
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone

from tqdm import tqdm

from tokenmill.benchmark.arrivals import ArrivalProcess
from tokenmill.benchmark.client import ClientConfig, OpenAIClient, completion_prompt
from tokenmill.benchmark.metrics import SLO, RequestRecord, Summary, summarize
from tokenmill.benchmark.prometheus import SERVER_HISTOGRAMS, agreement, server_means, speculative_stats
from tokenmill.benchmark.workloads import Conversation
from tokenmill.errors import InvalidParameterError, TokenmillError


class BenchmarkError(TokenmillError):
    """The benchmark cannot run: the server is unreachable or rejects every warm-up request."""


@dataclass(frozen=True)
class LoadConfig:
    """How hard to push the server."""

    request_rate: float = math.inf
    """Conversations per second on average; inf: all at once (capped by max_concurrency)."""
    burstiness: float = 1.0
    max_concurrency: int | None = None
    """Conversations in flight at most; None: no cap."""
    duration_s: float | None = None
    """Stop dispatching after this many seconds (the workload repeats); None: send the workload once."""
    warmup: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise InvalidParameterError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.duration_s is not None and self.duration_s <= 0:
            raise InvalidParameterError(f"duration must be positive, got {self.duration_s}")
        if self.duration_s is not None and math.isinf(self.request_rate) and self.max_concurrency is None:
            raise InvalidParameterError("a duration-bounded run needs a finite request rate or a max concurrency")
        if self.warmup < 0:
            raise InvalidParameterError(f"warmup must be >= 0, got {self.warmup}")
        ArrivalProcess(self.request_rate, self.burstiness, self.seed)  # validates rate and burstiness


@dataclass
class ServeResult:
    client: dict
    load: dict
    workload: dict
    summary: Summary
    records: list[RequestRecord] = field(default_factory=list)
    started_at: str = ""
    server_metrics: dict | None = None
    """Server-side means from its Prometheus histograms beside the client's (see prometheus.py)."""
    speculative: dict | None = None
    """The server's speculative-decoding counters over the measured requests (prometheus.py)."""

    def to_dict(self, with_records: bool = False) -> dict:
        data = {"kind": "serve", "started_at": self.started_at, "client": self.client, "load": self.load,
                "workload": self.workload, "summary": self.summary.to_dict()}
        if self.server_metrics is not None:
            data["server_metrics"] = self.server_metrics
        if self.speculative is not None:
            data["speculative"] = self.speculative
        if with_records:
            data["records"] = [asdict(r) for r in self.records]
        return data

    @classmethod
    def from_dict(cls, data: dict) -> ServeResult:
        records = [RequestRecord(**r) for r in data.get("records", [])]
        return cls(data["client"], data["load"], data["workload"], Summary.from_dict(data["summary"]), records,
                   data.get("started_at", ""), data.get("server_metrics"), data.get("speculative"))


def run_serve(client: ClientConfig, load: LoadConfig, conversations: list[Conversation],
              count_tokens: Callable[[str], int], slo: SLO | None = None, workload: dict | None = None,
              progress: bool = True, scrape_metrics: bool = False) -> ServeResult:
    """Run the benchmark to completion (blocking) and summarize it; with ``scrape_metrics`` also
    read the server's latency histograms over the measured requests."""
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    records, duration, scrapes = asyncio.run(_run(client, load, conversations, count_tokens, progress,
                                                  scrape_metrics))
    summary = summarize(records, duration, slo, count_tokens)
    load_info = {**asdict(load), "slo": asdict(slo) if slo else None}
    server = speculative = None
    if scrapes is not None:
        client_means = {name: getattr(summary, name).mean for name in SERVER_HISTOGRAMS}
        server = scrapes if "error" in scrapes else agreement(server_means(*scrapes), client_means)
        speculative = None if "error" in scrapes else speculative_stats(*scrapes)
    return ServeResult(asdict(client), load_info, workload or {}, summary, records, started, server, speculative)


async def _run(client_cfg: ClientConfig, load: LoadConfig, conversations: list[Conversation],
               count_tokens: Callable[[str], int], progress: bool, scrape: bool):
    """(records, duration, scrapes): scrapes is None, (before, after) /metrics texts, or {"error": ...}."""
    if not conversations:
        raise InvalidParameterError("the workload is empty")
    async with OpenAIClient(client_cfg) as client:
        if load.warmup:
            await _warmup(client, conversations[:load.warmup], load.max_concurrency, count_tokens)
        before = await _scrape(client) if scrape else None
        total = None if load.duration_s else sum(len(c.turns) for c in conversations)
        with tqdm(total=total, desc="requests", unit="req", disable=not progress) as bar:
            records, duration = await _dispatch(client, load, conversations, count_tokens, bar)
        if not scrape:
            return records, duration, None
        after = await _scrape(client) if isinstance(before, str) else before
        return records, duration, (before, after) if isinstance(after, str) else after


async def _scrape(client: OpenAIClient) -> str | dict:
    try:
        return await client.metrics_text()
    except Exception as exc:  # noqa: BLE001 (a server without /metrics still gets its benchmark)
        return {"error": f"cannot read {client.config.root}/metrics: {type(exc).__name__}: {exc}"}


async def _warmup(client: OpenAIClient, conversations: list[Conversation], max_concurrency: int | None,
                  count_tokens: Callable[[str], int]) -> None:
    gate = asyncio.Semaphore(max_concurrency or len(conversations))

    async def one(conv: Conversation) -> RequestRecord:
        async with gate:
            messages = _messages(conv, [], conv.turns[0])
            return await client.send(messages, conv.turns[0].output_len, 0)

    records = await asyncio.gather(*(one(c) for c in conversations))
    if not any(r.success for r in records):
        raise BenchmarkError(f"every warm-up request failed against {client.config.url}: "
                             f"{records[0].status} {records[0].error}")


async def _dispatch(client: OpenAIClient, load: LoadConfig, conversations: list[Conversation],
                    count_tokens: Callable[[str], int], bar: tqdm) -> tuple[list[RequestRecord], float]:
    records: list[RequestRecord] = []
    gate = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
    source: Iterator[Conversation] = itertools.cycle(conversations) if load.duration_s else iter(conversations)
    gaps = ArrivalProcess(load.request_rate, load.burstiness, load.seed).gaps()
    tasks = []
    start = time.perf_counter()
    due = start
    for conv in source:
        if gate is not None:
            await gate.acquire()
        if load.duration_s and time.perf_counter() - start >= load.duration_s:
            break
        tasks.append(asyncio.create_task(_converse(client, conv, count_tokens, records, bar, gate)))
        due += next(gaps)
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
    await asyncio.gather(*tasks)
    return records, time.perf_counter() - start


async def _converse(client: OpenAIClient, conv: Conversation, count_tokens: Callable[[str], int],
                    records: list[RequestRecord], bar: tqdm, gate: asyncio.Semaphore | None) -> None:
    """One conversation's turns in order; a failed turn ends the conversation."""
    history: list[dict] = []
    try:
        for turn in conv.turns:
            messages = _messages(conv, history, turn)
            prompt_len = (count_tokens(completion_prompt(messages)) if client.config.backend == "completions"
                          else sum(count_tokens(m["content"]) for m in messages))
            record = await client.send(messages, turn.output_len, prompt_len)
            records.append(record)
            bar.update(1)
            if not record.success:
                break
            history = messages + [{"role": "assistant", "content": record.text}]
    finally:
        if gate is not None:
            gate.release()


def _messages(conv: Conversation, history: list[dict], turn) -> list[dict]:
    system = [{"role": "system", "content": conv.system}] if conv.system and not history else []
    return system + history + [{"role": "user", "content": turn.prompt}]
