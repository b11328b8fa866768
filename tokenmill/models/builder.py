"""Checkpoint -> ready model: built on the meta device, then the checkpoint's tensors assigned.

    build_model(checkpoint, dtype, device)
      construct      the family's CausalLM (registry.py) on the meta device: no memory, no init
      adapt          optional: change the meta model first (a quantized checkpoint swaps in its
                     quantized layers)
      fuse, cast     q/k/v -> qkv, gate/up -> gate_up (loading/weights.py); float tensors to
                     ``dtype`` (float32 for those the model keeps so), integer ones and those the
                     model keeps as stored as they are
      check          every parameter present, none extra, every shape right: ModelFormatError
      assign         load_state_dict(assign=True), buffers (RoPE) moved to the device

:func:`load_float_model` reads a GGUF file or an HF directory (loading/checkpoint.py) and builds
it. A tokenmill-quantized directory is not a float checkpoint: ``tokenmill.loader.load_model``
loads every kind of model argument, quantized ones included.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from tokenmill.attention.backend import AttentionBackend
from tokenmill.attention.paged import PagedAttentionBackend
from tokenmill.config import ModelConfig
from tokenmill.errors import ModelFormatError
from tokenmill.loading.checkpoint import Checkpoint, read_checkpoint
from tokenmill.loading.sources import ModelSource
from tokenmill.loading.tokenizer import Tokenizer
from tokenmill.loading.weights import fuse
from tokenmill.models.base import CausalLM
from tokenmill.models.registry import MODEL_CLASSES


@dataclass
class LoadedModel:
    """A model ready to run, with what describes it."""

    model: CausalLM
    config: ModelConfig
    tokenizer: Tokenizer
    source: ModelSource
    """Where it was loaded from."""


def load_float_model(source: ModelSource, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                     cache_dir: Path | None = None) -> LoadedModel:
    """The model of a GGUF file or an HF directory, in ``dtype`` on ``device``, over a paged-attention
    backend. ``cache_dir``: where GGUF tokenizers are cached. Raises ModelFormatError for a
    tokenmill-quantized directory (load it with ``tokenmill.loader.load_model``)."""
    checkpoint, tokenizer = read_checkpoint(source, cache_dir)
    model = build_model(checkpoint, dtype, device)
    return LoadedModel(model, checkpoint.config, tokenizer, source)


def build_model(checkpoint: Checkpoint, dtype: torch.dtype, device: torch.device | str,
                adapt: Callable[[CausalLM], None] | None = None,
                backend: AttentionBackend | None = None) -> CausalLM:
    """Construct on the meta device, then assign the (fused, cast) checkpoint tensors.

    ``adapt`` may change the meta model before the tensors are assigned (a quantized checkpoint
    swaps in its quantized layers); integer tensors keep their dtype. ``backend``: the attention
    backend of every layer, a new PagedAttentionBackend by default."""
    config, tensors = checkpoint.config, checkpoint.tensors
    backend = backend if backend is not None else PagedAttentionBackend()
    with torch.device("meta"):
        model = MODEL_CLASSES[config.architecture](config, backend)
        if adapt is not None:
            adapt(model)
    try:
        state = {name: t.to(device=device, dtype=_load_dtype(model, name, t, dtype)) for name, t in fuse(tensors)}
    except KeyError as exc:  # fuse() found q/k/v or gate/up parts missing
        raise ModelFormatError(f"checkpoint does not fit the {config.architecture} model: {exc.args[0]}") from None
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    missing, unexpected = sorted(expected.keys() - state.keys()), sorted(state.keys() - expected.keys())
    if missing or unexpected:
        raise ModelFormatError(
            f"checkpoint does not fit the {config.architecture} model: missing {missing[:5]}"
            f"{'...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}")
    wrong = [f"{name} {tuple(t.shape)}, expected {expected[name]}" for name, t in state.items()
             if tuple(t.shape) != expected[name]]
    if wrong:
        raise ModelFormatError(f"checkpoint does not fit the {config.architecture} model: "
                               f"wrong shape of {'; '.join(wrong[:3])}")
    model.load_state_dict(state, assign=True)
    for module in model.modules():  # buffers computed at construction (RoPE) were built on CPU
        for name, buf in list(module.named_buffers(recurse=False)):
            module.register_buffer(name, buf.to(device), persistent=name not in module._non_persistent_buffers_set)
    if checkpoint.rope_freq_factors is not None:
        model.rotary_global.inv_freq = model.rotary_global.inv_freq / checkpoint.rope_freq_factors.float().to(device)
    return model.eval().requires_grad_(False)


def _load_dtype(model: CausalLM, name: str, t: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    """What a checkpoint tensor is assigned as: integer tensors and those the model keeps as stored
    (``keeps_stored_dtype``: a quantized layer's exact scales) unchanged, float32 where the model
    keeps float32, else ``dtype``."""
    if not t.is_floating_point() or model.keeps_stored_dtype(name):
        return t.dtype
    return torch.float32 if model.keeps_float32(name) else dtype
