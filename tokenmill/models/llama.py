"""The Llama family: Llama 2/3, SmolLM2, Mistral, Qwen2 (QKV bias), Qwen3 (QK-norm), and the
mixture-of-experts models built the same way: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE.

Block: x += attn(attn_norm(x)); x += mlp(ffn_norm(x)), the MLP a gated MLP or (MoE layers) a
SparseMoE (tokenmill.models.moe).
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
from tokenmill.models.moe import SparseMoE


class LlamaBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, index, backend)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SparseMoE(cfg.hidden_size, cfg.moe, cfg.hidden_act, index) if cfg.is_moe_layer(index) \
            else GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                cache: PagedLayer, meta: PagedAttentionMetadata, lora: LayerLoRA | None = None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rope, cache, meta, lora)
        return x + self.mlp(self.ffn_norm(x), lora)


class LlamaForCausalLM(CausalLM):
    def make_block(self, cfg: ModelConfig, index: int, backend: AttentionBackend) -> nn.Module:
        return LlamaBlock(cfg, index, backend)
