"""Prompt lookup (n-gram) drafting: find the newest n-gram of a sequence earlier in it, propose what
followed there.

For n from ``max_n`` down to ``min_n``: take the sequence's last n tokens, find their latest earlier
occurrence (prompt or output), and propose the up to k tokens that came after it. Input-grounded
work (summaries, edits, code changes, extraction) copies long runs of its prompt, so those guesses
are often right; open-ended text rarely repeats and gets no draft. The search is vectorized
(numpy over the token array) so a step's lookups cost microseconds, not a Python loop per token.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tokenmill.engine.request import Sequence as EngineSequence
from tokenmill.engine.spec.proposer import Draft
from tokenmill.errors import InvalidParameterError


class NgramProposer:
    name = "ngram"
    cheap = True
    num_used_blocks = 0

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise InvalidParameterError(f"ngram proposer needs 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seqs: list[EngineSequence], num_tokens: list[int]) -> list[Draft]:
        return [Draft(self.lookup(seq.all_token_ids, k)) for seq, k in zip(seqs, num_tokens)]

    def release(self, seq_id: str) -> None:
        pass

    def lookup(self, token_ids: Sequence[int], k: int) -> list[int]:
        """What followed the latest earlier occurrence of the longest matching n-gram: up to k tokens."""
        total = len(token_ids)
        if k <= 0 or total <= self.min_n:
            return []
        ids = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            start = _latest_match(ids, n)
            if start is not None:
                follow = ids[start + n:start + n + k]
                return follow.tolist()
        return []


def _latest_match(ids: np.ndarray, n: int) -> int | None:
    """Start of the latest occurrence of ``ids[-n:]`` that ends before the last token, or None."""
    total = len(ids)
    pattern = ids[total - n:]
    # candidate starts s in [0, total - n - 1]: the window ids[s:s + n] ends before the suffix itself
    hits = np.flatnonzero(ids[:total - n] == pattern[0])
    for j in range(1, n):
        if hits.size == 0:
            return None
        hits = hits[ids[hits + j] == pattern[j]]
    return int(hits[-1]) if hits.size else None
