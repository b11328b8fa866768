"""Batch-1 decode and prefill, tokenmill beside llama.cpp's ``llama-bench`` on the same GGUF, with
this machine's measured ceilings (memory bandwidth, bfloat16 GEMM peak) beside them, in one run.

    python bench/peers/decode_prefill_peers.py [--model smollm2-135m-instruct] [--rounds 5] [--threads 2]
                                               [--decode-tokens 128] [--prefill-lens 256,2048] [--no-peer]
                                               [--quick] [--out bench/results/peers/decode-prefill-STAMP.json]

Four sections, every figure a median:

1. Memory bandwidth, numpy, float32 arrays. DRAM: an array of max(4 x L3, 256 MiB); cache: one of
   L3 / 4 (L3 from /sys/devices/system/cpu/cpu0/cache/index3/size, else lscpu; unknown: 256 MiB
   and 8 MiB, with a note). Read = bytes / time of ``arr.max()`` (a SIMD reduction that is not
   compute-bound, unlike ``sum``'s pairwise adds), on 1 thread and on --threads threads (numpy
   releases the GIL in its loops: one Python thread per chunk); copy = 2 x bytes / time of
   ``np.copyto`` (read + write). A timed call passes over the array until 256 MiB have been read
   (32 passes of an 8 MiB cache array). The read ceiling is the higher of the two read figures.
2. Batch-1 decode, interleaved by round: a tokenmill child process (``LLM(model)``, the default
   dtype: on CPU "auto" keeps a GGUF's quantized weights as stored, bfloat16 activations), then
   ``llama-bench``, never both at once. tokenmill: decode tok/s = (N - 1) / (time of N tokens - time
   of 1 token), two fresh random prompts of --prompt-len ids, greedy, EOS ignored, after a warm-up
   call. llama.cpp: ``llama-bench -m GGUF -t THREADS -r 1 -o json -p LENS -n N``, which runs the
   same tests as ``-p 0 -n N`` (tgN: N decodes from an empty context) and ``-p LENS -n 0`` (ppL),
   after its own warm-up. Ratio tokenmill / llama.cpp: the target is >= 1.3.
   Bytes per token: what one decode step reads, from the loaded modules: every linear layer's
   tensors as its CPU kernel multiplies by them (``fused_decode.linear_spec``: GGUF-native
   ``GroupedLinear`` packed codes + (scale, min), int8 / int4 codes + scales, packed bfloat16), the
   LM head included (a tied head: the embedding matrix), plus the KV cache at the decode's mean
   context (prompt + N / 2 tokens); norms and the one embedding row gathered are left out. For
   llama.cpp: its ``model_size`` (the GGUF's tensor bytes). Effective bandwidth = bytes/token x
   tok/s, as a fraction of the DRAM and of the L3 read ceilings; the regime is the weights' bytes
   against the L3 size (a VM's L3 is shared with its neighbours: a fit is optimistic).
3. Prefill: time to the first token (``max_tokens=1``) of one prompt of exactly L random token ids,
   for L in --prefill-lens, one child process per weight format and round, after a warm-up prompt
   of the longest length: GGUF native (as in 2), bfloat16 (``dtype="bfloat16"``: dequantized),
   int8 and int4 weight-only (``tokenmill quantize MODEL --method int8|int4 --quality-tokens 0``,
   made once into ~/.cache/tokenmill/bench/<model>-<method>, loaded with ``dtype="bfloat16"``: every
   variant has bfloat16 activations); llama.cpp's ppL beside them.
   GFLOP/s counts the linear layers only: 2 x (decoder-layer linear parameters x L + LM-head
   parameters x 1, the logits of the last token only) / seconds, the same count for llama.cpp;
   attention's QK^T and PV products are left out (at 2048 tokens they add about a third for SmolLM2).
4. bfloat16 peak: tokenmill's own GEMM, ``ops.bf16_packed_linear(x, ops.bf16_pack(w), N, torch.Tensor())``
   at M = K = N = 2048, 2 M N K / time, median of several calls, on --threads torch threads.

Random prompts are fresh for every timed call (never a prefix-cache hit). llama-bench is built by
bench/peers/build_llama_cpp.py into ~/.cache/tokenmill/peers; when it is not there the peer is
skipped with a message (--no-peer: tokenmill alone). --quick: 1 round, 32 decode tokens, prefill
256 only, quantized directories only when already cached. Prints one table per section; writes
JSON, markdown and a PNG under bench/results/peers/ (or beside --out).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

import numpy as np
from build_llama_cpp import CACHE, binaries

from tokenmill.benchmark.report import fmt, markdown_table, write_json

RESULTS = Path(__file__).resolve().parents[1] / "results" / "peers"
SYS_L3 = Path("/sys/devices/system/cpu/cpu0/cache/index3/size")
MiB = 1 << 20
VARIANTS = {"gguf": ("auto", "GGUF native (default dtype)"), "bf16": ("bfloat16", "bfloat16 (dequantized)"),
            "int8": ("bfloat16", "int8 weight-only"), "int4": ("bfloat16", "int4 weight-only, g32")}
"""name -> (dtype, label); int8 and int4 load a directory made by ``tokenmill quantize``, in bfloat16
like the others ("auto" would compute such a directory in float32 on CPU)."""
QUANTIZED = ("int8", "int4")
TARGET_RATIO = 1.3
"""tokenmill / llama.cpp batch-1 decode tok/s aimed at."""
RUN_TIMEOUT_S = 1800
"""The longest one tokenmill child or llama-bench call may take."""


class Skip(Exception):
    """This part cannot run here; the message says why."""


def median_seconds(fn: Callable[[], object], calls: int) -> float:
    """The median time of ``calls`` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# ---------------------------------------------------------------- 1. memory bandwidth, numpy


