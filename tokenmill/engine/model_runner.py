"""The model runner: one forward pass over the new tokens of every scheduled sequence.

Input: the scheduler's list of (sequence, number of new tokens) and each sequence's block
tables. The tokens of all sequences are concatenated (ragged, no padding) with their
positions and a PagedAttentionMetadata; the output is the float32 logits of the last new
token of every sequence that completes this step (it samples), plus the logits of every new
position for sequences that asked for prompt logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.attention.paged import PagedAttentionMetadata, PagedKVCache
from tokenmill.engine.scheduler import ScheduledSequence
from tokenmill.models.base import CausalLM


@dataclass
class RunnerOutput:
    sample_logits: torch.Tensor
    """[number of completing sequences, vocab] float32, in schedule order."""
    sample_rows: list[int]
    """Index in the schedule of each row of ``sample_logits``."""
    all_logits: dict[int, torch.Tensor]
    """Index in the schedule -> [num_new_tokens, vocab] for sequences that asked (prompt logprobs)."""


class ModelRunner:
    def __init__(self, model: CausalLM, cache: PagedKVCache, device: torch.device) -> None:
        self.model, self.cache, self.device = model, cache, device

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSequence], block_tables: list[list[list[int]]],
                wants_all_logits: list[bool]) -> RunnerOutput:
        """``block_tables[i]``: per KV group, the block ids of scheduled sequence i."""
        tokens: list[int] = []
        query_lens, context_lens = [], []
        for item in scheduled:
            start = item.seq.num_computed_tokens
            tokens.extend(item.seq.all_token_ids[start:start + item.num_new_tokens])
            query_lens.append(item.num_new_tokens)
            context_lens.append(start + item.num_new_tokens)
        per_group = [list(tables) for tables in zip(*block_tables)]
        meta = PagedAttentionMetadata.build(query_lens, context_lens, per_group, self.cache.block_size, self.device)
        input_ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        hidden = self.model(input_ids, meta.positions(self.device), self.cache, meta)
        rows = [i for i, item in enumerate(scheduled) if item.completes]
        last = meta.last_token_indices()
        logits = self.model.compute_logits(hidden[[last[i] for i in rows]])
        full = {i: self.model.compute_logits(hidden[meta.query_start_loc[i]:meta.query_start_loc[i + 1]])
                for i, wants in enumerate(wants_all_logits) if wants}
        return RunnerOutput(logits, rows, full)
