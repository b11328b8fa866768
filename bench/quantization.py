"""Quantization methods on one model: size on disk, batch-1 decode tok/s, output tok/s at 16
concurrent requests, KV cache capacity and perplexity, one run; the peers at the same bit width
(llama.cpp's llama-bench on the shipped Q4_1 file, CTranslate2 int8) measured in the same run.

    python bench/quantization.py [--model smollm2-135m-instruct] [--ppl-tokens 8192] [--repeats 3]
                                 [--methods ...] [--peers llama.cpp ct2]

Rows: the bfloat16 baseline (the checkpoint as loaded, saved as bfloat16 safetensors), each weight
method quantized from the float32 weights and saved with save_quantized, and the KV cache methods
(``kv-int8``, ``kv-fp8``: bfloat16 weights, the KV cache stored quantized). Size: the saved
model.safetensors. Decode: (time for 1 + N tokens - time for 1 token) / N, greedy, EOS ignored,
LLM loaded from the saved directory, median of --repeats. Concurrent: 16 requests of 128 prompt
tokens and 128 output tokens submitted together, output tokens / wall time. KV tokens: what a
64 MiB KV budget holds. Perplexity: the first --ppl-tokens tokens of the Shakespeare corpus
(tokenmill.eval.corpus), windows of 512 tokens every 256 (through the quantized KV cache for the
kv rows). Prints a table and writes bench/results/quantization.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from tokenmill import LLM, SamplingParams
from tokenmill.eval.corpus import read_tokens
from tokenmill.eval.corpus import fetch_corpus
from tokenmill.eval.perplexity import perplexity
from tokenmill.loader import load_model
from tokenmill.loading.sources import resolve_model
from tokenmill.quantization import (
    Int4GPTQConfig, Int4WeightOnlyConfig, Int8WeightOnlyConfig, W8A8Config, quantize, save_quantized)
from tokenmill.quantization.checkpoint import save_tokenizer

RESULTS = Path(__file__).parent / "results"
METHODS = {"int8": Int8WeightOnlyConfig(), "int4-g32": Int4WeightOnlyConfig(group_size=32),
           "int4-g64": Int4WeightOnlyConfig(group_size=64), "int4-g128": Int4WeightOnlyConfig(group_size=128),
           "int4-gptq-g64": Int4GPTQConfig(group_size=64), "int4-gptq-g128": Int4GPTQConfig(group_size=128),
           "w8a8": W8A8Config(), "w8a8-static": W8A8Config(activation="static")}
KV_METHODS = {"kv-int8": "int8", "kv-fp8": "fp8"}
DEFAULT_METHODS = ["int8", "int4-g32", "int4-g64", "int4-g128", "int4-gptq-g64", "int4-gptq-g128", "w8a8",
                   "w8a8-static", "kv-int8", "kv-fp8"]
KV_BUDGET = 64 << 20
CONCURRENT, CONCURRENT_PROMPT, CONCURRENT_OUTPUT = 16, 128, 128


def decode_tok_s(llm: LLM, new_tokens: int, repeats: int) -> tuple[float, list[float]]:
    ids = llm.tokenizer.encode("Once upon a time")

    def run(n: int) -> float:
        start = time.perf_counter()
        out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == n
        return time.perf_counter() - start

    run(2)  # warm-up
    runs = [new_tokens / max(run(1 + new_tokens) - run(1), 1e-9) for _ in range(repeats)]
    return statistics.median(runs), runs


def concurrent_tok_s(llm: LLM) -> float:
    """Output tok/s of CONCURRENT requests submitted together (random prompt ids, EOS ignored)."""
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, llm.model_config.vocab_size, (CONCURRENT, CONCURRENT_PROMPT), generator=g).tolist()
    params = SamplingParams(temperature=0, max_tokens=CONCURRENT_OUTPUT, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))  # warm-up
    start = time.perf_counter()
    llm.generate(prompts, params)
    return CONCURRENT * CONCURRENT_OUTPUT / (time.perf_counter() - start)


def save_baseline(model_arg: str, out: Path) -> Path:
    from safetensors.torch import save_file

    loaded = load_model(model_arg, torch.bfloat16, "cpu")
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in loaded.model.state_dict().items()}, str(out / "model.safetensors"))
    save_tokenizer(loaded.tokenizer, out)
    return out / "model.safetensors"


def measure(name: str, model_dir: str, weights: Path, ids_text: Path, args: argparse.Namespace,
            kv_cache_dtype: str = "auto") -> dict:
    llm = LLM(model_dir, dtype="bfloat16", device="cpu", kv_cache_dtype=kv_cache_dtype, kv_cache_memory=KV_BUDGET,
              max_num_seqs=CONCURRENT)
    decode, runs = decode_tok_s(llm, args.decode_tokens, args.repeats)
    concurrent = concurrent_tok_s(llm)
    kv_tokens = llm.engine.kv_capacity_tokens
    del llm
    loaded = load_model(model_dir, torch.bfloat16, "cpu")
    ids = read_tokens(loaded.tokenizer, ids_text, args.ppl_tokens)
    ppl = perplexity(loaded.model, ids, context=512, stride=256, kv_cache_dtype=kv_cache_dtype)
    row = {"method": name, "size_mb": weights.stat().st_size / 1e6, "decode_tok_s": decode, "decode_runs": runs,
           "concurrent_tok_s": concurrent, "kv_tokens": kv_tokens, "kv_cache_dtype": kv_cache_dtype,
           "perplexity": ppl.perplexity, "ppl_tokens": ppl.tokens}
    print(f"{name:14s} {row['size_mb']:8.1f} MB  decode {decode:6.1f} tok/s  x{CONCURRENT} {concurrent:6.1f} tok/s  "
          f"KV {kv_tokens} tokens  perplexity {ppl.perplexity:.3f}", flush=True)
    return row


def llama_bench_tg128(gguf: Path, threads: int, repeats: int) -> float:
    """llama.cpp's own batch-1 decode figure (llama-bench tg128) on the GGUF file as shipped."""
    import subprocess
    import sys

    sys.path.insert(0, str(Path(__file__).parent / "peers"))
    from build_llama_cpp import binaries

    found = binaries()
    if not found:
        raise RuntimeError("llama.cpp is not built: python bench/peers/build_llama_cpp.py")
    out = subprocess.run([str(found["llama-bench"]), "-m", str(gguf), "-t", str(threads), "-p", "0", "-n", "128",
                          "-r", str(repeats), "-o", "json"], capture_output=True, text=True, check=True).stdout
    return float(json.loads(out)[0]["avg_ts"])


