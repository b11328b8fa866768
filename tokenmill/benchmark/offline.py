"""``tokenmill bench offline``: the engine alone, no HTTP: throughput, latency, MBU and MFU.

Requests (random token-id prompts of the drawn lengths, EOS ignored so each generates exactly
its output length) arrive all at once (the default) or at a request rate (arrivals.py), at most
``max_concurrency`` unfinished at a time when that is set, and the engine is stepped until they
finish. Per request: TTFT (first output token), TPOT and E2E from the time it was sent (see
:class:`RequestFeed`). Per step, from the engine's ``StepStats``: its wall time and, against this
machine's ceilings (hardware.py),

    decode steps (every scheduled sequence computes one token):
        MBU = (weight bytes + KV bytes of the tokens held) / step time / memory bandwidth
    all steps:
        MFU = 2 * matmul parameters * batched tokens / step time / peak matmul FLOP/s (model dtype)

reported as aggregates (total bytes or FLOPs over total time of those steps), with a roofline
plot of the decode and prefill steps.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import ClassVar
from pathlib import Path

import numpy as np
from tqdm import tqdm

from tokenmill.benchmark.arrivals import ArrivalProcess
from tokenmill.benchmark.hardware import HardwareCeilings, ModelCost, plot_roofline
from tokenmill.benchmark.metrics import Distribution
from tokenmill.benchmark.report import fmt, table
from tokenmill.benchmark.workloads import LengthDist
from tokenmill.config import Config
from tokenmill.errors import InvalidParameterError
from tokenmill.options import option
from tokenmill.sampling_params import SamplingParams

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class OfflineConfig(Config):
    """The offline benchmark's workload: random prompts of token ids, greedy, EOS ignored."""

    title: ClassVar[str] = "workload"

    num_requests: int = option(64, "requests")
    input_len: str = option("256", "prompt tokens: N or LO:HI")
    output_len: str = option("128", "output tokens: N or LO:HI")
    seed: int = option(0, "seed of the workload's prompts, lengths and arrival times")
    request_rate: float = option(math.inf, "requests per second, Poisson arrivals; inf adds them all at once")
    max_concurrency: int = option(0, "most requests unfinished at once, the rest wait to be sent; 0 for no cap")

    def __post_init__(self) -> None:
        LengthDist.parse(self.input_len)
        LengthDist.parse(self.output_len)
        if self.num_requests < 1:
            raise InvalidParameterError(f"num_requests must be >= 1, got {self.num_requests}")
        if not self.request_rate > 0:
            raise InvalidParameterError(f"request_rate must be > 0 (inf: all at once), got {self.request_rate}")
        if self.max_concurrency < 0:
            raise InvalidParameterError(f"max_concurrency must be >= 0 (0: no cap), got {self.max_concurrency}")


@dataclass(frozen=True)
class StepCost:
    """One engine step, priced: what it read and computed in how long."""

    seconds: float
    tokens: int
    decode_only: bool
    bytes_read: int
    flops: int


def random_token_prompts(llm, num: int, input_len: LengthDist, output_len: LengthDist,
                         seed: int) -> list[tuple[list[int], int]]:
    tok = llm.tokenizer
    rng = np.random.default_rng(seed)
    candidates = np.array([i for i in range(llm.model_config.vocab_size) if not tok.is_special(i)])
    ins, outs = input_len.sample(rng, num), output_len.sample(rng, num)
    return [(rng.choice(candidates, size=i).tolist(), o) for i, o in zip(ins, outs)]


class RequestFeed:
    """Hands the workload's requests to the engine in arrival order, between steps.

    A request is sent once it is due (``start`` + its arrival offset) and, with a concurrency cap,
    a slot is free. Its clock starts when it was sent, as a client's would: when it was due, or,
    if the cap held it back, when the slot it took was freed (a request due in the middle of a
    step is handed over after the step, but timed from when it was due).
    """

    def __init__(self, engine, prompts: list[tuple[list[int], int]], offsets: list[float], max_concurrency: int):
        self.engine, self.cap = engine, max_concurrency
        self.pending = deque(zip(offsets, prompts))
        self.in_flight = 0
        self.slot_freed = -math.inf
        self.sent: dict[str, tuple[float, int, int]] = {}
        """request id -> (when it was sent, prompt tokens, output tokens)."""

    def admit(self, start: float, now: float) -> None:
        """Send every request due by ``now`` that the cap lets in."""
        while self.pending and start + self.pending[0][0] <= now and (not self.cap or self.in_flight < self.cap):
            offset, (ids, out) = self.pending.popleft()
            request = self.engine.add_request(ids, SamplingParams(temperature=0, max_tokens=out, ignore_eos=True))
            self.sent[request.request_id] = (max(start + offset, self.slot_freed), len(ids), out)
            self.in_flight += 1

    def finished(self, now: float) -> None:
        if self.in_flight == self.cap:
            self.slot_freed = now
        self.in_flight -= 1

    def wait_for_next(self, start: float) -> None:
        """Sleep until the next request is due (the engine has nothing to do)."""
        time.sleep(max(0.0, start + self.pending[0][0] - time.perf_counter()))


