"""Test helpers: run a tokenmill model over whole prompts and compare with HF transformers."""

from __future__ import annotations

import torch

from tokenmill.attention.backend import ContiguousKVCache, TorchSDPABackend
from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.models.base import CausalLM


def new_cache(model: CausalLM, slots: int = 1, max_len: int = 256) -> ContiguousKVCache:
    cfg = model.config
    dtype = model.embed.weight.dtype
    return ContiguousKVCache(cfg.num_layers, slots, max_len, cfg.num_kv_heads, cfg.head_dim, dtype,
                             model.embed.weight.device)


@torch.inference_mode()
def prompt_logits(model: CausalLM, ids: list[int], chunk: int | None = None) -> torch.Tensor:
    """Logits [len(ids), vocab] for every position, optionally prefilled in chunks."""
    cache = new_cache(model, max_len=len(ids) + 8)
    chunk = chunk or len(ids)
    out = []
    for start in range(0, len(ids), chunk):
        piece = ids[start:start + chunk]
        meta = AttentionMetadata.build([len(piece)], [start + len(piece)], [0])
        hidden = model(torch.tensor(piece), meta.positions(), cache, meta)
        out.append(model.compute_logits(hidden))
    return torch.cat(out)
