"""Quantization-aware training against round-to-nearest INT4: perplexity of each, one run.

    python bench/qat.py [--model smollm2-135m-instruct] [--steps 100] [--seq-len 256] [--batch-size 1]
                        [--lr 5e-5] [--distill-weight 1.0] [--group-size 64] [--ppl-tokens 8192]

Rows: the bfloat16 model as loaded; round-to-nearest INT4 (min-max groups, the grid QAT trains
on) at group sizes 64 and 128; INT4 g64 with range search (Int4WeightOnlyConfig's default);
and QAT INT4 at --group-size after --steps AdamW steps on the middle half of the corpus
(tokenmill.quantization.qat.TRAIN_SPLIT), converted, saved with save_quantized and loaded back
as any quantized checkpoint. Every model computes in bfloat16 with the LM head in INT8, as
bench/quantization.py. Perplexity as bench/quantization.py: the first --ppl-tokens tokens of the
Shakespeare corpus, windows of 512 tokens every 256. Prints a table, writes
bench/results/qat.json and the loss curve bench/results/qat_loss.png (--name renames them).

Caveat: the training text is Shakespeare like the evaluation text. With --distill-weight 1 (the
default) the QAT model learns the float model's predictions, not the text, so a lower perplexity
is recovered quantization error rather than adaptation to the domain; with 0 it is both.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from tokenmill.eval.corpus import read_tokens
from tokenmill.eval.corpus import fetch_corpus
from tokenmill.eval.perplexity import perplexity
from tokenmill.loader import load_model
from tokenmill.loading.sources import resolve_model
from tokenmill.quantization import Int4WeightOnlyConfig, quantize, save_quantized
from tokenmill.quantization.qat import TRAIN_SPLIT, QATConfig, QATLog, qat

RESULTS = Path(__file__).parent / "results"
BASELINES = {"int4-g64": Int4WeightOnlyConfig(group_size=64, range_search=False),
             "int4-g128": Int4WeightOnlyConfig(group_size=128, range_search=False),
             "int4-g64-search": Int4WeightOnlyConfig(group_size=64, range_search=True)}


def measure(name: str, model, ids: list[int], extra: dict | None = None) -> dict:
    ppl = perplexity(model, ids, context=512, stride=256, progress=False)
    print(f"{name:16s} perplexity {ppl.perplexity:.3f}", flush=True)
    return {"method": name, "perplexity": ppl.perplexity, "ppl_tokens": ppl.tokens, **(extra or {})}


def run_qat(args: argparse.Namespace, ids: list[int], out_dir: Path) -> tuple[dict, QATLog]:
    config = QATConfig(group_size=args.group_size, steps=args.steps, lr=args.lr, seq_len=args.seq_len,
                       batch_size=args.batch_size, distill_weight=args.distill_weight,
                       warmup_steps=min(10, args.steps // 10))
    start = time.perf_counter()
    loaded, log = qat(args.model, config, dtype="bfloat16")
    seconds = time.perf_counter() - start
    saved = save_quantized(loaded, out_dir)
    del loaded
    reloaded = load_model(str(saved), torch.bfloat16, "cpu")
    row = measure(f"qat-int4-g{args.group_size}", reloaded.model, ids,
                  {"train_seconds": seconds, "train_tokens": config.steps * config.batch_size * config.seq_len,
                   "qat_config": asdict(config), "final_loss": sum(log.loss[-10:]) / len(log.loss[-10:])})
    return row, log


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--distill-weight", type=float, default=1.0)
    parser.add_argument("--ppl-tokens", type=int, default=8192)
    parser.add_argument("--baselines", nargs="*", default=list(BASELINES), choices=list(BASELINES))
    parser.add_argument("--name", default="qat", help="results/NAME.json and results/NAME_loss.png")
    args = parser.parse_args()

    corpus = fetch_corpus()
    source = resolve_model(args.model)
    results = {"model": source.name, "threads": torch.get_num_threads(), "torch": torch.__version__,
               "machine": platform.processor() or platform.machine(), "ppl_tokens": args.ppl_tokens,
               "train_split": TRAIN_SPLIT, "rows": []}
    base = load_model(source, torch.bfloat16, "cpu")
    ids = read_tokens(base.tokenizer, corpus, args.ppl_tokens)
    results["rows"].append(measure("bf16", base.model, ids))
    del base
    for name in args.baselines:
        loaded = quantize(args.model, BASELINES[name], dtype="bfloat16", progress=False)
        results["rows"].append(measure(name, loaded.model, ids))
        del loaded
    with tempfile.TemporaryDirectory() as tmp:
        row, log = run_qat(args, ids, Path(tmp) / "qat")
    results["rows"].append(row)
    results["losses"] = {"loss": log.loss, "ce": log.ce, "kl": log.kl}
    _report(results, RESULTS / f"{args.name}.json")
    _plot(log, RESULTS / f"{args.name}_loss.png", row["method"])


def _report(results: dict, out: Path) -> None:
    base = results["rows"][0]["perplexity"]
    print(f"\n{results['model']}, {results['threads']} threads, perplexity on {results['ppl_tokens']} tokens")
    print(f"{'method':16s} {'perplexity':>10s} {'vs bf16':>8s}")
    for r in results["rows"]:
        r["ppl_change"] = r["perplexity"] / base - 1
        print(f"{r['method']:16s} {r['perplexity']:10.3f} {100 * r['ppl_change']:+7.2f}%")
    RESULTS.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")


def _plot(log: QATLog, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(log.ce, label="cross entropy (text)", alpha=0.8)
    if log.kl:
        ax.plot(log.kl, label="KL(float || QAT)", alpha=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("nats per token")
    ax.set_yscale("log")
    ax.set_title(f"{title}: training losses")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
