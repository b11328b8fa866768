"""The batched multi-LoRA CPU kernel (``lora_add``, tokenmill/kernels/cpu/lora.cpp) against a PyTorch
per-slot loop, on SmolLM2-135M's projections; or (--cold) bfloat16 against int8 adapter weights
read from DRAM, over a model's worth of layers.

    python bench/lora_kernel.py [--threads 2] [--tokens 1 16 64 512] [--slots 8] [--rank 16]
                                [--dtypes bfloat16 float32] [--rounds 7] [--out bench/results/lora_kernel.json]
    python bench/lora_kernel.py --cold [--threads 2] [--tokens 1 16 64] [--slots 8] [--rank 16]
                                [--layers 30] [--rounds 15] [--flush-mb 256] [--out bench/results/lora_kernel_cold.json]

Shapes (K -> N, parts): qkv 576 -> 576 + 192 + 192 (P = 3), o 576 -> 576 (P = 1), gate_up
576 -> 1536 + 1536 (P = 2), down 1536 -> 576 (P = 1); every slot's A [P, R, K] and B [N, R] hot
(the same bank every call). Tokens: up to 64 (decode) spread over the slots round-robin (about
T / slots tokens a slot, interleaved); more (prefill) in one run of consecutive tokens per slot.

    kernel   ops.lora_add(x=, y=, slots=, A=, B=, part_starts=), y updated in place
    torch    for each slot present: h = x[idx] @ A[s].view(P * R, K).T, then per part
             y[idx, part] += h[:, p] @ B[s, part].T (index_select / matmul / index_add_); a timing
             reference only (it rounds h and the update to x's dtype, the kernel does not)

Each figure is the median over --rounds rounds of the time per call (µs; the JSON also has the
minimum); in every round each implementation runs for about 20 ms, in turn. The "layer" rows add
up the four projections.

--cold: what a decode step pays for its adapters when their weights are not in any cache. Each of
--layers layers has its own four projections' slot weights (distinct tensors, as a model's), all
--slots slots of rank --rank: about 75 MB in bfloat16 and 38 MB in int8 (plus its scales, 5 MB)
for SmolLM2-135M's 30 layers and 8 slots. A pass calls the kernel on every projection of every
layer in turn (tokens spread over the slots as above); before each timed pass the caches are
flushed by reading a --flush-mb buffer (0: no flush; the pass then finds what the previous one
left in the last-level cache). Weights, in turn within each round:
    bfloat16           x, y and A, B in bfloat16
    int8               x, y in bfloat16; A, B int8 with float32 per-row scales (quantize_rows)
    int8, float32 x    x, y in float32; the same int8 weights
The "empty" column is the same pass with every slot -1 (no adapter: the call and its checks
only). Figures are ms per pass, median (and minimum) over --rounds rounds. Then the error of the
int8 delta against the bfloat16 weights it was quantized from, for random weights (layer 0, float32
x): the relative L2 error of the delta and the largest error over the largest delta, per
projection.
Prints tables; writes JSON to --out (by default bench/results/lora_kernel.json, or
lora_kernel_cold.json with --cold, when bench/results exists).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"
SHAPES = [("qkv", 576, [576, 192, 192]), ("o", 576, [576]), ("gate_up", 576, [1536, 1536]), ("down", 1536, [576])]
PASS_SECONDS = 0.02
DECODE_MAX = 64
"""Up to this many tokens: decode-like slots (round-robin); more: one run per slot (prefill)."""


def slot_ids(tokens: int, slots: int) -> torch.Tensor:
    if tokens <= DECODE_MAX:
        return (torch.arange(tokens) % slots).to(torch.int32)
    return (torch.arange(tokens) * slots // tokens).to(torch.int32)


def torch_lora(x, y, slots, A, B, starts: list[int]) -> None:
    """The reference: one matmul pair per slot present (what a PyTorch implementation does)."""
    S, P, R, K = A.shape
    for s in torch.unique(slots).tolist():
        if s < 0:
            continue
        idx = (slots == s).nonzero().squeeze(1)
        h = x.index_select(0, idx) @ A[s].view(P * R, K).T
        delta = torch.cat([h[:, p * R:(p + 1) * R] @ B[s, starts[p]:starts[p + 1]].T for p in range(P)], dim=1)
        y.index_add_(0, idx, delta)


def measure(fns: dict, rounds: int) -> dict[str, tuple[float, float]]:
    """(median, min) over rounds of the seconds per call of each function; a round runs each for
    about PASS_SECONDS, in turn."""
    calls = {}
    for name, fn in fns.items():
        for _ in range(3):
            fn()
        start = time.perf_counter()
        fn()
        calls[name] = max(1, round(PASS_SECONDS / max(time.perf_counter() - start, 1e-7)))
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(calls[name]):
                fn()
            times[name].append((time.perf_counter() - start) / calls[name])
    return {name: (statistics.median(ts), min(ts)) for name, ts in times.items()}


def bench(ops, args) -> list[dict]:
    rows = []
    print(f"{torch.get_num_threads()} threads, R = {args.rank}, {args.slots} slots; µs per call, median of "
          f"{args.rounds} rounds")
    header = f"{'dtype':<9} {'T':>4} {'shape':<8} {'K':>5} {'N':>5} {'P':>2} | {'kernel':>9} {'torch':>9} {'x':>6}"
    print(header)
    print("-" * len(header))
    for dtype in (getattr(torch, d) for d in args.dtypes):
        for tokens in args.tokens:
            total = {"kernel": 0.0, "torch": 0.0}
            for i, (name, k, parts) in enumerate(SHAPES):
                g = torch.Generator().manual_seed(i)
                n, p = sum(parts), len(parts)
                starts = [0]
                for size in parts:
                    starts.append(starts[-1] + size)
                x = torch.randn(tokens, k, generator=g).to(dtype)
                y = torch.randn(tokens, n, generator=g).to(dtype)
                A = (torch.randn(args.slots, p, args.rank, k, generator=g) * k ** -0.5).to(dtype)
                B = (torch.randn(args.slots, n, args.rank, generator=g) * 1e-3).to(dtype)
                slots = slot_ids(tokens, args.slots)
                part_starts = torch.tensor(starts, dtype=torch.int64)
                fns = {
                    "kernel": lambda: ops.lora_add(x=x, y=y, slots=slots, A=A, B=B, part_starts=part_starts),
                    "torch": lambda: torch_lora(x, y, slots, A, B, starts),
                }
                measured = measure(fns, args.rounds)
                t = {key: median for key, (median, _) in measured.items()}
                for key in total:
                    total[key] += t[key]
                row = {"dtype": str(dtype).removeprefix("torch."), "tokens": tokens, "shape": name, "K": k, "N": n,
                       "P": p, "R": args.rank, "slots": args.slots, "kernel_us": t["kernel"] * 1e6,
                       "torch_us": t["torch"] * 1e6, "speedup": t["torch"] / t["kernel"],
                       "kernel_min_us": measured["kernel"][1] * 1e6, "torch_min_us": measured["torch"][1] * 1e6}
                rows.append(row)
                print(f"{row['dtype']:<9} {tokens:>4} {name:<8} {k:>5} {n:>5} {p:>2} | {row['kernel_us']:>9.1f} "
                      f"{row['torch_us']:>9.1f} {row['speedup']:>6.1f}", flush=True)
            rows.append({"dtype": str(dtype).removeprefix("torch."), "tokens": tokens, "shape": "layer",
                         "R": args.rank, "slots": args.slots, "kernel_us": total["kernel"] * 1e6,
                         "torch_us": total["torch"] * 1e6, "speedup": total["torch"] / total["kernel"]})
            print(f"{rows[-1]['dtype']:<9} {tokens:>4} {'layer':<8} {'':>5} {'':>5} {'':>2} | "
                  f"{rows[-1]['kernel_us']:>9.1f} {rows[-1]['torch_us']:>9.1f} {rows[-1]['speedup']:>6.1f}", flush=True)
    return rows


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [..., n] -> (int8 [..., n], float32 scale [...]): w ~ q * scale, symmetric per row of the
    last dimension (127 levels, round to nearest)."""
    w = w.float()
    scale = w.abs().amax(dim=-1) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(w / scale[..., None]).clamp_(-127, 127).to(torch.int8), scale