def l3_bytes() -> tuple[int | None, str]:
    """(L3 size in bytes, where it was read), or (None, why not)."""
    units = {"": 1, "K": 1 << 10, "M": MiB, "G": 1 << 30}
    try:
        size = re.fullmatch(r"(\d+)\s*([KMG]?)", SYS_L3.read_text().strip())
        if size:
            return int(size[1]) * units[size[2]], str(SYS_L3)
    except OSError:
        pass
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None, "no L3 size in sysfs and no lscpu"
    size = re.search(r"^L3 cache:\s*([\d.]+)\s*([KMG])i?B?", out, re.MULTILINE)
    if not size:
        return None, "neither sysfs nor lscpu gives an L3 size"
    return int(float(size[1]) * units[size[2]]), "lscpu"


def bandwidth(nbytes: int, threads: int, calls: int) -> dict:
    """GB/s over a float32 array of ``nbytes``: read (``max``) on 1 and ``threads`` threads, copy on ``threads``.

    A timed call passes over the array ``reps`` times (at least 256 MiB in all), each thread over
    its own chunk: a small array's passes would otherwise be as short as the thread pool's dispatch."""
    src = np.ones(nbytes // 4, dtype=np.float32)
    dst = np.empty_like(src)
    reps = -(-256 * MiB // src.nbytes)
    parts, outs = np.array_split(src, threads), np.array_split(dst, threads)

    def read(part: np.ndarray) -> None:
        for _ in range(reps):
            part.max()

    def copy(out: np.ndarray, part: np.ndarray) -> None:
        for _ in range(reps):
            np.copyto(out, part)

    with ThreadPoolExecutor(threads) as pool:
        read_1 = median_seconds(lambda: read(src), calls)
        read_n = median_seconds(lambda: list(pool.map(read, parts)), calls)
        copy_n = median_seconds(lambda: list(pool.map(copy, outs, parts)), calls)
    moved = reps * src.nbytes
    return {"bytes": src.nbytes, "passes_per_call": reps, "read_1_gbs": moved / read_1 / 1e9,
            "read_n_gbs": moved / read_n / 1e9, "copy_n_gbs": 2 * moved / copy_n / 1e9,
            "read_gbs": moved / min(read_1, read_n) / 1e9}


def measure_bandwidth(threads: int, calls: int) -> dict:
    l3, where = l3_bytes()
    dram = max(4 * l3, 256 * MiB) if l3 else 256 * MiB
    cache = l3 // 4 if l3 else 8 * MiB
    note = f"L3 {l3 / MiB:g} MiB ({where})" if l3 else f"L3 unknown ({where}): 256 MiB and 8 MiB arrays"
    print(f"== memory bandwidth: {note}", flush=True)
    return {"l3_bytes": l3, "l3_note": note, "threads": threads,
            "dram": bandwidth(dram, threads, calls), "cache": bandwidth(cache, threads, calls)}


# ---------------------------------------------------------------- 4. bfloat16 GEMM peak


def bf16_peak(threads: int, calls: int, n: int = 2048) -> dict:
    import torch

    from tokenmill.kernels.dispatch import cpu_ops

    ops = cpu_ops()
    if ops is None or not ops.bf16_linear_fast():
        return {"skipped": "tokenmill's bfloat16 CPU kernel is not available here"}
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, n, generator=gen).bfloat16()
    packed = ops.bf16_pack(torch.randn(n, n, generator=gen).bfloat16())
    no_bias = torch.Tensor()
    seconds = median_seconds(lambda: ops.bf16_packed_linear(x, packed, n, no_bias), calls)
    return {"m": n, "k": n, "n": n, "threads": threads, "gflops": 2 * n ** 3 / seconds / 1e9}


# ---------------------------------------------------------------- tokenmill, one child process per run


def step_cost(llm) -> dict:
    """What the loaded model's linears hold, as the CPU kernels read them, and the KV bytes per token."""
    from torch import nn

    from tokenmill.attention.kv_cache import PagedKVCache
    from tokenmill.kernels.dispatch import cpu_ops
    from tokenmill.models.fused_decode import linear_spec
    from tokenmill.quantization.linear import QuantizedLinear

    model, cache, cfg = llm.engine.runner.model, llm.engine.runner.cache, llm.model_config
    ops = cpu_ops()
    cost = {"layer_bytes": 0, "layer_params": 0, "head_bytes": 0, "head_params": 0}
    kinds: Counter[str] = Counter()
    for module in model.modules():
        if not isinstance(module, (nn.Linear, QuantizedLinear)):
            continue
        spec = linear_spec(module, ops) if ops is not None else None
        tensors = ([spec.weight, spec.scales, spec.bias] if spec is not None
                   else [*module.parameters(recurse=False), *module.buffers(recurse=False)])
        part = "head" if module is model.lm_head else "layer"
        cost[f"{part}_bytes"] += sum(t.nbytes for t in tensors if t is not None)
        cost[f"{part}_params"] += module.in_features * module.out_features
        kinds[spec.kind.name if spec is not None else type(module).__name__] += 1
    if model.lm_head is None:  # tied: the logits multiply by the embedding matrix
        cost["head_bytes"], cost["head_params"] = model.embed.weight.nbytes, model.embed.weight.numel()
        kinds["tied embedding"] += 1
    cost["kv_bytes_per_token"] = PagedKVCache.bytes_per_block(1, cfg.num_kv_heads, cfg.head_dim, cache.dtype,
                                                              cfg.num_layers)
    cost["kinds"] = dict(kinds)
    cost["dtype"] = str(llm.dtype).removeprefix("torch.")
    cost["kv_dtype"] = str(cache.dtype).removeprefix("torch.")
    return cost


def child(task: dict) -> dict:
    """One tokenmill run (in its own process): load, warm up, decode and / or prefill timings."""
    import torch

    from tokenmill import LLM, SamplingParams

    torch.set_num_threads(task["threads"])
    start = time.perf_counter()
    llm = LLM(task["model"], dtype=task["dtype"], device="cpu")
    result = {"load_s": time.perf_counter() - start, "cost": step_cost(llm)}
    rng = np.random.default_rng(task["seed"])

    def prompt(length: int) -> list[int]:  # fresh ids every call: never a prefix-cache hit
        return rng.integers(100, llm.model_config.vocab_size, size=length).tolist()

    def timed(ids: list[int], tokens: int) -> float:
        params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0)
        start = time.perf_counter()
        out = llm.generate([ids], params)
        took = time.perf_counter() - start
        assert len(out[0].outputs[0].token_ids) == tokens
        return took

    timed(prompt(task["prompt_len"]), 2)  # warm-up: first-call allocations, packed copies
    if n := task["decode_tokens"]:
        one, many = timed(prompt(task["prompt_len"]), 1), timed(prompt(task["prompt_len"]), n)
        result["decode_tok_s"] = (n - 1) / (many - one)
    if task["prefill"]:
        timed(prompt(max(task["prefill"])), 1)  # warm-up at the longest prompt
        result["ttft_s"] = {str(length): timed(prompt(length), 1) for length in task["prefill"]}
    return result


