"""Speculative decoding on and off, side by side in one run: output tok/s, acceptance, tokens per step.

    python bench/speculative.py [--model smollm2-135m-instruct] [--methods ngram eagle layerskip shortlist]
                                [--draft-model M] [--eagle-head DIR] [--batches 1 4 16 64] [--rounds 3]
                                [--max-tokens 192] [--k 4] [--no-adaptive] [--min-prompts 8]

Workloads, fixed here and built from the corpus (Shakespeare, public domain) so that every run
measures the same prompts:
    copy   "Copy the following passage exactly": input-grounded, the n-gram proposer's case
    edit   "Rewrite the passage, changing only the names": mostly copied, partly new
    code   "Rename the function ..." on a fixed Python module (CODE below): code modification
    open   a plain continuation of a passage: open-ended, little to look up
    chat   generic chat requests (task x topic) on held-out topics (tokenmill.eval.prompts, split
           "eval": topics no training prompt of a head or a draft distilled on chat names)

Each (workload, batch) runs speculation off and every method in rotating order, ``--rounds``
times, after a warm-up of WARMUP_TOKENS tokens each, on the same prompts: at least ``--min-prompts``
of them, ``batch`` at a time (a batch of 1 is 8 prompts one after the other); greedy, EOS allowed,
output tokens counted as produced. Reports the median output tok/s of each, the ratio to off,
the acceptance rate (kept / drafted), the mean accepted length (tokens per verification) and the
acceptance per draft position. Writes JSON and a PNG under bench/results/.
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
from tokenmill.eval.prompts import chat_prompts, chat_texts

RESULTS = Path(__file__).parent / "results"
WARMUP_TOKENS = 32
WORKLOADS = {
    "copy": "Copy the following passage exactly, word for word.\n\n{passage}",
    "edit": "Rewrite the following passage, changing only the names of the people in it.\n\n{passage}",
    "code": "Rename the function `{name}` to `{name}_v2` everywhere in this module and return the whole "
            "module.\n\n```python\n{code}```\n",
    "open": "{passage}",
    "chat": None,  # tokenmill.eval.prompts.chat_prompts(split="eval")
}

CODE = '''import math


def mean(values):
    """The arithmetic mean of a non-empty list."""
    return sum(values) / len(values)


def variance(values):
    """The population variance."""
    m = mean(values)
    return sum((v - m) ** 2 for v in values) / len(values)


def stddev(values):
    return math.sqrt(variance(values))


def zscores(values):
    m, s = mean(values), stddev(values)
    return [(v - m) / s for v in values]


def moving_average(values, window):
    out = []
    for i in range(len(values) - window + 1):
        out.append(mean(values[i:i + window]))
    return out
'''
CODE_NAMES = ["mean", "variance", "stddev", "zscores", "moving_average"]


def prompt_texts(workload: str, n: int, seed: int) -> list[str]:
    """The workload's n prompts (the user's text), drawn from the corpus with ``seed``; ``chat``:
    the held-out chat requests (the texts ``chat_prompts(split="eval")`` renders)."""
    if workload == "chat":
        return chat_texts(n, seed, split="eval")
    text = fetch_corpus().read_text(encoding="utf-8")
    rng = random.Random(seed)
    out = []
    for i in range(n):
        at = rng.randrange(0, len(text) - 2000)
        passage = text[at:at + rng.randrange(600, 1200)]
        out.append(WORKLOADS[workload].format(passage=passage, code=CODE, name=CODE_NAMES[i % len(CODE_NAMES)]))
    return out


def prompts(llm: LLM, workload: str, n: int, seed: int) -> list[list[int]]:
    """Token ids: instructions as a chat turn (the model's template), ``open`` as plain text to continue."""
    if workload == "chat":
        return chat_prompts(llm.tokenizer, n, seed, split="eval")
    texts = prompt_texts(workload, n, seed)
    if workload == "open":
        return [llm.tokenizer.encode(t) for t in texts]
    return [llm.render_chat([{"role": "user", "content": t}]) for t in texts]


def run(llm: LLM, ids: list[list[int]], max_tokens: int, batch: int | None = None) -> dict:
    """The prompts, ``batch`` at a time (one generate call each; all at once without) -> output tok/s,
    drafted / kept tokens, verifications, kept per position, output tokens per engine step. The n-gram
    proposer's memory of finished answers is cleared before each batch: the same prompts run again and
    again here, and their earlier answers would draft the next (a batch's own finished answers still
    draft for the rest of it, as in a server)."""
    drafter = llm.engine.drafter
    forget = getattr(drafter.proposer, "forget_history", None) if drafter else None
    c = drafter.counters if drafter else None
    before = (c.num_draft_tokens, c.num_accepted_tokens, c.num_drafts, list(c.accepted_per_position)) if c else None
    llm.engine.stats.clear()
    start = time.perf_counter()
    batch = batch or len(ids)
    outs = []
    for i in range(0, len(ids), batch):
        if forget is not None:  # each batch on its own, as if no earlier batch had run
            forget()
        outs += llm.generate(ids[i:i + batch], SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    out = {"tok_s": tokens / seconds, "per_step": tokens / max(len(llm.engine.stats), 1), "drafted": 0, "kept": 0,
           "drafts": 0, "per_pos": []}
    if c:
        out.update(drafted=c.num_draft_tokens - before[0], kept=c.num_accepted_tokens - before[1],
                   drafts=c.num_drafts - before[2],
                   per_pos=[a - b for a, b in zip(c.accepted_per_position, before[3])])
    return out


def engines(args) -> dict[str, LLM]:
    out = {"off": LLM(args.model, device="cpu")}
    for method in args.methods:
        spec = {"method": method, "num_speculative_tokens": args.k, "adaptive": not args.no_adaptive}
        if method == "draft":
            spec["draft_model"] = args.draft_model
        if method == "eagle":
            spec["draft_model"] = args.eagle_head
        if method == "layerskip" and args.layer_skip_layers:
            spec["layer_skip_layers"] = args.layer_skip_layers
        if method == "shortlist" and args.draft_vocab_size:
            spec["draft_vocab_size"] = args.draft_vocab_size
        out[method] = LLM(args.model, device="cpu", speculative=spec)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--methods", nargs="+", default=["ngram"], choices=["ngram", "draft", "eagle", "layerskip",
                                                                             "shortlist"])
    parser.add_argument("--draft-model", default=None, help="the draft of method draft (e.g. one distilled with "
                        "tokenmill distill --objective acceptance --data chat)")
    parser.add_argument("--eagle-head", default=None, help="the head directory of method eagle "
                        "(tokenmill spec train-heads MODEL --out DIR)")
    parser.add_argument("--layer-skip-layers", type=int, default=0)
    parser.add_argument("--draft-vocab-size", type=int, default=0, help="shortlist: the draft head's tokens "
                        "(0: the engine's default)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--min-prompts", type=int, default=8, help="a point whose batch is smaller runs this "
                        "many prompts (rounded up to whole batches), a batch at a time")
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--no-adaptive", action="store_true", help="always draft k tokens (speculative_adaptive off)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS / "speculative.json")
    args = parser.parse_args()
    if ("draft" in args.methods) != (args.draft_model is not None):
        parser.error("--methods draft needs --draft-model (and --draft-model needs --methods draft)")
    if ("eagle" in args.methods) != (args.eagle_head is not None):
        parser.error("--methods eagle needs --eagle-head (and --eagle-head needs --methods eagle)")
    llms = engines(args)
    names = list(llms)
    rows = []
    for workload in args.workloads:
        for batch in args.batches:
            # a batch below --min-prompts runs that many prompts, a batch at a time: one prompt is one
            # sample of how much of its answer a proposer finds (SmolLM2's code answers: 1.5-2.5 tokens
            # a step from one prompt to the next)
            n = -(-max(batch, args.min_prompts) // batch) * batch
            ids = prompts(llms["off"], workload, n, args.seed)
            # warm-up, the same for all: the prompts into the prefix cache, and a first verification at a
            # new size paying its one-off costs (memory faulted in: 1.2 s at 64 streams of Gemma 3)
            for llm in llms.values():
                run(llm, ids, WARMUP_TOKENS, batch)
            runs = {name: [] for name in names}
            for r in range(args.rounds):
                for name in names[r % len(names):] + names[:r % len(names)]:
                    runs[name].append(run(llms[name], ids, args.max_tokens, batch))
            off = statistics.median(x["tok_s"] for x in runs["off"])
            row = {"workload": workload, "batch": batch, "prompts": n, "off_tok_s": off, "methods": {}}
            line = f"{workload:5s} batch {batch:3d}: off {off:7.1f} tok/s"
            for name in names[1:]:
                tok_s = statistics.median(x["tok_s"] for x in runs[name])
                drafted, kept, drafts = (sum(x[k] for x in runs[name]) for k in ("drafted", "kept", "drafts"))
                per_pos = [sum(col) / drafts if drafts else None for col in zip(*(x["per_pos"] for x in runs[name]))]
                entry = {"tok_s": tok_s, "ratio": tok_s / off, "drafted": drafted, "kept": kept,
                         "acceptance": kept / drafted if drafted else None,
                         "mean_accepted_length": 1 + kept / drafts if drafts else None,
                         "acceptance_per_position": per_pos,
                         "tokens_per_step": statistics.median(x["per_step"] for x in runs[name]),
                         "runs": [x["tok_s"] for x in runs[name]]}
                row["methods"][name] = entry
                acc = f"{100 * entry['acceptance']:.0f}%, len {entry['mean_accepted_length']:.2f}" if drafted else "-"
                line += f" | {name} {tok_s:7.1f} x{tok_s / off:.2f} (accept {acc})"
            row["off_runs"] = [x["tok_s"] for x in runs["off"]]
            rows.append(row)
            print(line, flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                                    "rows": rows}, indent=2))
    _plot(rows, names[1:], args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


def _plot(rows: list[dict], methods: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (speed, accept) = plt.subplots(2, 1, figsize=(max(7, 0.6 * len(rows)), 6), sharex=True)
    labels = [f"{r['workload']}\nb={r['batch']}" for r in rows]
    width = 0.8 / max(len(methods), 1)
    for m, name in enumerate(methods):
        xs = [i + (m - (len(methods) - 1) / 2) * width for i in range(len(rows))]
        speed.bar(xs, [r["methods"][name]["ratio"] for r in rows], width, label=name)
        accept.bar(xs, [r["methods"][name]["acceptance"] or 0 for r in rows], width, label=name)
    speed.axhline(1.0, color="k", lw=0.8)
    speed.set_ylabel("output tok/s / off")
    accept.set_ylabel("acceptance rate")
    accept.set_xticks(range(len(rows)), labels, fontsize=8)
    speed.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
