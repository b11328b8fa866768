"""How often a smaller model (a draft, a pruned or distilled student) picks the target's greedy token.

    python bench/agreement.py DIR [DIR ...] [--model smollm2-135m-instruct] [--prompts 8] [--max-tokens 64]

The target answers held-out chat prompts greedily (tokenmill.eval.prompts, split "eval": topics no
training prompt names), served as ``LLM(model)`` serves it. Each model then reads prompt + answer
in one teacher-forced pass (float32; tokenmill.distillation.agreement, which a draft's
distillation run also reports) and its argmax at every answer position is compared with the
answer's token: the per-token agreement, which bounds a greedy draft's acceptance (with k draft
tokens and agreement a independent per position, the acceptance rate is about
(a + a^2 + ... + a^k) / k). The target itself is measured the same way (below 1.0 only by the
served weights' quantization against the float32 pass). Prints one line per model and writes
bench/results/agreement.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from tokenmill import LLM, SamplingParams
from tokenmill.distillation.agreement import agreement
from tokenmill.eval.prompts import chat_prompts
from tokenmill.loader import load_model

RESULTS = Path(__file__).parent / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+", help="model directories (or names) to compare with the target")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="the target")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS / "agreement.json")
    args = parser.parse_args()
    llm = LLM(args.model, device="cpu")
    prompts = chat_prompts(llm.tokenizer, args.prompts, args.seed, split="eval")
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.max_tokens))
    sequences = [(p, list(o.outputs[0].token_ids)) for p, o in zip(prompts, outs)]
    del llm
    rows = []
    for name in [args.model, *args.models]:
        a = agreement(load_model(name, torch.float32, "cpu").model, sequences)
        k4 = sum(a ** j for j in range(1, 5)) / 4
        rows.append({"model": name, "agreement": a, "acceptance_k4_if_independent": k4})
        print(f"{name}: agreement {a:.3f} over {sum(len(s[1]) for s in sequences)} answer tokens "
              f"(independent positions: acceptance at k=4 about {k4:.2f})", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"target": args.model, "prompts": args.prompts, "max_tokens": args.max_tokens,
                                    "rows": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
