"""Serving side by side: ``tokenmill serve`` and llama.cpp's ``llama-server`` on the same GGUF,
the same workload, at rising concurrency, in one run; prints the ratio table.

    python bench/peers/serve_compare.py [--concurrencies 1,4,16,64] [--input-len 256] [--output-len 128]
                                        [--rounds 2] [--min-requests 16] [--dtype auto] [--engines tokenmill,llama.cpp]
                                        [--variant bf16='--dtype bfloat16'] [--interleave 3]

The servers run one at a time (never both: they would share the cores), each on a free local
port, and are stopped after their sweep; their logs go beside the results. With --interleave R
every server is up for the whole run (an idle one takes no CPU) and each level runs R times, the
servers taking turns (the order rotated each repeat, every repeat on fresh prompts), so that a
noisy host's drift lands on all of them alike; a point is then the repeat with the median output
tok/s, and the JSON keeps every repeat and the per-repeat ratios. --variant NAME=ARGS adds a
tokenmill server with more serve options (e.g. bf16='--dtype bfloat16'), shown as "tokenmill NAME". llama-server is built
once into ~/.cache/tokenmill/peers (bench/peers/build_llama_cpp.py, about 12 minutes on 2 cores)
unless --no-build; when it cannot be built or started it is skipped with a message.

    tokenmill   python -m tokenmill serve GGUF --dtype D --max-num-seqs S
    llama.cpp   llama-server -m GGUF -c S*(input+output+pad) -np S --cont-batching -t THREADS

Workload (tokenmill.benchmark): random prompts of exactly --input-len tokens (the model's own
tokenizer, which is the GGUF's for both servers), --output-len tokens each with EOS ignored,
greedy, streamed through /v1/completions. Each level draws fresh prompts (no prefix-cache hits
across levels) of max(--min-requests, --rounds x concurrency) requests; both servers get the
very same prompts. Two requests of other prompts warm each server up first. Metrics are vLLM's
(see tokenmill/benchmark/metrics.py): output tok/s, TTFT p50/p99, TPOT p50. Ratios are
tokenmill / peer: above 1 is better for throughput, below 1 is better for latencies.
Writes JSON (all sweeps, and each alone for ``tokenmill bench compare``), markdown and a PNG
under bench/results/peers/.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shlex
import socket
import subprocess
import sys
import statistics
import time
import urllib.request
from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from build_llama_cpp import CACHE, binaries, build

from tokenmill.benchmark.client import ClientConfig
from tokenmill.benchmark.report import fmt, markdown_table, write_json
from tokenmill.benchmark.runner import LoadConfig, run_serve
from tokenmill.benchmark.sweep import (SweepPoint, SweepResult, best_goodput, find_saturation, parse_loads, run_sweep,
                                       sweep_rows)
from tokenmill.benchmark.workloads import Conversation, WorkloadSpec, build_workload, load_tokenizer

RESULTS = Path(__file__).resolve().parents[1] / "results" / "peers"
ENGINES = ("tokenmill", "llama.cpp")


@dataclass
class Server:
    name: str
    command: list[str]
    port: int
    ready: str  # the path that answers 200 once the server takes requests (tokenmill: after its warm-up)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tokenmill_server(args, gguf: Path, name: str = "tokenmill", extra: str = "") -> Server:
    port = free_port()
    return Server(name, [sys.executable, "-m", "tokenmill", "serve", str(gguf), "--port", str(port),
                         "--dtype", args.dtype, "--device", "cpu", "--max-num-seqs", str(args.slots),
                         *shlex.split(args.tokenmill_args), *shlex.split(extra)], port, "/ready")


def parse_variants(texts: list[str]) -> dict[str, str]:
    """--variant NAME=ARGS values -> {"tokenmill NAME": ARGS}; raises ValueError naming a bad one."""
    variants = {}
    for text in texts:
        name, sep, extra = text.partition("=")
        if not sep or not name.strip() or not extra.strip():
            raise ValueError(f"--variant {text!r}: give NAME=ARGS, e.g. bf16='--dtype bfloat16'")
        key = f"tokenmill {name.strip()}"
        if key in variants:
            raise ValueError(f"--variant {name.strip()!r} is given twice")
        variants[key] = extra
    return variants


def llama_server(args, gguf: Path) -> Server:
    """llama-server, built first when needed; raises RuntimeError when it cannot be."""
    found = binaries() or (build() if args.build else {})
    if not found:
        raise RuntimeError(f"llama-server is not built in {CACHE} (--no-build); "
                           f"run python bench/peers/build_llama_cpp.py")
    port = free_port()
    per_slot = args.input_len + args.output_len + 64
    return Server("llama.cpp", [str(found["llama-server"]), "-m", str(gguf), "--host", "127.0.0.1",
                                "--port", str(port), "-c", str(args.slots * per_slot), "-np", str(args.slots),
                                "--cont-batching", "-t", str(args.threads), "-tb", str(args.threads)], port, "/health")


@contextmanager
def running(server: Server, log: Path, timeout_s: float):
    """Start the server, wait until its readiness path answers 200, yield its root URL; stop it afterwards."""
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"starting {server.name}: {' '.join(server.command)}", flush=True)
    with open(log, "w") as out:
        proc = subprocess.Popen(server.command, stdout=out, stderr=subprocess.STDOUT)
    root = f"http://127.0.0.1:{server.port}"
    try:
        deadline = time.monotonic() + timeout_s
        while not _answers(root + server.ready):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{server.name} did not come up (exit code {proc.poll()}); see {log}")
            time.sleep(1)
        yield root
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status == 200
    except OSError:
        return False


def served_model(root: str) -> str:
    with urllib.request.urlopen(root + "/v1/models", timeout=10) as resp:
        return json.load(resp)["data"][0]["id"]


def workloads(args, tokenizer, loads: list[float], repeat: int = 0
              ) -> tuple[list[Conversation], list[list[Conversation]]]:
    """(warm-up, one workload per level): fresh prompts per level (and per repeat), drawn once for every server."""
    spec = WorkloadSpec("random", 2, str(args.input_len), str(args.output_len), seed=args.seed + 999)
    warm = build_workload(spec, tokenizer)
    levels = [build_workload(dataclasses.replace(spec, num_requests=max(args.min_requests, args.rounds * int(c)),
                                                 seed=args.seed + 1000 * level + 100_000 * repeat), tokenizer)
              for level, c in enumerate(loads)]
    return warm, levels


@contextmanager
def warmed(server: Server, warm: list[Conversation], count: Callable[[str], int], log: Path,
           startup_timeout_s: float):
    """Start the server (``running``), send it the warm-up requests, yield its client config."""
    with running(server, log, startup_timeout_s) as root:
        client = ClientConfig(root, served_model(root), "completions", ignore_eos=True, temperature=0.0)
        run_serve(client, LoadConfig(max_concurrency=len(warm)), warm, count, progress=False)
        yield client


def point_line(name: str, load: float, s, label: str = "") -> str:
    """One measured point, as the sweeps print it."""
    return (f"  {name} c={load:g}{label}: {s.completed} ok, {s.failed} failed, {s.output_throughput:,.1f} tok/s, "
            f"TTFT p50 {s.ttft.median or 0:.0f} ms, TPOT p50 {s.tpot.median or 0:.1f} ms")


def sweep(server: Server, warm: list[Conversation], levels: list[list[Conversation]], loads: list[float],
          count: Callable[[str], int], workload: dict, log: Path, startup_timeout_s: float) -> SweepResult:
    with warmed(server, warm, count, log, startup_timeout_s) as client:
        return run_sweep(client, LoadConfig(), "concurrency", loads, levels.__getitem__, count, workload=workload,
                         on_point=lambda point: print(point_line(server.name, point.load, point.summary), flush=True))


def interleaved(servers: list[Server], warm: list[Conversation], repeats: list[list[list[Conversation]]],
                loads: list[float], count: Callable[[str], int], workload: dict, stem: Path,
                startup_timeout_s: float) -> tuple[dict[str, SweepResult], dict[str, list[list[float]]]]:
    """Every server up at once; each level runs once per repeat on every server, taking turns.

    Returns ({server: sweep of the median repeats}, {server: [[out tok/s of each repeat] per level]})."""
    with ExitStack() as stack:
        clients = {server.name: stack.enter_context(warmed(server, warm, count, Path(f"{stem}-{_slug(server.name)}.log"),
                                                           startup_timeout_s))
                   for server in servers}
        runs: dict[str, list[list]] = {s.name: [[] for _ in loads] for s in servers}
        for level, load in enumerate(loads):
            for r, levels in enumerate(repeats):
                for server in servers[r % len(servers):] + servers[:r % len(servers)]:
                    cfg = LoadConfig(max_concurrency=int(load), seed=level + 1000 * r)
                    s = run_serve(clients[server.name], cfg, levels[level], count, workload=workload,
                                  progress=False).summary
                    runs[server.name][level].append(s)
                    print(point_line(server.name, load, s, f" repeat {r + 1}"), flush=True)
    results, throughputs = {}, {}
    for name, per_level in runs.items():
        points = [SweepPoint(load, _median_run(summaries)) for load, summaries in zip(loads, per_level)]
        results[name] = SweepResult("concurrency", points, dataclasses.asdict(clients[name]), workload, None,
                                    find_saturation(points), best_goodput(points))
        throughputs[name] = [[s.output_throughput for s in summaries] for summaries in per_level]
    return results, throughputs


def _median_run(summaries: list):
    """The run whose output tok/s is the median (the lower middle one for an even count)."""
    ranked = sorted(summaries, key=lambda s: s.output_throughput)
    return ranked[(len(ranked) - 1) // 2]


def _slug(name: str) -> str:
    return name.replace(" ", "-")


def repeat_ratios(throughputs: dict[str, list[list[float]]], loads: list[float]) -> tuple[list[str], list[list[str]]]:
    """tokenmill / each other server, repeat by repeat (the same prompts, minutes apart), and their median."""
    others = [n for n in throughputs if n != "tokenmill"]
    header = ["concurrency", *[f"tokenmill / {n} per repeat (median)" for n in others]]
    rows = []
    for level, load in enumerate(loads):
        cells = []
        for name in others:
            ratios = [a / b for a, b in zip(throughputs["tokenmill"][level], throughputs[name][level]) if b]
            cells.append(", ".join(f"x{x:.2f}" for x in ratios) + (f" (x{statistics.median(ratios):.2f})"
                                                                    if ratios else ""))
        rows.append([f"{load:g}", *cells])
    return header, rows


# ---------------------------------------------------------------- the ratio table


METRICS = (("out tok/s", lambda s: s.output_throughput), ("TTFT p50 ms", lambda s: s.ttft.median),
           ("TTFT p99 ms", lambda s: s.ttft.percentiles.get("p99")), ("TPOT p50 ms", lambda s: s.tpot.median))


def ratio_table(results: dict[str, SweepResult]) -> tuple[list[str], list[list[str]]]:
    """One row per concurrency and metric: every engine's value, then tokenmill / each peer."""
    names = list(results)
    peers = [n for n in names if n != "tokenmill"] if "tokenmill" in results else []
    header = ["concurrency", "metric", *names, *[f"tokenmill / {p}" for p in peers]]
    rows = []
    for i, point in enumerate(results[names[0]].points):
        for metric, get in METRICS:
            values = {n: get(r.points[i].summary) if i < len(r.points) else None for n, r in results.items()}
            rows.append([f"{point.load:g}", metric, *[fmt(values[n], 1) for n in names],
                         *[_ratio(values["tokenmill"], values[p]) for p in peers]])
    return header, rows


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"x{a / b:.2f}"


