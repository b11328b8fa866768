"""The weight-only CPU linears against tokenmill's bfloat16 GEMM, shape by shape and rows by rows.

    python bench/quantized_linear.py [--threads 2] [--rows 1 4 16 64 256 2048] [--mins asymmetric]
                                     [--group-size 32] [--budget 1.5] [--out bench/results/quantized_linear.json]

Kernels, all on the same shapes with bfloat16 x and bfloat16 out:
    bf16     bf16_packed_linear (tokenmill/kernels/cpu/bf16_linear.cpp), bfloat16 weights
    int4     int4_weight_linear, tokenmill's own int4 (w = (q - 8) * scale + zero, bfloat16 scales),
             on group_linear.cpp's kernel
    group4   group_weight_linear bits 4 (w = code * scale + min, codes 0..15: Q4_1 / Q4_K)
    group4vec  group4 on KernelPath.VECTOR: vdpbf16ps products at every row count, what the
             fixed-point products (few rows, AVX-512 VNNI), AMX tiles and, from dequant_rows() rows,
             the bfloat16 GEMM over weights dequantized once per call replace
    group5   group_weight_linear bits 5 (codes 0..31, 5/8 of a byte each: Q5_0, Q5_1, Q5_K)
    group7   group_weight_linear bits 7 (codes 0..127, a byte each: Q6_K)
    group8   group_weight_linear bits 8 (codes 0..255: Q8_0)
    i8copy8  int8_copy_linear over the same codes' int8 copy (grouped.int8_copy_pack: a byte each, 4
             columns a 32-bit lane; x in two int8 parts per group, vpdpbusd), what 8-bit layers take
             below the bfloat16 copy's rows with --int8-copies
all with --group-size input columns per group (32: Q4_0 .. Q8_0, Q4_K, Q5_K; 16: Q6_K), and
    int8     tokenmill's int8 (``Int8Linear`` with bfloat16 scales: symmetric codes, one scale per
             output channel), on the grouped kernel with one group per row
    int8fma  int8_weight_linear, the per-channel int8 kernel float32 activations keep (int8 -> float32,
             one float32 fma per weight)
--mins asymmetric (default): random mins of both signs, the K-quants' and Q4_1's case (the
many-rows schedule then pays two fmas per group end); symmetric: min = -offset * scale, held as
scales alone as a Q4_0, Q5_0 or Q8_0 file loads (the folded minimum is 0 and its fma skipped).

Shapes (--shapes layers): SmolLM2-135M's fused qkv (576 -> 1536 rounded), gate_up (576 -> 3072) and
down (1536 -> 576); Gemma-3-270M-like 640 -> 2048, 2048 -> 640, 1024 -> 640; --shapes heads: the
two tied LM heads, 576 -> 49152 and 640 -> 262144 (168M weights: past L3 in every layout); --shapes
stack: SmolLM2's 30 decoder layers (qkv 576 -> 960, o, gate_up, down), each layer its own weights, one
pass over all 120 linears a call, so that the weights stream from memory as in a decode step (its N is
the stack's weights / 576, so that GFLOP/s counts them all).
Weights hot (every kernel's weights in cache as far as they fit: the same call repeated), --threads
threads, each figure the median of repeated timings, the kernels interleaved round by round so
that machine noise hits all alike.
GFLOP/s = 2 M N K / time; "x bf16" is the median over rounds of bf16's time / the kernel's in the
same round. Prints a table and writes JSON (bench/results/quantized_linear.json).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from tokenmill.kernels import dispatch
from tokenmill.loading.gguf_groups import GroupedWeight
from tokenmill.quantization import kernels as qk
from tokenmill.quantization.grouped import int8_copy_pack
from tokenmill.quantization.linear import Int8Linear

RESULTS = Path(__file__).parent / "results"
SHAPES = [("smollm2 qkv", 576, 1536), ("smollm2 gate_up", 576, 3072), ("smollm2 down", 1536, 576),
          ("gemma 640->2048", 640, 2048), ("gemma 2048->640", 2048, 640), ("gemma 1024->640", 1024, 640)]
HEADS = [("smollm2 lm_head", 576, 49152), ("gemma lm_head", 640, 262144)]
STACK_LAYERS = 30
STACK = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # SmolLM2's qkv, o, gate_up, down: (K, N)


def stack(group: int, symmetric: bool, names) -> dict:
    """One callable of x [M, 576] per kernel: SmolLM2's STACK_LAYERS decoder layers' linears, each
    layer its own random weights (60 MB of 4-bit codes, 212 MB of bfloat16: past L3), called in
    layer order as a decode step calls them, so that the weights stream from memory."""
    layers = [[weights(n, k, group, symmetric, seed=len(STACK) * i + j, names=names)
               for j, (k, n) in enumerate(STACK)] for i in range(STACK_LAYERS)]
    xs = {}

    def run(name, x):
        m = x.shape[0]
        for layer in layers:
            for fns, (k, _) in zip(layer, STACK):
                if (k, m) not in xs:
                    xs[k, m] = torch.randn(m, k, generator=torch.Generator().manual_seed(k + m)).bfloat16()
                fns[name](x if k == x.shape[1] else xs[k, m])

    return {name: (lambda name: lambda x: run(name, x))(name) for name in layers[0][0]}
KERNELS = ["bf16", "int4", "group4", "group4vec", "group5", "group7", "group8", "i8copy8", "int8", "int8fma"]


def weights(n: int, k: int, group: int, symmetric: bool, seed: int, names=KERNELS):
    """One (callable of x) per kernel of ``names``, over random weights of the same shape."""
    ops = dispatch.cpu_ops()
    g = torch.Generator().manual_seed(seed)
    groups = k // group
    empty = torch.empty(0)
    fns = {}
    if "bf16" in names:
        bf16 = ops.bf16_pack((torch.randn(n, k, generator=g) * k ** -0.5).bfloat16())
        fns["bf16"] = lambda x: ops.bf16_packed_linear(x, bf16, n, empty)
    if "int4" in names:
        q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
        scale = (torch.rand(n, groups, generator=g) * 0.02).bfloat16()
        zero = (torch.randn(n, groups, generator=g) * 0.01).bfloat16()
        int4 = qk.int4_cpu_pack(qk.pack_nibbles(q), scale, zero)
        fns["int4"] = lambda x: ops.int4_weight_linear(x, int4[0], int4[1], group)
    for bits, largest, offset in ((4, 15, 8), (5, 31, 16), (7, 63, 32), (8, 255, 128)):
        wanted = [name for name in (f"group{bits}", f"group{bits}vec", f"i8copy{bits}") if name in names]
        if not wanted:
            continue
        codes = torch.randint(0, largest + 1, (n, k), generator=g, dtype=torch.uint8)
        s = torch.randn(n, groups, generator=g) * 0.01
        mins = -offset * s if symmetric else torch.randn(n, groups, generator=g) * 0.01 * offset
        if f"i8copy{bits}" in wanted:
            copy, copy_offset = int8_copy_pack(GroupedWeight(codes, s, mins, group, bits))
            fns[f"i8copy{bits}"] = lambda x: ops.int8_copy_linear(x, copy, n, group, copy_offset, empty)
            wanted.remove(f"i8copy{bits}")
        packed, sz = qk.group_cpu_pack(codes, s, mins, bits)
        if symmetric:  # Q4_0, Q5_0, Q8_0 as loaded: scales alone
            sz = qk.scales_alone(sz, bits)
        del codes
        for name in wanted:
            path = ops.KernelPath.VECTOR if name.endswith("vec") else ops.KernelPath.FASTEST
            fns[name] = (lambda packed, sz, bits, path: lambda x: ops.group_weight_linear(
                x, packed, sz, group, bits, path=path))(packed, sz, bits, path)
    if "int8" in names or "int8fma" in names:
        int8 = Int8Linear.from_float(torch.randn(n, k, generator=g) * k ** -0.5, None, torch.bfloat16)
        fns["int8"] = int8.matmul
        fns["int8fma"] = lambda x: ops.int8_weight_linear(x, int8.qweight, int8.scale)
    return {name: fns[name] for name in names if name in fns}


def measure(fns: dict, x: torch.Tensor, budget: float, min_rounds: int = 5,
            max_rounds: int = 2000) -> tuple[dict, dict]:
    """Median seconds per call of each fn, interleaved round by round for about ``budget`` s, and
    each fn's speed against bf16 as the median over rounds of the round's bf16 time / its time
    (paired within a round: what machine noise moves between rounds cancels)."""
    for f in fns.values():  # warm: weights into cache, allocations settled
        f(x), f(x)
    times = {name: [] for name in fns}
    start = time.perf_counter()
    while True:
        for name, f in fns.items():
            t0 = time.perf_counter()
            f(x)
            times[name].append(time.perf_counter() - t0)
        rounds = len(times["bf16"])
        if rounds >= max_rounds or (rounds >= min_rounds and time.perf_counter() - start > budget):
            break
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    paired = {name: statistics.median(b / t for b, t in zip(times["bf16"], ts)) for name, ts in times.items()}
    return medians, paired


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 256, 2048])
    parser.add_argument("--mins", choices=["asymmetric", "symmetric"], default="asymmetric")
    parser.add_argument("--group-size", type=int, default=32, choices=[16, 32, 64])
    parser.add_argument("--budget", type=float, default=1.5, help="seconds of timing per (shape, rows)")
    parser.add_argument("--kernels", nargs="+", choices=KERNELS[1:], default=KERNELS[1:],
                        help="which kernels to time beside bf16 (default: all)")
    parser.add_argument("--shapes", choices=["layers", "heads", "stack"], default="layers",
                        help="layers: the decoder layers' linears (hot in cache); heads: the tied LM heads "
                             "(Q8_0 in both shipped files: use --kernels group8 --mins symmetric), 28M and "
                             "168M weights, the Gemma one streamed from DRAM at every call; stack: SmolLM2's "
                             "30 layers' linears, distinct weights, one pass over all per call (streamed)")
    parser.add_argument("--out", type=Path, default=RESULTS / "quantized_linear.json")
    args = parser.parse_args()
    kernels = ["bf16", *args.kernels]
    ops = dispatch.cpu_ops()
    if ops is None or not ops.bf16_linear_fast() or not ops.group_linear_fast():
        raise SystemExit("needs tokenmill's CPU kernels with their AVX-512 BF16 paths")
    torch.set_num_threads(args.threads)
    rows = []
    header = (f"{'shape':<16} {'K':>5} {'N':>5} {'M':>5} | {'bf16 ms':>8} {'GF/s':>6} | "
              + " | ".join(f"{k + ' ms':>10} {'GF/s':>5} {'x bf16':>6}" for k in kernels[1:]))
    amx = ops.amx_tiles()
    tiles = f"AMX tiles from {ops.amx_min_rows()} rows (TOKENMILL_AMX=0: none)" if amx else "no AMX tiles"
    fixed = ops.fixed_point_rows()
    fixed_text = f"grouped codes on integer products below {fixed} rows" if fixed else "no fixed-point products"
    dequant = ops.dequant_rows()
    dequant_text = (f"from {dequant} rows the bfloat16 GEMM over weights dequantized once per call" if dequant
                    else "no dequantized rows")
    where = "weights streamed (30 layers a call)" if args.shapes == "stack" else "weights hot"
    print(f"{args.threads} threads, group {args.group_size}, {args.mins} mins, {where}, median per call; {tiles}; "
          f"{fixed_text}; {dequant_text}")
    print(header)
    print("-" * len(header))
    start = time.perf_counter()
    shapes = {"layers": SHAPES, "heads": HEADS,
              "stack": [(f"smollm2 x{STACK_LAYERS}", 576, sum(n * k for k, n in STACK) * STACK_LAYERS // 576)]}
    for i, (name, k, n) in enumerate(shapes[args.shapes]):
        fns = stack(args.group_size, args.mins == "symmetric", kernels) if args.shapes == "stack" else \
            weights(n, k, args.group_size, args.mins == "symmetric", seed=i, names=kernels)
        for m in args.rows:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
            t, ratio = measure(fns, x, args.budget)
            flop = 2 * m * n * k
            for kernel in kernels:
                rows.append({"shape": name, "K": k, "N": n, "M": m, "kernel": kernel, "ms": t[kernel] * 1e3,
                             "gflops": flop / t[kernel] / 1e9, "ratio_to_bf16": ratio[kernel]})
            print(f"{name:<16} {k:>5} {n:>5} {m:>5} | {t['bf16'] * 1e3:>8.3f} {flop / t['bf16'] / 1e9:>6.0f} | "
                  + " | ".join(f"{t[kn] * 1e3:>10.3f} {flop / t[kn] / 1e9:>5.0f} {ratio[kn]:>6.2f}"
                               for kn in kernels[1:]), flush=True)
    elapsed = time.perf_counter() - start
    result = {"threads": args.threads, "group_size": args.group_size, "mins": args.mins, "shapes": args.shapes,
              "x_dtype": "bfloat16",
              "amx_tiles": amx, "amx_min_rows": ops.amx_min_rows(), "fixed_point_rows": fixed,
              "dequant_rows": dequant,
              "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
              "seconds": round(elapsed, 1), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out} ({elapsed:.0f} s)")


if __name__ == "__main__":
    main()
