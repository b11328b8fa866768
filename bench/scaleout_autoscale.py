"""Autoscaling, watched: replicas over time under a burst of load, then idle.

    python bench/scaleout_autoscale.py

``tokenmill serve MODEL --replicas 1 --min-replicas 1 --max-replicas 2`` (tokenmill's policy:
engine queue per replica against ``--target-queue``, TTFT p90 against ``--slo-ttft``), on a Ray
cluster this script starts and stops. A burst of ``--burst`` requests, ``--concurrency`` at a time,
then idle. Every 0.5 s it records Ray Serve's running replicas and the requests in flight; it
reports when the second replica started serving, when the fleet went back to one (its
replica drained first), and whether any request failed. Writes bench/results/scaleout_autoscale.json
and a plot of the timeline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scaleout import RESULTS, VENV_BIN, run_load, stop_front  # noqa: E402
from launch import free_port, wait_ready  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--burst", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--idle", type=float, default=40.0, help="seconds watched after the burst")
    parser.add_argument("--out", default=str(RESULTS / "scaleout_autoscale.json"))
    args = parser.parse_args()
    RESULTS.mkdir(exist_ok=True)
    subprocess.run([str(VENV_BIN / "ray"), "stop"], capture_output=True)
    subprocess.run([str(VENV_BIN / "ray"), "start", "--head", "--num-cpus", "2", "--disable-usage-stats",
                    "--include-dashboard", "false"], check=True, capture_output=True)
    import ray
    from ray import serve

    port = free_port()
    log = RESULTS / "scaleout-autoscale.log"
    proc = subprocess.Popen([str(VENV_BIN / "tokenmill"), "serve", args.model, "--replicas", "1", "--min-replicas", "1",
                             "--max-replicas", "2", "--target-queue", "2", "--upscale-delay", "2",
                             "--downscale-delay", "10", "--replica-threads", "1", "--ray-address", "auto",
                             "--port", str(port), "--dtype", "bfloat16", "--max-num-seqs", "4",
                             "--served-model-name", "m"], stdout=log.open("w"), stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    timeline: list[dict] = []
    done = threading.Event()
    in_flight = [0]
    try:
        wait_ready(base, proc, str(log))
        ray.init(address="auto", logging_level="ERROR")
        start = time.perf_counter()

        def watch() -> None:
            while not done.is_set():
                status = serve.status().applications["tokenmill"].deployments["tokenmill-engine"]
                timeline.append({"t": time.perf_counter() - start, "running": status.replica_states.get("RUNNING", 0),
                                 "in_flight": in_flight[0]})
                time.sleep(0.5)
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        prompts = [f"Request {i}: write a short note about the number {i}." for i in range(args.burst)]

        def progress() -> None:
            in_flight[0] -= 1
        in_flight[0] = len(prompts)
        results = asyncio.run(run_load(base, "m", prompts, args.concurrency, args.max_tokens, on_progress=progress))
        burst_end = time.perf_counter() - start
        time.sleep(args.idle)
        done.set()
        watcher.join()
    finally:
        ray.shutdown()
        stop_front(proc)
        subprocess.run([str(VENV_BIN / "ray"), "stop"], capture_output=True)
    up = next((p["t"] for p in timeline if p["running"] >= 2), None)
    down = next((p["t"] for p in timeline if p["t"] > burst_end and p["running"] == 1), None) if up else None
    errors = sum(r["error"] is not None for r in results)
    summary = {"burst_requests": len(results), "errors": errors, "burst_seconds": burst_end,
               "second_replica_running_at": up, "back_to_one_at": down}
    print(f"burst of {len(results)} requests ended at {burst_end:.1f} s with {errors} errors; second replica "
          f"running at {up if up is None else round(up, 1)} s; back to one at {down if down is None else round(down, 1)} s")
    Path(args.out).write_text(json.dumps({"summary": summary, "timeline": timeline}, indent=2))
    plot(timeline, burst_end, Path(args.out).with_suffix(".png"))
    print(f"wrote {args.out}")


def plot(timeline: list[dict], burst_end: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.2))
    ts = [p["t"] for p in timeline]
    ax.step(ts, [p["running"] for p in timeline], where="post", label="running replicas", color="#2f6f9f")
    ax2 = ax.twinx()
    ax2.plot(ts, [p["in_flight"] for p in timeline], color="#c0504d", alpha=0.6, label="requests left in the burst")
    ax.axvline(burst_end, color="grey", linestyle=":")
    ax.set_xlabel("seconds")
    ax.set_ylabel("replicas")
    ax.set_ylim(0, 3)
    ax2.set_ylabel("requests left")
    fig.legend(loc="center right", bbox_to_anchor=(0.88, 0.6))
    fig.suptitle("autoscaling on engine queue (min 1, max 2 replicas)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
