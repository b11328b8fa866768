"""Pruning methods on one model: parameters, size on disk, perplexity, batch-1 decode tok/s and
16-concurrent output tok/s, side by side in one run.

    python bench/pruning.py [--model smollm2-135m-instruct] [--rows ...] [--extra NAME=DIR ...]
                            [--ppl-tokens 8192] [--rounds 3] [--work DIR]

Rows: ``original`` (the float32 source saved as bfloat16, as every row is), the unstructured
methods at 50% and 2:4 (magnitude, Wanda, SparseGPT), structured pruning by heads, channels,
layers and the plan over all three at about 25% and 50% of the non-embedding parameters, and any
``--extra NAME=DIR`` (a distilled student, say). Each pruned model is made once with
``tokenmill.pruning`` and kept in ``--work`` (a later run reuses it).

``--distill-steps N`` adds, after each pruned row, ``ROW+kdN``: the pruned model distilled from
the original for N steps (``tokenmill.distillation``: KL at T = 2 + 0.1 CE on the corpus'
training split, ``--distill-batch`` x 256 tokens a step, ``--distill-lr``), made once and kept
in ``--work`` too; its wall time and tokens seen join the row (``distill_seconds``,
``distill_tokens``), as they do for an ``--extra`` directory that a distillation wrote.

Every figure comes from the saved directory loaded as a server would load it (``LLM(dir,
dtype="bfloat16")``: the same dtype and kernels for every row; unstructured rows run the sparse
kernel where ``LLM`` picks it). Perplexity: the first ``--ppl-tokens`` tokens of the corpus
(held out: calibration reads its end), windows of 512 every 256. Decode: (time for 1 + N tokens -
time for 1) / N, greedy, EOS ignored. Concurrent: 16 requests of 128 prompt and 128 output
tokens submitted together. Speed is measured in ``--rounds`` rounds, each visiting every row in
turn (the machine is noisy; rows interleaved), and reported as medians and ratios to ``original``.
Prints a table, writes bench/results/pruning.json and bench/results/pruning.png.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quantization import KV_BUDGET, concurrent_tok_s, decode_tok_s  # noqa: E402  (bench/quantization.py)

from tokenmill import LLM  # noqa: E402
from tokenmill.distillation.config import DistillConfig  # noqa: E402
from tokenmill.distillation.distill import distill_models  # noqa: E402
from tokenmill.eval.corpus import fetch_corpus, read_tokens  # noqa: E402
from tokenmill.eval.perplexity import perplexity  # noqa: E402
from tokenmill.loader import load_model  # noqa: E402
from tokenmill.models.export import save_hf  # noqa: E402
from tokenmill.pruning.api import prune, save_pruned  # noqa: E402
from tokenmill.pruning.config import (  # noqa: E402
    MagnitudeConfig, SparseGPTConfig, StructuredConfig, WandaConfig)
from tokenmill.pruning.structured import parameter_count  # noqa: E402
from tokenmill.quantization.api import load_float32  # noqa: E402

RESULTS = Path(__file__).parent / "results"
ROWS = {
    "magnitude-50%": MagnitudeConfig(sparsity=0.5), "wanda-50%": WandaConfig(sparsity=0.5),
    "sparsegpt-50%": SparseGPTConfig(sparsity=0.5), "magnitude-2:4": MagnitudeConfig(sparsity="2:4"),
    "wanda-2:4": WandaConfig(sparsity="2:4"), "sparsegpt-2:4": SparseGPTConfig(sparsity="2:4"),
    "heads-2kv": StructuredConfig(num_kv_heads=2), "heads-1kv": StructuredConfig(num_kv_heads=1),
    "channels-25%": StructuredConfig(target_params=0.75, dims=("channels",)),
    "channels-50%": StructuredConfig(target_params=0.5, dims=("channels",)),
    "layers-25%": StructuredConfig(target_params=0.75, dims=("layers",)),
    "layers-50%": StructuredConfig(target_params=0.5, dims=("layers",)),
    "plan-25%": StructuredConfig(target_params=0.75), "plan-50%": StructuredConfig(target_params=0.5),
}


def build(name: str, model_arg: str, work: Path) -> Path:
    """The row's directory in ``work``, pruned (or, for ``original``, saved) now unless it is there."""
    out = work / name.replace(":", "of").replace("%", "")
    if (out / "config.json").exists():
        return out
    print(f"building {name} -> {out}", flush=True)
    if name == "original":
        loaded = load_float32(model_arg, torch.device("cpu"), Path.home() / ".cache" / "tokenmill")
        save_hf(loaded.model, loaded.config, loaded.tokenizer, out, torch.bfloat16)
    else:
        loaded, report = prune(model_arg, ROWS[name])
        save_pruned(loaded, report, out, torch.bfloat16)
    del loaded
    gc.collect()
    return out


