"""Batch-1 decode tok/s and prefill tok/s: tokenmill beside HF transformers, same GGUF, one run.

    python bench/decode_prefill.py [--model smollm2-135m-instruct] [--dtypes float32 bfloat16]

Both engines get the same token ids. Prefill: time to the first token of a long prompt.
Decode: (time for 1 + N tokens - time for 1 token) / N on a short prompt, greedy, EOS ignored.
Each figure is the median of --repeats runs, the engines interleaved so that machine noise
hits both alike. Prints a table, writes JSON and a PNG bar chart under bench/results/.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from tokenmill import LLM, SamplingParams
from tokenmill.loading.sources import resolve_model

RESULTS = Path(__file__).parent / "results"


def time_tokenmill(llm: LLM, ids: list[int], new_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    out = llm.generate([ids], params)
    elapsed = time.perf_counter() - start
    assert len(out[0].outputs[0].token_ids) == new_tokens
    return elapsed


def time_hf(model, ids: list[int], new_tokens: int) -> float:
    input_ids = torch.tensor([ids])
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             attention_mask=torch.ones_like(input_ids), pad_token_id=0)
    elapsed = time.perf_counter() - start
    assert out.shape[1] - len(ids) == new_tokens
    return elapsed


def measure(run, prompt_long: list[int], prompt_short: list[int], decode_tokens: int, repeats: int) -> dict:
    prefill, decode = [], []
    run(prompt_short, 2)  # warm-up
    for _ in range(repeats):
        prefill.append(len(prompt_long) / run(prompt_long, 1))
        one = run(prompt_short, 1)
        many = run(prompt_short, 1 + decode_tokens)
        decode.append(decode_tokens / max(many - one, 1e-9))
    return {"prefill_tok_s": statistics.median(prefill), "decode_tok_s": statistics.median(decode),
            "prefill_runs": prefill, "decode_runs": decode}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-hf", action="store_true", help="skip the HF transformers baseline")
    args = parser.parse_args()

    source = resolve_model(args.model)
    results = {"model": source.name, "file": str(source.path), "threads": torch.get_num_threads(),
               "machine": platform.processor() or platform.machine(), "torch": torch.__version__, "runs": []}
    for dtype in args.dtypes:
        llm = LLM(args.model, dtype=dtype, device="cpu")
        text = "The history of the printing press begins in " * 200
        long_ids = llm.tokenizer.encode(text)[:args.prefill_tokens]
        short_ids = llm.tokenizer.encode("Once upon a time")
        engines = {"tokenmill": lambda ids, n: time_tokenmill(llm, ids, n)}
        if not args.no_hf and source.format == "gguf":
            import transformers

            hf = transformers.AutoModelForCausalLM.from_pretrained(
                str(source.path.parent), gguf_file=source.path.name, dtype=getattr(torch, dtype)).eval()
            engines["hf-transformers"] = lambda ids, n: time_hf(hf, ids, n)
        for name, run in engines.items():
            row = {"engine": name, "dtype": dtype,
                   **measure(run, long_ids, short_ids, args.decode_tokens, args.repeats)}
            results["runs"].append(row)
            print(f"{name:16s} {dtype:9s} prefill {row['prefill_tok_s']:8.1f} tok/s   "
                  f"decode {row['decode_tok_s']:7.1f} tok/s", flush=True)
    _report(results)


def _report(results: dict) -> None:
    RESULTS.mkdir(exist_ok=True)
    by = {(r["engine"], r["dtype"]): r for r in results["runs"]}
    print("\nratios tokenmill / hf-transformers (median of runs):")
    for dtype in sorted({r["dtype"] for r in results["runs"]}):
        ours, theirs = by.get(("tokenmill", dtype)), by.get(("hf-transformers", dtype))
        if ours and theirs:
            print(f"  {dtype:9s} prefill x{ours['prefill_tok_s'] / theirs['prefill_tok_s']:.2f}   "
                  f"decode x{ours['decode_tok_s'] / theirs['decode_tok_s']:.2f}")
    out = RESULTS / "decode_prefill.json"
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    labels = [f"{r['engine']}\n{r['dtype']}" for r in results["runs"]]
    for ax, key, title in ((axes[0], "prefill_tok_s", "prefill tok/s"), (axes[1], "decode_tok_s", "batch-1 decode tok/s")):
        ax.bar(labels, [r[key] for r in results["runs"]], color=["C0" if "tokenmill" in lab else "C1" for lab in labels])
        ax.set_title(f"{title} ({results['model']})")
        ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / "decode_prefill.png", dpi=100)
    print(f"wrote {RESULTS / 'decode_prefill.png'}")


if __name__ == "__main__":
    main()
