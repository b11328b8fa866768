"""Quantization-aware training (QAT): fine-tune a model through fake-quantized weights, then quantize it.

Round-to-nearest INT4 moves every weight to its nearest grid point without asking what the
network needs; QAT lets the float weights learn where to sit on that grid. Three steps:

    prepare_qat(model, config)      each target nn.Linear (quantization_targets, as quantize()
                                    picks them) -> FakeQuantLinear: the float weight stays a
                                    trainable parameter, the forward multiplies by its
                                    quantize-dequantize image on the exact grid Int4Linear /
                                    Int8Linear will store
    qat_finetune(model, data, ...)  AdamW on next-token cross entropy and/or KL divergence to the
                                    float model's logits (distillation), on the training split
                                    of the corpus; gradients pass the rounding straight through
    convert_qat(model, config)      FakeQuantLinear -> Int4Linear / Int8Linear from the trained
                                    float weights: an ordinary quantized model (save_quantized,
                                    LLM(dir), serving) with Int4WeightOnlyConfig as its config

Straight-through estimator: the forward is dq = dequantize(round(w)), the backward treats the
rounding as the identity where w lies inside the clamp range of the grid and as a constant (zero
gradient) outside it (an autograd.Function, so that the forward value is dq exactly). The group
scales and zeros are recomputed from the weights at every forward (min-max, as
``quantize_int4_groupwise`` does) and get no gradient.

The tied LM head follows the int4 handler: the logits multiply a fake-quantized copy of the
embedding matrix (INT8 per channel with ``lm_head_int8``), the embedding lookup stays float.

Training runs the model's own blocks with one change: while :func:`training_attention` is active
the attention layers use :class:`CausalSDPABackend` (plain causal SDPA over a [batch, seq_len]
batch, no KV cache), since the paged backend writes keys into a cache in place, which has no
business in an autograd graph.

Data: :data:`TRAIN_SPLIT` of the corpus characters. Perplexity is measured on the first tokens of
the corpus (8192 to 16384 tokens, under 2% of it) and calibration reads its last 8 x 16384
characters (under 3%), so the middle half is text neither of them reads.
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from tokenmill.config import reject_unknown_keys
from tokenmill.device import resolve_device, resolve_dtype
from tokenmill.errors import InvalidParameterError
from tokenmill.lora.slots import LoRABatch
from tokenmill.models.base import CausalLM
from tokenmill.models.builder import LoadedModel
from tokenmill.paths import default_cache_dir
from tokenmill.quantization.api import load_float32
from tokenmill.quantization.config import (
    GROUP_SIZES, Int4WeightOnlyConfig, Int8WeightOnlyConfig, QuantConfig)
from tokenmill.quantization.linear import (
    Int4Linear, Int8Linear, QuantizedLinear, int4_group_params, int4_round, pad_to_groups,
    quantize_int8_per_channel)
from tokenmill.training.attention import NoCache, training_attention, CausalSDPABackend
from tokenmill.training.trainer import Trainer, TrainConfig
from tokenmill.quantization.targets import cast_float_parameters, quantization_targets, set_module

TRAIN_SPLIT = (0.25, 0.75)
"""Fractions of the corpus characters that training reads: its middle half (see the module docstring)."""

WEIGHT_KINDS = ("int4", "int8")


@dataclass(frozen=True)
class QATConfig:
    """Quantization-aware training: what the weights are quantized to and how they are trained.

    Example: ``qat("smollm2-135m-instruct", QATConfig(group_size=64, steps=100))``.
    """

    weight: str = "int4"
    """``int4`` (group-wise asymmetric, as Int4WeightOnlyConfig) or ``int8`` (per channel, symmetric)."""
    group_size: int = 64
    """int4: input columns sharing one scale and zero: 32, 64, 128 or 256. Each group's (scale, zero)
    is its min-max range, recomputed from the weights at every step (no range search: training
    moves the weights onto the grid instead)."""
    lm_head_int8: bool = True
    """int4: the LM head in INT8 per channel, as Int4WeightOnlyConfig.lm_head_int8."""
    quantize_lm_head: bool = True
    """Quantize (and fake-quantize while training) the LM head too."""
    steps: int = 100
    """Optimizer steps."""
    lr: float = 5e-5
    """Peak AdamW learning rate (linear warm-up over ``warmup_steps``, then cosine decay to zero)."""
    warmup_steps: int = 10
    """Steps of linear learning-rate warm-up."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    max_grad_norm: float = 1.0
    """Gradients are clipped to this global norm."""
    seq_len: int = 256
    """Tokens per training sequence."""
    batch_size: int = 1
    """Sequences per step."""
    distill_weight: float = 1.0
    """Loss = (1 - w) * cross entropy + w * KL(float model || QAT model) over the next-token
    distributions; 0 trains on the text alone, 1 on the float model's logits alone."""
    train_embedding: bool = False
    """Train the embedding matrix (and with it a tied LM head) too; off by default: the largest
    matrix, it is not quantized to 4 bits, and its gradient costs a vocabulary-sized matmul."""
    mixed_precision: bool = True
    """Run the forward and backward matmuls in bfloat16 under ``torch.autocast`` (about 2.5x the
    float32 speed on a CPU with AVX512-BF16); weights, gradients and AdamW states stay float32."""
    seed: int = 0
    """Seed of the order in which training sequences are drawn."""

    def __post_init__(self) -> None:
        if self.weight not in WEIGHT_KINDS:
            raise InvalidParameterError(f"QATConfig.weight must be one of {WEIGHT_KINDS}, got {self.weight!r}")
        if self.group_size not in GROUP_SIZES:
            raise InvalidParameterError(f"QATConfig.group_size must be one of {GROUP_SIZES}, got {self.group_size}")
        for name in ("steps", "seq_len", "batch_size"):
            if getattr(self, name) <= 0:
                raise InvalidParameterError(f"QATConfig.{name} must be positive, got {getattr(self, name)}")
        if self.seq_len < 2:
            raise InvalidParameterError(f"QATConfig.seq_len must be at least 2, got {self.seq_len}")
        if not self.lr > 0 or not math.isfinite(self.lr):
            raise InvalidParameterError(f"QATConfig.lr must be a positive number, got {self.lr}")
        if self.warmup_steps < 0 or self.weight_decay < 0 or not self.max_grad_norm > 0:
            raise InvalidParameterError("QATConfig: warmup_steps and weight_decay must be >= 0 and max_grad_norm > 0, "
                                        f"got {self.warmup_steps}, {self.weight_decay}, {self.max_grad_norm}")
        if not 0 <= self.distill_weight <= 1:
            raise InvalidParameterError(f"QATConfig.distill_weight must be in [0, 1], got {self.distill_weight}")

    def quant_config(self) -> QuantConfig:
        """The config of the quantized model :func:`convert_qat` produces (what its checkpoint stores)."""
        if self.weight == "int8":
            return Int8WeightOnlyConfig(quantize_lm_head=self.quantize_lm_head)
        return Int4WeightOnlyConfig(quantize_lm_head=self.quantize_lm_head, group_size=self.group_size,
                                    lm_head_int8=self.lm_head_int8, range_search=False)  # min-max, as trained