def run_child(task: dict) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(task["threads"])}
    proc = _run([sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(task)], env=env)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    """``cmd``'s output; RuntimeError when it fails or runs past RUN_TIMEOUT_S."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, **kwargs)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{Path(cmd[0]).name} ran past {RUN_TIMEOUT_S} s") from None
    if proc.returncode != 0:
        raise RuntimeError(f"{Path(cmd[0]).name} exit code {proc.returncode}: {proc.stderr.strip()[-2000:]}")
    return proc


def quantized_dir(model: str, name: str, method: str, make: bool) -> Path:
    """``tokenmill quantize``'s directory for ``method``, made once (into a scratch name, then renamed)."""
    from tokenmill.paths import default_cache_dir

    out = default_cache_dir() / "bench" / f"{name}-{method}"
    if (out / "config.json").is_file():
        return out
    if not make:
        raise Skip(f"{out} is not cached (--quick does not make it)")
    scratch = out.with_name(out.name + ".partial")
    shutil.rmtree(scratch, ignore_errors=True)
    print(f"quantizing {model} to {method} in {out} (once)", flush=True)
    cmd = [sys.executable, "-m", "tokenmill", "quantize", model, "--method", method, "--out", str(scratch),
           "--quality-tokens", "0"]
    if subprocess.run(cmd).returncode != 0:
        raise Skip(f"tokenmill quantize --method {method} failed (see above)")
    scratch.rename(out)
    return out


