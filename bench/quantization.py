"""Quantization methods on one model: size on disk, batch-1 decode tok/s and perplexity, one run.

    python bench/quantization.py [--model smollm2-135m-instruct] [--ppl-tokens 8192] [--repeats 3]

Rows: the bfloat16 baseline (the checkpoint as loaded, saved as bfloat16 safetensors) and each
method quantized from the float32 weights and saved with save_quantized. Size: the saved
model.safetensors. Decode: (time for 1 + N tokens - time for 1 token) / N, greedy, EOS
ignored, LLM loaded from the saved directory, median of --repeats. Perplexity: the first
--ppl-tokens tokens of the Shakespeare corpus (tokenmill.eval.corpus), windows of 512 tokens
every 256. Prints a table and writes bench/results/quantization.json.
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
from tokenmill.attention.paged import PagedAttentionBackend
from tokenmill.eval.commands import read_tokens
from tokenmill.eval.corpus import fetch_corpus
from tokenmill.eval.perplexity import perplexity
from tokenmill.loading.model_loader import load_model
from tokenmill.loading.sources import resolve_model
from tokenmill.quantization import (
    Int4GPTQConfig, Int4WeightOnlyConfig, Int8WeightOnlyConfig, quantize, save_quantized)
from tokenmill.quantization.checkpoint import save_tokenizer

RESULTS = Path(__file__).parent / "results"
METHODS = {"int8": Int8WeightOnlyConfig(), "int4-g32": Int4WeightOnlyConfig(group_size=32),
           "int4-g64": Int4WeightOnlyConfig(group_size=64), "int4-g128": Int4WeightOnlyConfig(group_size=128),
           "int4-gptq-g64": Int4GPTQConfig(group_size=64), "int4-gptq-g128": Int4GPTQConfig(group_size=128)}
DEFAULT_METHODS = ["int8", "int4-g32", "int4-g64", "int4-g128"]


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


def save_baseline(model_arg: str, out: Path) -> Path:
    from safetensors.torch import save_file

    loaded = load_model(resolve_model(model_arg), PagedAttentionBackend(), torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in loaded.model.state_dict().items()}, str(out / "model.safetensors"))
    save_tokenizer(loaded.tokenizer, out)
    return out / "model.safetensors"


def measure(name: str, model_dir: str, weights: Path, ids_text: Path, args: argparse.Namespace) -> dict:
    llm = LLM(model_dir, dtype="bfloat16", device="cpu")
    decode, runs = decode_tok_s(llm, args.decode_tokens, args.repeats)
    del llm
    loaded = load_model(resolve_model(model_dir), PagedAttentionBackend(), torch.bfloat16)
    ids = read_tokens(loaded.tokenizer, ids_text, args.ppl_tokens)
    ppl = perplexity(loaded.model, ids, context=512, stride=256)
    row = {"method": name, "size_mb": weights.stat().st_size / 1e6, "decode_tok_s": decode, "decode_runs": runs,
           "perplexity": ppl.perplexity, "ppl_tokens": ppl.tokens}
    print(f"{name:10s} {row['size_mb']:8.1f} MB  decode {decode:6.1f} tok/s  perplexity {ppl.perplexity:.3f}",
          flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--methods", nargs="+", default=DEFAULT_METHODS, choices=list(METHODS),
                        help=f"default {' '.join(DEFAULT_METHODS)}; the GPTQ rows calibrate (minutes more)")
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
            out = save_quantized(quantize(args.model, METHODS[name], dtype="bfloat16", progress=False),
                                 Path(tmp) / name)
            results["rows"].append(measure(name, str(out), out / "model.safetensors", corpus, args))
    _report(results)


def _report(results: dict) -> None:
    base = results["rows"][0]
    print(f"\n{results['model']}, {results['threads']} threads, perplexity on {results['ppl_tokens']} tokens")
    print(f"{'method':10s} {'size MB':>8s} {'decode tok/s':>12s} {'x bf16':>7s} {'perplexity':>10s} {'vs bf16':>8s}")
    for r in results["rows"]:
        r["decode_vs_bf16"] = r["decode_tok_s"] / base["decode_tok_s"]
        r["ppl_change"] = r["perplexity"] / base["perplexity"] - 1
        print(f"{r['method']:10s} {r['size_mb']:8.1f} {r['decode_tok_s']:12.1f} {r['decode_vs_bf16']:7.2f} "
              f"{r['perplexity']:10.3f} {100 * r['ppl_change']:+7.2f}%")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "quantization.json"
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