def distilled(name: str, source: Path, model_arg: str, steps: int, lr: float, batch: int, work: Path) -> Path:
    """The row's pruned model distilled from ``model_arg`` for ``steps`` (kept in ``work``)."""
    run = work / f"{source.name}-kd{steps}"
    student = run / "student"
    if (student / "config.json").exists():
        return student
    print(f"distilling {name} for {steps} steps -> {student}", flush=True)
    config = DistillConfig(train={"steps": steps, "lr": lr, "warmup_steps": max(1, steps // 10),
                                  "checkpoint_every": max(1, steps // 4)}, batch_size=batch, eval_tokens=0)
    result = distill_models(model_arg, source, config, run, progress=True)
    del result
    gc.collect()
    return student


def distill_cost(path: Path) -> dict:
    """Wall time and tokens of the distillation that wrote ``path`` (its config.json), if one did."""
    record = json.loads((path / "config.json").read_text()).get("distillation")
    if not record or "wall_seconds" not in record:  # none, or a run's student-latest (a checkpoint's record)
        return {}
    return {"distill_seconds": record["wall_seconds"], "distill_tokens": record["tokens_seen"],
            "distill_steps": record["config"]["train"]["steps"]}


def quality(path: Path, ppl_tokens: int) -> dict:
    """Perplexity, parameters, zeros and size of the directory's model (cached in it per token count)."""
    cached = path / f"bench_quality_{ppl_tokens}.json"
    weights = (path / "model.safetensors").stat()
    stamp = f"{weights.st_size}:{weights.st_mtime_ns}"  # a directory written again is measured again
    row = json.loads(cached.read_text()) if cached.exists() else {}
    if row.get("weights") == stamp:
        return {**row, "linear_zero_fraction": zero_fraction(path)}
    loaded = load_model(str(path), torch.bfloat16, "cpu")
    ids = read_tokens(loaded.tokenizer, fetch_corpus(), ppl_tokens)
    ppl = perplexity(loaded.model, ids, context=512, stride=256, progress=False)
    counts = parameter_count(loaded.config)
    row = {"perplexity": ppl.perplexity, "ppl_tokens": ppl.tokens, "embedding_params": counts.embedding,
           "non_embedding_params": counts.non_embedding, "size_mb": weights.st_size / 1e6, "weights": stamp}
    cached.write_text(json.dumps(row))
    return {**row, "linear_zero_fraction": zero_fraction(path)}


def zero_fraction(path: Path) -> float:
    """Exact zeros among the block linears' weights as the directory stores them (the loaded model
    may hold them in the sparse kernel's layout, without its zeros)."""
    zeros = total = 0
    with safe_open(path / "model.safetensors", "pt") as f:
        for name in f.keys():
            if name.startswith("model.layers.") and name.endswith("proj.weight"):
                w = f.get_tensor(name)
                zeros, total = zeros + int((w == 0).sum()), total + w.numel()
    return zeros / max(1, total)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--extra", nargs="*", default=[], metavar="NAME=DIR", help="further model directories")
    parser.add_argument("--ppl-tokens", type=int, default=8192)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--work", default=str(Path.home() / ".cache" / "tokenmill" / "bench-pruning"))
    parser.add_argument("--out", default=str(RESULTS / "pruning.json"))
    parser.add_argument("--distill-steps", type=int, default=0, help="also each pruned row distilled this many "
                        "steps (0: none)")
    parser.add_argument("--distill-lr", type=float, default=3e-4)
    parser.add_argument("--distill-batch", type=int, default=4, help="sequences of 256 tokens per distillation step")
    parser.add_argument("--build-only", action="store_true", help="make the rows' models, measure nothing")
    parser.add_argument("--quality-only", action="store_true", help="make the models and measure perplexity (cached), "
                        "not speed")
    args = parser.parse_args()
    work = Path(args.work)
    dirs = {"original": build("original", args.model, work)}
    for name in args.rows:
        dirs[name] = build(name, args.model, work)
    if args.distill_steps:
        for name in args.rows:  # after the pruning, so that --build-only can make every pruned row first
            dirs[f"{name}+kd{args.distill_steps}"] = distilled(name, dirs[name], args.model, args.distill_steps,
                                                               args.distill_lr, args.distill_batch, work)
    if args.build_only:
        return
    for spec in args.extra:
        name, _, path = spec.partition("=")
        dirs[name] = Path(path)
    dirs = dict(sorted(dirs.items(), key=lambda item: _order(item[0], args.rows)))
    rows = {}
    for name, path in dirs.items():
        rows[name] = {"name": name, "dir": str(path), **quality(path, args.ppl_tokens), **distill_cost(path)}
        print(f"{name:15s} perplexity {rows[name]['perplexity']:.2f}", flush=True)
    if args.quality_only:
        return
    for name, path in dirs.items():
        report = path / "pruning_report.json"
        if report.exists():
            rows[name]["pruning_seconds"] = json.loads(report.read_text())["seconds"]
        rows[name]["decode_runs"], rows[name]["concurrent_runs"] = [], []
    for r in range(args.rounds):  # one model in memory at a time, loaded again each round
        for name, path in dirs.items():
            llm = LLM(str(path), dtype="bfloat16", device="cpu", max_num_seqs=16, kv_cache_memory=KV_BUDGET)
            rows[name]["decode_runs"].append(decode_tok_s(llm, args.decode_tokens, 1)[0])
            rows[name]["concurrent_runs"].append(concurrent_tok_s(llm))
            del llm
            gc.collect()
            print(f"round {r + 1}/{args.rounds} {name:15s} decode {rows[name]['decode_runs'][-1]:6.1f} tok/s  "
                  f"x16 {rows[name]['concurrent_runs'][-1]:6.1f} tok/s", flush=True)
    base = rows["original"]
    for row in rows.values():
        row["decode_tok_s"] = statistics.median(row["decode_runs"])
        row["concurrent_tok_s"] = statistics.median(row["concurrent_runs"])
    for row in rows.values():
        row["decode_ratio"] = row["decode_tok_s"] / base["decode_tok_s"]
        row["concurrent_ratio"] = row["concurrent_tok_s"] / base["concurrent_tok_s"]
        row["ppl_change"] = row["perplexity"] / base["perplexity"] - 1
    results = {"model": args.model, "host": platform.processor() or platform.machine(), "torch": torch.__version__,
               "time": time.strftime("%Y-%m-%d %H:%M:%S"), "rounds": args.rounds, "ppl_tokens": args.ppl_tokens,
               "rows": list(rows.values())}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    _report(results)
    _plot(results, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


def _order(name: str, rows: list[str]) -> tuple[int, int]:
    """original first, each pruned row followed by its distilled one, --extra rows last."""
    base = name.split("+")[0]
    if name == "original":
        return (-1, 0)
    return (rows.index(base), 1 if "+" in name else 0) if base in rows else (len(rows), 0)


def _report(results: dict) -> None:
    print(f"\n{'row':16s} {'non-emb params':>15s} {'emb':>6s} {'MB':>6s} {'zeros':>6s} {'perplexity':>11s} "
          f"{'change':>8s} {'b1 tok/s':>9s} {'ratio':>6s} {'x16 tok/s':>10s} {'ratio':>6s} {'distilled':>18s}")
    for r in results["rows"]:
        print(f"{r['name']:16s} {r['non_embedding_params'] / 1e6:13.1f} M {r['embedding_params'] / 1e6:5.1f}M "
              f"{r['size_mb']:6.0f} {r['linear_zero_fraction']:6.1%} {r['perplexity']:11.2f} {r['ppl_change']:+8.1%} "
              f"{r['decode_tok_s']:9.1f} {r['decode_ratio']:6.2f} {r['concurrent_tok_s']:10.1f} "
              f"{r['concurrent_ratio']:6.2f} {_cost(r):>18s}")


def _cost(row: dict) -> str:
    if "distill_tokens" not in row:
        return ""
    return f"{row['distill_tokens'] / 1e3:.0f}k tok, {row['distill_seconds'] / 60:.1f} min"


def _plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 5))
    for ax, key, label in ((axes[0], "decode_ratio", "batch-1 decode speed vs original"),
                           (axes[1], "concurrent_ratio", "16-stream throughput vs original")):
        by_name = {r["name"]: r for r in results["rows"]}
        for r in results["rows"]:
            ax.scatter(r[key], r["perplexity"], s=30, marker="*" if "+" in r["name"] else "o")
            ax.annotate(r["name"], (r[key], r["perplexity"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
            base = by_name.get(r["name"].split("+")[0]) if "+" in r["name"] else None
            if base is not None:  # pruned -> distilled
                ax.annotate("", (r[key], r["perplexity"]), (base[key], base["perplexity"]),
                            arrowprops={"arrowstyle": "->", "color": "grey", "lw": 0.6})
        ax.set_xlabel(label)
        ax.set_ylabel("perplexity (held-out corpus)")
        ax.set_yscale("log")
        ax.axvline(1.0, color="grey", lw=0.5)
        ax.grid(alpha=0.3)
    fig.suptitle(f"pruning {results['model']} ({results['time']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
