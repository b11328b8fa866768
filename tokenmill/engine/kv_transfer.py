"""Moving a prompt's KV blocks between engines: what disaggregated prefill/decode hands over.

::

    prefill engine                                  decode engine
    runs the prompt (1 token); its full blocks      import_blocks: takes free blocks, writes the
    are in its prefix cache under their hashes      KV in, enters them into its prefix cache under
    export_blocks(hashes) -> KVBlocks  ──────────►  the same hashes, frees them (cached, evictable)
                                                    the request then arrives: a prefix-cache hit
                                                    for those blocks, only the rest is computed

Hashes are equal in both engines when they share ``CacheConfig.prefix_hash_key`` (block_pool.py).
The payload holds every layer's K and V of the leading blocks the exporter still has (and their
row scales, for a quantized KV cache): ``2 x layers x blocks x block_size x kv_heads x head_dim``
values. Engines with one KV group (every layer attends to the whole context) only: a hybrid model
(Gemma 3's sliding-window layers) keeps different blocks per group. Both functions run in the
engine's thread (between steps).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from tokenmill.errors import InvalidParameterError


@dataclass
class KVBlocks:
    hashes: list[int]
    """The blocks' hashes, in prompt order (the leading run the exporter held)."""
    block_size: int
    kv: torch.Tensor
    """[2 (K, V), layers, blocks, block_size, kv_heads, head_dim], in the cache's storage dtype."""
    scales: torch.Tensor | None = None
    """The rows' scales of a quantized KV cache (int8, fp8), else None."""
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds each side spent: 'export', 'import'."""

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size() + (self.scales.numel() * self.scales.element_size()
                                                           if self.scales is not None else 0)


def _single_group(engine):
    if len(engine.kv.groups) != 1:
        raise InvalidParameterError("KV transfer needs a model whose layers share one KV group; this one has "
                                    f"{len(engine.kv.groups)} (sliding-window layers)")
    return engine.kv.groups[0], engine.runner.cache


def export_blocks(engine, hashes: list[int]) -> KVBlocks:
    """The KV of the leading blocks of ``hashes`` that ``engine``'s prefix cache holds (none: an
    empty payload)."""
    start = time.perf_counter()
    group, cache = _single_group(engine)
    found = []
    for h in hashes:
        block = group.pool.get_cached_block(h)
        if block is None:
            break
        found.append(block.block_id)
    index = torch.tensor(found, dtype=torch.long, device=cache.storage[0].device)
    kv = cache.storage[0].index_select(2, index).cpu()
    scales = cache.scales[0].index_select(2, index).cpu() if cache.scales else None
    return KVBlocks(hashes[:len(found)], cache.block_size, kv, scales,
                    {"export": time.perf_counter() - start})


def import_blocks(engine, blocks: KVBlocks) -> int:
    """Enter ``blocks`` into ``engine``'s prefix cache (as free, cached blocks a request can hit)
    -> how many it took: those it already held are skipped, and it stops where its free blocks
    run out. Their KV must come from the same model and cache layout."""
    start = time.perf_counter()
    group, cache = _single_group(engine)
    if blocks.block_size != cache.block_size or blocks.kv.shape[1] != cache.storage[0].shape[1] \
            or blocks.kv.shape[3:] != cache.storage[0].shape[3:] or blocks.kv.dtype != cache.storage[0].dtype:
        raise InvalidParameterError(f"KV blocks of shape {tuple(blocks.kv.shape)} ({blocks.kv.dtype}) do not fit "
                                    f"this cache ({tuple(cache.storage[0].shape)}, {cache.storage[0].dtype})")
    missing = [i for i, h in enumerate(blocks.hashes) if group.pool.get_cached_block(h) is None]
    missing = missing[:group.pool.num_free_blocks]
    if not missing:
        blocks.timings["import"] = time.perf_counter() - start
        return 0
    new = group.pool.get_new_blocks(len(missing))
    device = cache.storage[0].device
    dst = torch.tensor([b.block_id for b in new], dtype=torch.long, device=device)
    src = torch.tensor(missing, dtype=torch.long)
    cache.storage[0].index_copy_(2, dst, blocks.kv.index_select(2, src).to(device))
    if cache.scales and blocks.scales is not None:
        cache.scales[0].index_copy_(2, dst, blocks.scales.index_select(2, src).to(device))
    for block, i in zip(new, missing):
        group.pool.cache_block(block, blocks.hashes[i])
    group.pool.free_blocks(reversed(new))
    blocks.timings["import"] = time.perf_counter() - start
    return len(new)
