"""Per-step attention metadata: how the flat token batch splits into sequences.

A step runs one forward pass over the concatenated new tokens of every scheduled
sequence (ragged, no padding)::

    tokens:          [ a0 a1 a2 | b7 | c3 c4 ]        T = 6 new tokens
    query_start_loc: [ 0,        3,   4,     6 ]      B + 1 offsets into tokens
    context_lens:    [ 3,        8,   5 ]             tokens of each sequence in the cache after
                                                       this step (already computed + new)
    cache_slots:     [ 0,        2,   1 ]             where each sequence's KV lives

A sequence's new tokens sit at positions ``context_len - query_len ... context_len - 1``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    query_start_loc: list[int]
    """B + 1 offsets of each sequence's new tokens in the flat batch."""
    context_lens: list[int]
    """Per sequence: cached tokens after this step (prefix already in cache + new tokens)."""
    cache_slots: list[int]
    """Per sequence: its row in a contiguous KV cache."""

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)

    def query_len(self, i: int) -> int:
        return self.query_start_loc[i + 1] - self.query_start_loc[i]

    def positions(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Absolute position of every new token, [T]."""
        parts = [torch.arange(c - self.query_len(i), c) for i, c in enumerate(self.context_lens)]
        return torch.cat(parts).to(device)

    def last_token_indices(self) -> list[int]:
        """Index in the flat batch of each sequence's last new token (where its next token is sampled)."""
        return [end - 1 for end in self.query_start_loc[1:]]

    @classmethod
    def build(cls, query_lens: list[int], context_lens: list[int], cache_slots: list[int]) -> "AttentionMetadata":
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        return cls(starts, list(context_lens), list(cache_slots))