def run_offline(llm, config: OfflineConfig, ceilings: HardwareCeilings, progress: bool = True) -> dict:
    """Run the workload through ``llm.engine`` and return the result (JSON-ready dict)."""
    prompts = random_token_prompts(llm, config.num_requests, LengthDist.parse(config.input_len),
                                   LengthDist.parse(config.output_len), config.seed)
    engine, cost = llm.engine, ModelCost.of(llm.engine.runner.model)
    _drain(engine, [(prompts[0][0][:8], 2)])  # warm-up: first-call allocations stay out of the figures
    offsets = ArrivalProcess(config.request_rate, seed=config.seed).offsets(len(prompts)).tolist()
    feed = RequestFeed(engine, prompts, offsets, config.max_concurrency)
    steps, first, done = [], {}, {}
    routing = None  # an MoE model's routing over the run (MoEStepStats)
    start = time.perf_counter()
    feed.admit(start, start)
    with tqdm(total=len(prompts), desc="offline", unit="req", disable=not progress) as bar:
        while feed.pending or engine.has_unfinished_requests():
            if not engine.has_unfinished_requests():
                feed.wait_for_next(start)
                feed.admit(start, time.perf_counter())
                continue
            outputs = engine.step()
            now = time.perf_counter()
            stats = engine.stats[-1]
            decode_only = stats.num_batched_tokens == stats.num_scheduled and stats.num_sampled == stats.num_scheduled
            active = None if stats.moe is None else sum(1 for row in stats.moe.tokens_per_expert for n in row if n)
            steps.append(StepCost(stats.seconds, stats.num_batched_tokens, decode_only,
                                  cost.bytes_read(stats.kv_tokens, active), cost.flops(stats.num_batched_tokens)))
            if stats.moe is not None:
                routing = stats.moe if routing is None else routing.plus(stats.moe)
            for delta in outputs:
                if delta.num_new_tokens and delta.request_id not in first:
                    first[delta.request_id] = now
                if delta.finished:
                    done[delta.request_id] = now
                    feed.finished(now)
                    bar.update(1)
            feed.admit(start, now)
    duration = time.perf_counter() - start
    return _result(llm, config, cost, ceilings, steps, feed.sent, first, done, duration, routing)


