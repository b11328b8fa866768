"""Which short-answer task separates two models, and how well the cheap one knows when it is right.

    python bench/routing_task.py [--models smollm2-135m-instruct gemma3-270m [MORE ...]] [--cheap MODEL]
                                 [--n 150] [--max-tokens 16]

Every model answers the held-out items (split "eval") of every task in tokenmill.eval.tasks,
greedily, each question rendered by the model's own chat template, all prompts of a model in one
``generate`` call. A task's eval split smaller than ``--n`` (the knowledge tasks: a few dozen
facts) is measured whole; the row ``mix`` pools every item of every task. Then:

1. accuracy per row (task or mix) and model, and the gap between the first two models, in points
   (first minus second); further models are measured and shown, not compared;
2. confidence of the cheap model (``--cheap``, default the first) on every row: signals from the
   logprobs of its answer, and how well each separates its right answers from its wrong ones:
   ROC AUC (the chance that a random right answer scores above a random wrong one) and the
   threshold that maximises TPR - FPR, with the share of answers it accepts and their accuracy.
   Signals (higher always means more confident): ``mean_logprob`` / ``min_logprob`` /
   ``mean_entropy`` (negated) over all generated tokens, which any router sees;
   ``answer_*`` the same over the tokens of the span the checker reads as the answer; and
   ``first_logprob``, the first generated token's. Entropy is estimated from the top
   ``--top-logprobs`` alternatives with the rest of the mass lumped as one outcome (a lower bound);
3. the chosen row: among rows of at least ``--min-items`` items whose gap reaches ``--min-gap``
   points and on which the cheap model is right at least ``--min-each`` times and wrong at least
   as often (else there is nothing for a cascade to route), the one where the cheap model's best
   signal has the highest AUC, i.e. where a cascade can best tell when to escalate. When no row
   qualifies, the largest gap, flagged.

Prints the tables and writes bench/results/routing_task.json (with a few raw answers per task and model).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from tokenmill import LLM, SamplingParams
from tokenmill.engine import CompletionOutput
from tokenmill.eval.tasks import TASKS, TaskItem, get_task, items

RESULTS = Path(__file__).parent / "results"
MIX = "mix"
"""The row that pools every task's items."""
SIGNALS = ("mean_logprob", "min_logprob", "mean_entropy", "answer_mean_logprob", "answer_min_logprob",
           "answer_mean_entropy", "first_logprob")


@dataclass
class Answer:
    """One model's answer to one item, graded, with its confidence signals (higher: more confident)."""

    item_id: str
    task: str
    text: str
    correct: bool
    signals: dict[str, float]


def eval_items(tasks: list[str], n: int, seed: int) -> list[TaskItem]:
    """Up to ``n`` eval items of every task (the whole split where it is smaller)."""
    return [item for task in tasks for item in items(task, min(n, len(get_task(task).split("eval"))), seed, "eval")]


def answer_all(model: str, batch: list[TaskItem], max_tokens: int, top: int) -> list[Answer]:
    """Every item answered greedily by ``model`` in one generate call, graded and scored."""
    llm = LLM(model)
    prompts = [llm.render_chat(item.messages) for item in batch]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=top)
    outputs = llm.generate(prompts, params, use_tqdm=True)
    return [grade(item, out.outputs[0], llm.tokenizer) for item, out in zip(batch, outputs)]


def grade(item: TaskItem, out: CompletionOutput, tokenizer: Any) -> Answer:
    """Check the answer and compute its signals; the answer span's tokens are those whose decoded
    characters overlap the span :meth:`TaskItem.answer_span` returns (all tokens when it is None)."""
    ends = [len(tokenizer.decode(out.token_ids[:i + 1])) for i in range(len(out.token_ids))]
    span = item.answer_span(out.text)
    in_span = [i for i, end in enumerate(ends) if span and end > span[0] and (i == 0 or ends[i - 1] < span[1])]
    logprobs = [lp.logprob for lp in out.logprobs]
    entropies = [entropy(lp.top) for lp in out.logprobs]
    picked = in_span or list(range(len(logprobs)))
    signals = {
        "mean_logprob": float(np.mean(logprobs)), "min_logprob": min(logprobs),
        "mean_entropy": -float(np.mean(entropies)),
        "answer_mean_logprob": float(np.mean([logprobs[i] for i in picked])),
        "answer_min_logprob": min(logprobs[i] for i in picked),
        "answer_mean_entropy": -float(np.mean([entropies[i] for i in picked])),
        "first_logprob": logprobs[0],
    }
    return Answer(item.id, item.task, out.text, item.check(out.text), signals)


