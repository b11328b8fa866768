"""A tiny random Llama-family model, as a tokenmill model and as an HF checkpoint directory."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.model_utils import save_byte_tokenizer
from tokenmill.config import ModelConfig
from tokenmill.loading.checkpoint import open_hf
from tokenmill.models.builder import LoadedModel, build_model
from tokenmill.loading.sources import ModelSource
from tokenmill.loading.tokenizer import Tokenizer


def write_tiny_checkpoint(path: Path, tie: bool = True, bias: bool = False, seed: int = 0) -> Path:
    """config.json + model.safetensors (HF names, random weights) + a byte-level tokenizer."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    hidden, inner, layers, heads, kv_heads, vocab = 64, 128, 2, 4, 2, 257
    head_dim = hidden // heads
    config = {"model_type": "qwen2" if bias else "llama", "vocab_size": vocab, "hidden_size": hidden,
                  "intermediate_size": inner, "num_hidden_layers": layers, "num_attention_heads": heads,
                  "num_key_value_heads": kv_heads, "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
                  "tie_word_embeddings": tie, "attention_bias": bias, "eos_token_id": 256}

    def rand(*shape: int, std: float = 0.08) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    tensors = {"model.embed_tokens.weight": rand(vocab, hidden, std=0.5), "model.norm.weight": 1 + rand(hidden)}
    if not tie:
        tensors["lm_head.weight"] = rand(vocab, hidden)
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": 1 + rand(hidden), p + "post_attention_layernorm.weight": 1 + rand(hidden),
            p + "self_attn.q_proj.weight": rand(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": rand(inner, hidden), p + "mlp.up_proj.weight": rand(inner, hidden),
            p + "mlp.down_proj.weight": rand(hidden, inner)})
        if bias:
            for proj, n in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
                tensors[p + f"self_attn.{proj}_proj.bias"] = rand(n * head_dim)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "model.safetensors"))
    save_byte_tokenizer(path)
    return path


def tiny_loaded(path: Path, dtype: torch.dtype = torch.float32) -> LoadedModel:
    checkpoint = open_hf(path)
    model = build_model(checkpoint, dtype, "cpu")
    return LoadedModel(model, checkpoint.config, Tokenizer.from_hf_dir(path), ModelSource(path.name, "hf", path))


def small_config(**overrides) -> ModelConfig:
    base = {"architecture": "llama", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128, "num_layers": 2,
                "num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "max_position_embeddings": 256, "bos_token_id": 1,
                "eos_token_id": 2}
    return ModelConfig(**{**base, **overrides})
