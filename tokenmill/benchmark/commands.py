"""``tokenmill bench serve|sweep|compare|offline|hardware``: argument parsing and the thin commands."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from tokenmill.config import LoadConfig
from tokenmill.engine import ENGINE_OPTIONS
from tokenmill.errors import InvalidParameterError
from tokenmill.benchmark.offline import OfflineConfig
from tokenmill.options import add_option_group, from_namespace, option_fields


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmark a server (serve, sweep), the engine (offline), compare results")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    serve = kinds.add_parser("serve", help="benchmark an OpenAI-compatible server (tokenmill, llama-server, vLLM)")
    _client_args(serve)
    _workload_args(serve)
    _load_args(serve)
    serve.add_argument("--request-rate", type=float, default=math.inf, help="requests/s on average (default: inf)")
    serve.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    serve.add_argument("--save-records", action="store_true", help="keep every request's timeline in the JSON")
    serve.add_argument("--scrape-metrics", action="store_true",
                       help="read the server's /metrics before and after: its latency histograms beside ours, and its "
                            "speculative-decoding counters (acceptance rate, mean accepted length, per position)")
    sweep = kinds.add_parser("sweep", help="serve benchmarks at rising rates or concurrencies; curve, plots, report")
    _client_args(sweep)
    _workload_args(sweep)
    _load_args(sweep)
    sweep.add_argument("--rates", default=None, help="comma-separated request rates, e.g. 1,2,4,8,inf")
    sweep.add_argument("--concurrencies", default=None, help="comma-separated max concurrencies, e.g. 1,4,16,64")
    sweep.add_argument("--max-concurrency", type=int, default=None, help="cap in flight during a rate sweep")
    sweep.add_argument("--min-gain", type=float, default=0.05,
                       help="saturated when throughput rises less than this over the best lower load (default 0.05)")
    sweep.add_argument("--latency-factor", type=float, default=3.0,
                       help="saturated when median E2E latency exceeds this x the lowest load's (default 3)")
    compare = kinds.add_parser("compare", help="ratios of two result files (b over a), regressions flagged")
    compare.add_argument("a", help="baseline result JSON")
    compare.add_argument("b", help="new result JSON")
    compare.add_argument("--threshold", type=float, default=0.05, help="worse by more than this is a regression")
    compare.add_argument("--fail-on-regression", action="store_true", help="exit status 1 when any metric regresses")
    offline = kinds.add_parser("offline", help="engine-only throughput and latency, MBU/MFU and a roofline plot")
    add_option_group(offline, LoadConfig)
    for cls in ENGINE_OPTIONS:  # --seed is the workload's (below); the requests are greedy
        add_option_group(offline, cls, exclude=("seed",))
    add_option_group(offline, OfflineConfig)
    offline.add_argument("--remeasure", action="store_true", help="measure the hardware ceilings again")
    offline.add_argument("--out", default=None, help="result JSON (default bench/results/offline-<time>.json)")
    offline.add_argument("--no-progress", action="store_true")
    hardware = kinds.add_parser("hardware", help="measure (once, then cached) memory bandwidth and matmul FLOP/s")
    hardware.add_argument("--device", default="auto")
    hardware.add_argument("--remeasure", action="store_true")


def _client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    p.add_argument("--backend", choices=("completions", "chat"), default="completions")
    p.add_argument("--model", "-m", default=None,
                   help="model whose tokenizer counts tokens (default: smollm2-135m-instruct)")
    p.add_argument("--tokenizer", default=None, help="tokenizer source if not --model (GGUF, HF dir, name)")
    p.add_argument("--served-model-name", default=None, help="the request's model field (default: the server's first)")
    p.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos (for servers that reject it)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--extra-body", default=None, help="JSON merged into every request body")
    p.add_argument("--api-key", default=None)
    p.add_argument("--slo", default=None, help="goodput objectives in ms, e.g. ttft=500,tpot=50,e2el=10000")
    p.add_argument("--out", default=None, help="result JSON (default bench/results/<kind>-<time>.json)")


def _workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", choices=("random", "prefix", "multi-turn", "jsonl"), default="random")
    p.add_argument("--num-requests", type=int, default=200,
                   help="requests (random, jsonl), questions (prefix) or conversations (multi-turn)")
    p.add_argument("--input-len", default="256", help="prompt tokens: N or LO:HI (default 256)")
    p.add_argument("--output-len", default="128", help="output tokens: N or LO:HI (default 128)")
    p.add_argument("--num-prefixes", type=int, default=4, help="prefix workload: shared system prompts")
    p.add_argument("--prefix-len", type=int, default=512, help="prefix workload: tokens of each system prompt")
    p.add_argument("--num-turns", type=int, default=3, help="multi-turn workload: user turns per conversation")
    p.add_argument("--dataset-path", default=None, help="jsonl workload: the file")
    p.add_argument("--seed", type=int, default=0)


def _load_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals: 1 = Poisson")
    p.add_argument("--duration", type=float, default=None, help="seconds to keep sending (the workload repeats)")
    p.add_argument("--warmup", type=int, default=0, help="warm-up requests, not recorded")


def _require(*modules: str) -> None:
    import importlib.util

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise InvalidParameterError(f"tokenmill bench needs {', '.join(missing)}: pip install 'tokenmill[bench]'")


def _client_setup(args: argparse.Namespace):
    """(client config, tokenizer, workload spec, SLO) from the shared arguments."""
    import asyncio
    import dataclasses

    _require("aiohttp", "matplotlib")

    from tokenmill.benchmark.client import ClientConfig, OpenAIClient
    from tokenmill.benchmark.metrics import SLO
    from tokenmill.benchmark.workloads import WorkloadSpec, load_tokenizer

    try:
        extra = json.loads(args.extra_body) if args.extra_body else {}
    except json.JSONDecodeError as exc:
        raise InvalidParameterError(f"--extra-body is not JSON: {exc}") from None
    tokenizer = load_tokenizer(args.tokenizer or args.model)
    served = args.served_model_name
    config = ClientConfig(args.base_url, served or "", args.backend, not args.no_ignore_eos, args.temperature, extra,
                          api_key=args.api_key)
    if served is None:
        config = dataclasses.replace(config, model=asyncio.run(_first_model(OpenAIClient(config))))
    spec = WorkloadSpec(args.workload, args.num_requests, args.input_len, args.output_len, args.num_prefixes,
                        args.prefix_len, args.num_turns, args.dataset_path, args.seed)
    return config, tokenizer, spec, SLO.parse(args.slo) if args.slo else None


async def _first_model(client) -> str:
    from tokenmill.benchmark.runner import BenchmarkError

    try:
        async with client:
            models = await client.served_models()
    except Exception as exc:  # noqa: BLE001 (refused, timed out, not JSON: all say the same to the user)
        raise BenchmarkError(f"cannot list the models of {client.config.root} ({type(exc).__name__}: {exc}); "
                             f"is the server up? pass --served-model-name to skip this") from None
    if not models:
        raise BenchmarkError(f"{client.config.root}/v1/models lists no model; pass --served-model-name")
    return models[0]


def _counter(tokenizer):
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False))


def cmd_serve(args: argparse.Namespace) -> int:
    from tokenmill.benchmark.report import (
        default_out,
        format_server_metrics,
        format_speculative,
        format_summary,
        write_json,
    )
    from tokenmill.benchmark.runner import LoadConfig, run_serve
    from tokenmill.benchmark.workloads import build_workload

    client, tokenizer, spec, slo = _client_setup(args)
    load = LoadConfig(args.request_rate, args.burstiness, args.max_concurrency, args.duration, args.warmup, args.seed)
    result = run_serve(client, load, build_workload(spec, tokenizer), _counter(tokenizer), slo, spec.describe(),
                       scrape_metrics=args.scrape_metrics)
    print(format_summary(result.summary))
    if result.server_metrics is not None:
        print(format_server_metrics(result.server_metrics))
    if result.speculative is not None:
        print(format_speculative(result.speculative))
    path = write_json(result.to_dict(with_records=args.save_records), args.out or default_out("serve"))
    print(f"results: {path}")
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    import dataclasses

    from tokenmill.benchmark.report import default_out, write_json
    from tokenmill.benchmark.runner import LoadConfig
    from tokenmill.benchmark.sweep import (
        markdown_report,
        parse_loads,
        plot_sweep,
        run_sweep,
    )
    from tokenmill.benchmark.workloads import build_workload

    if (args.rates is None) == (args.concurrencies is None):
        raise InvalidParameterError("give exactly one of --rates or --concurrencies")
    mode, loads = ("rate", parse_loads(args.rates)) if args.rates else ("concurrency", parse_loads(args.concurrencies))
    client, tokenizer, spec, slo = _client_setup(args)
    base = LoadConfig(math.inf, args.burstiness, args.max_concurrency if mode == "rate" else None, args.duration,
                      args.warmup, args.seed)

    def make_workload(level: int):
        return build_workload(dataclasses.replace(spec, seed=spec.seed + 1000 * level), tokenizer)

    def on_point(point) -> None:
        s = point.summary
        print(f"{mode} {point.load:g}: {s.completed} ok, {s.failed} failed, {s.output_throughput:,.1f} tok/s, "
              f"TTFT p50 {s.ttft.median or 0:.1f} ms, TPOT p50 {s.tpot.median or 0:.1f} ms", flush=True)

    result = run_sweep(client, base, mode, loads, make_workload, _counter(tokenizer), slo, spec.describe(),
                       args.min_gain, args.latency_factor, on_point)
    path = write_json(result.to_dict(), args.out or default_out("sweep"))
    plot = plot_sweep(result, path.with_suffix(".png"))
    report = path.with_suffix(".md")
    report.write_text(markdown_report(result, plot), encoding="utf-8")
    print(markdown_report(result, None))
    print(f"results: {path}\nplot: {plot}\nreport: {report}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from tokenmill.benchmark.compare import compare, format_comparison
    from tokenmill.benchmark.report import read_json

    rows = compare(_read(args.a, read_json), _read(args.b, read_json), args.threshold)
    print(format_comparison(rows, Path(args.a).stem, Path(args.b).stem, args.threshold))
    return 1 if args.fail_on_regression and any(r.regression for r in rows) else 0


def _read(path: str, read_json) -> dict:
    try:
        return read_json(path)
    except (OSError, json.JSONDecodeError) as exc:
        raise InvalidParameterError(f"cannot read {path}: {exc}") from None


def cmd_offline(args: argparse.Namespace) -> int:
    from tokenmill.benchmark.hardware import load_or_measure
    from tokenmill.benchmark.offline import (
        format_offline,
        plot_offline_roofline,
        run_offline,
    )
    from tokenmill.benchmark.report import default_out, write_json
    from tokenmill.llm import LLM

    _require("matplotlib")
    options = {f.name: getattr(args, f.name) for cls in (LoadConfig, *ENGINE_OPTIONS) for f in option_fields(cls)
               if f.name not in ("model", "seed")}
    llm = LLM(args.model, **options)
    print(f"hardware ceilings of {llm.device} (measured once, cached)...", flush=True)
    ceilings = load_or_measure(llm.device, remeasure=args.remeasure)
    config = from_namespace(OfflineConfig, args)
    result = run_offline(llm, config, ceilings, progress=not args.no_progress)
    print(format_offline(result))
    path = write_json(result, args.out or default_out("offline"))
    plot = plot_offline_roofline(result, path.with_suffix(".png"))
    print(f"results: {path}\nroofline: {plot}")
    if "moe" in result:
        from tokenmill.models.moe_stats import plot_expert_load

        moe = result["moe"]
        load_plot = plot_expert_load(moe["load"], path.with_name(path.stem + "-expert-load.png"),
                                     f"{result['model']['name']}: share of routed tokens per MoE layer "
                                     f"(even: {1 / len(moe['load'][0]):.3f})")
        print(f"expert load: {load_plot}")
    return 0


def cmd_hardware(args: argparse.Namespace) -> int:
    from tokenmill.benchmark.hardware import default_cache_path, load_or_measure
    from tokenmill.benchmark.report import fmt, table
    from tokenmill.device import resolve_device

    c = load_or_measure(resolve_device(args.device), remeasure=args.remeasure)
    rows = [("Device", c.device), ("Measured at", c.measured_at),
            ("Copy bandwidth (GB/s)", fmt(c.copy_bandwidth / 1e9, 1)),
            ("Read bandwidth (GB/s)", fmt(c.read_bandwidth / 1e9, 1))]
    rows += [(f"Matmul {name} (GFLOP/s)", fmt(v / 1e9, 1)) for name, v in c.matmul_flops.items()]
    print(table(rows, " Hardware ceilings "))
    print(f"cache: {default_cache_path()}")
    return 0


BENCH_COMMANDS = {"serve": cmd_serve, "sweep": cmd_sweep, "compare": cmd_compare, "offline": cmd_offline,
                  "hardware": cmd_hardware}


def cmd_bench(args: argparse.Namespace) -> int:
    return BENCH_COMMANDS[args.bench_command](args)
