"""Speculative decoding on and off, side by side in one run: output tok/s, acceptance, kept tokens per step.

    python bench/speculative.py [--model smollm2-135m-instruct] [--batches 1 4 16] [--rounds 3]
                                [--max-tokens 192] [--k 4]

Workloads, fixed here and built from the corpus (Shakespeare, public domain) so that every run
measures the same prompts:
    copy   "Copy the following passage exactly": input-grounded, the n-gram proposer's case
    edit   "Rewrite the passage, changing only the names": mostly copied, partly new
    open   a plain continuation of a passage: open-ended, little to look up

Each (workload, batch) runs speculation off and on in alternating order, ``--rounds`` times, on
the same prompts (greedy, EOS allowed; output tokens counted as produced: in bfloat16 a near-tie
may send the two down different paths). Reports the median output tok/s of each, their ratio, the
acceptance rate (kept / drafted) and the output tokens per engine step of each (how many steps
speculation saved). Writes JSON and a PNG under bench/results/.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from tokenmill import LLM, SamplingParams
from tokenmill.eval.corpus import fetch_corpus

RESULTS = Path(__file__).parent / "results"
WORKLOADS = {
    "copy": "Copy the following passage exactly, word for word.\n\n{passage}",
    "edit": "Rewrite the following passage, changing only the names of the people in it.\n\n{passage}",
    "open": "{passage}",
}


def prompts(llm: LLM, workload: str, n: int, seed: int) -> list[list[int]]:
    text = fetch_corpus().read_text(encoding="utf-8")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        at = rng.randrange(0, len(text) - 2000)
        passage = text[at:at + rng.randrange(600, 1200)]
        out.append(llm.tokenizer.encode(WORKLOADS[workload].format(passage=passage)))
    return out


def run(llm: LLM, ids: list[list[int]], max_tokens: int) -> tuple[float, int, int, float]:
    """-> (output tok/s, drafted, kept, output tokens per step) of one generate call."""
    drafter = llm.engine.drafter
    before = (drafter.num_draft_tokens, drafter.num_accepted_tokens) if drafter else (0, 0)
    llm.engine.stats.clear()
    start = time.perf_counter()
    outs = llm.generate(ids, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    drafted = (drafter.num_draft_tokens - before[0]) if drafter else 0
    kept = (drafter.num_accepted_tokens - before[1]) if drafter else 0
    return tokens / seconds, drafted, kept, tokens / max(len(llm.engine.stats), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS / "speculative.json")
    args = parser.parse_args()
    engines = {"off": LLM(args.model, device="cpu"),
               "ngram": LLM(args.model, device="cpu", speculative_method="ngram", num_speculative_tokens=args.k)}
    rows = []
    for workload in args.workloads:
        for batch in args.batches:
            ids = prompts(engines["off"], workload, batch, args.seed)
            for llm in engines.values():  # warm-up (and the prompts into the prefix cache for both alike)
                run(llm, ids, 8)
            tok_s = {name: [] for name in engines}
            per_step = {name: [] for name in engines}
            drafted = kept = 0
            for r in range(args.rounds):
                for name in (("off", "ngram") if r % 2 == 0 else ("ngram", "off")):
                    speed, d, k, tps = run(engines[name], ids, args.max_tokens)
                    tok_s[name].append(speed)
                    per_step[name].append(tps)
                    drafted, kept = drafted + d, kept + k
            off, on = statistics.median(tok_s["off"]), statistics.median(tok_s["ngram"])
            steps = {name: statistics.median(v) for name, v in per_step.items()}
            row = {"workload": workload, "batch": batch, "off_tok_s": off, "ngram_tok_s": on, "ratio": on / off,
                   "drafted": drafted, "kept": kept, "acceptance": kept / drafted if drafted else None,
                   "tokens_per_step": steps, "runs": tok_s}
            rows.append(row)
            acc = f"{100 * row['acceptance']:.0f}%" if drafted else "-"
            print(f"{workload:5s} batch {batch:3d}: off {off:7.1f} tok/s, ngram {on:7.1f} tok/s, x{on / off:.2f}; "
                  f"acceptance {acc}; output tokens per step {steps['off']:.2f} -> {steps['ngram']:.2f}",
                  flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                                    "rows": rows}, indent=2))
    _plot(rows, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels = [f"{r['workload']}\nb={r['batch']}" for r in rows]
    ax.bar(range(len(rows)), [r["ratio"] for r in rows], color="C0")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(rows)), labels, fontsize=8)
    ax.set_ylabel("ngram / off, output tok/s")
    ax.set_title("speculative decoding (n-gram)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
