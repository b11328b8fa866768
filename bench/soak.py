"""Soak: a bounded mixed run against `tokenmill serve` at several times its capacity.

    python bench/soak.py [--model smollm2-135m-instruct] [--requests 2000] [--overload 4]

Starts `tokenmill serve` (a subprocess, with an API-keys file of four tenants: one unlimited,
one at a requests-per-minute limit, one at a tokens-per-minute limit, one admin), measures its
capacity (completed requests/s at full concurrency, a short closed loop), then sends --requests
requests as Poisson arrivals at --overload times that rate, drawn from a mix of:

    ok            completions and chat, streamed or not
    disconnect    a stream the client drops after its first chunk
    deadline      X-Request-Timeout far below the generation's length
    bad input     invalid JSON, out-of-range values, token ids outside the vocabulary, a lone
                  surrogate, a prompt longer than the context, an unknown model, no API key
    limited       requests of the two limited tenants

while a poller times GET /health every 50 ms. When the run has drained it reports:

    status counts by (status, code); any 500 is a failure
    every 429 / 503 carries Retry-After and a documented reason code
    the server's RSS after warm-up and at the end (growth under 5%)
    KV blocks in use and requests queued or running afterwards (both 0), from /metrics
    /health latency p50 / p99 / max during the run

Prints the table, writes bench/results/soak.json and a PNG (status counts, /health latency over time).
Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
from launch import wait_ready

RESULTS = Path(__file__).parent / "results"
RETRY_CODES = {  # the reasons the server documents for a 429 or 503 (README, Server)
    "queue_full", "queue_tokens", "shed", "deadline", "deadline_exceeded", "tenant_requests", "tenant_tokens",
    "tenant_concurrency", "shutting_down", "engine_unavailable", "kv_cache_exhausted", "warming_up", "not_ready",
    "too_many_connections",
}
KEYS = {"alice": "sk-alice", "bob": "sk-bob", "carol": "sk-carol", "ops": "sk-ops"}
WORDS = "the quick brown fox jumps over a lazy dog while seven tired engineers measure tail latency".split()


def keys_file(path: Path) -> None:
    def entry(name: str, **limits) -> dict:
        return {"name": name, "key_sha256": hashlib.sha256(KEYS[name].encode()).hexdigest(), **limits}

    tenants = [entry("alice"), entry("bob", requests_per_minute=30), entry("carol", tokens_per_minute=2000),
               entry("ops", admin=True)]
    path.write_text(json.dumps({"tenants": tenants}))


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def auth(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[name]}"}


class Soak:
    def __init__(self, base: str, model: str, args: argparse.Namespace) -> None:
        self.base, self.model, self.args = base, model, args
        self.rng = random.Random(args.seed)
        self.statuses: Counter[tuple[int, str]] = Counter()
        self.kinds: Counter[str] = Counter()
        self.problems: list[str] = []
        self.health: list[tuple[float, float]] = []

    # ---- the request mix ------------------------------------------------------------------------
    def pick(self) -> tuple[str, dict]:
        """(kind, request description) drawn from the mix."""
        r, rng, model = self.rng.random(), self.rng, self.model
        body = {"model": model, "prompt": prompt(rng, rng.randint(8, 48)), "max_tokens": rng.randint(4, 24),
                "temperature": 0}
        if r < 0.40:
            return "ok", {"path": "/v1/completions", "json": {**body, "stream": rng.random() < 0.5},
                          "headers": auth("alice")}
        if r < 0.50:
            chat = {"model": model, "messages": [{"role": "user", "content": prompt(rng, 12)}], "max_tokens": 12,
                    "stream": rng.random() < 0.5}
            return "ok-chat", {"path": "/v1/chat/completions", "json": chat, "headers": auth("alice")}
        if r < 0.58:
            return "disconnect", {"path": "/v1/completions", "json": {**body, "stream": True, "max_tokens": 64},
                                  "headers": auth("alice"), "drop": True}
        if r < 0.66:
            return "deadline", {"path": "/v1/completions", "json": {**body, "max_tokens": 200, "ignore_eos": True},
                                "headers": {**auth("alice"), "X-Request-Timeout": "0.3"}}
        if r < 0.74:
            return "limited-rpm", {"path": "/v1/completions", "json": body, "headers": auth("bob")}
        if r < 0.82:
            return "limited-tpm", {"path": "/v1/completions", "json": {**body, "max_tokens": 64},
                                   "headers": auth("carol")}
        bad = [
            ("bad-json", {"content": b'{"model": "x", "prompt": ', "headers": {"Content-Type": "application/json"}}),
            ("bad-value", {"json": {**body, "temperature": -3}}),
            ("bad-token", {"json": {**body, "prompt": [1, 2, 10**9]}}),
            ("bad-surrogate", {"content": json.dumps({**body, "prompt": "x\ud800y"}).encode(),
                               "headers": {"Content-Type": "application/json"}}),
            ("bad-long", {"json": {**body, "prompt": "word " * 40_000}}),
            ("bad-model", {"json": {**body, "model": "no-such-model"}}),
            ("no-key", {"json": body, "headers": {}}),
        ]
        kind, spec = rng.choice(bad)
        headers = {} if kind == "no-key" else {**auth("alice"), **spec.pop("headers", {})}
        spec.pop("headers", None)
        return kind, {"path": "/v1/completions", "headers": headers, **spec}

    async def send(self, client: httpx.AsyncClient, kind: str, req: dict) -> None:
        self.kinds[kind] += 1
        kwargs = {k: req[k] for k in ("json", "content", "headers") if k in req}
        try:
            async with client.stream("POST", self.base + req["path"], **kwargs) as resp:
                code = None
                if req.get("drop") and resp.status_code == 200:
                    async for _ in resp.aiter_raw():
                        break  # drop the connection after the first chunk
                    self.statuses[(200, "dropped")] += 1
                    return
                body = await resp.aread()
                if resp.status_code >= 400:
                    try:
                        code = json.loads(body)["error"].get("code")
                    except (ValueError, KeyError, TypeError):
                        self.problems.append(f"{kind}: {resp.status_code} without an OpenAI error body: {body[:120]!r}")
                self.statuses[(resp.status_code, code or "")] += 1
                if resp.status_code >= 500 and resp.status_code != 503:
                    self.problems.append(f"{kind}: {resp.status_code} {body[:200]!r}")
                if resp.status_code in (429, 503):
                    if "retry-after" not in resp.headers:
                        self.problems.append(f"{kind}: {resp.status_code} {code} without Retry-After")
                    if code not in RETRY_CODES:
                        self.problems.append(f"{kind}: {resp.status_code} with undocumented code {code!r}")
        except httpx.HTTPError as exc:
            self.statuses[(0, type(exc).__name__)] += 1
            self.problems.append(f"{kind}: transport error {type(exc).__name__}: {exc}")

    # ---- phases -----------------------------------------------------------------------------------
    async def capacity(self, client: httpx.AsyncClient, seconds: float, concurrency: int) -> float:
        """Completed requests per second of the 'ok' kind in a closed loop."""
        done, stop = 0, time.monotonic() + seconds

        async def loop() -> None:
            nonlocal done
            rng = random.Random(self.rng.random())
            while time.monotonic() < stop:
                body = {"model": self.model, "prompt": prompt(rng, rng.randint(8, 48)),
                        "max_tokens": rng.randint(4, 24), "temperature": 0}
                r = await client.post(self.base + "/v1/completions", json=body, headers=auth("alice"))
                done += r.status_code == 200

        start = time.monotonic()
        await asyncio.gather(*(loop() for _ in range(concurrency)))
        return done / (time.monotonic() - start)

    async def poll_health(self, client: httpx.AsyncClient, stop: asyncio.Event) -> None:
        t0 = time.monotonic()
        while not stop.is_set():
            start = time.monotonic()
            try:
                await client.get(self.base + "/health", timeout=30)
            except httpx.HTTPError:
                pass
            self.health.append((start - t0, time.monotonic() - start))
            await asyncio.sleep(0.05)

    async def run(self, rate: float) -> float:
        limits = httpx.Limits(max_connections=self.args.concurrency, max_keepalive_connections=self.args.concurrency)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client, \
                httpx.AsyncClient(timeout=30) as health_client:
            stop = asyncio.Event()
            poller = asyncio.create_task(self.poll_health(health_client, stop))
            gate = asyncio.Semaphore(self.args.concurrency)
            tasks, start = [], time.monotonic()

            async def one(kind: str, req: dict) -> None:
                async with gate:
                    await self.send(client, kind, req)

            for i in range(self.args.requests):
                kind, req = self.pick()
                tasks.append(asyncio.create_task(one(kind, req)))
                await asyncio.sleep(self.rng.expovariate(rate))
                if time.monotonic() - start > self.args.max_seconds:
                    break
            await asyncio.gather(*tasks)
            elapsed = time.monotonic() - start
            stop.set()
            await poller
            return elapsed


def scrape(base: str) -> dict[str, float]:
    text = httpx.get(base + "/metrics", headers=auth("ops"), timeout=30).text
    values = {}
    for line in text.splitlines():
        if line.startswith("tokenmill:") and " " in line:
            name, value = line.rsplit(" ", 1)
            values[name.split("{")[0]] = values.get(name.split("{")[0], 0.0) + float(value)
    return values


def start_server(args: argparse.Namespace, keys: Path, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tokenmill", "serve", args.model, "--port", str(port), "--api-keys", str(keys),
           "--max-num-seqs", str(args.max_num_seqs), "--max-queued-requests", str(args.max_queued),
           "--request-timeout", "60", "--dtype", args.dtype]
    log = open(Path(tempfile.gettempdir()) / "soak-server.log", "w")
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--overload", type=float, default=4.0, help="arrival rate as a multiple of capacity")
    parser.add_argument("--concurrency", type=int, default=48, help="client connections at most")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--max-queued", type=int, default=16)
    parser.add_argument("--max-seconds", type=float, default=900, help="stop sending after this long")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    base = f"http://127.0.0.1:{args.port}"
    with tempfile.TemporaryDirectory() as tmp:
        keys = Path(tmp) / "keys.json"
        keys_file(keys)
        proc = start_server(args, keys, args.port)
        try:
            wait_ready(base, proc, f"{tempfile.gettempdir()}/soak-server.log")
            soak = Soak(base, args.model, args)
            rate = asyncio.run(_capacity(soak, args.max_num_seqs))
            rss_start = rss_bytes(proc.pid)
            print(f"capacity {rate:.2f} req/s; sending {args.requests} requests at {args.overload}x "
                  f"({rate * args.overload:.1f} req/s); RSS {rss_start / 2**20:.0f} MiB", flush=True)
            elapsed = asyncio.run(soak.run(rate * args.overload))
            time.sleep(1.0)  # let aborted streams and deadlines settle
            after = scrape(base)
            rss_end = rss_bytes(proc.pid)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    report(args, soak, rate, elapsed, rss_start, rss_end, after)


async def _capacity(soak: Soak, concurrency: int) -> float:
    async with httpx.AsyncClient(timeout=120) as client:
        await soak.capacity(client, 5, concurrency)  # warm-up
        return await soak.capacity(client, 20, concurrency)


def report(args, soak: Soak, rate: float, elapsed: float, rss_start: int, rss_end: int, after: dict) -> None:
    latencies = sorted(h for _, h in soak.health)
    p = (lambda q: latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1000) if latencies else (lambda q: 0)
    growth = rss_end / rss_start - 1
    kv_blocks = after.get("tokenmill:kv_cache_used_blocks", float("nan"))
    queued = after.get("tokenmill:num_requests_waiting", float("nan")) + after.get("tokenmill:num_requests_running", 0)
    checks = {
        "no 500": not any(s >= 500 and s != 503 for s, _ in soak.statuses),
        "429/503 with Retry-After and a documented code": not soak.problems,
        "RSS growth under 5%": growth < 0.05,
        "no KV block held afterwards": kv_blocks == 0,
        "nothing queued or running afterwards": queued == 0,
    }
    print(f"\n{sum(soak.statuses.values())} requests in {elapsed:.1f} s (capacity {rate:.2f} req/s, "
          f"offered {rate * args.overload:.2f} req/s)")
    print(f"{'status':>6}  {'code':24s} count")
    for (status, code), n in sorted(soak.statuses.items()):
        print(f"{status:>6}  {code:24s} {n}")
    print(f"kinds sent: {dict(sorted(soak.kinds.items()))}")
    print(f"RSS {rss_start / 2**20:.1f} -> {rss_end / 2**20:.1f} MiB ({growth * 100:+.2f}%)")
    print(f"after: KV blocks in use {kv_blocks:.0f}, waiting + running {queued:.0f}")
    print(f"/health latency: p50 {p(0.5):.1f} ms, p99 {p(0.99):.1f} ms, max {p(1.0):.1f} ms "
          f"({len(latencies)} probes)")
    for problem in soak.problems[:20]:
        print(f"  problem: {problem}")
    for name, ok in checks.items():
        print(f"  [{'ok' if ok else 'FAIL'}] {name}")
    RESULTS.mkdir(exist_ok=True)
    result = {"args": vars(args), "capacity_rps": rate, "seconds": elapsed,
              "statuses": {f"{s} {c}".strip(): n for (s, c), n in sorted(soak.statuses.items())},
              "kinds": dict(soak.kinds), "rss_start": rss_start, "rss_end": rss_end, "rss_growth": growth,
              "kv_used_blocks_after": kv_blocks, "queued_after": queued,
              "health_ms": {"p50": p(0.5), "p99": p(0.99), "max": p(1.0), "probes": len(latencies)},
              "problems": soak.problems, "checks": checks}
    (RESULTS / "soak.json").write_text(json.dumps(result, indent=2))
    _plot(soak)
    sys.exit(0 if all(checks.values()) else 1)


def _plot(soak: Soak) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4))
    items = sorted(soak.statuses.items())
    a.barh([f"{s} {c}" for (s, c), _ in items], [n for _, n in items])
    a.set_xlabel("responses")
    a.set_title("status (code)")
    if soak.health:
        b.plot([t for t, _ in soak.health], [h * 1000 for _, h in soak.health], ".", markersize=2)
        b.set_yscale("log")
    b.set_xlabel("s into the run")
    b.set_ylabel("GET /health latency (ms)")
    b.set_title(f"/health during the soak (median {statistics.median([h for _, h in soak.health] or [0]) * 1000:.1f} ms)")
    fig.tight_layout()
    fig.savefig(RESULTS / "soak.png", dpi=100)
    print(f"wrote {RESULTS / 'soak.json'} and .png")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
