"""The sparse bfloat16 CPU linear against the dense one, kernel by kernel and in a whole model.

    python bench/sparse_linear.py [--threads 2] [--rows 1 4 16 64 256] [--densities 0.5 2:4 0.3 0.2]
                                  [--rounds 7] [--cold-factor 2] [--model-rounds 5] [--no-model]
                                  [--out bench/results/sparse_linear.json]

Kernels, on the same shapes with bfloat16 x and bfloat16 out:
    dense    bf16_packed_linear (tokenmill/kernels/cpu/bf16_linear.cpp): density 1.0, 16 bits a weight
    sparse   sparse_bf16_linear (sparse_linear.cpp) over sparse_bf16_pack's layout: a 32-bit mask
             per 32 weights and the nonzeros, 16 x density + 1 bits a weight; outputs bit-identical
             to dense on the same pruned weight
at densities 0.5, 0.3, 0.2 (random unstructured zeros) and 2:4 (2 nonzeros in every 4 inputs).

Shapes: SmolLM2-135M's fused qkv (576 -> 960), o (576 -> 576), gate_up (576 -> 3072), down
(1536 -> 576); Gemma-3-270M's qkv (640 -> 1536), o (1024 -> 640), gate_up (640 -> 4096), down
(2048 -> 640). Weights hot (the same weight every call: in L2 / L3 as far as it fits) and cold (a
rotating set of copies, each kernel's at least --cold-factor times the L3 cache, so that every call
streams its weight from DRAM, as a batch-1 decode step does across 30 layers). Each figure is the
median over --rounds rounds of the time per call; in every round each kernel runs once, in turn,
so that machine noise hits all alike. GB/s = weight bytes read per call / time.

Then the same in a model: SmolLM2-135M (bfloat16) with every block linear pruned to 50% (per row,
by magnitude), as it is (dense kernel) and sparsified (tokenmill.pruning.sparse_linear.sparsify):
decode tok/s of 1 sequence and of 16 at once, greedy, the two models interleaved round by round,
their tokens checked identical.

Prints tables; writes JSON (bench/results/sparse_linear.json) and a PNG plot of the speed ratio
(dense time / sparse time) against rows, per density, hot and cold (sparse_linear.png).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from tokenmill.kernels import dispatch

RESULTS = Path(__file__).parent / "results"
SHAPES = [("smollm2 qkv", 576, 960), ("smollm2 o", 576, 576), ("smollm2 gate_up", 576, 3072),
          ("smollm2 down", 1536, 576), ("gemma qkv", 640, 1536), ("gemma o", 1024, 640),
          ("gemma gate_up", 640, 4096), ("gemma down", 2048, 640)]
PASS_SECONDS = 0.02
"""Hot weights: calls per round so that a round of one kernel takes about this long."""


def l3_bytes() -> int:
    """This CPU's last-level cache (sysfs), or 32 MiB where it cannot be read."""
    for index in (3, 2):
        path = Path(f"/sys/devices/system/cpu/cpu0/cache/index{index}/size")
        if path.exists():
            text = path.read_text().strip()
            scale = {"K": 2 ** 10, "M": 2 ** 20}.get(text[-1], 1)
            return int(text.rstrip("KM")) * scale
    return 32 * 2 ** 20


def pruned(weight: torch.Tensor, density: str, g: torch.Generator) -> torch.Tensor:
    """``weight`` with zeros: "2:4" (2 random survivors in every 4 inputs) or a fraction kept at random."""
    n, k = weight.shape
    if density == "2:4":
        scores = torch.rand(n, k // 4, 4, generator=g)
        keep = torch.zeros_like(scores, dtype=torch.bool).scatter_(2, scores.topk(2, dim=2).indices, True).view(n, k)
    else:
        keep = torch.rand(n, k, generator=g) < float(density)
    return weight * keep.to(weight.dtype)


def kernels_for(ops, n: int, k: int, densities: list[str], copies_bytes: int | None, seed: int) -> dict:
    """name -> (fn(x, i), copies, weight bytes per call): dense and each density, over ``copies``
    copies of the weight at distinct addresses (1 for hot: ``copies_bytes`` None)."""
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(n, k, generator=g) * k ** -0.5).bfloat16()
    empty = torch.empty(0)
    out = {}

    def copies_of(nbytes: int) -> int:
        return 1 if copies_bytes is None else max(2, math.ceil(copies_bytes / nbytes))

    packed = ops.bf16_pack(weight)
    nbytes = packed.numel() * 2
    dense = [packed.clone() for _ in range(copies_of(nbytes))]
    out["dense"] = (lambda x, i: ops.bf16_packed_linear(x, dense[i], n, empty), len(dense), nbytes)
    for density in densities:
        parts = ops.sparse_bf16_pack(pruned(weight, density, g))
        nbytes = sum(t.numel() * t.element_size() for t in parts)
        sets = [tuple(t.clone() for t in parts) for _ in range(copies_of(nbytes))]
        out[density] = (lambda x, i, sets=sets: ops.sparse_bf16_linear(x, *sets[i], None, n), len(sets), nbytes)
    return out