# ---------------------------------------------------------------- llama.cpp


def llama_bench(binary: Path, gguf: Path, threads: int, prefill: list[int], decode_tokens: int) -> dict:
    """{"tgN" / "ppL": {"tok_s", "model_size"}} of one ``llama-bench -r 1`` run (after its warm-up)."""
    cmd = [str(binary), "-m", str(gguf), "-t", str(threads), "-r", "1", "-o", "json",
           "-p", ",".join(map(str, prefill)) or "0", "-n", str(decode_tokens)]
    tests = {}
    for entry in json.loads(_run(cmd).stdout):
        test = f"pp{entry['n_prompt']}" if entry["n_prompt"] else f"tg{entry['n_gen']}"
        tests[test] = {"tok_s": entry["avg_ts"], "model_size": entry["model_size"]}
    return tests


# ---------------------------------------------------------------- the rounds


def run_rounds(args, gguf: Path, sources: dict[str, Path], bench_binary: Path | None) -> dict:
    """Per engine / variant, a list of per-round results (or {"failed": why})."""
    runs: dict[str, list[dict]] = {name: [] for name in [*sources, *(["llama.cpp"] if bench_binary else [])]}
    for r in range(args.rounds):
        for name, path in sources.items():
            task = {"model": str(path), "dtype": VARIANTS[name][0], "threads": args.threads, "seed": args.seed + r,
                    "prompt_len": args.prompt_len, "decode_tokens": args.decode_tokens if name == "gguf" else 0,
                    "prefill": args.prefill}
            print(f"round {r + 1}/{args.rounds}: tokenmill {name}", flush=True)
            runs[name].append(_attempt(run_child, task))
            if name == "gguf" and bench_binary:  # the peer right after tokenmill's decode run
                print(f"round {r + 1}/{args.rounds}: llama-bench", flush=True)
                runs["llama.cpp"].append(_attempt(llama_bench, bench_binary, gguf, args.threads, args.prefill,
                                                  args.decode_tokens))
    return runs


def _attempt(fn: Callable[..., dict], *fn_args) -> dict:
    try:
        result = fn(*fn_args)
    except Exception as exc:  # noqa: BLE001 (one failed run must not lose the others' numbers)
        print(f"  failed: {type(exc).__name__}: {exc}", flush=True)
        return {"failed": f"{type(exc).__name__}: {exc}"}
    shown = {k: v for k, v in result.items() if k in ("decode_tok_s", "ttft_s", "load_s")} or result
    print(f"  {json.dumps(shown)}", flush=True)
    return result


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _weight_bytes(cost: dict | None) -> int | None:
    return cost and cost["layer_bytes"] + cost["head_bytes"]


