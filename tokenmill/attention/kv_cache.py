"""Paged KV storage: every layer's keys and values in preallocated pools of fixed-size blocks.

The pool of each KV group is preallocated from a memory budget as fixed-size blocks. A
sequence owns a block table; token ``p`` of the sequence lives in slot ``p % block_size`` of
block ``table[p // block_size]``::

    block_size = 4, table = [7, 2, 9]          context of 10 tokens
    positions:  0 1 2 3 | 4 5 6 7 | 8 9 . .
    blocks:        7    |    2    |    9
    slot of position p = table[p // 4] * 4 + p % 4     (position 9 -> 9 * 4 + 1 = 37)

Block 0 of every group is the null block: never written (zeros), a sliding-window group puts
it in the table where blocks fell out of the window, and batched decodes pad with it. Attention
never reads a key older than the window and masks the padding, so it only holds places.

Layers are split into KV groups (0: global layers; 1: sliding-window layers of hybrid models
such as Gemma 3); each group has its own pool and its own block ids. Storage is NHD,
``[num_blocks, block_size, kv_heads, head_dim]``, so a slot is one contiguous
``[kv_heads, head_dim]`` row: new tokens are written with one ``index_copy_``, a sequence's keys
read with one ``index_select`` over slots (or as a view of a slot range) that SDPA takes as a
strided ``[kv_heads, tokens, head_dim]`` view. HND needs a second copy to bring heads first, or
a gather along dim 1 that measured 50x slower on CPU; NHD is also the layout of the CUDA paged
kernels (flash-attn, FlashInfer).

Invariants: a group's storage is allocated once and never reallocated, and every
:class:`PagedLayer` is a view of it (a write through the layer is a write to the pool); the null
block holds zeros, so even padding reads finite values; a quantized cache keeps one float16 scale
per stored row, laid out like the rows without ``head_dim``, and a row is only ever written
together with its scale.

The block ids themselves are handed out by ``tokenmill.engine.block_pool``; the per-step view of
which slots a step reads and writes is ``tokenmill.attention.metadata``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tokenmill.attention.kv_quant import (
    SCALE_DTYPE,
    as_bytes,
    dequantize_rows,
    is_quantized,
    quantize_rows,
    row_bytes,
    storage_dtype,
)
from tokenmill.kernels import dispatch


@dataclass
class PagedLayer:
    """The KV storage of one layer, as the backend receives it from ``PagedKVCache.layer``."""

    keys: torch.Tensor
    """[num_blocks, block_size, kv_heads, head_dim], in the model's dtype or quantized (int8, fp8)."""
    values: torch.Tensor
    """Like keys."""
    group: int
    """KV group: which block tables and slot mapping of the metadata apply."""
    key_scales: torch.Tensor | None = None
    """Quantized storage: float16 [num_blocks, block_size, kv_heads], one scale per stored row."""
    value_scales: torch.Tensor | None = None
    key_slots: torch.Tensor = field(init=False, repr=False)
    """keys viewed as [num_blocks * block_size, kv_heads, head_dim], indexed by slot."""
    value_slots: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.key_slots = self.keys.flatten(0, 1)
        self.value_slots = self.values.flatten(0, 1)

    @property
    def quantized(self) -> bool:
        return self.key_scales is not None

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens' keys and values [T, kv_heads, head_dim] at ``slots`` (quantized
        storage: rounded to its grid, on CPU by tokenmill's kernel when built)."""
        if not self.quantized:
            self.key_slots.index_copy_(0, slots, k)
            self.value_slots.index_copy_(0, slots, v)
            return
        ops = dispatch.for_tensors(k)
        for x, rows, scales in ((k, self.key_slots, self.key_scales), (v, self.value_slots, self.value_scales)):
            if ops is not None:
                ops.write_quantized_kv(x.contiguous(), slots, rows, scales.flatten(0, 1))
                continue
            q, scale = quantize_rows(x, rows.dtype)
            as_bytes(rows).index_copy_(0, slots, as_bytes(q))
            scales.flatten(0, 1).index_copy_(0, slots, scale)

    def read(self, slots: torch.Tensor | slice, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at ``slots`` in ``dtype``: [n, kv_heads, head_dim] each (a view for a
        slot range of unquantized storage, else a gather)."""
        if not self.quantized:
            return _take(self.key_slots, slots), _take(self.value_slots, slots)
        k = _take(as_bytes(self.key_slots), slots).view(self.keys.dtype)
        v = _take(as_bytes(self.value_slots), slots).view(self.values.dtype)
        return (dequantize_rows(k, _take(self.key_scales.flatten(0, 1), slots), dtype),
                dequantize_rows(v, _take(self.value_scales.flatten(0, 1), slots), dtype))


class PagedKVCache:
    """Block storage of every layer; the block ids themselves are handed out elsewhere."""

    def __init__(self, num_blocks: int | list[int], block_size: int, layer_groups: list[int], num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                 kv_cache_dtype: str = "auto") -> None:
        """``dtype``: the model's; ``kv_cache_dtype``: ``auto`` (store in ``dtype``), ``int8`` or ``fp8``
        (quantized rows with float16 scales, see kv_quant)."""
        num_groups = max(layer_groups) + 1
        self.num_blocks = list(num_blocks) if isinstance(num_blocks, (list, tuple)) else [num_blocks] * num_groups
        if len(self.num_blocks) != num_groups or min(self.num_blocks) < 2:
            raise ValueError(f"need at least 2 blocks (null block + 1) for each of {num_groups} groups: {num_blocks}")
        self.block_size, self.layer_groups = block_size, list(layer_groups)
        # one tensor per group, [2 (keys, values), layers of the group, blocks, block_size, kv_heads, head_dim],
        # so that copy_blocks is one copy per group; zeroed so that the null block holds finite values
        self.kv_cache_dtype = kv_cache_dtype
        self.dtype = storage_dtype(kv_cache_dtype, dtype)
        self.storage = [torch.zeros(2, layer_groups.count(g), n, block_size, num_kv_heads, head_dim, dtype=self.dtype,
                                    device=device) for g, n in enumerate(self.num_blocks)]
        # quantized: one float16 scale per stored row, laid out like the rows without head_dim
        self.scales = [torch.zeros(s.shape[:-1], dtype=SCALE_DTYPE, device=device) for s in self.storage] \
            if is_quantized(self.dtype) else None
        index_in_group = [layer_groups[:i].count(g) for i, g in enumerate(layer_groups)]
        self.layers = [PagedLayer(self.storage[g][0, j], self.storage[g][1, j], g,
                                  *((self.scales[g][0, j], self.scales[g][1, j]) if self.scales else ()))
                       for g, j in zip(layer_groups, index_in_group)]

    def layer(self, index: int) -> PagedLayer:
        return self.layers[index]

    @property
    def nbytes(self) -> int:
        """Bytes of every block of every group (and their scales when quantized)."""
        return sum(t.numel() * t.element_size() for t in [*self.storage, *(self.scales or [])])

    def copy_blocks(self, group: int, pairs: list[tuple[int, int]]) -> None:
        """Copy block ``src`` to block ``dst`` for each ``(src, dst)``, in every layer of ``group``
        (all sources are read before any destination is written)."""
        if not pairs:
            return
        store = as_bytes(self.storage[group])
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=store.device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=store.device)
        store.index_copy_(2, dst, store.index_select(2, src))
        if self.scales:
            self.scales[group].index_copy_(2, dst, self.scales[group].index_select(2, src))

    @staticmethod
    def bytes_per_block(block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                        num_layers: int) -> int:
        """Bytes of one block id across ``num_layers`` layers (keys and values; ``dtype`` the storage
        dtype, a quantized one with its scales)."""
        return 2 * num_layers * block_size * num_kv_heads * row_bytes(head_dim, dtype)

    @staticmethod
    def num_blocks_for_budget(budget_bytes: int, block_size: int, num_kv_heads: int, head_dim: int,
                              dtype: torch.dtype, num_layers: int) -> int:
        """Blocks of a pool shared by ``num_layers`` layers that fit in ``budget_bytes`` (null block
        included: ``(n - 1) * block_size`` tokens fit). Groups of equal block counts: pass all layers."""
        return budget_bytes // PagedKVCache.bytes_per_block(block_size, num_kv_heads, head_dim, dtype, num_layers)


def _take(slots_view: torch.Tensor, slots: torch.Tensor | slice) -> torch.Tensor:
    """Keys (or values) at ``slots``: a view for a slot range, else a gather; [n, kv_heads, head_dim]."""
    return slots_view[slots] if isinstance(slots, slice) else slots_view.index_select(0, slots)
