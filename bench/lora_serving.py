"""Multi-LoRA serving, side by side in one run: the same load on the base model alone and spread
over distinct adapters, over each base (bfloat16, 4-bit), plus adapter load time and memory.

    python bench/lora_serving.py [--model smollm2-135m-instruct] [--bases bf16 q4 int4]
                                 [--streams 16] [--adapters 8] [--rank 16] [--rounds 3]
                                 [--prompt-tokens 256] [--max-tokens 128]

Load: ``--streams`` sequences at once (``max_num_seqs`` = streams), each a different prompt of
``--prompt-tokens`` tokens from the corpus, ``--max-tokens`` greedy tokens with EOS ignored;
"lora" spreads them round-robin over ``--adapters`` random adapters of rank ``--rank`` on all
seven projections (PEFT format, written here: scaled like a trained adapter, B nonzero), "base"
runs them on the base model. Base and lora alternate within each round; the figure is the median
output tok/s (generated tokens / wall time of the whole batch, prefill included) and the ratio
lora / base.

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
from tokenmill.lora.adapter import projection_shape

RESULTS = Path(__file__).parent / "results"
HF_PROJECTIONS = {"attn.q": "self_attn.q_proj", "attn.k": "self_attn.k_proj", "attn.v": "self_attn.v_proj",
                  "attn.o": "self_attn.o_proj", "mlp.gate": "mlp.gate_proj", "mlp.up": "mlp.up_proj",
                  "mlp.down": "mlp.down_proj"}


def write_adapter(path: Path, cfg, rank: int, seed: int) -> None:
    """A random PEFT adapter on all seven projections of every layer: A ~ Kaiming-uniform (PEFT's
    init), B small and nonzero, alpha = 2 * rank."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for projection, hf in HF_PROJECTIONS.items():
            out, inp = projection_shape(cfg, projection)
            prefix = f"base_model.model.model.layers.{layer}.{hf}"
            bound = (3 / inp) ** 0.5
            tensors[f"{prefix}.lora_A.weight"] = (torch.rand(rank, inp, generator=gen) * 2 - 1) * bound
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out, rank, generator=gen) * 0.01
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": sorted(
            h.rsplit(".", 1)[1] for h in HF_PROJECTIONS.values()), "lora_dropout": 0.0, "bias": "none"}))


def make_llm(model: str, base: str, streams: int, adapters: int, rank: int, tmp: Path) -> LLM:
    if base == "int4":
        from tokenmill.quantization import Int4WeightOnlyConfig, quantize, save_quantized

        print("  quantizing to int4 g32 ...", flush=True)
        model = str(save_quantized(quantize(model, Int4WeightOnlyConfig(group_size=32), progress=False),
                                   tmp / "int4"))
    dtype = "bfloat16" if base == "bf16" else "auto"
    return LLM(model, dtype=dtype, max_num_seqs=streams, enable_lora=True, max_loras=adapters,
               max_lora_rank=rank, max_cpu_loras=adapters, enable_prefix_caching=False)


def run_batch(llm: LLM, prompts: list[list[int]], adapters: list[str | None], max_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, lora=adapters)
    seconds = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--bases", nargs="+", default=["bf16", "q4"], choices=["bf16", "q4", "int4"])
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
            llm = make_llm(args.model, base, args.streams, args.adapters, args.rank, Path(tmp))
            manager = llm.engine.lora
            paths = []
            for i in range(args.adapters):
                paths.append(Path(tmp) / f"adapter{i}")
                if not paths[-1].exists():
                    write_adapter(paths[-1], llm.model_config, args.rank, seed=i)
            load_ms = []
            for i, path in enumerate(paths):
                start = time.perf_counter()
                llm.load_lora(f"a{i}", str(path))
                load_ms.append((time.perf_counter() - start) * 1e3)
            adapter = manager.get("a0")
            text = fetch_corpus()
            ids = llm.tokenizer.encode(text[:200_000])
            prompts = [ids[i * 997:i * 997 + args.prompt_tokens] for i in range(args.streams)]
            names = [f"a{i % args.adapters}" for i in range(args.streams)]
            run_batch(llm, prompts[:2], names[:2], 8)  # warm-up: kernels, slots
            run_batch(llm, prompts[:2], [None, None], 8)
            base_tps, lora_tps = [], []
            for r in range(args.rounds):
                for kind in (("base", "lora") if r % 2 == 0 else ("lora", "base")):
                    tps = run_batch(llm, prompts, [None] * args.streams if kind == "base" else names, args.max_tokens)
                    (base_tps if kind == "base" else lora_tps).append(tps)
                    print(f"  round {r} {kind}: {tps:.1f} tok/s", flush=True)
            entry = {
                "base_tok_s": base_tps, "lora_tok_s": lora_tps,
                "base_median": statistics.median(base_tps), "lora_median": statistics.median(lora_tps),
                "load_ms_median": statistics.median(load_ms), "load_ms": load_ms,
                "adapter_mib_host_float32": adapter.nbytes / 2**20,
                "slot_mib_per_adapter": manager.slots.nbytes / manager.slots.num_slots / 2**20,
            }
            entry["ratio"] = entry["lora_median"] / entry["base_median"]
            results["bases"][base] = entry
            print(f"  {base}: base {entry['base_median']:.1f} tok/s, {args.adapters} adapters "
                  f"{entry['lora_median']:.1f} tok/s, ratio x{entry['ratio']:.3f}; load {entry['load_ms_median']:.0f} ms "
                  f"per adapter, {entry['adapter_mib_host_float32']:.1f} MiB host (float32), "
                  f"{entry['slot_mib_per_adapter']:.1f} MiB per slot", flush=True)
            del llm
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
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = range(len(bases))
    ax.bar([x - 0.2 for x in xs], [results["bases"][b]["base_median"] for b in bases], 0.4, label="base alone")
    ax.bar([x + 0.2 for x in xs], [results["bases"][b]["lora_median"] for b in bases], 0.4,
           label=f"{results['config']['adapters']} adapters")
    for x, b in zip(xs, bases):
        ax.text(x + 0.2, results["bases"][b]["lora_median"], f"x{results['bases'][b]['ratio']:.2f}", ha="center",
                va="bottom")
    ax.set_xticks(list(xs), bases)
    ax.set_ylabel("output tok/s")
    ax.set_title(f"{results['config']['streams']} streams, rank {results['config']['rank']} on 7 projections")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main()
