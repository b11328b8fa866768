"""The model runner: one forward pass over the new tokens of every scheduled sequence.

Input: a list of (sequence, number of new tokens). The tokens of all sequences are
concatenated (ragged, no padding) with their positions and an AttentionMetadata; the
output is the float32 logits of each sequence's last new token, plus the logits of every
new position for sequences that asked for prompt logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.attention.kv_cache import ContiguousKVCache
from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.engine.request import Sequence
from tokenmill.models.base import CausalLM


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int
    all_logits: bool = False
    """Return logits for every new token (prompt logprobs), not just the last."""


@dataclass
class RunnerOutput:
    last_logits: torch.Tensor
    """[num_sequences, vocab] float32: logits after each sequence's last new token."""
    all_logits: dict[int, torch.Tensor]
    """Index in the schedule -> [num_new_tokens, vocab] for sequences that asked."""


class ModelRunner:
    def __init__(self, model: CausalLM, device: torch.device) -> None:
        cfg = model.config
        self.model, self.device = model, device
        self.cache = ContiguousKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                                       model.embed.weight.dtype, device)

    def allocate(self, seq: Sequence, capacity: int) -> None:
        seq.cache_slot = self.cache.allocate(capacity)

    def free(self, seq: Sequence) -> None:
        if seq.cache_slot is not None:
            self.cache.free(seq.cache_slot)
            seq.cache_slot = None

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSequence]) -> RunnerOutput:
        tokens: list[int] = []
        query_lens, context_lens, slots = [], [], []
        for item in scheduled:
            seq, n = item.seq, item.num_new_tokens
            start = seq.num_computed_tokens
            tokens.extend(seq.all_token_ids[start:start + n])
            self.cache.ensure_capacity(seq.cache_slot, start + n)
            query_lens.append(n)
            context_lens.append(start + n)
            slots.append(seq.cache_slot)
        meta = AttentionMetadata.build(query_lens, context_lens, slots)
        input_ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        hidden = self.model(input_ids, meta.positions(self.device), self.cache, meta)
        last = self.model.compute_logits(hidden[meta.last_token_indices()])
        full = {i: self.model.compute_logits(hidden[meta.query_start_loc[i]:meta.query_start_loc[i + 1]])
                for i, item in enumerate(scheduled) if item.all_logits}
        return RunnerOutput(last, full)
