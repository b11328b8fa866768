"""Prefix-aware routing against round-robin at 2, 8 and 100 replicas, in simulation.

    python bench/scaleout_sim.py                       # service times from bench/results/scaleout.json
    python bench/scaleout_sim.py --prefill-ms 2.5 --decode-ms 30

The router is tokenmill's own (tokenmill/scaleout/policy.py, as the Ray request router runs it);
the replicas are tokenmill/scaleout/simulate.py's queueing model, with the per-token service times
``bench/scaleout.py`` measured on this machine (one replica, one thread). The workload scales with
the replica count: ``--prompts-per-replica`` system prompts per replica (so the fleet's caches
together hold them, one replica's never does), uniform or Zipf-skewed, Poisson arrivals at
``--load`` of the fleet's prefill capacity without any cache hit.

Writes bench/results/scaleout_sim.json and a plot of hit rate and TTFT p50/p99 against replicas.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from tqdm import tqdm

from tokenmill.scaleout.simulate import ServiceTimes, Workload, result_row, simulate

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--measured", default=str(RESULTS / "scaleout.json"),
                        help="bench/scaleout.py's output, for its service times")
    parser.add_argument("--prefill-ms", type=float, help="prefill ms per prompt token (instead of --measured)")
    parser.add_argument("--decode-ms", type=float, help="decode ms per output token (instead of --measured)")
    parser.add_argument("--replicas", default="2,8,100")
    parser.add_argument("--system-tokens", type=int, default=320)
    parser.add_argument("--question-tokens", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--cache-tokens", type=int, default=2048, help="prefix cache per replica, in tokens")
    parser.add_argument("--prompts-per-replica", type=float, default=5.0)
    parser.add_argument("--zipf", type=float, default=0.0)
    parser.add_argument("--load", type=float, default=0.7,
                        help="arrival rate as a fraction of the fleet's prefill capacity with no cache hits")
    parser.add_argument("--requests-per-replica", type=int, default=80)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--report-period", type=float, default=0.5)
    parser.add_argument("--seeds", type=int, default=1,
                        help="workloads per row (seeds n + 1000k): hit rate and TTFT means, p99 the median of the runs'")
    parser.add_argument("--out", default=str(RESULTS / "scaleout_sim.json"))
    args = parser.parse_args()

    if args.prefill_ms is not None and args.decode_ms is not None:
        times = ServiceTimes(args.prefill_ms / 1000, args.decode_ms / 1000)
        source = "given"
    else:
        measured = Path(args.measured)
        if not measured.exists():
            sys.exit(f"{measured} does not exist: run bench/scaleout.py first, or give --prefill-ms and --decode-ms")
        times = ServiceTimes(**json.loads(measured.read_text())["service_times"])
        source = str(measured)
    print(f"service times ({source}): prefill {times.prefill_per_token * 1000:.2f} ms/token, "
          f"decode {times.decode_per_token * 1000:.2f} ms/token")

    prompt_tokens = args.system_tokens + args.question_tokens
    rows = []
    counts = [int(n) for n in args.replicas.split(",")]
    with tqdm(total=2 * len(counts) * args.seeds, desc="simulating") as bar:
        for n in counts:
            capacity = n / (prompt_tokens * times.prefill_per_token)  # requests/s, every prompt computed
            for policy in ("prefix", "round_robin"):
                runs = []
                for k in range(args.seeds):
                    seed = n + 1000 * k
                    workload = Workload(num_prompts=max(int(args.prompts_per_replica * n), 2),
                                        system_tokens=args.system_tokens, question_tokens=args.question_tokens,
                                        output_tokens=args.output_tokens, num_requests=args.requests_per_replica * n,
                                        rate=args.load * capacity, zipf=args.zipf, seed=seed)
                    runs.append(result_row(simulate(policy, n, workload, times, slots=args.slots,
                                                    cache_blocks=args.cache_tokens // 16,
                                                    report_period=args.report_period, seed=seed)))
                    bar.update()
                rows.append(seed_summary(runs))
    print(f"{'replicas':>8} {'policy':12} {'hit rate':>8} {'TTFT p50':>9} {'TTFT p99':>9}")
    for row in rows:
        print(f"{row['replicas']:>8} {row['policy']:12} {row['hit_rate']:>8.3f} {row['ttft_p50'] * 1000:>7.0f}ms "
              f"{row['ttft_p99'] * 1000:>7.0f}ms")
    out = {"service_times": {"prefill_per_token": times.prefill_per_token,
                             "decode_per_token": times.decode_per_token, "source": source},
           "config": {k: v for k, v in vars(args).items() if k not in ("out", "measured")}, "results": rows}
    Path(args.out).write_text(json.dumps(out, indent=2))
    plot(rows, Path(args.out).with_suffix(".png"))
    print(f"wrote {args.out}")


def seed_summary(runs: list[dict]) -> dict:
    """One row for the runs of one (replicas, policy): hit rate, TTFT p50 and mean wait averaged, p99
    the median run's (a tail is noisy from one workload to the next)."""
    if len(runs) == 1:
        return runs[0]
    row = dict(runs[0], seeds=len(runs), requests=sum(r["requests"] for r in runs))
    for key in ("hit_rate", "ttft_p50", "mean_wait"):
        row[key] = statistics.fmean(r[key] for r in runs)
    row["ttft_p99"] = statistics.median(r["ttft_p99"] for r in runs)
    return row


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    for policy, color in (("prefix", "#2f6f9f"), ("round_robin", "#c0504d")):
        sel = [r for r in rows if r["policy"] == policy]
        xs = [r["replicas"] for r in sel]
        axes[0].plot(xs, [r["hit_rate"] * 100 for r in sel], "o-", color=color, label=policy)
        axes[1].plot(xs, [r["ttft_p50"] * 1000 for r in sel], "o-", color=color, label=policy)
        axes[2].plot(xs, [r["ttft_p99"] * 1000 for r in sel], "o-", color=color, label=policy)
    for ax, title in zip(axes, ("prefix-cache hit rate (%)", "TTFT p50 (ms)", "TTFT p99 (ms)")):
        ax.set_xscale("log")
        ax.set_xlabel("replicas")
        ax.set_title(title)
    axes[1].set_yscale("log")
    axes[2].set_yscale("log")
    axes[0].legend()
    fig.suptitle("simulated: prefix-aware routing vs round-robin (service times measured on this machine)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
