"""AMX tiles against the vector kernels, end to end, on a host that has them: batch-1 decode and
prefill of one model, in child processes run with and without ``TOKENMILL_AMX=0``, interleaved by
round so that machine noise hits both alike.

    python bench/amx.py [--model smollm2-135m-instruct] [--rounds 3] [--dtypes auto,bfloat16]
                        [--prefill-lens 256,2048] [--out bench/results/amx-MODEL.json]

Each child is ``bench/peers/decode_prefill_peers.py``'s own (``LLM(model, dtype)``, a warm-up, then
decode tok/s = (N - 1) / (time of N tokens - time of 1) on a 256-token prompt, and the time to the
first token of one prompt of each prefill length, fresh random ids every call). ``auto`` keeps a
GGUF's weights as stored (bfloat16 activations); ``bfloat16`` dequantizes them. Prints medians and
the tiles / vectors ratios; writes JSON and a PNG beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
CHILD = HERE / "peers" / "decode_prefill_peers.py"
RESULTS = HERE / "results"


def run(task: dict, amx: bool) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(task["threads"]), "TOKENMILL_AMX": "1" if amx else "0"}
    proc = subprocess.run([sys.executable, str(CHILD), "--child", json.dumps(task)], env=env, capture_output=True,
                          text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"child failed ({'tiles' if amx else 'vectors'}): {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtypes", default="auto,bfloat16")
    parser.add_argument("--prefill-lens", default="256,2048")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    from tokenmill.kernels import dispatch

    ops = dispatch.cpu_ops()
    if ops is None or not ops.amx_tiles():
        raise SystemExit("this host runs no AMX tiles (no AMX-BF16, no tile state granted, or TOKENMILL_AMX=0)")
    lens = [int(v) for v in args.prefill_lens.split(",") if v]
    runs: dict[str, dict[str, list]] = {}
    for r in range(args.rounds):
        for dtype in args.dtypes.split(","):
            for amx in (True, False):
                task = {"model": args.model, "dtype": dtype, "threads": args.threads, "seed": r, "prompt_len": 256,
                        "decode_tokens": 128, "prefill": lens}
                out = run(task, amx)
                side = runs.setdefault(dtype, {}).setdefault("tiles" if amx else "vectors", [])
                side.append(out)
                print(f"round {r + 1} {dtype:9s} {'tiles' if amx else 'vectors':7s} decode {out['decode_tok_s']:6.1f} "
                      "tok/s  " + "  ".join(f"prefill {L}: {int(L) / t:6.0f} tok/s" for L, t in out["ttft_s"].items()),
                      flush=True)
    summary = {}
    print(f"\n{args.model}, medians of {args.rounds} rounds, tiles / vectors:")
    for dtype, sides in runs.items():
        row = {}
        for side, outs in sides.items():
            row[side] = {"decode_tok_s": statistics.median(o["decode_tok_s"] for o in outs),
                         **{f"prefill_{L}_tok_s": statistics.median(L / o["ttft_s"][str(L)] for o in outs)
                            for L in lens}}
        row["ratio"] = {k: row["tiles"][k] / row["vectors"][k] for k in row["tiles"]}
        summary[dtype] = row
        print(f"  {dtype:9s} " + "  ".join(f"{k}: {row['tiles'][k]:.0f} / {row['vectors'][k]:.0f} = x{v:.2f}"
                                          for k, v in row["ratio"].items()))
    out = args.out or RESULTS / f"amx-{args.model}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": args.model, "rounds": args.rounds, "threads": args.threads,
                               "summary": summary, "runs": runs}, indent=1) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = list(next(iter(summary.values()))["tiles"])
    fig, axes = plt.subplots(1, len(metrics), figsize=(4 * len(metrics), 3.5))
    for ax, metric in zip(axes, metrics):
        names = list(summary)
        for i, side in enumerate(("vectors", "tiles")):
            ax.bar([j + 0.4 * i for j in range(len(names))], [summary[n][side][metric] for n in names], 0.4,
                   label=side)
        ax.set_xticks([j + 0.2 for j in range(len(names))], names)
        ax.set_title(metric.replace("_", " "))
    axes[0].legend()
    fig.suptitle(f"{args.model}: AMX tiles vs vector kernels")
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
