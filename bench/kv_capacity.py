"""KV memory: sequences served at one fixed KV budget, paged vs a contiguous max-length row per
sequence, and the KV memory left unused inside allocated blocks.

    python bench/kv_capacity.py [--budget-mib 512] [--num-requests 128]

The contiguous figure is what a cache that reserves the whole context window per sequence
(``max_model_len`` tokens) fits in the same budget. The paged figure is the peak number of
sequences the engine held KV for at once on a workload of random prompts (32-1024 tokens) and
outputs (16-512). Internal fragmentation = idle slots in allocated blocks / allocated slots,
averaged over the steps where the pool was at least half full (steady state).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path

from tokenmill import LLM, SamplingParams
from tokenmill.attention.kv_cache import PagedKVCache

RESULTS = Path(__file__).parent / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--budget-mib", type=int, default=512)
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()

    budget = args.budget_mib * 2**20
    llm = LLM(args.model, dtype=args.dtype, device="cpu", kv_cache_memory=budget, max_num_seqs=256,
              block_size=args.block_size)
    cfg, engine = llm.model_config, llm.engine
    token_bytes = PagedKVCache.bytes_per_block(1, cfg.num_kv_heads, cfg.head_dim, llm.dtype, cfg.num_layers)
    contiguous = budget // (engine.max_model_len * token_bytes)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, cfg.vocab_size) for _ in range(rng.randint(32, 1024))]
               for _ in range(args.num_requests)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(16, 512), ignore_eos=True) for _ in prompts]
    llm.generate(prompts, params, use_tqdm=True)
    stats = list(engine.stats)
    peak = max(s.num_running for s in stats)
    total_blocks = engine.kv_capacity_tokens // args.block_size
    steady = [s for s in stats if s.kv_used_blocks >= total_blocks / 2]
    waste = [1 - s.kv_tokens / (s.kv_used_blocks * args.block_size) for s in steady if s.kv_used_blocks]
    result = {
        "model": llm.model_name, "dtype": args.dtype, "budget_bytes": budget, "bytes_per_token": token_bytes,
        "max_model_len": engine.max_model_len, "kv_capacity_tokens": engine.kv_capacity_tokens,
        "contiguous_sequences": contiguous, "paged_peak_sequences": peak,
        "ratio": peak / max(contiguous, 1e-9), "steady_state_steps": len(steady),
        "internal_fragmentation_mean": statistics.mean(waste) if waste else None,
        "internal_fragmentation_max": max(waste) if waste else None,
        "preemptions": sum(s.num_preempted for s in stats),
    }
    print(json.dumps(result, indent=2))
    print(f"\nat {args.budget_mib} MiB: contiguous {contiguous} sequences, paged peak {peak} "
          f"(x{result['ratio']:.1f}); unused slots in allocated blocks at steady state: "
          f"{100 * (result['internal_fragmentation_mean'] or 0):.2f}% mean, "
          f"{100 * (result['internal_fragmentation_max'] or 0):.2f}% max")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "kv_capacity.json").write_text(json.dumps(result, indent=2))
    _plot(stats, contiguous, RESULTS / "kv_capacity.png")


def _plot(stats, contiguous: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot([s.num_running for s in stats], label="paged: sequences holding KV")
    ax.axhline(contiguous, color="C1", linestyle="--", label="contiguous max-length rows")
    ax.set_xlabel("engine step")
    ax.set_ylabel("concurrent sequences")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