def plot(results: dict[str, SweepResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(METRICS), figsize=(4.2 * len(METRICS), 3.8))
    for ax, (metric, get) in zip(axes, METRICS):
        for name, result in results.items():
            ys = [get(p.summary) for p in result.points]
            ax.plot([p.load for p in result.points], [math.nan if y is None else y for y in ys], "o-", label=name)
        loads = [p.load for p in next(iter(results.values())).points]
        ax.set(xscale="log", xlabel="concurrency", title=metric, yscale="linear" if "tok/s" in metric else "log")
        ax.set_xticks(loads, [f"{x:g}" for x in loads], minor=False)
        ax.tick_params(axis="x", which="minor", bottom=False, labelbottom=False)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a GGUF model name or file")
    parser.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated, of {','.join(ENGINES)}")
    parser.add_argument("--concurrencies", default="1,4,16,64")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2, help="requests per level = max(min, rounds x concurrency)")
    parser.add_argument("--min-requests", type=int, default=16)
    parser.add_argument("--slots", type=int, default=None,
                        help="tokenmill --max-num-seqs and llama-server -np (default: the highest concurrency)")
    parser.add_argument("--dtype", default="auto", help="tokenmill's --dtype (auto, its default: a GGUF runs as stored)")
    parser.add_argument("--tokenmill-args", default="", help="more options for tokenmill serve, e.g. '--bf16-copy-rows 8'")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=ARGS",
                        help="one more tokenmill server with more serve options, shown as 'tokenmill NAME', "
                             "e.g. bf16='--dtype bfloat16' (repeatable)")
    parser.add_argument("--interleave", type=int, default=0, metavar="R",
                        help="keep every server up and run each level R times, servers taking turns (0: one "
                             "server after the other, once)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama-server -t")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--startup-timeout", type=float, default=600, help="seconds a server may take to come up")
    parser.add_argument("--no-build", dest="build", action="store_false",
                        help="skip llama.cpp when it is not built yet instead of building it")
    args = parser.parse_args()
    loads = parse_loads(args.concurrencies)
    args.slots = args.slots or int(max(loads))
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if unknown := set(engines) - set(ENGINES):
        parser.error(f"unknown engines {sorted(unknown)}; use {','.join(ENGINES)}")
    try:
        variants = parse_variants(args.variant)
    except ValueError as exc:
        parser.error(str(exc))
    if args.interleave < 0:
        parser.error(f"--interleave must be >= 0, got {args.interleave}")

    from tokenmill.loading.sources import resolve_model

    source = resolve_model(args.model)
    if source.format != "gguf":
        parser.error(f"{args.model} is not a GGUF model: both servers must load the same GGUF file")
    gguf = source.path
    tokenizer = load_tokenizer(args.model)
    print("drawing the prompts", flush=True)
    warm, levels = workloads(args, tokenizer, loads)
    workload = {"kind": "random", "input_len": args.input_len, "output_len": args.output_len, "seed": args.seed,
                "num_requests": [len(w) for w in levels]}

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    stem = RESULTS / f"serve-{datetime.now():%Y%m%d-%H%M%S}"
    results: dict[str, SweepResult] = {}
    skipped: dict[str, str] = {}
    servers: list[Server] = []
    for name in [*engines, *variants]:
        try:
            servers.append(tokenmill_server(args, gguf, name, variants.get(name, "")) if name.startswith("tokenmill")
                           else llama_server(args, gguf))
        except RuntimeError as exc:
            print(f"  skipped {name}: {exc}", flush=True)
            skipped[name] = str(exc)
    throughputs = None
    if args.interleave:
        print(f"== {', '.join(s.name for s in servers)}: {args.interleave} repeats, taking turns", flush=True)
        repeats = [levels] + [workloads(args, tokenizer, loads, r)[1] for r in range(1, args.interleave)]
        workload["repeats"] = args.interleave
        try:
            results, throughputs = interleaved(servers, warm, repeats, loads, count, workload, stem,
                                               args.startup_timeout)
        except RuntimeError as exc:  # a server that did not come up: the others were stopped
            sys.exit(f"--interleave needs every server up: {exc}")
    else:
        for server in servers:
            print(f"== {server.name}", flush=True)
            try:
                results[server.name] = sweep(server, warm, levels, loads, count, workload,
                                             Path(f"{stem}-{_slug(server.name)}.log"), args.startup_timeout)
            except RuntimeError as exc:
                print(f"  skipped {server.name}: {exc}", flush=True)
                skipped[server.name] = str(exc)
    if not results:
        sys.exit("no engine ran")

    for name, result in results.items():
        print(f"\n{name}\n" + markdown_table(*sweep_rows(result)))
    table = markdown_table(*ratio_table(results))
    if throughputs and "tokenmill" in throughputs and len(throughputs) > 1:
        table += "\n\nOutput tok/s, repeat by repeat:\n\n" + markdown_table(*repeat_ratios(throughputs, loads))
    intro = (f"`{gguf.name}`, random prompts of {args.input_len} tokens, {args.output_len} out (EOS ignored), "
             f"streamed /v1/completions, {args.slots} slots; tokenmill {args.dtype}; llama-server -t {args.threads}. "
             f"Latencies in ms; ratios tokenmill / peer: > 1 is better for tok/s, < 1 is better for latencies.")
    skips = "".join(f"\n- {n} skipped: {why}" for n, why in skipped.items())
    print(f"\n{intro}\n\n{table}{skips}")
    for name, result in results.items():       # each alone too: tokenmill bench compare A.json B.json
        write_json(result.to_dict(), f"{stem}-{_slug(name)}.json")
    write_json({"kind": "serve_peers", "args": vars(args), "gguf": str(gguf), "skipped": skipped,
                "sweeps": {n: r.to_dict() for n, r in results.items()},
                "repeat_output_throughput": throughputs}, stem.with_suffix(".json"))
    stem.with_suffix(".md").write_text(f"# Serving peers\n\n{intro}\n\n{table}\n{skips}\n\n![serve]({stem.name}.png)\n")
    plot(results, stem.with_suffix(".png"))
    print(f"wrote {stem}.json, .md and .png")


if __name__ == "__main__":
    main()
