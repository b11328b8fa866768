"""Per-token cost of the serving path: the offline engine and ``tokenmill serve`` on the same weights
and prompts, at concurrency 1, in one run.

    python bench/serve_vs_engine.py [--model smollm2-135m-instruct] [--dtype auto] [--input-len 256]
                                    [--output-len 128] [--requests 4] [--rounds 3]

Each round runs the engine alone (a child process stepping ``LLMEngine`` and timing each step that
gave the request a token) and then the server (``python -m tokenmill serve``, a child process; this
process is the client: one streamed ``/v1/completions`` at a time, EOS ignored, greedy, timing each
SSE chunk as it arrives). Nothing else of ours runs meanwhile. Both get the same fresh prompts of
exactly --input-len random token ids (distinct per request: no prefix-cache hits) and one warm-up
request first.

Reported, medians over the rounds: TTFT, TPOT ((last - first token) / (tokens - 1)), and the
inter-token latency p50 and p99 (the client's: every chunk is timed when it arrives, so a token held
back or batched shows up as a gap); ratio server / engine, target at most 1.15. Writes
bench/results/serve_vs_engine.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
from launch import free_port, wait_ready

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
TARGET = 1.15


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, 20000) for _ in range(length)] for _ in range(n + 1)]  # +1: warm-up


def quantiles(latencies: list[float]) -> dict[str, float]:
    s = sorted(latencies)
    return {"p50_ms": s[len(s) // 2] * 1e3, "p99_ms": s[min(len(s) - 1, int(len(s) * 0.99))] * 1e3}


def summarize(runs: list[tuple[float, list[float]]]) -> dict[str, float]:
    """runs: (ttft seconds, token arrival times) per request."""
    ttft = [r[0] for r in runs]
    tpot = [(t[-1] - t[0]) / (len(t) - 1) for _, t in runs]
    itl = [b - a for _, t in runs for a, b in zip(t, t[1:])]
    return {"ttft_ms": statistics.median(ttft) * 1e3, "tpot_ms": statistics.median(tpot) * 1e3, **quantiles(itl),
            "tokens": sum(len(t) for _, t in runs)}


# ------------------------------------------------------------------ engine side (a child process)

def engine_main(args) -> None:
    sys.path.insert(0, str(ROOT))
    from tokenmill import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, device="cpu", max_num_seqs=args.max_num_seqs)
    engine = llm.engine
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0)
    runs = []
    for i, prompt in enumerate(prompts(args.requests, args.input_len, args.seed)):
        engine.add_request(prompt, params)
        times, start = [], time.perf_counter()
        while engine.has_unfinished_requests():
            for delta in engine.step():
                if any(s.token_ids for s in delta.samples):
                    times.append(time.perf_counter())
        if i:
            runs.append((times[0] - start, times))
    print(json.dumps(summarize(runs)))


def run_engine(args) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--engine-child", "--model", args.model, "--dtype", args.dtype,
           "--input-len", str(args.input_len), "--output-len", str(args.output_len),
           "--requests", str(args.requests), "--seed", str(args.seed), "--max-num-seqs", str(args.max_num_seqs)]
    out = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------ server side (this process is the client)

def run_server(args, log: Path) -> dict[str, float]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "tokenmill", "serve", args.model, "--port", str(port), "--dtype", args.dtype,
           "--device", "cpu", "--max-num-seqs", str(args.max_num_seqs), "--served-model-name", "bench"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        wait_ready(url, proc, str(log), timeout=600)
        runs = []
        with httpx.Client(timeout=120) as client:
            for i, prompt in enumerate(prompts(args.requests, args.input_len, args.seed)):
                body = {"model": "bench", "prompt": prompt, "max_tokens": args.output_len, "ignore_eos": True,
                        "temperature": 0, "stream": True}
                times, start = [], time.perf_counter()
                with client.stream("POST", url + "/v1/completions", json=body) as response:
                    response.raise_for_status()
                    for line in response.iter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            times.append(time.perf_counter())  # one chunk per engine step that gave a token
                if i:
                    runs.append((times[0] - start, times))
        return summarize(runs)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--requests", type=int, default=4, help="measured requests per round (after one warm-up)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS / "serve_vs_engine.json")
    parser.add_argument("--engine-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine_child:
        engine_main(args)
        return
    args.out.parent.mkdir(parents=True, exist_ok=True)
    rounds = []
    for r in range(args.rounds):
        engine = run_engine(args)
        server = run_server(args, args.out.with_suffix(".server.log"))
        rounds.append({"engine": engine, "server": server})
        print(f"round {r + 1}/{args.rounds}: engine TPOT {engine['tpot_ms']:.2f} ms, server TPOT "
              f"{server['tpot_ms']:.2f} ms (ITL p99 {server['p99_ms']:.2f} ms)", flush=True)
    keys = ("ttft_ms", "tpot_ms", "p50_ms", "p99_ms")
    med = {side: {k: statistics.median(rd[side][k] for rd in rounds) for k in keys} for side in ("engine", "server")}
    ratio = med["server"]["tpot_ms"] / med["engine"]["tpot_ms"]
    print(f"\n{args.model} {args.dtype}, {args.input_len} prompt + {args.output_len} output tokens, concurrency 1, "
          f"medians of {args.rounds} rounds x {args.requests} requests")
    print(f"{'':8} {'TTFT ms':>9} {'TPOT ms':>9} {'ITL p50':>9} {'ITL p99':>9}")
    for side in ("engine", "server"):
        print(f"{side:8} " + " ".join(f"{med[side][k]:9.2f}" for k in keys))
    print(f"server / engine TPOT: {ratio:.3f} (target <= {TARGET}){'' if ratio <= TARGET else '  ABOVE TARGET'}")
    args.out.write_text(json.dumps({"model": args.model, "dtype": args.dtype, "input_len": args.input_len,
                                    "output_len": args.output_len, "rounds": rounds, "median": med,
                                    "tpot_ratio": ratio, "target": TARGET}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
