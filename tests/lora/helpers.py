"""Tiny random HF models with random PEFT adapters, and tokenmill runs of them with a LoRA slot."""

from __future__ import annotations

import copy

import torch

from tokenmill.attention.kv_cache import PagedKVCache
from tokenmill.attention.metadata import PagedAttentionMetadata
from tokenmill.config import layer_groups
from tokenmill.lora.slots import LoRABatch, LoRASlots
from tokenmill.models.base import CausalLM
from tests.model_utils import BLOCK, save_byte_tokenizer

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
COMMON = dict(vocab_size=320, hidden_size=64, intermediate_size=112, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5)


def hf_config(family: str):
    import transformers

    if family == "gemma3":
        return transformers.Gemma3TextConfig(
            **{**COMMON, "num_hidden_layers": 4, "num_key_value_heads": 1}, head_dim=32, sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            query_pre_attn_scalar=24)
    return transformers.LlamaConfig(**COMMON, tie_word_embeddings=False)


def tiny_hf_model(family: str, path, seed: int = 0):
    """A random tiny ``family`` model saved (with a byte tokenizer) as an HF checkpoint at ``path``."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(family), dtype=torch.float32).eval()
    with torch.no_grad():  # random norm weights, so that every parameter matters
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn_like(p) * 0.3 + (0.0 if family == "gemma3" else 1.0))
    model.save_pretrained(path)
    save_byte_tokenizer(path)
    return model


def random_adapter(base, path, seed: int, r: int = 8, alpha: float = 16, targets=ALL_PROJECTIONS,
                   b_gain: float = 4.0, **extra):
    """A PEFT adapter with random A and B (B is zero at PEFT's default init; PEFT's random B times
    ``b_gain``) on a copy of ``base``, saved at ``path``; returns the PEFT model (unmerged)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0,
                        init_lora_weights=False, **extra)
    peft_model = get_peft_model(copy.deepcopy(base), config).eval()
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(b_gain)  # PEFT's random B is small; make the update matter against the base
    peft_model.save_pretrained(path)
    return peft_model


@torch.no_grad()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].float()


def merged_logits(peft_model, ids: list[int]) -> torch.Tensor:
    """HF transformers + PEFT with the adapter merged into the weights."""
    merged = copy.deepcopy(peft_model).merge_and_unload()
    return hf_logits(merged, ids)


@torch.inference_mode()
def lora_logits(model: CausalLM, slots: LoRASlots | None, ids_per_seq: list[list[int]],
                slot_per_seq: list[int]) -> list[torch.Tensor]:
    """Every position's logits of several whole prompts run together in one step, each with its
    LoRA slot (-1: the base model), through a paged KV cache."""
    cfg, device = model.config, model.embed.weight.device
    groups, windows = layer_groups(cfg)
    tables, next_block = [], 1
    for ids in ids_per_seq:
        n = -(-len(ids) // BLOCK)
        tables.append(list(range(next_block, next_block + n)))
        next_block += n
    cache = PagedKVCache(next_block, BLOCK, groups, cfg.num_kv_heads, cfg.head_dim, model.embed.weight.dtype, device)
    lens = [len(ids) for ids in ids_per_seq]
    meta = PagedAttentionMetadata.build(lens, lens, [tables] * len(windows), BLOCK, device)
    token_slots = torch.tensor([s for ids, s in zip(ids_per_seq, slot_per_seq) for _ in ids], dtype=torch.int32)
    batch = LoRABatch(slots.modules, token_slots) if slots is not None and (token_slots >= 0).any() else None
    flat = torch.tensor([t for ids in ids_per_seq for t in ids], device=device)
    logits = model.compute_logits(model(flat, meta.positions(device), cache, meta, batch))
    return list(logits.split(lens))
