"""The batched multi-LoRA CPU kernel (``lora_add``, tokenmill/kernels/cpu/lora.cpp) against a PyTorch
per-slot loop, on SmolLM2-135M's projections.

    python bench/lora_kernel.py [--threads 2] [--tokens 1 16 64 512] [--slots 8] [--rank 16]
                                [--dtypes bfloat16 float32] [--rounds 7] [--out bench/results/lora_kernel.json]

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
Prints a table; writes JSON to --out (by default bench/results/lora_kernel.json, when
bench/results exists).
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 512])
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path, default=RESULTS / "lora_kernel.json" if RESULTS.is_dir() else None)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None, ops=None) -> None:
    args = parse_args(argv)
    if ops is None:
        from tokenmill.kernels import dispatch

        ops = dispatch.cpu_ops()
        if ops is None:
            raise SystemExit("needs tokenmill's CPU kernels (python -m tokenmill.kernels)")
    torch.set_num_threads(args.threads)
    rows = bench(ops, args)
    if args.out is not None:
        result = {"threads": args.threads, "rounds": args.rounds, "rank": args.rank, "slots": args.slots,
                  "machine": platform.processor() or platform.machine(), "torch": torch.__version__, "rows": rows}
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