def _drain(engine, prompts: list[tuple[list[int], int]]) -> None:
    for ids, out in prompts:
        engine.add_request(ids, SamplingParams(temperature=0, max_tokens=out, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()


def _result(llm, config: OfflineConfig, cost: ModelCost, ceilings: HardwareCeilings, steps: list[StepCost],
            added: dict, first: dict, done: dict, duration: float, routing=None) -> dict:
    ttft, tpot, e2el = [], [], []
    for rid, (t0, _, out) in added.items():
        ttft.append(first[rid] - t0)
        e2el.append(done[rid] - t0)
        if out > 1:
            tpot.append((done[rid] - first[rid]) / (out - 1))
    inputs = sum(n for _, n, _ in added.values())
    outputs = sum(o for _, _, o in added.values())
    decode = [s for s in steps if s.decode_only and s.tokens]
    prefill = [s for s in steps if not s.decode_only and s.tokens]
    dtype = str(llm.dtype).removeprefix("torch.")
    peak, bw = ceilings.peak_flops(dtype), ceilings.memory_bandwidth
    summary = {
        "duration_s": duration, "requests": len(added), "total_input_tokens": inputs, "total_output_tokens": outputs,
        "requests_per_s": len(added) / duration, "output_tok_s": outputs / duration,
        "total_tok_s": (inputs + outputs) / duration,
        "ttft": asdict(Distribution.of(ttft, PERCENTILES)), "tpot": asdict(Distribution.of(tpot, PERCENTILES)),
        "e2el": asdict(Distribution.of(e2el, PERCENTILES)),
        "decode_step": asdict(Distribution.of([s.seconds for s in decode], PERCENTILES)),
        "prefill_step": asdict(Distribution.of([s.seconds for s in prefill], PERCENTILES)),
        "num_steps": len(steps), "num_decode_steps": len(decode),
        "mean_decode_batch": float(np.mean([s.tokens for s in decode])) if decode else None,
        "mbu": _rate(decode, "bytes_read") / bw if decode else None,
        "mfu": _rate(steps, "flops") / peak if steps else None,
        "mfu_prefill": _rate(prefill, "flops") / peak if prefill else None,
    }
    result = {"kind": "offline", "model": {"name": llm.model_name, "dtype": dtype, "device": str(llm.device),
                                           **asdict(cost)},
              "config": asdict(config), "hardware": asdict(ceilings), "summary": summary,
              "roofline": _roofline_points(decode, prefill)}
    if routing is not None:
        result["moe"] = moe_summary(routing)
    return result


def moe_summary(routing) -> dict:
    """An MoE model's routing over the run: per MoE layer each expert's share of the assignments,
    the most loaded expert against an even share, dropped assignments, mean router entropy."""
    layers = [i for i, row in enumerate(routing.tokens_per_expert) if sum(row)]
    load = [[n / sum(routing.tokens_per_expert[i]) for n in routing.tokens_per_expert[i]] for i in layers]
    experts = len(load[0])
    return {"layers": layers, "load": load, "tokens_per_expert": [routing.tokens_per_expert[i] for i in layers],
            "max_load_vs_even": max(max(row) for row in load) * experts, "dropped": routing.dropped,
            "assignments": sum(map(sum, routing.tokens_per_expert)), "mean_router_entropy": routing.mean_entropy}


def _rate(steps: list[StepCost], attr: str) -> float:
    """Total bytes or FLOPs of the steps over their total time."""
    return sum(getattr(s, attr) for s in steps) / sum(s.seconds for s in steps)


def _roofline_points(decode: list[StepCost], prefill: list[StepCost]) -> list[tuple[str, float, float]]:
    points = []
    for label, group in (("decode", decode), ("prefill", prefill)):
        if group:
            flops, nbytes = sum(s.flops for s in group), sum(s.bytes_read for s in group)
            points.append((label, flops / nbytes, flops / sum(s.seconds for s in group)))
    return points


def plot_offline_roofline(result: dict, path: str | Path) -> Path:
    return plot_roofline(HardwareCeilings(**result["hardware"]), [tuple(p) for p in result["roofline"]], path,
                         f"{result['model']['name']} ({result['model']['dtype']}) on {result['hardware']['device']}")


def format_offline(result: dict) -> str:
    s, m, hw = result["summary"], result["model"], result["hardware"]

    def pct(v):
        return "-" if v is None else f"{100 * v:.1f}%"

    rows = [("Model", f"{m['name']} ({m['dtype']}, {m['device']})"),
            ("Requests", str(s["requests"])), ("Duration (s)", fmt(s["duration_s"])),
            ("Request throughput (req/s)", fmt(s["requests_per_s"])),
            ("Output token throughput (tok/s)", fmt(s["output_tok_s"])),
            ("Total token throughput (tok/s)", fmt(s["total_tok_s"])),
            ("TTFT median / p99 (ms)", f"{fmt(s['ttft']['median'])} / {fmt(s['ttft']['percentiles']['p99'])}"),
            ("TPOT median / p99 (ms)", f"{fmt(s['tpot']['median'])} / {fmt(s['tpot']['percentiles']['p99'])}"),
            ("Decode step median / p99 (ms)",
             f"{fmt(s['decode_step']['median'])} / {fmt(s['decode_step']['percentiles']['p99'])}"),
            ("Mean decode batch (seqs)", fmt(s["mean_decode_batch"], 1)),
            ("Weights read per step (MiB)", fmt(m["weight_bytes"] / 2**20, 1)),
            ("Memory bandwidth (GB/s)", fmt(hw["memory_bandwidth"] / 1e9, 1)),
            (f"Peak matmul {m['dtype']} (GFLOP/s)", fmt(hw["matmul_flops"][m["dtype"]] / 1e9, 1)),
            ("MBU (decode steps)", pct(s["mbu"])), ("MFU (all steps)", pct(s["mfu"])),
            ("MFU (prefill steps)", pct(s["mfu_prefill"]))]
    if "moe" in result:
        moe = result["moe"]
        rows += [("MoE: most loaded expert vs even share", f"x{fmt(moe['max_load_vs_even'], 2)}"),
                 ("MoE: dropped / routed assignments", f"{moe['dropped']} / {moe['assignments']}"),
                 ("MoE: mean router entropy (nats)", fmt(moe["mean_router_entropy"], 3))]
    return table(rows, " Offline Benchmark Result ")