def entropy(top: list[tuple[int, float]]) -> float:
    """Entropy (nats) of a distribution known by its top alternatives, the rest lumped as one outcome."""
    probs = [math.exp(lp) for _, lp in top]
    rest = max(0.0, 1.0 - sum(probs))
    return -sum(p * math.log(p) for p in probs + [rest] if p > 0)


def roc_auc(scores: np.ndarray, positive: np.ndarray) -> float | None:
    """P(score of a random positive > score of a random negative), ties counted half (Mann-Whitney U);
    None when every answer is right, or every one wrong."""
    n_pos, n_neg = int(positive.sum()), int((~positive).sum())
    if not n_pos or not n_neg:
        return None
    order = np.argsort(scores, kind="stable")
    ranks = np.empty(len(scores))
    ranks[order] = np.arange(1, len(scores) + 1)
    for value in np.unique(scores):  # average the ranks of tied scores
        tied = scores == value
        ranks[tied] = ranks[tied].mean()
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def best_threshold(scores: np.ndarray, positive: np.ndarray) -> dict[str, float]:
    """The threshold (accept when score >= it) maximising TPR - FPR, with what accepting does."""
    best = {"youden_j": -1.0}
    for t in np.unique(scores):
        accept = scores >= t
        tpr = (accept & positive).sum() / max(1, positive.sum())
        fpr = (accept & ~positive).sum() / max(1, (~positive).sum())
        if tpr - fpr > best["youden_j"]:
            best = {"youden_j": float(tpr - fpr), "threshold": float(t), "accept_rate": float(accept.mean()),
                    "accepted_accuracy": float(positive[accept].mean())}
    return best


def rows_of(answers: list[Answer], tasks: list[str]) -> dict[str, list[Answer]]:
    """Answers per task, and all of them under MIX."""
    return {**{task: [a for a in answers if a.task == task] for task in tasks}, MIX: answers}


def accuracy(answers: list[Answer]) -> dict[str, Any]:
    right = sum(a.correct for a in answers)
    return {"correct": right, "n": len(answers), "accuracy": right / len(answers)}


def confidence(answers: list[Answer]) -> dict[str, Any]:
    """Accuracy of ``answers`` and, per signal, its AUC and best threshold (AUC None: nothing to separate)."""
    positive = np.array([a.correct for a in answers])
    signals = {}
    for name in SIGNALS:
        scores = np.array([a.signals[name] for a in answers])
        auc = roc_auc(scores, positive)
        signals[name] = {"auc": auc, **(best_threshold(scores, positive) if auc is not None else {})}
    return {**accuracy(answers), "signals": signals}


def best_signal(report: dict[str, Any]) -> str | None:
    scored = {name: r["auc"] for name, r in report["signals"].items() if r["auc"] is not None}
    return max(scored, key=scored.get) if scored else None


