"""Mixture-of-experts decode speed, side by side in one run: a Mixtral-shaped model against dense
models with the same active and the same total parameters.

    python bench/moe.py [--batches 1 32] [--decode-tokens 32] [--rounds 3] [--dtype bfloat16]
                        [--experts 8] [--top-k 2] [--layers 30] [--upcycled DIR]

Models (random weights, SmolLM2-135M's shape otherwise: hidden 576, 9 heads, 3 KV heads, vocab
49152): ``moe`` has ``--experts`` experts of SmolLM2's MLP shape (576 -> 1536), ``--top-k`` per
token; ``dense-active`` one MLP of top_k * 1536 (the parameters a token runs through);
``dense-total`` one MLP of experts * 1536 (the parameters the MoE model holds). Each runs
``batch`` sequences of 64-token prompts and ``--decode-tokens`` greedy tokens through the engine;
the figure is the median wall time of the decode steps (every sequence computes one token), the
models rotating within each round. At batch 32 every expert is active, so besides the time ratio
the run reports the bytes each model's decode step must read (the MoE: attention, routers and the
experts its routers picked in that step, from the engine's routing stats) and time per byte.
With ``--upcycled DIR`` (what ``tokenmill upcycle smollm2-135m-instruct --out DIR`` wrote), the
run also times the upcycled SmolLM2 against the dense original the same way (decode ms per step
and tok/s) and copies the upcycling report's quality figures: held-out perplexity of the dense
model, of the dense model trained on the same tokens and of the upcycled one, expert balance and
router entropy. Writes JSON and a PNG under bench/results/.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch

from tokenmill import SamplingParams
from tokenmill.config import ModelConfig, MoESpec
from tokenmill.engine import EngineConfig, LLMEngine
from tokenmill.loader import load_model
from tokenmill.loading.checkpoint import Checkpoint
from tokenmill.models.builder import LoadedModel, build_model
from tokenmill.models.registry import MODEL_CLASSES

RESULTS = Path(__file__).parent / "results"
EXPERT_WIDTH = 1536


def random_model(cfg: ModelConfig, dtype: torch.dtype, seed: int = 0):
    """A model of ``cfg`` with random weights (std 0.02; norms 1), built as a checkpoint would be."""
    from tokenmill.attention.paged import PagedAttentionBackend

    with torch.device("meta"):
        shapes = {n: tuple(t.shape) for n, t in MODEL_CLASSES[cfg.architecture](cfg, PagedAttentionBackend())
                  .state_dict().items()}
    gen = torch.Generator().manual_seed(seed)

    def tensors():
        for name, shape in shapes.items():
            if name.endswith("norm.weight"):
                yield name, torch.ones(shape)
            else:
                yield name, (torch.randn(shape, generator=gen) * 0.02).to(dtype)

    return build_model(Checkpoint(cfg, tensors()), dtype, "cpu")


def configs(base: ModelConfig, experts: int, top_k: int, layers: int) -> dict[str, ModelConfig]:
    common = dataclasses.replace(base, num_layers=layers, layer_types=())
    return {
        "moe": dataclasses.replace(common, intermediate_size=EXPERT_WIDTH, moe=MoESpec(
            num_experts=experts, top_k=top_k, expert_intermediate_size=EXPERT_WIDTH)),
        "dense-active": dataclasses.replace(common, intermediate_size=top_k * EXPERT_WIDTH),
        "dense-total": dataclasses.replace(common, intermediate_size=experts * EXPERT_WIDTH),
    }


def decode_bytes(model, step_moe) -> int:
    """Bytes one decode step reads: every parameter but the routed experts', plus the experts the
    routers picked in the step (all of them for a dense model's MLP)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if step_moe is None:
        return total
    expert = model.layers[0].mlp.experts[0]
    per_expert = sum(p.numel() * p.element_size() for p in expert.parameters())
    all_experts = sum(1 for block in model.layers if hasattr(block.mlp, "experts") for _ in block.mlp.experts)
    active = sum(1 for row in step_moe.tokens_per_expert for n in row if n)
    return total - (all_experts - active) * per_expert


def decode_steps(engine: LLMEngine, batch: int, tokens: int, seed: int) -> tuple[list[float], list[int]]:
    """Wall seconds and bytes read of each decode step of ``batch`` sequences generating ``tokens``."""
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    engine.stats.clear()
    for _ in range(batch):
        engine.add_request(torch.randint(0, 49152, (64,), generator=gen).tolist(), params)
    while engine.has_unfinished_requests():
        engine.step()
    model = engine.runner.model
    steps = [s for s in engine.stats if s.num_batched_tokens == batch and s.num_scheduled == batch]
    return [s.seconds for s in steps], [decode_bytes(model, s.moe) for s in steps]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--upcycled", default=None, help="a tokenmill upcycle output directory")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)

    smollm = load_model("smollm2-135m-instruct", "float32", "cpu")  # its shape and tokenizer
    engines = {}
    for name, cfg in configs(smollm.config, args.experts, args.top_k, args.layers).items():
        print(f"building {name} ...", flush=True)
        model = random_model(cfg, dtype)
        params = sum(p.numel() for p in model.parameters())
        engines[name] = (LLMEngine(LoadedModel(model, cfg, smollm.tokenizer, smollm.source), torch.device("cpu"),
                                   EngineConfig.from_options(max_num_seqs=max(args.batches))), params)
        print(f"  {params / 1e6:.0f}M parameters", flush=True)
    if args.upcycled:
        for name, path in (("smollm2", None), ("smollm2-upcycled", Path(args.upcycled) / "student")):
            loaded = load_model("smollm2-135m-instruct" if path is None else path, dtype, "cpu")
            engines[name] = (LLMEngine(loaded, torch.device("cpu"), EngineConfig.from_options(
                max_num_seqs=max(args.batches))), sum(p.numel() for p in loaded.model.parameters()))
    del smollm

    results: dict = {"config": vars(args), "parameters": {n: p for n, (_, p) in engines.items()}, "batches": {}}
    for batch in args.batches:
        times: dict[str, list[float]] = {n: [] for n in engines}
        bytes_read: dict[str, list[int]] = {n: [] for n in engines}
        names = list(engines)
        for name in names:  # warm-up: kernels, packed weights, allocator
            decode_steps(engines[name][0], batch, 4, seed=99)
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                seconds, read = decode_steps(engines[name][0], batch, args.decode_tokens, seed=r)
                times[name] += seconds
                bytes_read[name] += read
                print(f"  batch {batch} round {r} {name}: {1e3 * statistics.median(seconds):.2f} ms/step", flush=True)
        entry = {"step_ms": {n: 1e3 * statistics.median(v) for n, v in times.items()},
                 "step_mb": {n: statistics.median(v) / 1e6 for n, v in bytes_read.items()}}
        entry["ms_per_gb"] = {n: entry["step_ms"][n] / (entry["step_mb"][n] / 1e3) for n in engines}
        entry["ratio_vs_dense_active"] = entry["step_ms"]["moe"] / entry["step_ms"]["dense-active"]
        entry["ratio_vs_dense_total"] = entry["step_ms"]["moe"] / entry["step_ms"]["dense-total"]
        entry["bytes_ratio_vs_dense_active"] = entry["step_mb"]["moe"] / entry["step_mb"]["dense-active"]
        entry["tok_s"] = {n: batch * 1e3 / ms for n, ms in entry["step_ms"].items()}
        if args.upcycled:
            entry["ratio_upcycled_vs_smollm2"] = entry["step_ms"]["smollm2-upcycled"] / entry["step_ms"]["smollm2"]
        results["batches"][batch] = entry
        print(f"batch {batch}: " + ", ".join(f"{n} {entry['step_ms'][n]:.2f} ms ({entry['step_mb'][n]:.0f} MB read)"
                                             for n in engines)
              + f"; moe / dense-active x{entry['ratio_vs_dense_active']:.2f} (bytes x"
                f"{entry['bytes_ratio_vs_dense_active']:.2f}), moe / dense-total x{entry['ratio_vs_dense_total']:.2f}",
              flush=True)
        if args.upcycled:
            print(f"  upcycled SmolLM2 {entry['tok_s']['smollm2-upcycled']:.1f} tok/s vs dense "
                  f"{entry['tok_s']['smollm2']:.1f} tok/s (step x{entry['ratio_upcycled_vs_smollm2']:.2f})", flush=True)
    if args.upcycled:
        report = json.loads((Path(args.upcycled) / "upcycle.json").read_text())
        results["upcycled"] = {k: report[k] for k in ("perplexity", "routing", "expert_similarity", "parameters",
                                                      "tokens_seen", "config")}
        ppl, routing = report["perplexity"], report["routing"]
        print(f"upcycled SmolLM2: perplexity dense {ppl['dense']:.2f}, dense trained on the same tokens "
              f"{ppl.get('dense_trained', float('nan')):.2f}, upcycled {ppl['upcycled']:.2f}; expert shares "
              f"{routing['min_share']:.3f}..{routing['max_share']:.3f}, router entropy "
              f"{100 * routing['entropy_fraction']:.0f}% of the maximum", flush=True)
    RESULTS.mkdir(exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = RESULTS / f"moe-{stamp}.json"
    out.write_text(json.dumps(results, indent=2))
    plot(results, RESULTS / f"moe-{stamp}.png")
    print(f"wrote {out}")


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = list(results["batches"])
    fig, axes = plt.subplots(1, len(batches), figsize=(4 * len(batches), 3.5))
    for ax, batch in zip([axes] if len(batches) == 1 else axes, batches):
        entry = results["batches"][batch]
        names = list(entry["step_ms"])
        ax.bar(names, [entry["step_ms"][n] for n in names], color=[f"C{i}" for i in range(len(names))])
        ax.tick_params(axis="x", labelrotation=30)
        for i, n in enumerate(names):
            ax.text(i, entry["step_ms"][n], f"{entry['step_mb'][n]:.0f} MB", ha="center", va="bottom", fontsize=8)
        ax.set_title(f"batch {batch}")
        ax.set_ylabel("decode step (ms)")
    fig.suptitle(f"{results['config']['experts']} experts, top-{results['config']['top_k']}, "
                 f"{results['config']['dtype']}")
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main()
