"""Decode step time by the number of rows in the step, as the engine runs it: what the kernels' row
schedules and the bfloat16 copies cost end to end.

    python bench/decode_steps.py [--model smollm2-135m-instruct] [--rows 1 4 8 12 16 20 24 32]
                                 [--context 128] [--tokens 40] [--rounds 2] [--bf16-copy-rows N]
                                 [--no-int8-copies] [--no-head-int8-activations] [--int8-activations]
                                 [--out bench/results/decode_steps.json]

For each row count B: B random prompts of ``--context`` tokens (the same ones every round), greedy,
``--tokens`` tokens each with EOS ignored, one ``LLM.generate`` call; the figure is the median time of
its decode-only steps of exactly B sequences (the engine's own StepStats, the first 4 left out),
and the best of ``--rounds`` rounds. ``--bf16-copy-rows`` as in ``LLM(..., bf16_copy_rows=N)`` (default:
the model's default), ``--no-int8-copies`` as ``int8_copies=False``, ``--no-head-int8-activations``
as ``head_int8_activations=False``, ``--int8-activations`` as ``int8_activations=True``. Compare two settings or two
checkouts by running this for each, alternately.
Prints a line per row count and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path

from tokenmill import LLM, SamplingParams

RESULTS = Path(__file__).parent / "results"
SKIP = 4
"""Decode steps of each call left out: the first ones at a new size pay one-off costs."""


def step_ms(llm: LLM, prompts: list[list[int]], tokens: int) -> float:
    """Median decode step time (ms) of one generate call over ``prompts``, steps of all of them only."""
    llm.engine.stats.clear()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True), use_tqdm=False)
    rows = len(prompts)
    steps = [s.seconds for s in llm.engine.stats if s.num_batched_tokens == rows and s.num_sampled == rows]
    if len(steps) <= SKIP:
        raise SystemExit(f"only {len(steps)} decode steps of {rows} rows: raise --tokens")
    return 1000 * statistics.median(steps[SKIP:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 12, 16, 20, 24, 32])
    parser.add_argument("--context", type=int, default=128, help="prompt tokens per sequence")
    parser.add_argument("--tokens", type=int, default=40, help="output tokens per sequence")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--bf16-copy-rows", type=int, default=None)
    parser.add_argument("--no-int8-copies", action="store_true", help="as LLM(..., int8_copies=False)")
    parser.add_argument("--no-head-int8-activations", action="store_true",
                        help="as LLM(..., head_int8_activations=False)")
    parser.add_argument("--int8-activations", action="store_true", help="as LLM(..., int8_activations=True)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS / "decode_steps.json")
    args = parser.parse_args()
    options = ({} if args.bf16_copy_rows is None else {"bf16_copy_rows": args.bf16_copy_rows}) | (
        {"int8_copies": False} if args.no_int8_copies else {}) | (
        {"head_int8_activations": False} if args.no_head_int8_activations else {}) | (
        {"int8_activations": True} if args.int8_activations else {})
    llm = LLM(args.model, device="cpu", **options)
    rng = random.Random(args.seed)
    vocab = llm.model_config.vocab_size
    prompts = [[rng.randrange(1000, min(vocab, 20000)) for _ in range(args.context)] for _ in range(max(args.rows))]
    start = time.perf_counter()
    best: dict[int, float] = {}
    for _ in range(args.rounds):
        for rows in args.rows:
            ms = step_ms(llm, prompts[:rows], args.tokens)
            best[rows] = min(best.get(rows, ms), ms)
    for rows, ms in best.items():
        print(f"{rows:4d} rows: {ms:7.2f} ms a step, {rows / ms * 1000:8.1f} tok/s")
    result = {"model": args.model, "context": args.context, "tokens": args.tokens, "rounds": args.rounds,
              "bf16_copy_rows": args.bf16_copy_rows, "int8_copies": not args.no_int8_copies,
              "head_int8_activations": not args.no_head_int8_activations, "int8_activations": args.int8_activations,
              "machine": platform.processor() or platform.machine(),
              "seconds": round(time.perf_counter() - start, 1), "step_ms": best}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
