"""A model checkpoint on disk -> its architecture, its tensors under canonical names, its tokenizer.

Pure reading: nothing here builds a model. Two formats::

    GGUF file      metadata -> ModelConfig (gguf_config), tensors dequantized to float
                   (gguf_file, dequant), Llama q/k rows un-permuted, rope_freqs kept aside
    HF directory   config.json -> ModelConfig (hf_config), *.safetensors in file order,
                   Gemma's (1 + w) norms folded to w + 1

Both come out as a :class:`Checkpoint` whose tensors are an iterator under tokenmill's canonical,
unfused names (weights.py), read one at a time as they are consumed, so that a model is never
held twice in memory. ``models/builder.py`` fuses them and assigns them to a model.

A directory written by ``tokenmill quantize`` (``quantization_config`` in its config.json) is an
HF directory too, but its tensors are already fused and quantized: :func:`read_checkpoint`
refuses it, and ``tokenmill.loader.load_model`` hands it to the quantization package.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from tokenmill.config import ModelConfig
from tokenmill.errors import ModelFormatError
from tokenmill.loading.gguf_config import gguf_model_config, permutes_rope_rows
from tokenmill.loading.gguf_file import GGUFFile
from tokenmill.loading.hf_config import hf_model_config, quantization_config_of
from tokenmill.loading.sources import ModelSource
from tokenmill.loading.tokenizer import Tokenizer
from tokenmill.loading.weights import gguf_name, hf_name, map_tensors, unpermute_rope_rows


@dataclass
class Checkpoint:
    """A model's architecture and its tensors under canonical (unfused) names, read lazily."""

    config: ModelConfig
    tensors: Iterator[tuple[str, torch.Tensor]]
    """(canonical name, tensor) pairs, each read from disk when the iterator reaches it; consumed once."""
    rope_freq_factors: torch.Tensor | None = None
    """Per-frequency divisors of the global RoPE (GGUF's rope_freqs, e.g. Llama 3.1 scaling)."""


def read_checkpoint(source: ModelSource, cache_dir: Path | None = None) -> tuple[Checkpoint, Tokenizer]:
    """The checkpoint and tokenizer of a GGUF file or an (unquantized) HF directory.

    The checkpoint is opened first: an unsupported architecture is the error to report, not its
    tokenizer's. ``cache_dir``: where GGUF tokenizer pipelines are cached (Gemma's merges take
    about 2 s to derive). Raises ModelFormatError for a tokenmill-quantized directory."""
    if source.format == "gguf":
        gguf = GGUFFile(source.path)
        checkpoint = open_gguf(gguf)
        tokenizer_cache = cache_dir / "tokenizers" if cache_dir else None
        return checkpoint, Tokenizer.from_gguf_metadata(gguf.metadata, cache_dir=tokenizer_cache)
    if quantization_config_of(source.path) is not None:
        raise ModelFormatError(
            f"{source.path} is a tokenmill-quantized checkpoint: its tensors are already quantized; "
            "load it with tokenmill.loader.load_model or LLM")
    checkpoint = open_hf(source.path)
    return checkpoint, Tokenizer.from_hf_dir(source.path)


def open_gguf(gguf: GGUFFile) -> Checkpoint:
    """The checkpoint of an open GGUF file (its tensors dequantized to float as they are read)."""
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
    """The checkpoint of an HF directory: config.json and every ``*.safetensors`` file, sorted by name."""
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
