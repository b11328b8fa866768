"""One training loop: AdamW with warm-up and cosine decay, gradient accumulation, clipping,
bfloat16 autocast, a progress bar, checkpoints and resume.

On CPU the loop keeps freed large blocks for reuse (:func:`tokenmill.allocator.keep_large_buffers`):
a distillation step's [tokens, vocabulary] logits are 200 MB tensors, made and freed several
times a step, and with glibc's defaults each is a fresh mmap paid for in page faults (measured:
4.9 s -> 2.7-3.0 s per 1024-token distillation step of SmolLM2 into a pruned student, 2 vCPUs).

    trainer = Trainer(modules, TrainConfig(steps=500, grad_accum=4), out_dir="run/")
    log = trainer.fit(batches, loss_fn)

``modules`` name the ``nn.Module`` objects whose trainable parameters (``requires_grad``) are
optimized and whose state a checkpoint keeps. ``loss_fn(batch) -> (loss, {name: float})`` runs the
forward pass; the floats are logged per step. ``batches`` yields ``steps * grad_accum``
micro-batches in a fixed order (seeded): on resume the ones of the finished steps are skipped, so
a resumed run sees the data a run without interruption would have seen. ``after_step(step)``,
when given, runs after each optimizer update with the number of steps done (before a checkpoint
is written): for constraints the update must not break, such as a pruned model's zeros, and for
periodic measurements; the floats of the dict it may return are logged under their names (lists
of their own: a value measured every 50 steps makes a list of its own length). A checkpoint
(``out_dir/checkpoint.pt``, every ``checkpoint_every`` steps and at the end) holds the modules'
state, the optimizer's and scheduler's, the step and the log so far; ``on_checkpoint(step)``, when
given, runs after each periodic one (not the last: the caller saves what training produced).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from tokenmill.allocator import keep_large_buffers
from tokenmill.errors import InvalidParameterError

CHECKPOINT = "checkpoint.pt"


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 100
    """Optimizer steps."""
    lr: float = 5e-5
    """Peak AdamW learning rate (linear warm-up over ``warmup_steps``, then cosine decay to zero)."""
    warmup_steps: int = 10
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    """Gradients are clipped to this global norm."""
    grad_accum: int = 1
    """Micro-batches whose gradients add up to one optimizer step."""
    mixed_precision: bool = True
    """Forward and backward matmuls in bfloat16 under ``torch.autocast`` (weights, gradients and
    AdamW states stay float32)."""
    checkpoint_every: int = 0
    """Write a checkpoint every this many steps (and at the end) when there is an ``out_dir``; 0: at the end only."""

    def __post_init__(self) -> None:
        if self.steps <= 0 or self.grad_accum <= 0 or self.warmup_steps < 0 or self.checkpoint_every < 0:
            raise InvalidParameterError(f"training: steps and grad_accum must be positive, warmup_steps and "
                                        f"checkpoint_every >= 0; got {self.steps}, {self.grad_accum}, "
                                        f"{self.warmup_steps}, {self.checkpoint_every}")
        if not self.lr > 0 or not math.isfinite(self.lr) or self.weight_decay < 0 or not self.max_grad_norm > 0:
            raise InvalidParameterError(f"training: lr and max_grad_norm must be positive and weight_decay >= 0; got "
                                        f"{self.lr}, {self.max_grad_norm}, {self.weight_decay}")

    def lr_factor(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        progress = (step - self.warmup_steps) / max(1, self.steps - self.warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


@dataclass
class TrainLog:
    """What each optimizer step logged (each value the mean over its micro-batches)."""

    values: dict[str, list[float]] = field(default_factory=dict)
    resumed_at: int = 0
    """The step the run resumed from (0: from the start)."""

    def add(self, entry: dict[str, float]) -> None:
        for name, value in entry.items():
            self.values.setdefault(name, []).append(value)


class Trainer:
    def __init__(self, modules: dict[str, nn.Module], config: TrainConfig, out_dir: str | Path | None = None,
                 desc: str = "training", progress: bool = True) -> None:
        self.modules, self.config, self.desc, self.progress = modules, config, desc, progress
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.params = [p for m in modules.values() for p in m.parameters() if p.requires_grad]
        if not self.params:
            raise InvalidParameterError(f"{desc}: nothing to train (no parameter requires grad)")
        self.optimizer = torch.optim.AdamW(self.params, lr=config.lr, weight_decay=config.weight_decay,
                                           betas=(0.9, 0.95))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, config.lr_factor)
        self.step = 0
        self.log = TrainLog()

    # ---- checkpoints ----------------------------------------------------------------------------
    def save(self) -> Path | None:
        if self.out_dir is None:
            return None
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / CHECKPOINT
        tmp = path.with_suffix(".tmp")
        torch.save({"step": self.step, "modules": {k: m.state_dict() for k, m in self.modules.items()},
                    "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                    "log": self.log.values, "steps": self.config.steps}, tmp)
        tmp.replace(path)  # never a half-written checkpoint
        return path

    def resume(self) -> bool:
        """Load ``out_dir/checkpoint.pt`` when there is one -> whether it did."""
        path = self.out_dir / CHECKPOINT if self.out_dir is not None else None
        if path is None or not path.exists():
            return False
        state = torch.load(path, map_location="cpu", weights_only=False)
        missing = sorted(set(self.modules) - set(state["modules"]))
        if missing:
            raise InvalidParameterError(f"{path}: checkpoint has no state for {', '.join(missing)}")
        for name, module in self.modules.items():
            module.load_state_dict(state["modules"][name])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = state["step"]
        self.log = TrainLog(dict(state["log"]), resumed_at=self.step)
        return True

    # ---- the loop -------------------------------------------------------------------------------
    def fit(self, batches: Iterable[Any], loss_fn: Callable[[Any], tuple[torch.Tensor, dict[str, float]]],
            resume: bool = True,
            after_step: Callable[[int], dict[str, float] | None] | None = None,
            on_checkpoint: Callable[[int], None] | None = None) -> TrainLog:
        cfg = self.config
        if resume:
            self.resume()
        micro = iter(batches)
        for _ in itertools.islice(micro, self.step * cfg.grad_accum):  # the finished steps' data
            pass
        device_type = self.params[0].device.type
        if device_type == "cpu":
            keep_large_buffers()  # a step's logits and activations are fresh mmaps, page-faulted, otherwise
        bar = tqdm(total=cfg.steps, initial=self.step, desc=self.desc, disable=not self.progress, unit="step")
        while self.step < cfg.steps:
            self.optimizer.zero_grad(set_to_none=True)
            sums: dict[str, float] = {}
            for _ in range(cfg.grad_accum):
                batch = next(micro, None)
                if batch is None:
                    raise InvalidParameterError(f"{self.desc}: the data ran out at step {self.step}")
                with torch.autocast(device_type, dtype=torch.bfloat16, enabled=cfg.mixed_precision):
                    loss, values = loss_fn(batch)
                (loss / cfg.grad_accum).backward()
                for name, value in {"loss": loss.item(), **values}.items():
                    sums[name] = sums.get(name, 0.0) + value / cfg.grad_accum
            torch.nn.utils.clip_grad_norm_(self.params, cfg.max_grad_norm)
            self.optimizer.step()
            self.scheduler.step()
            self.step += 1
            self.log.add(sums)
            if after_step is not None:
                self.log.add(after_step(self.step) or {})
            bar.update(1)
            bar.set_postfix({k: f"{v:.4f}" for k, v in sums.items()})
            if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0 and self.step < cfg.steps:
                if self.save() is not None and on_checkpoint is not None:
                    on_checkpoint(self.step)
        bar.close()
        self.save()
        return self.log
