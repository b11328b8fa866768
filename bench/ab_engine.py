"""A/B of two checkouts of tokenmill on the engine's hot paths, interleaved: is a change slower?

    python bench/ab_engine.py --baseline DIR [--candidate .] [--pairs 5] [--num-requests 64]

Each pair runs one worker process per checkout, back to back, the order alternating between
pairs (A B, B A, ...), so drift of the shared machine hits both alike. A worker imports tokenmill
from its own checkout (PYTHONPATH) and measures, on that checkout's own bench scripts:

    offline   bench/offline_throughput.py's tokenmill side: its seeded random requests (prompts
              32-1024, outputs 16-512 tokens, EOS ignored), bfloat16, max batch 32; output tok/s
    b1-bf16   batch-1 greedy decode of SmolLM2 in bfloat16: (t(1 + N tokens) - t(1 token)) / N
              as bench/decode_prefill.py measures it, median of 3
    b1-int4   the same on an int4 g32 checkpoint (made once by the candidate's `tokenmill quantize`)

The figure per metric is the median over pairs of candidate / baseline. Prints the table, writes
bench/results/ab_engine.json and a PNG of every pair's values.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
METRICS = ("offline_tok_s", "b1_bf16_tok_s", "b1_int4_tok_s")


def worker(args: argparse.Namespace) -> None:
    """Runs inside one checkout: every metric once, JSON on the last line of stdout."""
    sys.path.insert(0, str(Path.cwd() / "bench"))
    import decode_prefill as dp
    import offline_throughput as ot

    from tokenmill import LLM

    out = {}
    llm = LLM("smollm2-135m-instruct", dtype="bfloat16", device="cpu", max_num_seqs=32)
    requests = ot.make_requests(args.num_requests, llm.model_config.vocab_size, 0, (32, 1024), (16, 512))
    ot.run_tokenmill(llm, requests[:2])  # warm-up
    elapsed = ot.run_tokenmill(llm, requests)
    out["offline_tok_s"] = sum(o for _, o in requests) / elapsed
    out["b1_bf16_tok_s"] = _batch1(dp, llm, args.decode_tokens)
    del llm
    out["b1_int4_tok_s"] = _batch1(dp, LLM(args.int4_dir, dtype="bfloat16", device="cpu"), args.decode_tokens)
    print(json.dumps(out), flush=True)


def _batch1(dp, llm, decode_tokens: int) -> float:
    ids = llm.tokenizer.encode("The history of the printing press begins")
    dp.time_tokenmill(llm, ids, 2)  # warm-up
    runs = []
    for _ in range(3):
        one = dp.time_tokenmill(llm, ids, 1)
        many = dp.time_tokenmill(llm, ids, 1 + decode_tokens)
        runs.append(decode_tokens / max(many - one, 1e-9))
    return statistics.median(runs)


def run_worker(checkout: Path, args: argparse.Namespace) -> dict:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--num-requests", str(args.num_requests),
           "--decode-tokens", str(args.decode_tokens), "--int4-dir", str(args.int4_dir)]
    proc = subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"worker in {checkout} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def ensure_int4(path: Path, candidate: Path) -> None:
    if (path / "config.json").exists():
        return
    print(f"quantizing an int4 g32 checkpoint into {path} ...", flush=True)
    subprocess.run([sys.executable, "-m", "tokenmill", "quantize", "smollm2-135m-instruct", "--method", "int4",
                    "--group-size", "32", "--out", str(path)], cwd=candidate,
                   env={**os.environ, "PYTHONPATH": str(candidate)}, check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", type=Path, help="checkout of the commit before the change")
    parser.add_argument("--candidate", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--num-requests", type=int, default=64, help="offline requests (the script's default: 256)")
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--int4-dir", type=Path, default=Path("/tmp/tokenmill-ab-int4-g32"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.baseline is None:
        parser.error("--baseline is required")
    checkouts = {"baseline": args.baseline.resolve(), "candidate": args.candidate.resolve()}
    ensure_int4(args.int4_dir, checkouts["candidate"])
    runs: dict[str, list[dict]] = {"baseline": [], "candidate": []}
    for i in range(args.pairs):
        order = ["baseline", "candidate"] if i % 2 == 0 else ["candidate", "baseline"]
        for name in order:
            start = time.perf_counter()
            runs[name].append(run_worker(checkouts[name], args))
            print(f"pair {i + 1}/{args.pairs} {name:9s} " + "  ".join(f"{m} {runs[name][-1][m]:7.1f}" for m in METRICS)
                  + f"  ({time.perf_counter() - start:.0f} s)", flush=True)
    summary = {}
    for m in METRICS:
        ratios = [c[m] / b[m] for b, c in zip(runs["baseline"], runs["candidate"])]
        summary[m] = {"baseline_median": statistics.median(r[m] for r in runs["baseline"]),
                      "candidate_median": statistics.median(r[m] for r in runs["candidate"]),
                      "ratio_median": statistics.median(ratios), "ratios": ratios}
    print(f"\n{'metric':16s} {'baseline':>9s} {'candidate':>9s} {'median ratio':>13s}")
    for m, s in summary.items():
        print(f"{m:16s} {s['baseline_median']:9.1f} {s['candidate_median']:9.1f} {s['ratio_median']:13.3f}")
    RESULTS.mkdir(exist_ok=True)
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "checkouts": {k: str(v) for k, v in checkouts.items()},
              "runs": runs, "summary": summary}
    (RESULTS / "ab_engine.json").write_text(json.dumps(result, indent=2))
    _plot(runs)


def _plot(runs: dict[str, list[dict]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(METRICS), figsize=(4 * len(METRICS), 3.2))
    for ax, m in zip(axes, METRICS):
        for name, color in (("baseline", "C0"), ("candidate", "C1")):
            ax.plot(range(1, len(runs[name]) + 1), [r[m] for r in runs[name]], "o-", color=color, label=name)
        ax.set_title(m)
        ax.set_xlabel("pair")
        ax.set_ylim(bottom=0)
    axes[0].set_ylabel("tok/s")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "ab_engine.png", dpi=100)
    print(f"wrote {RESULTS / 'ab_engine.json'} and .png")


if __name__ == "__main__":
    main()