def ct2_decode(model: str, threads: int, new_tokens: int, repeats: int) -> float:
    """CTranslate2 int8 batch-1 decode tok/s, timed like ours (see bench/peers/offline_peers.py)."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent / "peers"))
    import offline_peers

    args = argparse.Namespace(install=False, threads=threads)
    gguf = offline_peers.gguf_path(model)
    generate = offline_peers.ct2_engine(args, gguf, offline_peers.export_hf(gguf))
    prompt = [[1, 2, 3, 4]]
    generate(prompt, 2)

    def run(n: int) -> float:
        start = time.perf_counter()
        generate(prompt, n)
        return time.perf_counter() - start

    return statistics.median(new_tokens / max(run(1 + new_tokens) - run(1), 1e-9) for _ in range(repeats))


def peers(args: argparse.Namespace, source) -> list[dict]:
    rows = []
    for peer in args.peers:
        try:
            if peer == "llama.cpp":
                tok_s = llama_bench_tg128(source.path, torch.get_num_threads(), args.repeats)
                rows.append({"peer": "llama.cpp llama-bench tg128", "bits": "Q4_1 (4-bit)", "decode_tok_s": tok_s})
            else:
                tok_s = ct2_decode(args.model, torch.get_num_threads(), args.decode_tokens, args.repeats)
                rows.append({"peer": "CTranslate2", "bits": "int8", "decode_tok_s": tok_s})
        except Exception as exc:  # noqa: BLE001 (a peer that cannot run here is reported, not fatal)
            rows.append({"peer": peer, "skipped": f"{type(exc).__name__}: {exc}"})
        print(f"peer {rows[-1]}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--methods", nargs="+", default=DEFAULT_METHODS, choices=list(METHODS) + list(KV_METHODS),
                        help=f"default {' '.join(DEFAULT_METHODS)}")
    parser.add_argument("--peers", nargs="*", default=["llama.cpp", "ct2"], choices=["llama.cpp", "ct2"])
    parser.add_argument("--ppl-tokens", type=int, default=8192)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    corpus = fetch_corpus()
    source = resolve_model(args.model)
    results = {"model": source.name, "file": str(source.path), "threads": torch.get_num_threads(),
               "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
               "corpus": str(corpus), "ppl_tokens": args.ppl_tokens, "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        weights = save_baseline(args.model, Path(tmp) / "bf16")
        # the baseline runs from the original checkpoint; its size is that of its bfloat16 weights
        results["rows"].append(measure("bf16", args.model, weights, corpus, args))
        for name in args.methods:
            if name in KV_METHODS:
                results["rows"].append(measure(name, args.model, weights, corpus, args, KV_METHODS[name]))
                continue
            out = save_quantized(quantize(args.model, METHODS[name], dtype="bfloat16", progress=False),
                                 Path(tmp) / name)
            results["rows"].append(measure(name, str(out), out / "model.safetensors", corpus, args))
    results["peers"] = peers(args, source)
    _report(results)


def _report(results: dict) -> None:
    base = results["rows"][0]
    print(f"\n{results['model']}, {results['threads']} threads, perplexity on {results['ppl_tokens']} tokens")
    print(f"{'method':14s} {'size MB':>8s} {'decode tok/s':>12s} {'x bf16':>7s} {'x16 tok/s':>9s} {'KV tokens':>9s} "
          f"{'perplexity':>10s} {'vs bf16':>8s}")
    for r in results["rows"]:
        r["decode_vs_bf16"] = r["decode_tok_s"] / base["decode_tok_s"]
        r["ppl_change"] = r["perplexity"] / base["perplexity"] - 1
        r["kv_tokens_vs_bf16"] = r["kv_tokens"] / base["kv_tokens"]
        print(f"{r['method']:14s} {r['size_mb']:8.1f} {r['decode_tok_s']:12.1f} {r['decode_vs_bf16']:7.2f} "
              f"{r['concurrent_tok_s']:9.1f} {r['kv_tokens']:9d} {r['perplexity']:10.3f} {100 * r['ppl_change']:+7.2f}%")
    for p in results.get("peers", []):
        print(f"peer {p['peer']:28s} " + (f"{p['bits']:14s} decode {p['decode_tok_s']:6.1f} tok/s"
                                         if "skipped" not in p else f"skipped: {p['skipped']}"))
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "quantization.json"
    out.write_text(json.dumps(results, indent=2))
    _plot(results, RESULTS / "quantization.png")
    print(f"wrote {out} and quantization.png")


def _plot(results: dict, path: Path) -> None:
    """Speed against quality: batch-1 decode and 16-concurrent tok/s vs change in perplexity."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, title in ((axes[0], "decode_tok_s", "batch-1 decode"),
                           (axes[1], "concurrent_tok_s", f"{CONCURRENT} concurrent requests")):
        for i, r in enumerate(results["rows"]):
            ax.scatter(100 * r["ppl_change"], r[key], color=f"C{i % 10}")
            ax.annotate(r["method"], (100 * r["ppl_change"], r[key]), fontsize=8, xytext=(3, 3),
                        textcoords="offset points")
        if key == "decode_tok_s":
            for p in results.get("peers", []):
                if "skipped" not in p:
                    ax.axhline(p["decode_tok_s"], ls="--", lw=1, color="gray")
                    ax.annotate(f"{p['peer']} ({p['bits']})", (0, p["decode_tok_s"]), fontsize=7, color="gray")
        ax.set(xlabel="perplexity change vs bf16 (%)", ylabel="output tok/s", title=title)
    fig.suptitle(f"{results['model']}: quantization, speed vs quality")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
