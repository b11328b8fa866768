"""A contiguous KV cache: one growable row per sequence slot.

Slot s of layer l holds keys ``[kv_heads, capacity_s, head_dim]`` (values alike); a slot grows
by doubling when a sequence outgrows it, so a short request never pays for the whole context
window. The paged cache of the serving engine replaces this behind the same ``layer()`` call.
"""

from __future__ import annotations

import torch


class ContiguousKVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", initial_capacity: int = 256) -> None:
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.initial_capacity = initial_capacity
        self.keys: list[list[torch.Tensor | None]] = [[] for _ in range(num_layers)]
        self.values: list[list[torch.Tensor | None]] = [[] for _ in range(num_layers)]
        self._free: list[int] = []

    def layer(self, index: int) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        return self.keys[index], self.values[index]

    def allocate(self, capacity: int) -> int:
        """A slot able to hold ``capacity`` tokens."""
        slot = self._free.pop() if self._free else len(self.keys[0])
        if slot == len(self.keys[0]):
            for layer in range(self.num_layers):
                self.keys[layer].append(None)
                self.values[layer].append(None)
        size = max(capacity, self.initial_capacity)
        for layer in range(self.num_layers):
            self.keys[layer][slot] = self._empty(size)
            self.values[layer][slot] = self._empty(size)
        return slot

    def ensure_capacity(self, slot: int, tokens: int) -> None:
        """Grow ``slot`` (doubling, keeping its contents) until it holds ``tokens``."""
        current = self.keys[0][slot].shape[1]
        if tokens <= current:
            return
        size = max(tokens, 2 * current)
        for store in (self.keys, self.values):
            for layer in range(self.num_layers):
                grown = self._empty(size)
                grown[:, :current] = store[layer][slot]
                store[layer][slot] = grown

    def free(self, slot: int) -> None:
        for layer in range(self.num_layers):
            self.keys[layer][slot] = None
            self.values[layer][slot] = None
        self._free.append(slot)

    @property
    def num_allocated(self) -> int:
        return sum(t is not None for t in self.keys[0]) if self.keys else 0

    def _empty(self, size: int) -> torch.Tensor:
        return torch.zeros(self.num_kv_heads, size, self.head_dim, dtype=self.dtype, device=self.device)