def decode_rows(args, ok: dict[str, list[dict]], cost: dict | None, bandwidth: dict) -> list[dict]:
    """Each engine's median decode tok/s, the bytes a step reads and the bandwidth that makes."""
    tg, context = f"tg{args.decode_tokens}", args.prompt_len + args.decode_tokens / 2
    measured = []
    if "gguf" in ok:
        per_token = cost and _weight_bytes(cost) + cost["kv_bytes_per_token"] * context
        measured.append(("tokenmill", [r["decode_tok_s"] for r in ok["gguf"]], _weight_bytes(cost), per_token))
    if "llama.cpp" in ok:
        tests = [r[tg] for r in ok["llama.cpp"] if tg in r]
        size = tests[0]["model_size"] if tests else None
        measured.append(("llama.cpp", [t["tok_s"] for t in tests], size, size))
    rows = []
    for engine, values, weights, per_token in measured:
        tok_s = _median(values)
        effective = per_token * tok_s / 1e9 if per_token and tok_s else None
        rows.append({"engine": engine, "tok_s": tok_s, "runs": values, "weight_bytes": weights,
                     "bytes_per_token": per_token, "effective_gbs": effective,
                     "of_dram": _ratio(effective, bandwidth["dram"]["read_gbs"]),
                     "of_cache": _ratio(effective, bandwidth["cache"]["read_gbs"])})
    return rows


def prefill_rows(args, ok: dict[str, list[dict]], cost: dict | None, peak_gflops: float | None) -> list[dict]:
    """Each variant's median prefill tok/s per prompt length, its GFLOP/s and its ratio to llama.cpp's."""
    rows = []
    for name, results in ok.items():
        for length in args.prefill:
            if name == "llama.cpp":
                tests = [r[f"pp{length}"] for r in results if f"pp{length}" in r]
                values, ttft = [t["tok_s"] for t in tests], None
                weights = tests[0]["model_size"] if tests else None
            else:
                seconds = [r["ttft_s"][str(length)] for r in results]
                values, ttft = [length / s for s in seconds], _median(seconds)
                weights = _weight_bytes(results[0]["cost"]) if results else None
            tok_s = _median(values)
            flops = cost and 2 * (cost["layer_params"] * length + cost["head_params"])
            gflops = flops * tok_s / length / 1e9 if flops and tok_s else None
            rows.append({"engine": name, "tokens": length, "ttft_s": ttft, "tok_s": tok_s, "runs": values,
                         "weight_bytes": weights, "gflops": gflops, "of_peak": _ratio(gflops, peak_gflops)})
    peer = {r["tokens"]: r["tok_s"] for r in rows if r["engine"] == "llama.cpp"}
    for row in rows:
        row["vs_llama_cpp"] = None if row["engine"] == "llama.cpp" else _ratio(row["tok_s"], peer.get(row["tokens"]))
    return rows


def summarize(args, runs: dict[str, list[dict]], skipped: dict[str, str], ceilings: dict) -> dict:
    """Medians over the rounds, and what they mean against the ceilings."""
    ok = {name: [r for r in results if "failed" not in r] for name, results in runs.items()}
    cost = next((r["cost"] for r in ok.get("gguf", [])), None)
    decode = decode_rows(args, ok, cost, ceilings["bandwidth"])
    tok_s = {d["engine"]: d["tok_s"] for d in decode}
    weights, l3 = _weight_bytes(cost), ceilings["bandwidth"]["l3_bytes"]
    regime = None
    if weights and l3:
        regime = "fit in L3 (cache regime)" if weights <= l3 else "exceed L3 (DRAM regime)"
    return {"decode": decode, "decode_ratio": _ratio(tok_s.get("tokenmill"), tok_s.get("llama.cpp")),
            "target_ratio": TARGET_RATIO, "decode_context_tokens": args.prompt_len + args.decode_tokens / 2,
            "prefill": prefill_rows(args, ok, cost, ceilings["bf16_peak"].get("gflops")), "regime": regime,
            "skipped": skipped, "tokenmill_cost": cost}


# ---------------------------------------------------------------- report


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _mb(value: float | None) -> str:
    return "-" if value is None else f"{value / 1e6:,.1f}"


def _times(ratio: float | None) -> str:
    return "-" if ratio is None else f"x{ratio:.2f}"


def bandwidth_table(args, bw: dict) -> str:
    n = bw["threads"]
    rows = [[regime, f"{bw[key]['bytes'] / MiB:,.0f}", fmt(bw[key]["read_1_gbs"], 1), fmt(bw[key]["read_n_gbs"], 1),
             fmt(bw[key]["copy_n_gbs"], 1), fmt(bw[key]["read_gbs"], 1)]
            for regime, key in (("DRAM (>= 4 x L3)", "dram"), ("cache (L3 / 4)", "cache"))]
    header = ["regime", "array MiB", "read GB/s, 1 thread", f"read GB/s, {n} threads",
              f"copy GB/s, {n} threads (r + w)", "read ceiling GB/s"]
    return (f"Memory bandwidth: numpy, float32, {bw['l3_note']}, median of {args.bw_calls} calls\n"
            + markdown_table(header, rows))


