"""Attention for training forwards: whole sequences in a flat batch, causal, no KV cache.

:func:`training_attention` swaps every attention layer of a model (or a head) onto
:class:`CausalSDPABackend` for the duration of a ``with`` block; :class:`NoCache` is the cache
argument such a forward takes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.models.layers import Attention


class CausalSDPABackend:
    """Attention for training: a flat batch of ``batch_size`` sequences of ``seq_len`` tokens each,
    every one attending causally over itself (within its window on sliding layers), no cache."""

    def __init__(self, batch_size: int, seq_len: int) -> None:
        self.batch_size, self.seq_len = batch_size, seq_len

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: Any, meta: Any, scale: float,
                sliding_window: int | None) -> torch.Tensor:
        """q [B * S, H, D], k/v [B * S, Hkv, D] -> [B * S, H, D]."""
        b, s = self.batch_size, self.seq_len
        q4, k4, v4 = (t.view(b, s, t.shape[1], t.shape[2]).transpose(1, 2) for t in (q, k, v))  # [B, H, S, D]
        mask = None
        if sliding_window is not None and sliding_window < s:
            pos = torch.arange(s, device=q.device)
            mask = (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] < sliding_window)
        o = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, is_causal=mask is None, scale=scale,
                                           enable_gqa=q.shape[1] != k.shape[1])
        return o.transpose(1, 2).reshape(q.shape)


class NoCache:
    """The KV cache argument of a training forward: CausalSDPABackend reads none."""

    def layer(self, index: int) -> None:
        return None


@contextmanager
def training_attention(model: nn.Module, backend: CausalSDPABackend) -> Iterator[None]:
    """Every attention layer of ``model`` uses ``backend`` inside the block; restored after."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    saved = [m.backend for m in layers]
    for m in layers:
        m.backend = backend
    try:
        yield
    finally:
        for m, b in zip(layers, saved):
            m.backend = b
