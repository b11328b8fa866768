"""The engine's side of speculative decoding: who drafts, how much, and how much a verification kept.

Before each step :meth:`Drafter.propose` gives every eligible decoding sequence a draft of at most
``num_speculative_tokens`` tokens (``Sequence.draft_token_ids``); the scheduler gives it the slots
for its next token plus the draft (from free blocks only), the runner returns the logits of all of
those positions, and the engine samples each one with the sequence's own sampling state. Row i
says which token follows the draft's first i tokens, so the draft is kept up to its first token
that differs from its row's, and that row's token is appended after it (or, all kept, the last
row's): 1 to k + 1 tokens a step, each the one plain decoding would have produced.

Eligible: greedy requests without penalties (row i's token then depends on the logits alone), past
``min_tokens`` (no stop-token mask), one sample (``n == 1``), and with room left under
``max_tokens`` and the context window. Everything else decodes as before in the same batch.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenmill.engine.config import SpeculativeConfig
from tokenmill.engine.request import Sequence, SequenceStatus
from tokenmill.engine.spec.ngram import NgramProposer
from tokenmill.engine.spec.proposer import Proposer


def make_proposer(config: SpeculativeConfig) -> Proposer | None:
    if config.speculative_method is None:
        return None
    if config.speculative_method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    raise ValueError(f"no proposer for {config.speculative_method!r}")  # SpeculativeConfig checked the name


class Drafter:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer) -> None:
        self.config, self.proposer = config, proposer
        self.num_draft_tokens = 0
        """Drafted tokens verified so far."""
        self.num_accepted_tokens = 0
        """Of those, the ones kept."""

    @staticmethod
    def eligible(seq: Sequence) -> bool:
        state, params = seq.sampling, seq.sampling.params
        return (seq.status == SequenceStatus.RUNNING and seq.num_tokens - seq.num_computed_tokens == 1
                and state.greedy and not state.has_penalties and params.n == 1
                and len(seq.output_token_ids) >= params.min_tokens)

    def propose(self, running: Iterable[Sequence], max_model_len: int) -> None:
        """Set the draft of every running sequence: a proposal where eligible, else none."""
        for seq in running:
            seq.draft_token_ids = []
            if not self.eligible(seq):
                continue
            room = max_model_len - seq.num_tokens  # drafted positions num_tokens .. must stay in the window
            max_tokens = seq.sampling.params.max_tokens
            if max_tokens is not None:  # the token after the draft is sampled anyway
                room = min(room, max_tokens - len(seq.output_token_ids) - 1)
            k = min(self.config.num_speculative_tokens, room)
            if k > 0:
                seq.draft_token_ids = self.proposer.propose(seq.all_token_ids, k)[:k]

    def accepted(self, draft: list[int], targets: list[int]) -> int:
        """How many of ``draft`` verification kept: its longest prefix equal to ``targets`` (row i's
        token follows the draft's first i tokens); counted into the totals."""
        n = 0
        while n < len(draft) and draft[n] == targets[n]:
            n += 1
        self.num_draft_tokens += len(draft)
        self.num_accepted_tokens += n
        return n
