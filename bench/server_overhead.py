"""Server overhead on time to first token: HTTP TTFT (client side, a streaming chat completion,
until the first content chunk arrives) minus the engine's own TTFT (first token time minus arrival in the
engine, which the server reports in the X-Engine-TTFT header), at low load: one request at a time.

    python bench/server_overhead.py [--model smollm2-135m-instruct] [--requests 30]

Starts ``tokenmill serve`` as a separate process on a free port, so client and server do not
share a GIL; prints p50/p90 and writes bench/results/server_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "Name three prime numbers.",
             "Explain in one sentence why the sky is blue.", "What is 12 times 12?"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, port: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "serve", model, "--port", str(port)],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("the server did not become ready")


def one(client: httpx.Client, model: str, question: str) -> tuple[float, float]:
    """(HTTP TTFT, engine TTFT) in seconds for one streaming chat completion."""
    body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": 8, "temperature": 0,
            "stream": True}
    start = time.perf_counter()
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        lines = response.iter_lines()
        for line in lines:
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                http_ttft = time.perf_counter() - start
                break
        else:
            raise RuntimeError("no content chunk in the stream")
        engine_ttft = float(response.headers["x-engine-ttft"])
        for _ in lines:  # read the rest, so that one request at a time is really one
            pass
    return http_ttft, engine_ttft


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    port = free_port()
    proc = start_server(args.model, port)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
            for i in range(args.warmup):
                one(client, args.model, QUESTIONS[i % len(QUESTIONS)])
            samples = [one(client, args.model, QUESTIONS[i % len(QUESTIONS)]) for i in range(args.requests)]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    overhead_ms = [(h - e) * 1e3 for h, e in samples]
    result = {
        "model": args.model, "requests": args.requests,
        "http_ttft_ms_p50": statistics.median(h * 1e3 for h, _ in samples),
        "engine_ttft_ms_p50": statistics.median(e * 1e3 for _, e in samples),
        "overhead_ms_p50": statistics.median(overhead_ms), "overhead_ms_p90": percentile(overhead_ms, 90),
        "overhead_ms": overhead_ms,
    }
    print(f"{args.requests} streaming requests, one at a time, {args.model}")
    print(f"  HTTP TTFT p50     {result['http_ttft_ms_p50']:8.2f} ms")
    print(f"  engine TTFT p50   {result['engine_ttft_ms_p50']:8.2f} ms")
    print(f"  overhead p50      {result['overhead_ms_p50']:8.2f} ms   (target < 5 ms)")
    print(f"  overhead p90      {result['overhead_ms_p90']:8.2f} ms")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "server_overhead.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
