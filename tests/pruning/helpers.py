"""Tiny random HF checkpoints (Llama with GQA and Gemma 3) for the pruning and distillation tests."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.model_utils import save_byte_tokenizer
from tests.quantization.helpers import tiny_loaded as load_tiny  # noqa: F401  (an HF dir as a LoadedModel)

COMMON = dict(vocab_size=320, hidden_size=96, intermediate_size=128, num_hidden_layers=4,
              num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=512, rms_norm_eps=1e-5)


def hf_config(family: str):
    import transformers

    if family == "gemma3":
        return transformers.Gemma3TextConfig(
            **{**COMMON, "num_attention_heads": 4, "num_key_value_heads": 2}, head_dim=16, sliding_window=8,
            layer_types=["sliding_attention", "full_attention"] * 2, query_pre_attn_scalar=16)
    return transformers.LlamaConfig(**COMMON, tie_word_embeddings=True)


def write_tiny(path: Path, family: str = "llama", seed: int = 0) -> Path:
    """An HF checkpoint directory of random weights (norms random too, so every parameter matters)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(family), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn_like(p) * 0.2 + (1.0 if family != "gemma3" else 0.0))
    model.save_pretrained(path)
    save_byte_tokenizer(path)
    return path


def calibration(n: int = 8, length: int = 64, seed: int = 1) -> list[list[int]]:
    """Token ids with structure (repeated random phrases), so that inputs are correlated as text's are."""
    g = torch.Generator().manual_seed(seed)
    phrases = torch.randint(0, 256, (12, 8), generator=g)
    out = []
    for _ in range(n):
        picks = torch.randint(0, 12, (length // 8,), generator=g)
        out.append(phrases[picks].reshape(-1).tolist())
    return out