COLD_CONFIGS = [
    # name, x dtype, int8 weights
    ("bfloat16", torch.bfloat16, False),
    ("int8", torch.bfloat16, True),
    ("int8, float32 x", torch.float32, True),
]


def cold_weights(args) -> list[list[dict]]:
    """Per layer, per projection: K, N, part_starts and the bfloat16 and int8 slot weights."""
    layers = []
    for layer in range(args.layers):
        modules = []
        for i, (name, k, parts) in enumerate(SHAPES):
            g = torch.Generator().manual_seed(1000 * layer + i)
            n, p = sum(parts), len(parts)
            starts = [0]
            for size in parts:
                starts.append(starts[-1] + size)
            A = (torch.randn(args.slots, p, args.rank, k, generator=g) * k ** -0.5).to(torch.bfloat16)
            B = (torch.randn(args.slots, n, args.rank, generator=g) * 1e-3).to(torch.bfloat16)
            A_q, A_scale = quantize_rows(A)
            B_q, B_scale = quantize_rows(B)
            modules.append({"name": name, "K": k, "N": n, "part_starts": torch.tensor(starts, dtype=torch.int64),
                            "A": A, "B": B, "A_q": A_q, "A_scale": A_scale, "B_q": B_q, "B_scale": B_scale})
        layers.append(modules)
    return layers


