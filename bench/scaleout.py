"""Scale-out on Ray Serve: prefix-aware routing against round-robin, failover, per-replica service times.

    python bench/scaleout.py                      # SmolLM2-135M bfloat16, 2 replicas of 1 thread

One run, on a Ray cluster this script starts (``ray start --head --num-cpus 2``) and stops:

1. **Routing.** ``tokenmill serve MODEL --replicas 2 --routing prefix`` then ``--routing round_robin``
   (a fresh front and fresh replicas each), the same workload: ``--prompts`` system prompts of
   about ``--system-tokens`` tokens, more than one replica's KV cache holds (``--kv-tokens`` per
   replica), ``--questions`` questions each, in one shuffled order, ``--concurrency`` streamed
   requests at a time. Reported: prefix-cache hit rate (cached prompt tokens / prompt tokens, from
   each response's usage), TTFT p50/p99 (client side), requests per replica.
2. **Failover.** Under the same kind of load (prefix routing), the replica with more requests in
   flight is killed (``ray.kill`` of its actor); reported: requests retried on the other replica,
   client errors, streams cut after their first token, and the seconds until Ray Serve ran 2
   healthy replicas again.
3. **Disaggregated prefill/decode** (prototype): 1 prefill + 1 decode replica on the same workload,
   against the 2 colocated replicas of 1.: TTFT, TPOT, KV bytes moved per request and the seconds
   spent exporting and importing them.
4. **Service times** of one replica at concurrency 1 (prefill seconds per prompt token, decode
   seconds per output token), which ``bench/scaleout_sim.py`` feeds its queueing model.

Writes bench/results/scaleout.json and bench/results/scaleout.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launch import free_port, wait_ready  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
VENV_BIN = Path(sys.executable).parent
TOPICS = ["astronomy", "cooking", "tax law", "gardening", "chess", "plumbing", "poetry", "networking",
          "geology", "sailing", "baking", "painting", "radio", "beekeeping", "cycling", "opera"]


def system_prompt(i: int, words: int) -> str:
    rng = random.Random(i)
    topic = TOPICS[i % len(TOPICS)]
    vocab = ["careful", "precise", "friendly", "brief", "expert", "patient", "clear", "honest", "detailed", "calm"]
    body = " ".join(rng.choice(vocab) for _ in range(words))
    return f"System prompt {i}: you are an assistant for {topic}. Style notes: {body}."


def workload(args) -> list[str]:
    prompts = [system_prompt(i, args.system_words) for i in range(args.prompts)]
    items = [f"{prompts[p]}\nQuestion {q}: what is the first thing to know about {TOPICS[(p + q) % len(TOPICS)]}?"
             for p in range(args.prompts) for q in range(args.questions)]
    random.Random(0).shuffle(items)
    return items


async def one(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start, first, usage, error, tokens = time.perf_counter(), None, None, None, 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return {"error": f"HTTP {r.status_code}", "tokens": 0}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    error = event["error"].get("code")
                elif event.get("choices") and event["choices"][0]["text"]:
                    tokens += 1
                    first = first or time.perf_counter()
                if event.get("usage"):
                    usage = event["usage"]
    except httpx.HTTPError as exc:
        error = type(exc).__name__
    end = time.perf_counter()
    return {"ttft": (first - start) if first else None, "usage": usage, "error": error, "tokens": tokens,
            "end": end - start, "tpot": (end - first) / (tokens - 1) if first and tokens > 1 else None}


async def run_load(base: str, model: str, prompts: list[str], concurrency: int, max_tokens: int,
                   on_progress=None) -> list[dict]:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        async def task(p):
            async with sem:
                out = await one(client, model, p, max_tokens)
                if on_progress:
                    on_progress()
                return out
        return await asyncio.gather(*(task(p) for p in prompts))


def quantile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(int(q * len(values)), len(values) - 1)] if values else float("nan")


def metrics(base: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def start_front(args, routing: str, log: Path, replicas: int = 2, prefill: int = 0) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [str(VENV_BIN / "tokenmill"), "serve", args.model, "--replicas", str(replicas), "--replica-threads", "1",
           "--prefill-replicas", str(prefill),
           "--routing", routing, "--ray-address", "auto", "--port", str(port), "--dtype", args.dtype,
           "--max-num-seqs", str(args.max_num_seqs), "--served-model-name", "m",
           "--kv-cache-memory", str(args.kv_bytes), "--routing-stats-period", "0.5"]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    wait_ready(base, proc, str(log))
    return proc, base


def stop_front(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def routing_run(args, routing: str, prompts: list[str], prefill: int = 0) -> dict:
    label = routing if not prefill else "disaggregated"
    log = RESULTS / f"scaleout-{label}.log"
    proc, base = start_front(args, routing, log, replicas=2 - prefill, prefill=prefill)
    try:
        asyncio.run(run_load(base, "m", ["warm-up request"], 1, 2))
        start = time.perf_counter()
        results = asyncio.run(run_load(base, "m", prompts, args.concurrency, args.max_tokens))
        wall = time.perf_counter() - start
        m = metrics(base)
    finally:
        stop_front(proc)
    ok = [r for r in results if r["error"] is None and r["usage"]]
    prompt_tokens = sum(r["usage"]["prompt_tokens"] for r in ok)
    cached = sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in ok)
    ttfts = [r["ttft"] for r in ok if r["ttft"] is not None]
    per_replica = {k.split('replica="')[1].split('"')[0]: v for k, v in m.items()
                   if k.startswith("tokenmill:replica_requests_total") and 'event="routed"' in k}
    decisions = {k.split('reason="')[1].split('"')[0]: 0.0 for k in m if k.startswith("tokenmill:router_decisions_total")}
    for k, v in m.items():
        if k.startswith("tokenmill:router_decisions_total"):
            decisions[k.split('reason="')[1].split('"')[0]] += v
    tpots = [r["tpot"] for r in ok if r["tpot"] is not None]
    transfer = {name: sum(v for k, v in m.items() if k.startswith(f"tokenmill:kv_transfer_{name}_total"))
                for name in ("requests", "bytes", "seconds")}
    row = {"routing": label, "requests": len(results), "errors": len(results) - len(ok),
           "tpot_p50": quantile(tpots, 0.5), "transfer": transfer,
           "hit_rate": cached / max(prompt_tokens, 1), "prompt_tokens": prompt_tokens, "cached_tokens": cached,
           "ttft_p50": quantile(ttfts, 0.5), "ttft_p99": quantile(ttfts, 0.99), "wall_s": wall,
           "requests_per_replica": sorted(per_replica.values()), "decisions": decisions}
    print(f"{label:13s} hit rate {row['hit_rate']:.3f}  TPOT p50 {row['tpot_p50'] * 1000:.0f} ms  "
          f"TTFT p50 {row['ttft_p50'] * 1000:.0f} ms  p99 {row['ttft_p99'] * 1000:.0f} ms  wall {wall:.1f} s  "
          f"per replica {row['requests_per_replica']}  "
          f"errors {row['errors']}", flush=True)
    return row


def failover_run(args, prompts: list[str]) -> dict:
    import ray
    from ray import serve

    log = RESULTS / "scaleout-failover.log"
    proc, base = start_front(args, "prefix", log)
    ray.init(address="auto", logging_level="ERROR")
    try:
        asyncio.run(run_load(base, "m", ["warm-up request"], 1, 2))
        before = metrics(base)
        done = []
        killed: dict = {}

        async def load_and_kill():
            load = asyncio.create_task(run_load(base, "m", prompts, args.concurrency, args.failover_tokens,
                                                on_progress=lambda: done.append(1)))
            while len(done) < len(prompts) // 4:
                await asyncio.sleep(0.05)
            m = metrics(base)
            routed = {k.split('replica="')[1].split('"')[0]: v - before.get(k, 0.0) for k, v in m.items()
                      if k.startswith("tokenmill:replica_requests_total") and 'event="routed"' in k}
            victim = max(routed, key=routed.get)
            killed["at"] = time.perf_counter()
            killed["replica"] = victim
            ray.kill(ray.get_actor(f"SERVE_REPLICA::tokenmill#tokenmill-engine#{victim}", namespace="serve"))
            return await load
        results = asyncio.run(load_and_kill())
        # recovered: Ray Serve runs 2 healthy replicas again
        while True:
            status = serve.status().applications["tokenmill"].deployments["tokenmill-engine"]
            running = status.replica_states.get("RUNNING", 0)
            if running >= 2 and status.status == "HEALTHY":
                break
            time.sleep(0.1)
        recovered = time.perf_counter() - killed["at"]
        after = metrics(base)
    finally:
        ray.shutdown()
        stop_front(proc)
    retried = sum(v - before.get(k, 0.0) for k, v in after.items()
                  if k.startswith("tokenmill:replica_requests_total") and 'event="retried"' in k)
    errors = [r for r in results if r["error"] is not None]
    cut = [r for r in errors if r["tokens"] > 0]
    row = {"requests": len(results), "killed_replica": killed["replica"], "retried": retried,
           "errors": len(errors), "errors_after_first_token": len(cut),
           "errors_before_first_token": len(errors) - len(cut),
           "completed": len(results) - len(errors), "seconds_to_recover": recovered}
    print(f"failover: {row['requests']} requests, replica {row['killed_replica']} killed: {row['retried']:.0f} "
          f"retried, {row['completed']} completed, {row['errors_after_first_token']} streams cut after their "
          f"first token, {row['errors_before_first_token']} lost before any; 2 replicas healthy again after "
          f"{recovered:.1f} s", flush=True)
    return row


def service_times(args) -> dict:
    """One replica's prefill and decode seconds per token at concurrency 1 (through the front)."""
    log = RESULTS / "scaleout-service.log"
    proc, base = start_front(args, "round_robin", log)
    try:
        rows = []
        for i in range(6):
            prompt = system_prompt(100 + i, args.system_words)  # never cached
            r = asyncio.run(run_load(base, "m", [prompt], 1, 32))[0]
            rows.append((r["ttft"] / r["usage"]["prompt_tokens"], (r["end"] - r["ttft"]) / 31))
    finally:
        stop_front(proc)
    prefill = statistics.median(p for p, _ in rows[1:])
    decode = statistics.median(d for _, d in rows[1:])
    print(f"service times: prefill {prefill * 1000:.2f} ms/token, decode {decode * 1000:.2f} ms/token", flush=True)
    return {"prefill_per_token": prefill, "decode_per_token": decode}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(11, 3.4))
    names = [r["routing"] for r in rows]
    colors = ["#2f6f9f", "#c0504d"]
    axes[0].bar(names, [r["hit_rate"] * 100 for r in rows], color=colors)
    axes[0].set_title("prefix-cache hit rate (%)")
    axes[1].bar(names, [r["ttft_p50"] * 1000 for r in rows], color=colors)
    axes[1].set_title("TTFT p50 (ms)")
    axes[2].bar(names, [r["ttft_p99"] * 1000 for r in rows], color=colors)
    axes[2].set_title("TTFT p99 (ms)")
    fig.suptitle("2 replicas on Ray Serve, prefix-sharing workload")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompts", type=int, default=10, help="system prompts")
    parser.add_argument("--questions", type=int, default=6, help="questions per system prompt")
    parser.add_argument("--system-words", type=int, default=300, help="style words per system prompt (~ tokens)")
    parser.add_argument("--kv-tokens", type=int, default=3072,
                        help="KV cache per replica, in tokens: fewer system prompts than --prompts")
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--failover-tokens", type=int, default=48)
    parser.add_argument("--out", default=str(RESULTS / "scaleout.json"))
    args = parser.parse_args()
    RESULTS.mkdir(exist_ok=True)
    # SmolLM2: 30 layers x 3 KV heads x 64 dims x 2 (K, V) x 2 bytes (bf16)
    args.kv_bytes = args.kv_tokens * 30 * 3 * 64 * 2 * 2
    env = {**os.environ, "RAY_DEDUP_LOGS": "0"}
    subprocess.run([str(VENV_BIN / "ray"), "stop"], capture_output=True)
    subprocess.run([str(VENV_BIN / "ray"), "start", "--head", "--num-cpus", "2", "--disable-usage-stats",
                    "--include-dashboard", "false"], check=True, capture_output=True, env=env)
    try:
        prompts = workload(args)
        rows = [routing_run(args, routing, prompts) for routing in ("prefix", "round_robin")]
        disaggregated = routing_run(args, "prefix", prompts, prefill=1)
        failover = failover_run(args, workload(argparse.Namespace(**{**vars(args), "questions": 3})))
        service = service_times(args)
    finally:
        subprocess.run([str(VENV_BIN / "ray"), "stop"], capture_output=True)
    prefix, rr = rows
    summary = {"hit_rate_ratio": prefix["hit_rate"] / max(rr["hit_rate"], 1e-9),
               "ttft_p50_ratio": rr["ttft_p50"] / prefix["ttft_p50"], "ttft_p99_ratio": rr["ttft_p99"] / prefix["ttft_p99"]}
    print(f"prefix vs round-robin: hit rate x{summary['hit_rate_ratio']:.2f}, TTFT p50 x{summary['ttft_p50_ratio']:.2f} "
          f"faster, p99 x{summary['ttft_p99_ratio']:.2f}")
    moved = disaggregated["transfer"]
    if moved["requests"]:
        print(f"disaggregated (1 prefill + 1 decode replica) vs colocated (2, prefix routing): TTFT p50 "
              f"{disaggregated['ttft_p50'] * 1000:.0f} vs {prefix['ttft_p50'] * 1000:.0f} ms, TPOT p50 "
              f"{disaggregated['tpot_p50'] * 1000:.0f} vs {prefix['tpot_p50'] * 1000:.0f} ms, wall "
              f"{disaggregated['wall_s']:.1f} vs {prefix['wall_s']:.1f} s; KV moved "
              f"{moved['bytes'] / moved['requests'] / 2**20:.2f} MiB per request, "
              f"{moved['seconds'] / moved['requests'] * 1000:.1f} ms export + import")
    out = {"config": {k: v for k, v in vars(args).items() if k != "out"}, "routing": rows, "summary": summary,
           "disaggregated": disaggregated, "failover": failover, "service_times": service}
    Path(args.out).write_text(json.dumps(out, indent=2))
    plot(rows, Path(args.out).with_suffix(".png"))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