def peak_line(args, peak: dict) -> str:
    if "skipped" in peak:
        return f"bfloat16 peak: skipped ({peak['skipped']})"
    return (f"bfloat16 peak: {peak['gflops']:,.1f} GFLOP/s (tokenmill's bf16_packed_linear, M = K = N = {peak['m']}, "
            f"{peak['threads']} threads, median of {args.peak_calls} calls)")


def decode_table(args, summary: dict) -> str:
    rows = [[d["engine"], fmt(d["tok_s"], 1), str(len(d["runs"])), _mb(d["weight_bytes"]), _mb(d["bytes_per_token"]),
             fmt(d["effective_gbs"], 1), _pct(d["of_dram"]), _pct(d["of_cache"])] for d in summary["decode"]]
    header = ["engine", "tok/s", "rounds", "weights MB", "MB read / token", "effective GB/s", "of DRAM read",
              "of L3 read"]
    ratio = summary["decode_ratio"]
    verdict = "" if ratio is None else f" ({'meets' if ratio >= TARGET_RATIO else 'below'} the x{TARGET_RATIO} target)"
    return (f"Batch-1 decode: {args.decode_tokens} tokens after a {args.prompt_len}-token prompt, {args.threads} threads, "
            f"KV read at {summary['decode_context_tokens']:g} tokens, median of {args.rounds} round(s)\n"
            + markdown_table(header, rows)
            + f"\ntokenmill / llama.cpp: {_times(ratio)}{verdict}; tokenmill's linear weights {summary['regime'] or '-'}")


def prefill_table(args, summary: dict) -> str:
    labels = {**{k: f"tokenmill {label}" for k, (_, label) in VARIANTS.items()}, "llama.cpp": "llama.cpp llama-bench"}
    rows = [[labels[p["engine"]], str(p["tokens"]), fmt(p["ttft_s"] and 1e3 * p["ttft_s"], 1), fmt(p["tok_s"], 1),
             _mb(p["weight_bytes"]), fmt(p["gflops"], 1), _pct(p["of_peak"]), _times(p["vs_llama_cpp"])]
            for p in summary["prefill"]]
    header = ["engine", "tokens", "TTFT ms", "tok/s", "weights MB", "GFLOP/s (linears)", "of bf16 peak",
              "vs llama.cpp"]
    return (f"Prefill: one prompt of random ids, time to first token, median of {args.rounds} round(s)\n"
            + markdown_table(header, rows))


def report(args, ceilings: dict, summary: dict) -> str:
    sections = [bandwidth_table(args, ceilings["bandwidth"]), peak_line(args, ceilings["bf16_peak"]),
                decode_table(args, summary), prefill_table(args, summary)]
    if summary["skipped"]:
        sections.append("\n".join(f"- {name} skipped: {why}" for name, why in summary["skipped"].items()))
    return "\n\n".join(sections)