def choose(table: dict, conf: dict, pair: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """The chosen row and why; see step 3 of the module docstring."""
    gaps = {row: 100 * (cells[pair[0]]["accuracy"] - cells[pair[1]]["accuracy"]) for row, cells in table.items()}

    def routable(row: str) -> bool:
        right = conf[row]["correct"]
        return (conf[row]["n"] >= args.min_items and abs(gaps[row]) >= args.min_gap
                and min(right, conf[row]["n"] - right) >= args.min_each)

    candidates = [row for row in table if routable(row)]
    if candidates:
        row = max(candidates, key=lambda r: conf[r]["signals"][best_signal(conf[r])]["auc"])
    else:
        row = max(table, key=lambda r: abs(gaps[r]))
    signal = best_signal(conf[row])
    return {"task": row, "gap_points": gaps[row], "better_model": pair[0] if gaps[row] > 0 else pair[1],
            "qualifies": bool(candidates), "candidates": candidates, "gaps": gaps, "signal": signal,
            "signal_report": conf[row]["signals"][signal] if signal else None}


def print_report(console: Console, table: dict, models: list[str], chosen: dict, conf: dict, cheap: str) -> None:
    acc = Table(title="accuracy (greedy, chat template, eval split); gap = first model - second, in points")
    for col in ["row", "n", *models, "gap", f"best AUC of {cheap}"]:
        acc.add_column(col, justify="left" if col == "row" else "right")
    for row, cells in table.items():
        signal = best_signal(conf[row])
        auc = f"{conf[row]['signals'][signal]['auc']:.3f} {signal}" if signal else "-"
        acc.add_row(row + (" *" if row == chosen["task"] else ""), str(cells[models[0]]["n"]),
                    *(f"{cells[m]['accuracy']:.1%}" for m in models), f"{chosen['gaps'][row]:+.1f}", auc)
    console.print(acc)
    console.print(f"chosen: {chosen['task']} ({chosen['better_model']} better by {abs(chosen['gap_points']):.1f} "
                  f"points{'' if chosen['qualifies'] else '; NO row met every condition'})")
    for row in dict.fromkeys([chosen["task"], MIX]):
        print_signals(console, conf[row], f"confidence of {cheap} on {row}")


def print_signals(console: Console, report: dict, title: str) -> None:
    sig = Table(title=f"{title} (n={report['n']}, accuracy {report['accuracy']:.1%})")
    for col in ("signal", "AUC", "threshold", "accepts", "accepted acc"):
        sig.add_column(col, justify="left" if col == "signal" else "right")
    for name, r in report["signals"].items():
        if r["auc"] is None:
            sig.add_row(name, "-", "-", "-", "-")
        else:
            sig.add_row(name, f"{r['auc']:.3f}", f"{r['threshold']:.3f}", f"{r['accept_rate']:.1%}",
                        f"{r['accepted_accuracy']:.1%}")
    console.print(sig)


def examples(by_model: dict[str, list[Answer]], per_task: int = 3) -> dict[str, dict[str, list[dict]]]:
    out: dict[str, dict[str, list[dict]]] = {}
    for model, answers in by_model.items():
        for a in answers:
            shown = out.setdefault(a.task, {}).setdefault(model, [])
            if len(shown) < per_task:
                shown.append({"id": a.item_id, "text": a.text, "correct": a.correct})
    return out


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["smollm2-135m-instruct", "gemma3-270m"],
                        help="models to measure; the gap is the first minus the second")
    parser.add_argument("--cheap", default=None, help="the model whose confidence is scored (default: the first)")
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--n", type=int, default=150, help="eval items per task (fewer where the split is smaller)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--top-logprobs", type=int, default=20, help="alternatives per position, for the entropy")
    parser.add_argument("--min-gap", type=float, default=15.0, help="accuracy points the chosen row must separate")
    parser.add_argument("--min-items", type=int, default=100, help="items the chosen row must have")
    parser.add_argument("--min-each", type=int, default=10,
                        help="right and wrong answers the cheap model must have on the chosen row")
    parser.add_argument("--out", type=Path, default=RESULTS / "routing_task.json")
    args = parser.parse_args()
    if len(args.models) < 2:
        parser.error("--models needs at least two models")
    return args


def main() -> None:
    args = parse_args()
    cheap = args.cheap or args.models[0]
    batch = eval_items(args.tasks, args.n, args.seed)
    by_model = {model: answer_all(model, batch, args.max_tokens, args.top_logprobs)
                for model in dict.fromkeys([*args.models, cheap])}
    rows = {model: rows_of(answers, args.tasks) for model, answers in by_model.items()}
    table = {row: {model: accuracy(rows[model][row]) for model in args.models} for row in rows[args.models[0]]}
    conf = {row: confidence(answers) for row, answers in rows[cheap].items()}
    chosen = choose(table, conf, args.models[:2], args)
    print_report(Console(width=160), table, args.models, chosen, conf, cheap)
    result = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "accuracy": table, "chosen": chosen, "cheap_model": cheap, "confidence": conf,
              "examples": examples(by_model)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    Console().print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
