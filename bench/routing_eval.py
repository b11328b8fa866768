"""Routing evaluated on checkable answers: accuracy and measured cost per 1k requests of each policy.

    python bench/routing_eval.py --cheap /work/cache/smollm2-22layers --strong smollm2-135m-instruct \\
        --tasks next,capital,opposite,first_letter --n 120 --train 160 --price-per-hour 1.0

Two served models behind one ``tokenmill serve`` (``cheap`` and ``strong``), questions from
tokenmill.eval.tasks (each checked by its own checker), sent through the OpenAI chat endpoint
``--concurrency`` at a time, every policy on the same held-out items:

    cheap-only, strong-only   the models by name
    rule:length               prompts of at most the median length to the cheap model
    rule:tags                 requests tagged (``metadata.task``) with a task the cheap model got
                              within ``--rule-margin`` points of the strong one on the train split
    cascade@T                 the cheap answer unless its mean token logprob is below T
    learned@P                 a router trained (tokenmill route train) on the train split's
                              outcomes (label: the cheap model answered right), cheap when
                              P(cheap suffices) >= P

Cost is what the server measured and returned per request (``usage.cost``: the request's share
of every step it ran in, at ``--price-per-hour``; a cascade pays for both attempts). The first
server runs the train split and every policy but the learned ones; the second, started with the
trained router, runs those. Writes bench/results/routing_eval.json, a markdown table and a plot
of accuracy against cost per 1k requests with the Pareto frontier.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launch import free_port, wait_ready  # noqa: E402

from tokenmill.benchmark.report import grid, save_figure  # noqa: E402
from tokenmill.eval.tasks import TaskItem, mixture  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cheap", required=True, help="the cheaper model's source")
    p.add_argument("--strong", default="smollm2-135m-instruct", help="the stronger model's source")
    p.add_argument("--tasks", default="next,capital,opposite,first_letter", help="comma-separated task names")
    p.add_argument("--n", type=int, default=120, help="held-out items every policy answers")
    p.add_argument("--train", type=int, default=160, help="train-split items the rule and the router learn from")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=12)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--price-per-hour", type=float, default=1.0)
    p.add_argument("--thresholds", default="-0.2,-0.4,-0.7,-1.0", help="cascade thresholds (mean logprob)")
    p.add_argument("--router-thresholds", default="0.35,0.5,0.65", help="learned-route probability thresholds")
    p.add_argument("--rule-margin", type=float, default=5.0, help="points the cheap model may trail on a task")
    p.add_argument("--serve-args", default="--max-num-seqs 8", help="extra flags for tokenmill serve")
    p.add_argument("--out", default=str(RESULTS / "routing_eval.json"))
    return p.parse_args()


class Server:
    """``tokenmill serve`` with the two models (and routes) in a subprocess, stopped on exit."""

    def __init__(self, args: argparse.Namespace, routes: list[dict], workdir: Path, name: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        routes_file = workdir / f"routes-{name}.json"
        routes_file.write_text(json.dumps({"routes": routes}))
        self.log = workdir / f"serve-{name}.log"
        self.cmd = [sys.executable, "-m", "tokenmill", "serve", "--model", f"cheap={args.cheap}", "--model",
                    f"strong={args.strong}", "--port", str(self.port), "--price-per-hour", str(args.price_per_hour),
                    "--routes", str(routes_file), "--request-timeout", "1200", *args.serve_args.split()]

    def __enter__(self) -> Server:
        self.proc = subprocess.Popen(self.cmd, stdout=self.log.open("w"), stderr=subprocess.STDOUT)
        wait_ready(self.url, self.proc, str(self.log))
        return self

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


async def ask_all(url: str, model: str, items: list[TaskItem], args: argparse.Namespace, label: str) -> list[dict]:
    """Every item through ``model`` (a served model or a route) -> one record per item, in order."""
    gate = asyncio.Semaphore(args.concurrency)
    bar = tqdm(total=len(items), desc=label, unit="req", leave=False)

    async def one(client: httpx.AsyncClient, item: TaskItem) -> dict:
        async with gate:
            r = await client.post("/v1/chat/completions", json={
                "model": model, "messages": item.messages, "max_tokens": args.max_tokens, "temperature": 0,
                "metadata": {"task": item.task}})
        bar.update(1)
        r.raise_for_status()
        body = r.json()
        text = body["choices"][0]["message"]["content"]
        return {"id": item.id, "task": item.task, "answered_by": body["model"], "correct": item.check(text),
                "cost": body["usage"]["cost"], "prompt_tokens": body["usage"]["prompt_tokens"], "text": text}

    async with httpx.AsyncClient(base_url=url, timeout=1200) as client:
        out = await asyncio.gather(*[one(client, item) for item in items])
    bar.close()
    return out


def summary(label: str, records: list[dict]) -> dict:
    n = len(records)
    return {"policy": label, "n": n, "accuracy": sum(r["correct"] for r in records) / n,
            "cost_per_1k_requests": 1000 * sum(r["cost"] for r in records) / n,
            "to_cheap": sum(r["answered_by"] == "cheap" for r in records) / n}


def accuracy_by_task(records: list[dict]) -> dict[str, float]:
    tasks = sorted({r["task"] for r in records})
    return {t: 100 * statistics.mean(r["correct"] for r in records if r["task"] == t) for t in tasks}


def frontier(points: list[dict]) -> list[dict]:
    """Policies no other is both cheaper (or as cheap) and more accurate (or as accurate) than."""
    def dominated(p):
        return any(q is not p and q["cost_per_1k_requests"] <= p["cost_per_1k_requests"]
                   and q["accuracy"] >= p["accuracy"] and (q["cost_per_1k_requests"], q["accuracy"])
                   != (p["cost_per_1k_requests"], p["accuracy"]) for q in points)
    return sorted((p for p in points if not dominated(p)), key=lambda p: p["cost_per_1k_requests"])


def plot(points: list[dict], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    front = frontier(points)
    ax.plot([p["cost_per_1k_requests"] for p in front], [100 * p["accuracy"] for p in front], "-", color="tab:blue",
            label="Pareto frontier", zorder=1)
    for i, p in enumerate(sorted(points, key=lambda p: (p["accuracy"], p["cost_per_1k_requests"]))):
        kind = p["policy"].split("@")[0].split(":")[0]
        color = {"cheap-only": "tab:red", "strong-only": "tab:green", "rule": "tab:purple", "cascade": "tab:orange",
                 "learned": "tab:brown"}.get(kind, "gray")
        ax.scatter(p["cost_per_1k_requests"], 100 * p["accuracy"], color=color, zorder=2)
        ax.annotate(p["policy"], (p["cost_per_1k_requests"], 100 * p["accuracy"]), textcoords="offset points",
                    xytext=(5, 4 if i % 2 else -11), fontsize=8)  # alternate sides: neighbours stay legible
    ax.set_xlabel("measured cost per 1k requests (price-per-hour units)")
    ax.set_ylabel("accuracy (%)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    return save_figure(fig, path)


def train_router(records: list[dict], items: list[TaskItem], url: str, workdir: Path) -> Path:
    """The learned route's router, from the cheap model's train-split outcomes (token ids from /tokenize)."""
    log = workdir / "outcomes.jsonl"
    with log.open("w") as f:
        for record, item in zip(records, items):
            ids = httpx.post(url + "/tokenize", json={"model": "cheap", "messages": item.messages},
                             timeout=60).json()["tokens"]
            f.write(json.dumps({"prompt_token_ids": ids, "label": int(record["correct"])}) + "\n")
    router = workdir / "router.json"
    subprocess.run([sys.executable, "-m", "tokenmill", "route", "train", "--log", str(log), "--out", str(router)],
                   check=True)
    return router


def main() -> None:
    args = parse_args()
    tasks = args.tasks.split(",")
    train_items = mixture(tasks, args.train, args.seed, "train")
    eval_items = mixture(tasks, args.n, args.seed, "eval")
    workdir = Path(tempfile.mkdtemp(prefix="routing-eval-"))
    thresholds = [float(t) for t in args.thresholds.split(",")]
    results: dict[str, list[dict]] = {}
    with Server(args, [], workdir, "probe") as server:
        train = {m: asyncio.run(ask_all(server.url, m, train_items, args, f"train {m}")) for m in ("cheap", "strong")}
        by_task = {m: accuracy_by_task(r) for m, r in train.items()}
        easy = [t for t in tasks if by_task["cheap"][t] >= by_task["strong"][t] - args.rule_margin]
        lengths = sorted(r["prompt_tokens"] for r in train["cheap"])
        router = train_router(train["cheap"], train_items, server.url, workdir)
    routes = [{"name": "rule:length", "policy": "rule", "default": "strong",
               "rules": [{"max_prompt_tokens": lengths[len(lengths) // 2], "model": "cheap"}]},
              {"name": "rule:tags", "policy": "rule", "default": "strong",
               "rules": [{"tags": {"task": t}, "model": "cheap"} for t in easy]},
              *({"name": f"cascade@{t:g}", "policy": "cascade", "models": ["cheap", "strong"], "threshold": t}
                for t in thresholds),
              *({"name": f"learned@{p}", "policy": "learned", "models": ["cheap", "strong"], "router": str(router),
                 "threshold": float(p)} for p in args.router_thresholds.split(","))]
    with Server(args, routes, workdir, "eval") as server:
        for policy in ["cheap", "strong", *(r["name"] for r in routes)]:
            results[policy] = asyncio.run(ask_all(server.url, policy, eval_items, args, policy))
    points = [summary({"cheap": "cheap-only", "strong": "strong-only"}.get(k, k), v) for k, v in results.items()]
    gap = 100 * (points[1]["accuracy"] - points[0]["accuracy"])
    front = {p["policy"] for p in frontier(points)}
    rows = [[p["policy"], f"{100 * p['accuracy']:.1f}", f"{p['cost_per_1k_requests']:.4f}",
             f"{100 * p['to_cheap']:.0f}%", "*" if p["policy"] in front else ""] for p in points]
    print(grid(["policy", "accuracy %", "cost / 1k req", "to cheap", "frontier"], rows,
               title=f"{len(eval_items)} held-out items of {', '.join(tasks)}; strong - cheap = {gap:.1f} points"))
    print(f"train-split accuracy by task: {json.dumps(by_task)}; rule:tags sends {easy} to the cheap model")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": vars(args), "gap_points": gap, "train_accuracy_by_task": by_task,
                               "rule_tags_cheap_tasks": easy, "policies": points, "frontier": sorted(front),
                               "eval_accuracy_by_task": {k: accuracy_by_task(v) for k, v in results.items()},
                               "records": results}, indent=1))
    md = out.with_suffix(".md")
    md.write_text("| policy | accuracy % | cost / 1k requests | to cheap | frontier |\n|---|---|---|---|---|\n"
                  + "\n".join("| " + " | ".join(r) + " |" for r in rows) + "\n")
    path = plot(points, out.with_suffix(".png"), f"routing on {len(eval_items)} held-out items "
                f"({', '.join(tasks)})\ncheap={Path(args.cheap).name}, strong={Path(args.strong).name}, "
                f"concurrency {args.concurrency}")
    print(f"wrote {out}, {md} and {path}")


if __name__ == "__main__":
    main()
