"""Multi-LoRA serving, side by side in one run: the same load on the base model alone and spread
over distinct adapters, over each base (bfloat16, 4-bit), plus adapter load time and memory.

    python bench/lora_serving.py [--model smollm2-135m-instruct] [--bases bf16 q4 int4]
                                 [--lora-dtypes auto int8] [--streams 16] [--adapters 8] [--rank 16]
                                 [--rounds 3] [--prompt-tokens 256] [--max-tokens 128]

Load: ``--streams`` sequences at once (``max_num_seqs`` = streams), each a different prompt of
``--prompt-tokens`` tokens from the corpus, ``--max-tokens`` greedy tokens with EOS ignored;
"lora" spreads them round-robin over ``--adapters`` random adapters of rank ``--rank`` on all
seven projections (PEFT format, written here: scaled like a trained adapter, B nonzero), "base"
runs them on the base model. "lora-auto" holds the slots in the model's dtype, "lora-int8" in int8
(``lora_dtype``), each its own LLM on the same weights. The runs rotate within each round; the
figure is the median output tok/s (generated tokens / wall time of the whole batch, prefill
included) and the ratio to base. int8's quality cost: how much of each greedy output it shares
with lora-auto's before the first difference.

Bases: ``bf16`` the GGUF dequantized to bfloat16; ``q4`` the GGUF's own 4-bit weights served
natively (dtype auto); ``int4`` ``tokenmill quantize``'s INT4 g32 weights, quantized in-process.
Writes JSON and a PNG under bench/results/.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from tokenmill import LLM, SamplingParams
from tokenmill.eval.corpus import fetch_corpus
from tokenmill.finetune.lora import HF_NAMES
from tokenmill.lora.adapter import projection_shape

RESULTS = Path(__file__).parent / "results"


def write_adapter(path: Path, cfg, rank: int, seed: int) -> None:
    """A random PEFT adapter on all seven projections of every layer: A ~ Kaiming-uniform (PEFT's
    init), B small and nonzero, alpha = 2 * rank."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for projection, hf in HF_NAMES.items():
            out, inp = projection_shape(cfg, projection)
            prefix = f"base_model.model.model.layers.{layer}.{hf}"
            bound = (3 / inp) ** 0.5
            tensors[f"{prefix}.lora_A.weight"] = (torch.rand(rank, inp, generator=gen) * 2 - 1) * bound
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out, rank, generator=gen) * 0.01
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": sorted(
            h.rsplit(".", 1)[1] for h in HF_NAMES.values()), "lora_dropout": 0.0, "bias": "none"}))


def make_llm(model: str, base: str, args, lora_dtype: str, tmp: Path) -> LLM:
    if base == "int4":
        int4_dir = tmp / "int4"
        if not int4_dir.exists():
            from tokenmill.quantization import Int4WeightOnlyConfig, quantize, save_quantized

            print("  quantizing to int4 g32 ...", flush=True)
            save_quantized(quantize(model, Int4WeightOnlyConfig(group_size=32), progress=False), int4_dir)
        model = str(int4_dir)
    dtype = "bfloat16" if base == "bf16" else "auto"
    return LLM(model, dtype=dtype, max_num_seqs=args.streams, enable_lora=True, max_loras=args.adapters,
               max_lora_rank=args.rank, max_cpu_loras=args.adapters, lora_dtype=lora_dtype,
               enable_prefix_caching=False)


