"""One step over a paged KV cache, as every attention layer of the step sees it.

The step's new tokens are one flat batch, sequence after sequence::

    query_start_loc = [0, 5, 6, 14]     three sequences: 5 new tokens (a prompt), 1 (a decode), 8
    context_lens    = [5, 38, 45]       their cached tokens after the step, the new ones included

and, per KV group (see ``tokenmill.attention.kv_cache``), every sequence's block table and the
slot each new token is written to.

Invariants, enforced by :meth:`PagedAttentionMetadata.build`: each block table covers its
sequence's context; no new token is written into the null block 0; ``slot_mapping[g][t]`` is
``table[p // block_size] * block_size + p % block_size`` for new token t at position p.
What the layers derive from the step alone (which keys each sequence sees, masks, kernel
arguments) is an :class:`~tokenmill.attention.plan.AttentionPlan`, built once per (group,
window) by :meth:`PagedAttentionMetadata.plan` and shared by the layers that ask for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tokenmill.attention.plan import AttentionPlan


@dataclass
class PagedAttentionMetadata:
    """One step over a paged cache: the flat batch of new tokens plus, per KV group,
    the block tables and the slot of every new token."""

    query_start_loc: list[int]
    """B + 1 offsets of each sequence's new tokens in the flat batch."""
    context_lens: list[int]
    """Per sequence: cached tokens after this step (prefix already in cache + new tokens)."""
    block_tables: list[list[list[int]]]
    """Per group, per sequence: its block ids, covering at least its context."""
    slot_mapping: list[torch.Tensor]
    """Per group: int64 [T], ``block_id * block_size + offset`` of each new token."""
    block_size: int
    device: torch.device
    _plans: dict[tuple[int, int | None], AttentionPlan] = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)

    def query_len(self, i: int) -> int:
        return self.query_start_loc[i + 1] - self.query_start_loc[i]

    def positions(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Absolute position of every new token, [T]."""
        positions: list[int] = []
        for i, c in enumerate(self.context_lens):  # one tensor from a list: an arange per sequence
            positions.extend(range(c - self.query_len(i), c))  # and a cat cost 2 us a sequence
        return torch.tensor(positions, dtype=torch.long, device=device)

    def last_token_indices(self) -> list[int]:
        """Index in the flat batch of each sequence's last new token (where its next token is sampled)."""
        return [end - 1 for end in self.query_start_loc[1:]]

    @classmethod
    def build(cls, query_lens: list[int], context_lens: list[int], block_tables_per_group: list[list[list[int]]],
              block_size: int, device: torch.device | str = "cpu") -> PagedAttentionMetadata:
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        slot_mapping = []
        for tables in block_tables_per_group:
            slots: list[int] = []
            for table, ctx, n in zip(tables, context_lens, query_lens):
                if len(table) * block_size < ctx:
                    raise ValueError(f"block table of {len(table)} blocks cannot hold {ctx} tokens")
                if 0 in table[(ctx - n) // block_size:(ctx - 1) // block_size + 1]:
                    raise ValueError("new tokens would be written into the null block 0")
                slots.extend(table[p // block_size] * block_size + p % block_size for p in range(ctx - n, ctx))
            slot_mapping.append(torch.tensor(slots, dtype=torch.long, device=device))
        return cls(starts, list(context_lens), [[list(t) for t in tables] for tables in block_tables_per_group],
                   slot_mapping, block_size, torch.device(device))

    def plan(self, group: int, window: int | None) -> AttentionPlan:
        """How layers of KV ``group`` with sliding ``window`` (None: global) attend this step:
        built by the first layer that asks, the same object for the others."""
        key = (group, window)
        if key not in self._plans:
            self._plans[key] = AttentionPlan.build(self.query_start_loc, self.context_lens, self.block_tables[group],
                                                   self.block_size, window, self.device)
        return self._plans[key]