def cold_pass(ops, layers, tokens: int, slots: torch.Tensor, dtype: torch.dtype, int8: bool):
    """A function running one pass: every projection of every layer, with its own x and y."""
    g = torch.Generator().manual_seed(tokens)
    xs = {k: torch.randn(tokens, k, generator=g).to(dtype) for k in {m["K"] for m in layers[0]}}
    ys = {n: torch.zeros(tokens, n, dtype=dtype) for n in {m["N"] for m in layers[0]}}
    calls = []
    for modules in layers:
        for m in modules:
            kw = {"x": xs[m["K"]], "y": ys[m["N"]], "slots": slots, "part_starts": m["part_starts"]}
            if int8:
                kw.update(A=m["A_q"], B=m["B_q"], A_scale=m["A_scale"], B_scale=m["B_scale"])
            else:
                kw.update(A=m["A"], B=m["B"])
            calls.append(kw)

    def run() -> None:
        for kw in calls:
            ops.lora_add(**kw)
    return run


def weight_bytes(layers, int8: bool) -> int:
    keys = ("A_q", "A_scale", "B_q", "B_scale") if int8 else ("A", "B")
    return sum(m[key].numel() * m[key].element_size() for modules in layers for m in modules for key in keys)


def cold_bench(ops, args) -> dict:
    layers = cold_weights(args)
    flush = torch.ones(max(args.flush_mb, 1) << 18) if args.flush_mb > 0 else None
    sizes = {name: weight_bytes(layers, int8) / 1e6 for name, _, int8 in COLD_CONFIGS}
    print(f"{torch.get_num_threads()} threads, {args.layers} layers x 4 projections, {args.slots} slots, R = "
          f"{args.rank}; weights {sizes['bfloat16']:.1f} MB bfloat16, {sizes['int8']:.1f} MB int8 (with scales); "
          + (f"caches flushed ({args.flush_mb} MB read) before each pass" if flush is not None else
             "no flush between passes"))
    print(f"ms per {args.layers}-layer pass, median (min) of {args.rounds} rounds")
    names = [name for name, _, _ in COLD_CONFIGS]
    header = f"{'T':>4} | " + " | ".join(f"{name:>17}" for name in names) + f" | {'int8/bf16':>9} | {'empty':>6}"
    print(header)
    print("-" * len(header))
    rows = []
    for tokens in args.tokens:
        slots = slot_ids(tokens, args.slots)
        passes = {name: cold_pass(ops, layers, tokens, slots, dtype, int8) for name, dtype, int8 in COLD_CONFIGS}
        passes["empty"] = cold_pass(ops, layers, tokens, torch.full_like(slots, -1), torch.bfloat16, False)
        times = {name: [] for name in passes}
        for fn in passes.values():
            fn()
        for _ in range(args.rounds):
            for name, fn in passes.items():
                if flush is not None:
                    flush.sum()
                start = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - start) * 1e3)
        med = {name: statistics.median(ts) for name, ts in times.items()}
        low = {name: min(ts) for name, ts in times.items()}
        row = {"tokens": tokens, "ms": med, "min_ms": low, "int8_over_bf16": med["int8"] / med["bfloat16"]}
        rows.append(row)
        cells = " | ".join(f"{med[name]:>8.2f} ({low[name]:>5.2f})" for name in names)
        print(f"{tokens:>4} | {cells} | {row['int8_over_bf16']:>9.2f} | {med['empty']:>6.2f}", flush=True)
    errors = cold_errors(ops, layers[0], args)
    return {"layers": args.layers, "flush_mb": args.flush_mb, "weights_mb": sizes, "rows": rows, "errors": errors}


