"""Gemma 3 (text): MQA/GQA, interleaved sliding-window and global layers with their own RoPE
bases, QK-norm, embeddings scaled by sqrt(hidden), gelu-tanh MLP, and a norm after each sublayer.

Block: x += post_attn_norm(attn(attn_norm(x))); x += post_ffn_norm(mlp(ffn_norm(x))).
Norm weights are held as the multiplier itself ("1 + w" of the HF checkpoint, as GGUF stores it).
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.attention.backend import AttentionBackend
from tokenmill.attention.kv_cache import PagedLayer
from tokenmill.attention.metadata import PagedAttentionMetadata
from tokenmill.config import ModelConfig
from tokenmill.lora.slots import LayerLoRA
from tokenmill.models.base import CausalLM
from tokenmill.models.layers import Attention, GatedMLP, RMSNorm


class Gemma3Block(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, backend: AttentionBackend) -> None:
        super().__init__()

        def norm() -> RMSNorm:
            return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cast_before_scale=False)

        self.attn_norm, self.post_attn_norm = norm(), norm()
        self.ffn_norm, self.post_ffn_norm = norm(), norm()
        self.attn = Attention(cfg, index, backend, norm_cast_before_scale=False)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                cache: PagedLayer, meta: PagedAttentionMetadata, lora: LayerLoRA | None = None) -> torch.Tensor:
        x = x + self.post_attn_norm(self.attn(self.attn_norm(x), rope, cache, meta, lora))
        return x + self.post_ffn_norm(self.mlp(self.ffn_norm(x), lora))


class Gemma3ForCausalLM(CausalLM):
    norm_cast_before_scale = False

    def make_block(self, cfg: ModelConfig, index: int, backend: AttentionBackend) -> nn.Module:
        return Gemma3Block(cfg, index, backend)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        # HF multiplies by sqrt(hidden) rounded to the weight dtype
        return h * torch.tensor(self.config.hidden_size ** 0.5, dtype=h.dtype)