def plot(ceilings: dict, summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    decode = [d for d in summary["decode"] if d["tok_s"]]
    ax = axes[0]
    ax.bar([d["engine"] for d in decode], [d["tok_s"] for d in decode], color=[f"C{i}" for i in range(len(decode))])
    for i, d in enumerate(decode):
        ax.scatter([i] * len(d["runs"]), d["runs"], color="k", s=10, zorder=3)
    ax.set(ylabel="tok/s", title="batch-1 decode (dots: rounds)")

    ax = axes[1]
    engines = list(dict.fromkeys(p["engine"] for p in summary["prefill"]))
    lengths = sorted({p["tokens"] for p in summary["prefill"]})
    width = 0.8 / max(len(engines), 1)
    for i, engine in enumerate(engines):
        ys = [next((p["tok_s"] or 0 for p in summary["prefill"] if p["engine"] == engine and p["tokens"] == t), 0)
              for t in lengths]
        ax.bar([j + i * width for j in range(len(lengths))], ys, width, label=engine)
    ax.set_xticks([j + width * (len(engines) - 1) / 2 for j in range(len(lengths))], [str(t) for t in lengths])
    ax.set(xlabel="prompt tokens", ylabel="tok/s", title="prefill")
    ax.legend(fontsize=8)

    ax = axes[2]
    bw = ceilings["bandwidth"]
    bars = [("DRAM read", bw["dram"]["read_gbs"]), ("L3 read", bw["cache"]["read_gbs"])]
    bars += [(f"{d['engine']} decode", d["effective_gbs"]) for d in decode if d["effective_gbs"]]
    ax.barh([b[0] for b in bars], [b[1] for b in bars], color=[f"C{i}" for i in range(len(bars))])
    ax.set(xlabel="GB/s", title="bandwidth: ceilings and decode's effective")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a GGUF model name or file")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 5; --quick: 1)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads for tokenmill, llama-bench -t")
    parser.add_argument("--decode-tokens", type=int, default=None, help="N (default 128; --quick: 32)")
    parser.add_argument("--prompt-len", type=int, default=16, help="the decode runs' prompt tokens")
    parser.add_argument("--prefill-lens", default=None, help="comma-separated (default 256,2048; --quick: 256)")
    parser.add_argument("--bw-calls", type=int, default=9, help="timed calls per bandwidth figure")
    parser.add_argument("--peak-calls", type=int, default=5, help="timed calls of the bfloat16 GEMM")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-peer", dest="peer", action="store_false", help="tokenmill alone, no llama-bench")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 round, 32 tokens, prefill 256")
    parser.add_argument("--out", type=Path, default=None, help="the JSON path; markdown and PNG beside it")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    args.rounds = args.rounds or (1 if args.quick else 5)
    args.decode_tokens = args.decode_tokens or (32 if args.quick else 128)
    args.prefill = [int(x) for x in (args.prefill_lens or ("256" if args.quick else "256,2048")).split(",") if x]
    if args.decode_tokens < 2 or args.rounds < 1:
        parser.error("--decode-tokens must be at least 2 and --rounds at least 1")

    from tokenmill.benchmark.hardware import device_key
    from tokenmill.loading.sources import resolve_model

    source = resolve_model(args.model)
    if source.format != "gguf":
        parser.error(f"{args.model} is not a GGUF model: both engines must load the same GGUF file")
    gguf = source.path
    skipped: dict[str, str] = {}
    bench_binary = None
    if not args.peer:
        skipped["llama.cpp"] = "--no-peer"
    elif not (bench_binary := binaries().get("llama-bench")):
        skipped["llama.cpp"] = (f"llama-bench is not built in {CACHE} (python bench/peers/build_llama_cpp.py; "
                                "it may be building now)")
    if "llama.cpp" in skipped:
        print(f"llama.cpp skipped: {skipped['llama.cpp']}", flush=True)
    sources = {"gguf": gguf, "bf16": gguf}
    for method in QUANTIZED:
        try:
            sources[method] = quantized_dir(args.model, source.name, method, make=not args.quick)
        except Skip as exc:
            print(f"{method} skipped: {exc}", flush=True)
            skipped[method] = str(exc)

    import torch

    torch.set_num_threads(args.threads)
    ceilings = {"device": device_key(torch.device("cpu")), "bandwidth": measure_bandwidth(args.threads, args.bw_calls)}
    print("== bfloat16 GEMM peak", flush=True)
    ceilings["bf16_peak"] = bf16_peak(args.threads, args.peak_calls)
    print(f"== {args.rounds} round(s) on {gguf.name}", flush=True)
    runs = run_rounds(args, gguf, sources, bench_binary)
    summary = summarize(args, runs, skipped, ceilings)

    text = report(args, ceilings, summary)
    print(f"\n{text}")
    out = args.out or RESULTS / f"decode-prefill-{datetime.now():%Y%m%d-%H%M%S}.json"
    write_json({"kind": "decode_prefill_peers", "args": {k: str(v) if isinstance(v, Path) else v
                                                         for k, v in vars(args).items() if k != "child"},
                "gguf": str(gguf), "ceilings": ceilings, "summary": summary, "runs": runs}, out)
    out.with_suffix(".md").write_text(f"# Decode and prefill beside llama.cpp\n\n`{gguf.name}`, {ceilings['device']}"
                                      f"\n\n{text}\n\n![decode and prefill]({out.with_suffix('.png').name})\n")
    plot(ceilings, summary, out.with_suffix(".png"))
    print(f"wrote {out} and its .md and .png")


if __name__ == "__main__":
    main()
