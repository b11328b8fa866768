"""CacheConfig: how big the paged KV pool is and how it is cut into blocks and groups."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from tokenmill.attention.kv_quant import check_kv_cache_dtype
from tokenmill.errors import InvalidParameterError


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    """Tokens per KV block."""
    kv_cache_memory: float | int = 0.1
    """KV pool size: bytes when > 1, else a fraction of the device's free memory."""
    enable_prefix_caching: bool = True
    """Reuse cached full blocks of identical prompt prefixes."""
    kv_cache_dtype: str = "auto"
    """How keys and values are stored: ``auto`` (the model's dtype), ``int8`` or ``fp8`` (e4m3),
    each row of head_dim values with a float16 scale: about 1.9x the tokens of bfloat16."""

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise InvalidParameterError(f"block_size must be >= 1, got {self.block_size}")
        if not self.kv_cache_memory > 0:
            raise InvalidParameterError(f"kv_cache_memory must be > 0 (bytes or a fraction), got {self.kv_cache_memory}")
        check_kv_cache_dtype(self.kv_cache_dtype)

    def budget_bytes(self, device: torch.device) -> int:
        if self.kv_cache_memory > 1:
            return int(self.kv_cache_memory)
        return int(self.kv_cache_memory * free_memory(device))


def free_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
