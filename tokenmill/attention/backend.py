"""The attention backend interface and the contiguous KV cache.

A backend stores the new keys/values of a step into the KV cache and computes
attention of the new queries over each sequence's cached context. The model's
attention layer calls it with everything it needs as arguments (no globals), so a
paged cache and device-specific kernels plug in behind the same call.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch
import torch.nn.functional as F

from tokenmill.attention.metadata import AttentionMetadata


class KVCache(Protocol):
    def layer(self, index: int) -> tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]:
        """(keys, values) of one layer, indexed by cache slot: ``keys[slot]`` is [kv_heads, capacity, head_dim]."""


class AttentionBackend(Protocol):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]],
                meta: AttentionMetadata, scale: float, sliding_window: int | None) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] of the new tokens -> attention output [T, H, D]."""


def attention_mask(q_len: int, ctx_len: int, first_key: int, window: int | None,
                   device: torch.device) -> torch.Tensor | None:
    """Boolean [q_len, ctx_len - first_key] mask (True = attend) for new tokens at the end of the context.

    Query i sits at position ``ctx_len - q_len + i``; keys cover positions ``first_key .. ctx_len - 1``.
    A query sees key p when ``p <= its position`` and, on sliding-window layers, ``its position - p < window``.
    Returns None when every query may see every key (one decode token whose window covers the keys).
    """
    if q_len == 1 and (window is None or ctx_len - first_key <= window):
        return None
    q_pos = torch.arange(ctx_len - q_len, ctx_len, device=device)[:, None]
    k_pos = torch.arange(first_key, ctx_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= (q_pos - k_pos) < window
    return mask


class TorchSDPABackend:
    """Attention with ``torch.nn.functional.scaled_dot_product_attention`` per sequence (CPU and CUDA)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata, scale: float, sliding_window: int | None) -> torch.Tensor:
        k_cache, v_cache = cache
        out = torch.empty_like(q)
        gqa = q.shape[1] != k.shape[1]
        for i in range(meta.num_seqs):
            start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            ctx, slot, q_len = meta.context_lens[i], meta.cache_slots[i], end - start
            k_cache[slot][:, ctx - q_len:ctx] = k[start:end].transpose(0, 1)
            v_cache[slot][:, ctx - q_len:ctx] = v[start:end].transpose(0, 1)
            # keys older than the window of the first new query are never seen
            first_key = 0 if sliding_window is None else max(0, ctx - q_len - sliding_window + 1)
            keys = k_cache[slot][:, first_key:ctx].unsqueeze(0)
            values = v_cache[slot][:, first_key:ctx].unsqueeze(0)
            mask = attention_mask(q_len, ctx, first_key, sliding_window, q.device)
            query = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
            o = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa)
            out[start:end] = o[0].transpose(0, 1)
        return out
