"""What every drafting method gives the engine: up to k next tokens for each sequence of a step.

A proposer sees the sequences that may draft and how many tokens each may draft, and returns one
:class:`Draft` per sequence, possibly empty. The target verifies every guess in the same step
(spec/verify.py), so a wrong guess costs only compute. A proposer that keeps state per sequence
(a draft model's KV) gives it back in :meth:`Proposer.release`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from tokenmill.engine.request import Sequence


@dataclass(slots=True)
class Draft:
    token_ids: list[int]
    probs: torch.Tensor | None = None
    """``[len(token_ids), V]`` float32: the distribution each token was drawn from (the draft model's,
    processed like the request's own sampling), for rejection sampling; None when the tokens were
    chosen deterministically (a point mass: n-gram lookup, greedy or seeded drafting)."""
    hidden: torch.Tensor | None = None
    """``[len(token_ids), H]``: the target's own final hidden states at the sequence's last token and
    each drafted token but the last, their KV written in the target's cache (a draft that is the
    target itself: spec/shortlist.py), for verification to reuse; None otherwise."""


NO_DRAFT = Draft([])


class Proposer(Protocol):
    name: str
    """The method's name (``speculative={"method": name}``), for logs and metrics."""
    cheap: bool
    """Drafting costs next to nothing (a lookup): the engine drafts first and sizes the drafts after.
    Otherwise (a model) the engine sizes the drafts first and the proposer drafts exactly that much."""

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[Draft]:
        """A draft of at most ``num_tokens[i]`` tokens to follow ``seqs[i].all_token_ids``, per sequence."""
        ...

    def release(self, seq_id: str) -> None:
        """Forget the sequence (it finished, was aborted or preempted): free what it holds."""
        ...

    @property
    def num_used_blocks(self) -> int:
        """KV blocks the proposer holds for sequences (0 for a stateless one)."""
        ...
