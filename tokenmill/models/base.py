"""The decoder-only causal LM skeleton every family shares.

``forward(input_ids [T], positions [T], kv_cache, meta, lora=None) -> hidden [T, hidden]`` runs one
step over a flat batch of new tokens (``lora``: which LoRA adapter each token runs with, if any);
``compute_logits(hidden)`` applies the final norm and LM head to the rows that need logits
(usually each sequence's last token).
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from tokenmill.attention.backend import AttentionBackend, KVCache
from tokenmill.attention.metadata import PagedAttentionMetadata
from tokenmill.config import ModelConfig
from tokenmill.lora.slots import LoRABatch
from tokenmill.models.layers import RMSNorm, Rotary, has_hooks, linear, packed_bf16_linear
from tokenmill.models.moe import SparseMoE
from tokenmill.models.moe_stats import ExpertStats


class CausalLM(nn.Module):
    """Embedding, a stack of blocks built by ``make_block``, final norm and LM head."""

    norm_cast_before_scale = True
    use_fused_decode = True
    """One-call decode steps on CPU where they apply (tokenmill.models.fused_decode); False keeps
    the layer-by-layer path, which gives the same results (for tests and profiling)."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = cfg
        # _weight skips the random init: weights always come from a checkpoint
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(self.make_block(cfg, i, backend) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, self.norm_cast_before_scale)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary_global = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        local_theta = cfg.rope_local_theta if cfg.rope_local_theta is not None else cfg.rope_theta
        self.rotary_local = Rotary(cfg.head_dim, local_theta, None if cfg.rope_local_theta else cfg.rope_scaling)
        self.expert_stats = None
        if cfg.moe is not None:
            self.expert_stats = ExpertStats(cfg.num_layers, cfg.moe.num_experts)
            for block in self.layers:
                if isinstance(block.mlp, SparseMoE):
                    block.mlp.stats = self.expert_stats
        # KV cache -> its FusedDecoder (or None: not available); weak, so a dropped cache frees its pool
        self._fused: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def make_block(self, cfg: ModelConfig, index: int, backend: AttentionBackend) -> nn.Module:
        raise NotImplementedError

    def prepare_moe(self) -> None:
        """Ready every MoE expert's weights for its kernel (tokenmill.models.moe.SparseMoE.prepare)."""
        for module in self.modules():
            if isinstance(module, SparseMoE):
                module.prepare()

    def set_moe_capacity(self, capacity_factor: float | None) -> None:
        """Capacity-factor routing in every MoE layer (tokenmill.models.moe); None: exact no-drop."""
        for module in self.modules():
            if isinstance(module, SparseMoE):
                module.capacity_factor = capacity_factor

    def keeps_stored_dtype(self, param_name: str) -> bool:
        """Tensors assigned in the dtype the checkpoint has (none here; a natively loaded GGUF
        model keeps its grouped layers' exact float16 / float32 scales so)."""
        return False

    def keeps_float32(self, param_name: str) -> bool:
        """Parameters held in float32 whatever the model dtype (Gemma's 1 + w norm multipliers,
        which bfloat16 would round differently from HF's float32 ``1 + w``; MoE routers and gates)."""
        if param_name.endswith((".router.weight", ".shared_gate.weight")):
            return True  # MoE gates: tiny, and float32 logits pick experts as the float model does
        return not self.norm_cast_before_scale and param_name.endswith("norm.weight")

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache,
                meta: PagedAttentionMetadata, lora: LoRABatch | None = None) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        rope_global = self.rotary_global(positions, h.dtype)
        rope_local = self.rotary_local(positions, h.dtype) if self.config.rope_local_theta else rope_global
        decode_only = meta is not None and meta.query_start_loc[-1] == meta.num_seqs
        fused = self.fused_decoder(kv_cache) if decode_only and self.use_fused_decode and not torch.is_grad_enabled() \
            else None
        if fused is not None:
            return fused.run(h, [rope_global, rope_local], meta, lora)
        for i, block in enumerate(self.layers):
            rope = rope_local if self.config.layer_type(i) == "sliding" else rope_global
            h = block(h, rope, kv_cache.layer(i), meta, None if lora is None else lora.layer(i))
        return h

    def fused_decoder(self, kv_cache: KVCache):
        """The one-call decode stack over ``kv_cache`` (tokenmill.models.fused_decode), None where
        it does not apply; built on first use and when the model's linear modules change."""
        from tokenmill.models.fused_decode import FusedDecoder

        return FusedDecoder.cached(self, kv_cache, self._fused)

    def compute_logits(self, hidden: torch.Tensor, kernel_rows: int | None = None) -> torch.Tensor:
        """hidden [N, hidden] -> float32 logits [N, vocab]. ``kernel_rows``: a quantized head whose kernel
        depends on the number of rows picks it as for this many (the step's sampling sequences: a
        verification's extra rows then get plain decoding's numerics)."""
        h = self.norm(hidden)
        head = self.lm_head
        if head is None:  # tied: the embedding matrix
            logits = packed_bf16_linear(self.embed, self.embed.weight, None, h, out_float32=True)
            return torch.nn.functional.linear(h, self.embed.weight).float() if logits is None else logits
        # Heads whose kernel writes float32 directly (the bfloat16-rounded values, widened) skip a
        # conversion pass over [rows, vocab]: a quantized head's forward_float32, a dense one's packed kernel.
        direct = getattr(head, "forward_float32", None)
        if direct is not None and not has_hooks(head):
            return direct(h) if kernel_rows is None else direct(h, kernel_rows)
        return linear(head, h, out_float32=True).float()