def measure(kernels: dict, x: torch.Tensor, rounds: int) -> dict[str, float]:
    """Median seconds per call of each kernel; a round runs each kernel in turn over its copies."""
    calls = {}
    for name, (fn, copies, _) in kernels.items():  # warm-up, and calls per round
        for i in range(copies):
            fn(x, i)
        start = time.perf_counter()
        fn(x, 0)
        one = time.perf_counter() - start
        calls[name] = copies if copies > 1 else max(1, round(PASS_SECONDS / max(one, 1e-7)))
    times = {name: [] for name in kernels}
    for _ in range(rounds):
        for name, (fn, copies, _) in kernels.items():
            start = time.perf_counter()
            for i in range(calls[name]):
                fn(x, i % copies)
            times[name].append((time.perf_counter() - start) / calls[name])
    return {name: statistics.median(ts) for name, ts in times.items()}


def kernel_bench(ops, args) -> list[dict]:
    cold_bytes = int(args.cold_factor * l3_bytes())
    header = f"{'shape':<16} {'K':>5} {'N':>5} {'temp':>4} {'M':>4} | {'dense ms':>9} {'GB/s':>5} | " + " | ".join(
        f"{d + ' ms':>9} {'GB/s':>5} {'x':>5}" for d in args.densities)
    print(f"{args.threads} threads, median per call of {args.rounds} interleaved rounds; x = dense time / sparse time;"
          f" cold sets >= {cold_bytes / 2 ** 20:.0f} MiB each")
    print(header)
    print("-" * len(header))
    rows = []
    for s, (name, k, n) in enumerate(SHAPES):
        for temp in ("hot", "cold"):
            kernels = kernels_for(ops, n, k, args.densities, cold_bytes if temp == "cold" else None, seed=s)
            for m in args.rows:
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
                t = measure(kernels, x, args.rounds)
                vectors = -(-n // 16) * k // 2
                for kernel, (_, copies, nbytes) in kernels.items():
                    rows.append({"shape": name, "K": k, "N": n, "M": m, "weights": temp, "kernel": kernel,
                                 "copies": copies, "ms": t[kernel] * 1e3, "weight_bytes": nbytes,
                                 "bits_per_weight": 8 * nbytes / (n * k), "gb_s": nbytes / t[kernel] / 1e9,
                                 "ns_per_vector_thread": t[kernel] * 1e9 * args.threads / vectors,
                                 "ratio_to_dense": t["dense"] / t[kernel]})
                dense = t["dense"]
                print(f"{name:<16} {k:>5} {n:>5} {temp:>4} {m:>4} | {dense * 1e3:>9.4f} "
                      f"{kernels['dense'][2] / dense / 1e9:>5.1f} | " + " | ".join(
                          f"{t[d] * 1e3:>9.4f} {kernels[d][2] / t[d] / 1e9:>5.1f} {dense / t[d]:>5.2f}"
                          for d in args.densities), flush=True)
            del kernels
    return rows


def prune_rows(model: nn.Module, density: float) -> None:
    """Zero the smallest |w| of every row of every block linear, keeping ``density`` of each row."""
    with torch.no_grad():
        for module in model.layers.modules():
            if type(module) is nn.Linear:
                w = module.weight
                drop = w.abs().float().topk(round(w.shape[1] * (1 - density)), dim=1, largest=False).indices
                w.scatter_(1, drop, 0)


def model_bench(args) -> dict:
    from tokenmill import LLM, SamplingParams
    from tokenmill.pruning.sparse_linear import sparsify

    llms = {}
    for name in ("dense", "sparse"):
        llm = LLM(args.model, dtype="bfloat16", device="cpu", kv_cache_memory=2 ** 28)
        prune_rows(llm.engine.runner.model, 0.5)
        llms[name] = llm
    swapped = sparsify(llms["sparse"].engine.runner.model)
    prompts = [llms["dense"].tokenizer.encode(f"Story {i}: once upon a time, a") for i in range(16)]

    def run(llm, batch: int, tokens: int) -> tuple[float, list]:
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        start = time.perf_counter()
        out = llm.generate(prompts[:batch], params)
        return time.perf_counter() - start, [o.outputs[0].token_ids for o in out]

    n = args.decode_tokens
    results = {(name, b): [] for name in llms for b in (1, 16)}
    identical = True
    for llm in llms.values():
        run(llm, 16, 4)  # warm-up
    for _ in range(args.model_rounds):
        for batch in (1, 16):
            tokens = {}
            for name, llm in llms.items():
                one, _ = run(llm, batch, 1)
                many, tokens[name] = run(llm, batch, 1 + n)
                results[(name, batch)].append(batch * n / max(many - one, 1e-9))
            identical &= tokens["dense"] == tokens["sparse"]
    out = {"model": args.model, "pruned_density": 0.5, "swapped_linears": len(swapped), "decode_tokens": n,
           "identical_tokens": identical, "runs": []}
    for batch in (1, 16):
        d, s = (statistics.median(results[(name, batch)]) for name in ("dense", "sparse"))
        out["runs"].append({"sequences": batch, "dense_tok_s": d, "sparse_tok_s": s, "speedup": s / d,
                            "dense_runs": results[("dense", batch)], "sparse_runs": results[("sparse", batch)]})
        print(f"{args.model} pruned 50%, {batch:>2} sequences: dense {d:7.1f} tok/s, sparse {s:7.1f} tok/s, "
              f"x {s / d:.2f}", flush=True)
    print(f"greedy tokens identical: {identical} ({len(swapped)} linears sparsified)")
    return out


def plot(rows: list[dict], densities: list[str], path: Path) -> None:
    """Ratio (dense / sparse time) against rows per density: the geometric mean over shapes, the
    band the shapes' range; hot and cold side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, temp in zip(axes, ("hot", "cold")):
        for density in densities:
            mine = [r for r in rows if r["weights"] == temp and r["kernel"] == density]
            ms = sorted({r["M"] for r in mine})
            ratios = [[r["ratio_to_dense"] for r in mine if r["M"] == m] for m in ms]
            mean = [math.exp(statistics.fmean(math.log(v) for v in rs)) for rs in ratios]
            line, = ax.plot(ms, mean, marker="o", label=f"density {density}")
            ax.fill_between(ms, [min(rs) for rs in ratios], [max(rs) for rs in ratios], color=line.get_color(),
                            alpha=0.12)
        ax.axhline(1.0, color="black", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("rows (M)")
        ax.set_title(f"weights {temp}" + (" (streamed from DRAM)" if temp == "cold" else " (in cache)"))
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("dense time / sparse time (>1: sparse faster)")
    axes[0].legend()
    fig.suptitle("sparse_bf16_linear vs bf16_packed_linear, SmolLM2-135M and Gemma-3-270M shapes")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    parser.add_argument("--densities", nargs="+", default=["0.5", "2:4", "0.3", "0.2"])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--cold-factor", type=float, default=2.0, help="each cold set's size in L3 caches")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--model-rounds", type=int, default=5)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--no-model", action="store_true", help="kernels only")
    parser.add_argument("--out", type=Path, default=RESULTS / "sparse_linear.json")
    args = parser.parse_args()
    if args.rounds < 5:
        parser.error("--rounds must be at least 5")
    ops = dispatch.cpu_ops()
    if ops is None or not ops.bf16_linear_fast() or not ops.sparse_linear_fast():
        raise SystemExit("needs tokenmill's CPU kernels with their AVX-512 BF16 + VBMI2 paths")
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    rows = kernel_bench(ops, args)
    model = None if args.no_model else model_bench(args)
    elapsed = time.perf_counter() - start
    result = {"threads": args.threads, "rounds": args.rounds, "l3_bytes": l3_bytes(), "cold_factor": args.cold_factor,
              "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
              "seconds": round(elapsed, 1), "rows": rows, "model": model}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    plot(rows, args.densities, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')} ({elapsed:.0f} s)")


if __name__ == "__main__":
    main()