def run_batch(llm: LLM, prompts: list[list[int]], adapters: list[str | None], max_tokens: int
              ) -> tuple[float, list[list[int]]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, lora=adapters)
    seconds = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outputs]
    return sum(map(len, tokens)) / seconds, tokens


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Mean fraction of each greedy output that two runs share before they first differ."""
    shared = []
    for x, y in zip(a, b):
        n = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        shared.append(n / max(len(x), 1))
    return sum(shared) / len(shared)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--bases", nargs="+", default=["bf16", "q4"], choices=["bf16", "q4", "int4"])
    parser.add_argument("--lora-dtypes", nargs="+", default=["auto", "int8"], choices=["auto", "int8"])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()

    results: dict = {"config": vars(args), "bases": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for base in args.bases:
            print(f"base {base}", flush=True)
            llms = {d: make_llm(args.model, base, args, d, Path(tmp)) for d in args.lora_dtypes}
            first = llms[args.lora_dtypes[0]]
            paths = []
            for i in range(args.adapters):
                paths.append(Path(tmp) / f"adapter{i}")
                if not paths[-1].exists():
                    write_adapter(paths[-1], first.model_config, args.rank, seed=i)
            load_ms = []
            for llm in llms.values():
                for i, path in enumerate(paths):
                    start = time.perf_counter()
                    llm.load_lora(f"a{i}", str(path))
                    load_ms.append((time.perf_counter() - start) * 1e3)
            text = fetch_corpus().read_text(encoding="utf-8")
            ids = first.tokenizer.encode(text[:200_000])
            prompts = [ids[i * 997:i * 997 + args.prompt_tokens] for i in range(args.streams)]
            names = [f"a{i % args.adapters}" for i in range(args.streams)]
            runs = [("base", first, [None] * args.streams)] + [(f"lora-{d}", llm, names) for d, llm in llms.items()]
            for _, llm, adapters in runs:  # warm-up: kernels, slots, decode stacks
                run_batch(llm, prompts[:4], adapters[:4], 8)
            speeds: dict[str, list[float]] = {kind: [] for kind, _, _ in runs}
            outputs: dict[str, list[list[int]]] = {}
            for r in range(args.rounds):
                for kind, llm, adapters in runs[r % len(runs):] + runs[:r % len(runs)]:
                    tps, outputs[kind] = run_batch(llm, prompts, adapters, args.max_tokens)
                    speeds[kind].append(tps)
                    print(f"  round {r} {kind}: {tps:.1f} tok/s", flush=True)
            entry: dict = {"tok_s": speeds, "median": {k: statistics.median(v) for k, v in speeds.items()},
                           "load_ms_median": statistics.median(load_ms), "load_ms": load_ms,
                           "adapter_mib_host_float32": first.engine.lora.get("a0").nbytes / 2**20,
                           "slot_mib_per_adapter": {d: llm.engine.lora.slots.nbytes / args.adapters / 2**20
                                                    for d, llm in llms.items()}}
            entry["ratio"] = {k: v / entry["median"]["base"] for k, v in entry["median"].items() if k != "base"}
            if "lora-auto" in outputs and "lora-int8" in outputs:
                entry["int8_greedy_agreement"] = agreement(outputs["lora-auto"], outputs["lora-int8"])
            results["bases"][base] = entry
            ratios = ", ".join(f"{k} {entry['median'][k]:.1f} tok/s (x{v:.3f})" for k, v in entry["ratio"].items())
            quality = (f"; int8 slots: greedy outputs share {100 * entry['int8_greedy_agreement']:.1f}% of their "
                       "tokens with the model-dtype slots' before the first difference"
                       if "int8_greedy_agreement" in entry else "")
            print(f"  {base}: base {entry['median']['base']:.1f} tok/s; {args.adapters} adapters: {ratios}; load "
                  f"{entry['load_ms_median']:.0f} ms per adapter, {entry['adapter_mib_host_float32']:.1f} MiB host "
                  f"(float32), MiB per slot {entry['slot_mib_per_adapter']}{quality}", flush=True)
            del llms, first
    RESULTS.mkdir(exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = RESULTS / f"lora_serving-{stamp}.json"
    out.write_text(json.dumps(results, indent=2))
    _plot(results, RESULTS / f"lora_serving-{stamp}.png")
    print(f"wrote {out}")


def _plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bases = list(results["bases"])
    kinds = list(results["bases"][bases[0]]["median"])
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(kinds)
    for j, kind in enumerate(kinds):
        xs = [x + (j - (len(kinds) - 1) / 2) * width for x in range(len(bases))]
        values = [results["bases"][b]["median"][kind] for b in bases]
        ax.bar(xs, values, width, label=kind if kind == "base" else f"{results['config']['adapters']} adapters, "
               f"slots {kind.removeprefix('lora-')}")
        for x, b, v in zip(xs, bases, values):
            if kind != "base":
                ax.text(x, v, f"x{results['bases'][b]['ratio'][kind]:.2f}", ha="center", va="bottom")
    ax.set_xticks(list(range(len(bases))), bases)
    ax.set_ylabel("output tok/s")
    ax.set_title(f"{results['config']['streams']} streams, rank {results['config']['rank']} on 7 projections")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main()
