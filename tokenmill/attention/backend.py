"""The attention backend interface: what the model's attention layer calls.

A backend stores the new keys/values of a step into the KV cache and computes attention of the
new queries over each sequence's cached context. The layer passes everything as arguments
(its cache storage, the step's metadata), so device-specific kernels plug in behind this call.
``tokenmill.attention.paged`` holds the implementation used on CPU and CUDA, over the storage of
``tokenmill.attention.kv_cache`` and the step of ``tokenmill.attention.metadata``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from tokenmill.attention.kv_cache import PagedLayer
    from tokenmill.attention.metadata import PagedAttentionMetadata


class KVCache(Protocol):
    def layer(self, index: int) -> "PagedLayer":
        """The KV storage of one layer."""


class AttentionBackend(Protocol):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: "PagedLayer",
                meta: "PagedAttentionMetadata", scale: float, sliding_window: int | None) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] of the new tokens -> attention output [T, H, D]."""
