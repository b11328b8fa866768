"""Build a ready model (weights on device, in the requested dtype) from a ModelSource."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

from tokenmill.attention.backend import AttentionBackend
from tokenmill.config import ModelConfig
from tokenmill.errors import ModelFormatError
from tokenmill.loading.gguf_config import gguf_model_config, permutes_rope_rows
from tokenmill.loading.gguf_file import GGUFFile
from tokenmill.loading.hf_config import hf_model_config
from tokenmill.loading.sources import ModelSource
from tokenmill.loading.tokenizer import Tokenizer
from tokenmill.loading.weights import fuse, gguf_name, hf_name, map_tensors, unpermute_rope_rows
from tokenmill.models.base import CausalLM
from tokenmill.models.registry import MODEL_CLASSES
from tokenmill.quantization.config import quantization_config_of


@dataclass
class LoadedModel:
    model: CausalLM
    config: ModelConfig
    tokenizer: Tokenizer
    source: ModelSource


def load_model(source: ModelSource, backend: AttentionBackend, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu", cache_dir: Path | None = None) -> LoadedModel:
    # the checkpoint first: an unsupported architecture is the error to report, not its tokenizer's
    if source.format == "gguf":
        gguf = GGUFFile(source.path)
        checkpoint = open_gguf(gguf)
        tokenizer_cache = cache_dir / "tokenizers" if cache_dir else None  # Gemma's merges take ~2 s to derive
        tokenizer = Tokenizer.from_gguf_metadata(gguf.metadata, cache_dir=tokenizer_cache)
    elif quantization_config_of(source.path) is not None:  # written by `tokenmill quantize`
        from tokenmill.quantization.checkpoint import load_quantized

        model, config = load_quantized(source.path, backend, dtype, device)
        return LoadedModel(model, config, Tokenizer.from_hf_dir(source.path), source)
    else:
        checkpoint = open_hf(source.path)
        tokenizer = Tokenizer.from_hf_dir(source.path)
    model = build_model(checkpoint, backend, dtype, device)
    return LoadedModel(model, checkpoint.config, tokenizer, source)


@dataclass
class Checkpoint:
    """A model's architecture and its tensors under canonical (unfused) names, read lazily."""

    config: ModelConfig
    tensors: Iterator[tuple[str, torch.Tensor]]
    rope_freq_factors: torch.Tensor | None = None
    """Per-frequency divisors of the global RoPE (GGUF's rope_freqs, e.g. Llama 3.1 scaling)."""


def build_model(checkpoint: Checkpoint, backend: AttentionBackend, dtype: torch.dtype,
                device: torch.device | str, adapt: Callable[[CausalLM], None] | None = None) -> CausalLM:
    """Construct on the meta device, then assign the (fused, cast) checkpoint tensors.

    ``adapt`` may change the meta model before the tensors are assigned (a quantized checkpoint
    swaps in its quantized layers); integer tensors keep their dtype."""
    config, tensors = checkpoint.config, checkpoint.tensors
    with torch.device("meta"):
        model = MODEL_CLASSES[config.architecture](config, backend)
        if adapt is not None:
            adapt(model)
    try:
        state = {name: t.to(device=device, dtype=(torch.float32 if model.keeps_float32(name) else dtype)
                            if t.is_floating_point() else t.dtype)
                 for name, t in fuse(tensors)}
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


def open_gguf(gguf: GGUFFile) -> Checkpoint:
    names = set(gguf.tensor_names)
    config = gguf_model_config(gguf.metadata, names)
    permute = permutes_rope_rows(gguf.metadata)

    def transform(name: str, t: torch.Tensor) -> torch.Tensor:
        if permute and name.endswith("attn.q.weight"):
            return unpermute_rope_rows(t, config.num_heads)
        if permute and name.endswith("attn.k.weight"):
            return unpermute_rope_rows(t, config.num_kv_heads)
        return t

    raw = ((name, gguf.load_tensor(name)) for name in gguf.tensor_names)
    freq_factors = gguf.load_tensor("rope_freqs.weight") if "rope_freqs.weight" in names else None
    return Checkpoint(config, map_tensors(raw, gguf_name, transform), freq_factors)


def open_hf(path: Path) -> Checkpoint:
    from safetensors import safe_open

    try:
        raw_config = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelFormatError(f"cannot read {path / 'config.json'}: {exc}") from None
    config = hf_model_config(raw_config)
    family = config.architecture

    def transform(name: str, t: torch.Tensor) -> torch.Tensor:
        if family == "gemma3" and name.endswith("norm.weight"):
            return t.float() + 1.0  # Gemma stores w for a (1 + w) multiplier
        return t

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for file in sorted(path.glob("*.safetensors")):
            try:
                with safe_open(str(file), framework="pt") as f:
                    for name in f.keys():
                        yield name, f.get_tensor(name)
            except Exception as exc:  # safetensors raises its own error types for corrupt files
                raise ModelFormatError(f"cannot read {file}: {exc}") from None

    named = map_tensors(tensors(), lambda n: hf_name(n, family), transform)
    if config.tie_word_embeddings:
        named = (item for item in named if item[0] != "lm_head.weight")
    return Checkpoint(config, named)