def qat_config_from_dict(data: dict[str, Any]) -> QATConfig:
    """A QATConfig from keyword data, unknown keys rejected with their names."""
    reject_unknown_keys(QATConfig, data)
    return QATConfig(**data)


# --------------------------------------------------------------------------- fake quantization

class _StraightThrough(torch.autograd.Function):
    """Value ``dq`` exactly (``w + (dq - w).detach()`` can be one ulp off); gradient: masked identity."""

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor, dq: torch.Tensor, inside: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inside)
        return dq

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (inside,) = ctx.saved_tensors
        return grad * inside, None, None


def straight_through(w: torch.Tensor, dq: torch.Tensor, inside: torch.Tensor) -> torch.Tensor:
    """Value ``dq``; gradient with respect to ``w``: 1 where ``inside``, 0 elsewhere."""
    return _StraightThrough.apply(w, dq.detach(), inside)


def int4_fake_quant(groups: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """groups [..., g] float32 -> their INT4 image (q - 8) * scale + zero under (scale, zero) [...],
    q = int4_round (Int4Linear's grid); straight-through where q needs no clamping, within
    [zero - 8.5 scale, zero + 7.5 scale] (a group's min and max are inside: a bound of
    exactly zero + 7 scale could drop the max by a rounding error)"""
    s, z = scale.float()[..., None], zero.float()[..., None]
    q = int4_round(groups.detach(), scale, zero)
    dq = (q.float() - 8) * s + z
    inside = (groups >= z - 8.5 * s) & (groups <= z + 7.5 * s)  # those int4_round does not clamp
    return straight_through(groups, dq, inside)


def fake_quantize_int4(weight: torch.Tensor, group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """weight [N, K] -> float32 [N, K] equal to ``Int4Linear.from_float(weight, ...).dequantize()``:
    min-max (scale, zero) per group in ``dtype`` (no gradient), rounding passed straight through."""
    w = pad_to_groups(weight, group_size)
    groups = w.view(w.shape[0], -1, group_size)
    with torch.no_grad():
        scale, zero = int4_group_params(groups, dtype)
    return int4_fake_quant(groups, scale, zero).reshape(w.shape)[:, :weight.shape[1]]


def int8_fake_quant(weight: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """weight [N, K] and its rounding q [N, K] in -127..127 under scale [N] -> the symmetric INT8
    image q * scale; straight-through where q needs no clamping, |w| <= 127.5 scale."""
    w, s = weight.float(), scale.float()[:, None]
    return straight_through(w, q.float() * s, w.abs() <= 127.5 * s)


def fake_quantize_int8(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """weight [N, K] -> float32 [N, K] equal to ``Int8Linear.from_float(weight, ...).dequantize()``:
    absmax scale per row in ``dtype`` (no gradient), rounding passed straight through."""
    with torch.no_grad():
        q, scale = quantize_int8_per_channel(weight, dtype)
    return int8_fake_quant(weight, q, scale)


class FakeQuantLinear(nn.Module):
    """y = x Wq^T (+ b), Wq the fake-quantized image of the float parameter ``weight``.

    ``weight`` is the original layer's parameter object itself (for a tied LM head, the
    embedding's), so the optimizer trains it in place. A frozen weight's image is computed once.
    """

    def __init__(self, weight: nn.Parameter, bias: torch.Tensor | None, bits: int, group_size: int,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.weight = weight
        self.bias = bias if bias is None or isinstance(bias, nn.Parameter) else nn.Parameter(bias)
        self.bits, self.group_size, self.dtype = bits, group_size, dtype
        self._frozen: tuple[int, torch.Tensor] | None = None

    def fake_weight(self) -> torch.Tensor:
        """float32 [N, K]: the weight as its quantized form will compute with it."""
        if not self.weight.requires_grad and self._frozen is not None and self._frozen[0] == self.weight._version:
            return self._frozen[1]
        if self.bits == 4:
            w = fake_quantize_int4(self.weight, self.group_size, self.dtype)
        else:
            w = fake_quantize_int8(self.weight, self.dtype)
        if not self.weight.requires_grad:
            self._frozen = (self.weight._version, w.detach())
        return w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.fake_weight().to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def to_quantized(self) -> QuantizedLinear:
        """The real quantized layer of the current float weight (same grid as the forward)."""
        weight = self.weight.detach()
        bias = None if self.bias is None else self.bias.detach()
        if self.bits == 4:
            return Int4Linear.from_float(weight, bias, self.dtype, self.group_size)
        return Int8Linear.from_float(weight, bias, self.dtype)

    def extra_repr(self) -> str:
        kind = f"int4 g{self.group_size}" if self.bits == 4 else "int8 per channel"
        return f"in_features={self.in_features}, out_features={self.out_features}, {kind}"


def prepare_qat(model: CausalLM, config: QATConfig, dtype: torch.dtype | None = None) -> CausalLM:
    """Swap each linear layer that ``quantize(model, config.quant_config())`` would quantize for a
    FakeQuantLinear holding its float weight, in place. ``dtype``: the dtype the converted model
    will compute in (its scales and zeros are rounded to it; default: the model's dtype)."""
    if getattr(model, "quantization_config", None) is not None:
        raise InvalidParameterError("prepare_qat needs a float model; this one is already quantized")
    if any(isinstance(m, FakeQuantLinear) for m in model.modules()):
        raise InvalidParameterError("prepare_qat: the model is already prepared")
    dtype = dtype or model.embed.weight.dtype
    for target in quantization_targets(model, config.quant_config()):
        int8 = config.weight == "int8" or (target.name == "lm_head" and config.lm_head_int8)
        set_module(model, target.name, FakeQuantLinear(target.weight, target.bias, 8 if int8 else 4,
                                                       config.group_size, dtype))
    return model


def fake_quant_layers(model: nn.Module) -> list[tuple[str, FakeQuantLinear]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, FakeQuantLinear)]


def convert_qat(model: CausalLM, config: QATConfig, progress: bool = True) -> CausalLM:
    """Replace every FakeQuantLinear by its Int4Linear / Int8Linear, in place: the result is an
    ordinary quantized model (``quantization_config`` = ``config.quant_config()``) in the dtype
    given to :func:`prepare_qat`, with every parameter frozen."""
    layers = fake_quant_layers(model)
    if not layers:
        raise InvalidParameterError("convert_qat: the model has no fake-quantized layers (run prepare_qat first)")
    dtype = layers[0][1].dtype
    for name, layer in tqdm(layers, desc=f"converting {config.quant_config().method}", disable=not progress,
                            unit="layer"):
        set_module(model, name, layer.to_quantized())
    cast_float_parameters(model, dtype)
    model.requires_grad_(False)
    model.quantization_config = config.quant_config()
    return model


# --------------------------------------------------------------------------- training forward

def training_logits(model: CausalLM, ids: torch.Tensor, lora: LoRABatch | None = None,
                    hidden_only: bool = False) -> torch.Tensor:
    """ids [B, S] -> float32 logits [B, S, vocab], differentiable (each row its own sequence);
    ``lora``: an adapter applied to every token (LoRA training); ``hidden_only``: the final hidden
    states [B * S, hidden] instead (for a caller that needs the logits of a few rows only)."""
    b, s = ids.shape
    positions = torch.arange(s, device=ids.device).repeat(b)
    with training_attention(model, CausalSDPABackend(b, s)):
        hidden = model(ids.reshape(-1), positions, NoCache(), None, lora)
    return hidden if hidden_only else model.compute_logits(hidden).view(b, s, -1)


# --------------------------------------------------------------------------- data and loop

def training_ids(tokenizer: Any, cache_dir: Path | None = None) -> list[int]:
    """Token ids of :data:`TRAIN_SPLIT` of the corpus (the text perplexity and calibration never read)."""
    from tokenmill.eval.corpus import fetch_corpus

    text = fetch_corpus(cache_dir).read_text(encoding="utf-8")
    begin, end = (int(f * len(text)) for f in TRAIN_SPLIT)
    return tokenizer.encode(text[begin:end], add_special_tokens=False)


def sample_batches(ids: list[int], count: int, batch_size: int, seq_len: int, seed: int,
                   device: torch.device, trained: list[bool] | None = None) -> Iterator[Any]:
    """``count`` batches [batch_size, seq_len] of windows at seeded random offsets of ``ids``.
    With ``trained`` (one flag per token of ``ids``): (windows, mask) pairs, the bool mask
    [batch_size, seq_len] true where the position's next token is a trained one (the same
    windows as without it)."""
    if len(ids) < seq_len:
        raise InvalidParameterError(f"training needs at least seq_len = {seq_len} tokens, got {len(ids)}")
    data = torch.tensor(ids, dtype=torch.long)
    next_trained = None if trained is None else torch.tensor(list(trained[1:]) + [False], dtype=torch.bool)
    g = torch.Generator().manual_seed(seed)
    span = torch.arange(seq_len)
    for _ in range(count):
        starts = torch.randint(0, len(ids) - seq_len + 1, (batch_size,), generator=g)
        index = starts[:, None] + span
        windows = data[index].to(device)
        yield windows if next_trained is None else (windows, next_trained[index].to(device))


@dataclass
class QATLog:
    """Per-step training losses (nats per predicted token)."""

    loss: list[float] = field(default_factory=list)
    """The optimized loss: (1 - w) * ce + w * kl."""
    ce: list[float] = field(default_factory=list)
    """Next-token cross entropy on the training text."""
    kl: list[float] = field(default_factory=list)
    """KL(float model || QAT model); empty without distillation."""


def qat_loss(logits: torch.Tensor, ids: torch.Tensor, teacher_logits: torch.Tensor | None,
             distill_weight: float) -> tuple[torch.Tensor, float, float | None]:
    """logits [B, S, V] of ids [B, S] -> (loss, cross entropy, KL or None) over positions 0..S-2."""
    pred = logits[:, :-1].reshape(-1, logits.shape[-1])
    ce = F.cross_entropy(pred, ids[:, 1:].reshape(-1))
    if teacher_logits is None:
        return ce, ce.item(), None
    logp = F.log_softmax(pred, dim=-1)
    teacher_logp = F.log_softmax(teacher_logits[:, :-1].reshape(-1, logits.shape[-1]), dim=-1)
    kl = F.kl_div(logp, teacher_logp, log_target=True, reduction="batchmean")
    return (1 - distill_weight) * ce + distill_weight * kl, ce.item(), kl.item()


def trainable_parameters(model: CausalLM, config: QATConfig) -> list[nn.Parameter]:
    """Every float parameter but the embedding (unless ``train_embedding``); sets requires_grad."""
    model.requires_grad_(True)
    model.embed.weight.requires_grad_(config.train_embedding)
    return [p for p in model.parameters() if p.requires_grad]


def qat_finetune(model: CausalLM, data: Any, config: QATConfig, teacher: CausalLM | None = None,
                 progress: bool = True, cache_dir: Path | None = None) -> QATLog:
    """Train a model prepared by :func:`prepare_qat` for ``config.steps`` AdamW steps, in place.

    ``data``: training token ids, or a tokenizer to read :data:`TRAIN_SPLIT` of the corpus with.
    ``teacher``: the float model whose logits are distilled (needed when distill_weight > 0).
    """
    if not fake_quant_layers(model):
        raise InvalidParameterError("qat_finetune: the model has no fake-quantized layers (run prepare_qat first)")
    if config.distill_weight > 0 and teacher is None:
        raise InvalidParameterError("qat_finetune: distill_weight > 0 needs the float model as teacher")
    ids = list(data) if isinstance(data, (list, tuple)) else training_ids(data, cache_dir)
    trainable_parameters(model, config)  # what the trainer optimizes: requires_grad set here
    if teacher is not None:
        teacher.requires_grad_(False)

    def loss_fn(batch: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        teacher_logits = None
        if teacher is not None and config.distill_weight > 0:
            with torch.no_grad():
                teacher_logits = training_logits(teacher, batch)
        loss, ce, kl = qat_loss(training_logits(model, batch), batch, teacher_logits, config.distill_weight)
        return loss, {"ce": ce} if kl is None else {"ce": ce, "kl": kl}

    train = TrainConfig(steps=config.steps, lr=config.lr, warmup_steps=config.warmup_steps,
                        weight_decay=config.weight_decay, max_grad_norm=config.max_grad_norm,
                        mixed_precision=config.mixed_precision)
    trainer = Trainer({"model": model}, train, desc="QAT", progress=progress)
    batches = sample_batches(ids, config.steps, config.batch_size, config.seq_len, config.seed,
                             model.embed.weight.device)
    values = trainer.fit(batches, loss_fn).values
    model.requires_grad_(False)
    return QATLog(values.get("loss", []), values.get("ce", []), values.get("kl", []))


def qat(model: str | os.PathLike, config: QATConfig, dtype: str | torch.dtype = "bfloat16", device: str = "cpu",
        progress: bool = True, cache_dir: str | os.PathLike | None = None) -> tuple[LoadedModel, QATLog]:
    """Load a model (name, GGUF file, HF directory) in float32, train it with QAT on the corpus and
    convert it: -> (a quantized ``LoadedModel`` in ``dtype``, ready for ``save_quantized``, the losses)."""
    resolved = resolve_device(device)
    target_dtype = resolve_dtype(dtype, resolved)
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    loaded = load_float32(model, resolved, cache)
    teacher = copy.deepcopy(loaded.model) if config.distill_weight > 0 else None
    prepare_qat(loaded.model, config, target_dtype)
    log = qat_finetune(loaded.model, loaded.tokenizer, config, teacher, progress, cache)
    del teacher
    convert_qat(loaded.model, config, progress)
    return loaded, log
