"""What every quantization handler works on: the linear layers to replace, and how to replace them.

    quantization_targets(model, config)   every nn.Linear of the blocks (fused qkv and gate_up
                                          included), then the LM head (a tied head: the
                                          embedding matrix) -> [Target(name, weight, bias)]
    set_module(model, name, module)       swap one module in by its path
    replace_each(model, targets, make)    set_module for every target, with a progress bar
    cast_float_parameters(model, dtype)   float parameters to the compute dtype
    detached(targets)                     the targets' tensors, kept as they are through such a cast

A handler (handlers.py) receives the model, its config, the targets and a
:class:`QuantizeContext`, and swaps a quantized layer in for each target.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from tokenmill.models.base import CausalLM
from tokenmill.quantization.config import QuantConfig
from tokenmill.quantization.linear import QuantizedLinear


@dataclass
class Target:
    """One linear layer to quantize: its module path and the float weight it computes with."""

    name: str
    """Path of the module in the model (``layers.3.mlp.gate_up``, ``lm_head``)."""
    weight: torch.Tensor
    bias: torch.Tensor | None


@dataclass
class QuantizeContext:
    """What a handler may need besides the model and config."""

    dtype: torch.dtype
    """dtype of the activations, scales and every float parameter left unquantized."""
    progress: bool = True
    tokenizer: object | None = None
    """The model's tokenizer, for handlers that calibrate on text."""
    cache_dir: Path | None = None
    calibration: list[list[int]] | None = None
    """Token ids of calibration sequences; None: handlers that calibrate draw them from the corpus."""


def quantization_targets(model: CausalLM, config: QuantConfig) -> list[Target]:
    """Every nn.Linear of the blocks (fused qkv and gate_up included), then the LM head when
    ``config.quantize_lm_head``: the model's own, or for tied embeddings the embedding matrix."""
    targets = [Target(name, m.weight, m.bias) for name, m in model.layers.named_modules(prefix="layers")
               if isinstance(m, nn.Linear)]
    if config.quantize_lm_head:
        head = model.lm_head
        targets.append(Target("lm_head", model.embed.weight if head is None else head.weight,
                              None if head is None else head.bias))
    return targets


def detached(targets: list[Target]) -> list[Target]:
    """The targets holding their weight and bias tensors as they are now instead of the model's
    Parameters, so that casting the model afterwards (to calibrate in the compute dtype) leaves
    them as they were: float32 for a float32 model. No copy: they share the old storage, which
    the cast no longer uses."""
    return [Target(t.name, t.weight.detach(), None if t.bias is None else t.bias.detach()) for t in targets]


def set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def replace_each(model: CausalLM, targets: list[Target], make: Callable[[Target], QuantizedLinear],
                 progress: bool, desc: str) -> None:
    """Swap every target for ``make(target)``, one at a time, with a progress bar."""
    for target in tqdm(targets, desc=desc, disable=not progress, unit="layer"):
        set_module(model, target.name, make(target))


def cast_float_parameters(model: CausalLM, dtype: torch.dtype) -> None:
    """Float parameters to ``dtype``, except those the model keeps in float32 (RoPE buffers stay)."""
    for name, param in model.named_parameters():
        if not model.keeps_float32(name) and param.is_floating_point():
            param.data = param.data.to(dtype)