def cold_errors(ops, modules, args) -> list[dict]:
    """The int8 delta against the delta of the bfloat16 weights it was quantized from (as float32:
    the same values), float32 x, y = 0."""
    tokens = 64
    slots = slot_ids(tokens, args.slots)
    print(f"\nint8 against bfloat16 weights, the delta of {tokens} tokens (float32 x, random weights):")
    print(f"{'shape':<8} | {'rel. L2 error':>13} | {'max err / max |delta|':>21}")
    out = []
    sq_err = sq_ref = 0.0
    for m in modules:
        g = torch.Generator().manual_seed(7)
        x = torch.randn(tokens, m["K"], generator=g)
        ref = torch.zeros(tokens, m["N"])
        ops.lora_add(x=x, y=ref, slots=slots, A=m["A"].float(), B=m["B"].float(), part_starts=m["part_starts"])
        got = torch.zeros(tokens, m["N"])
        ops.lora_add(x=x, y=got, slots=slots, A=m["A_q"], B=m["B_q"], part_starts=m["part_starts"],
                     A_scale=m["A_scale"], B_scale=m["B_scale"])
        err = (got.double() - ref.double())
        rel = float(err.norm() / ref.double().norm())
        worst = float(err.abs().max() / ref.double().abs().max())
        sq_err += float(err.pow(2).sum())
        sq_ref += float(ref.double().pow(2).sum())
        out.append({"shape": m["name"], "rel_l2": rel, "max_rel": worst})
        print(f"{m['name']:<8} | {rel:>13.4%} | {worst:>21.4%}")
    total = (sq_err / sq_ref) ** 0.5
    out.append({"shape": "all", "rel_l2": total})
    print(f"{'all':<8} | {total:>13.4%} |")
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cold", action="store_true", help="bfloat16 against int8 weights, from DRAM")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, nargs="+", default=None,
                        help="default: 1 16 64 512 (--cold: 1 16 64)")
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"])
    parser.add_argument("--rounds", type=int, default=None, help="default: 7 (--cold: 15)")
    parser.add_argument("--layers", type=int, default=30, help="--cold: layers, each with its own weights")
    parser.add_argument("--flush-mb", type=int, default=256, help="--cold: buffer read before each pass (0: none)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.tokens is None:
        args.tokens = [1, 16, 64] if args.cold else [1, 16, 64, 512]
    if args.rounds is None:
        args.rounds = 15 if args.cold else 7
    if args.out is None and RESULTS.is_dir():
        args.out = RESULTS / ("lora_kernel_cold.json" if args.cold else "lora_kernel.json")
    return args


def main(argv: list[str] | None = None, ops=None) -> None:
    args = parse_args(argv)
    if ops is None:
        from tokenmill.kernels import dispatch

        ops = dispatch.cpu_ops()
        if ops is None:
            raise SystemExit("needs tokenmill's CPU kernels (python -m tokenmill.kernels)")
    torch.set_num_threads(args.threads)
    if args.cold:
        result = cold_bench(ops, args)
    else:
        result = {"rows": bench(ops, args)}
    if args.out is not None:
        result = {"threads": args.threads, "rounds": args.rounds, "rank": args.rank, "slots": args.slots,
                  "machine": platform.processor() or platform.machine(), "torch": torch.__version__, **result}
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
