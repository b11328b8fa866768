"""Distil for a wall-clock budget rather than a step count: load teacher and student once, time a
few training micro-batches on them, then run ``tokenmill.distillation.distill`` with as many
optimizer steps as fit in the budget (its warm-up and cosine schedule laid over those steps). Made
for a lent GPU machine's fixed lease (``bench/cuda_check.sh``); it writes what ``tokenmill
distill`` writes, plus ``budget.json`` (the probe's seconds per step and the steps chosen).

    python bench/distill_budget.py --teacher T --student S --out DIR --seconds 180 [--device cuda]
        [--batch-size 64] [--seq-len 512] [--lr 6e-4] [--eval-tokens 4096] [--eval-every 25]
        [--freeze-embedding] [--max-steps N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from tokenmill.commands.distill import print_summary
from tokenmill.device import resolve_device
from tokenmill.distillation.config import DistillConfig
from tokenmill.distillation.distill import distill, step_loss
from tokenmill.paths import default_cache_dir
from tokenmill.quantization.api import load_float32


def seconds_per_step(teacher, student, config: DistillConfig, device: torch.device, probes: int = 3) -> float:
    """Median time of one micro-batch's forward and backward passes (after one warm-up); the
    optimizer's own step is left out, which the budget's margin covers."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    g = torch.Generator().manual_seed(0)
    batch = torch.randint(0, student.config.vocab_size, (config.batch_size, config.seq_len), generator=g).to(device)
    teacher.requires_grad_(False)
    student.requires_grad_(True)
    times = []
    for _ in range(probes + 1):
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=config.train.mixed_precision):
            loss, _ = step_loss(teacher, student, None, batch, config)
        loss.backward()
        sync()
        times.append(time.perf_counter() - start)
    student.zero_grad(set_to_none=True)
    return statistics.median(times[1:]) * config.train.grad_accum


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--teacher", required=True)
    parser.add_argument("--student", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seconds", type=float, required=True, help="the training loop's budget")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--lr", type=float, default=6e-4)
    parser.add_argument("--eval-tokens", type=int, default=4096)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--freeze-embedding", action="store_true")
    parser.add_argument("--max-steps", type=int, default=100_000)
    parser.add_argument("--margin", type=float, default=0.8, help="fraction of the budget the probe's rate fills")
    args = parser.parse_args()

    device, cache = resolve_device(args.device), default_cache_dir()
    teacher, student = load_float32(args.teacher, device, cache), load_float32(args.student, device, cache)
    options = {"batch_size": args.batch_size, "seq_len": args.seq_len, "eval_tokens": args.eval_tokens,
               "eval_every": args.eval_every, "train_embedding": not args.freeze_embedding}
    probe = DistillConfig.from_dict(options)
    per_step = seconds_per_step(teacher.model, student.model, probe, device)
    steps = max(10, min(args.max_steps, int(args.seconds * args.margin / per_step)))
    config = DistillConfig.from_dict({**options, "train": {"steps": steps, "lr": args.lr, "checkpoint_every": 0}})
    print(f"probe: {per_step:.3f} s a step of {config.tokens_per_step:,} tokens -> {steps} steps "
          f"({steps * config.tokens_per_step:,} tokens) in a {args.seconds:.0f} s budget", flush=True)
    result = distill(teacher, student, config, args.out, cache_dir=cache)
    budget = {"seconds_budget": args.seconds, "probe_seconds_per_step": per_step, "steps": steps,
              "tokens_seen": result.tokens_seen, "wall_seconds": result.wall_seconds, "perplexity": result.perplexity,
              "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
    (args.out / "budget.json").write_text(json.dumps(budget, indent=2))
    print_summary(result, config, args.out)


if __name__ == "__main__":
    main()
