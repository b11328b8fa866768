"""The shared training loop: gradient accumulation, the learning-rate schedule, and a run cut short
and resumed from its checkpoint ending exactly where an uninterrupted run ends."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tokenmill.errors import InvalidParameterError
from tokenmill.training.trainer import CHECKPOINT, TrainConfig, Trainer


def _data(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randn(8, 4, generator=g)
        yield x, x @ torch.tensor([1.0, -2.0, 0.5, 3.0])


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(4, 1)


def _loss(model):
    def fn(batch):
        x, y = batch
        loss = ((model(x).squeeze(-1) - y) ** 2).mean()
        return loss, {"mse": loss.item()}
    return fn


CFG = TrainConfig(steps=12, lr=0.3, warmup_steps=2, grad_accum=2, mixed_precision=False, checkpoint_every=4)


def test_a_resumed_run_ends_where_an_uninterrupted_one_does(tmp_path):
    whole = _model()
    log = Trainer({"m": whole}, CFG, tmp_path / "a", progress=False).fit(_data(24), _loss(whole))
    assert len(log.values["loss"]) == 12 and log.values["loss"][-1] < log.values["loss"][0] / 3

    cut = _model()
    short = TrainConfig(**{**CFG.__dict__, "steps": 12})
    trainer = Trainer({"m": cut}, short, tmp_path / "b", progress=False)
    data = _data(24)
    with pytest.raises(InvalidParameterError, match="ran out at step 5"):
        trainer.fit((b for i, b in zip(range(10), data)), _loss(cut))  # killed after 5 steps' data
    assert (tmp_path / "b" / CHECKPOINT).exists()  # written at step 4
    again = _model()  # a new process: fresh weights, state from the checkpoint
    resumed = Trainer({"m": again}, short, tmp_path / "b", progress=False).fit(_data(24), _loss(again))
    assert resumed.resumed_at == 4 and len(resumed.values["loss"]) == 12
    assert torch.allclose(again.weight, whole.weight, atol=1e-6) and torch.allclose(again.bias, whole.bias, atol=1e-6)


def test_gradient_accumulation_is_one_step_over_the_micro_batches():
    a, b = _model(), _model()
    Trainer({"m": a}, TrainConfig(steps=1, lr=0.1, warmup_steps=0, grad_accum=2, mixed_precision=False),
            progress=False).fit(_data(2), _loss(a))
    x = torch.cat([bt[0] for bt in _data(2)])
    y = torch.cat([bt[1] for bt in _data(2)])
    Trainer({"m": b}, TrainConfig(steps=1, lr=0.1, warmup_steps=0, mixed_precision=False),
            progress=False).fit(iter([(x, y)]), _loss(b))
    assert torch.allclose(a.weight, b.weight, atol=1e-6)


def test_the_schedule_warms_up_then_decays_to_zero_and_bad_settings_are_refused():
    cfg = TrainConfig(steps=10, warmup_steps=2)
    assert [round(cfg.lr_factor(s), 3) for s in (0, 1, 2, 10)] == [0.5, 1.0, 1.0, 0.0]
    with pytest.raises(InvalidParameterError, match="grad_accum must be positive"):
        TrainConfig(grad_accum=0)
    with pytest.raises(InvalidParameterError, match="nothing to train"):
        Trainer({"m": _model().requires_grad_(False)}, cfg)
