"""What every drafting method gives the engine: up to k next tokens for a sequence, cheaply.

A proposer sees a sequence's tokens (prompt then output) and returns at most ``k`` guesses of the
tokens that follow, possibly none. It holds no KV and changes nothing the engine owns; the
target model verifies every guess in the next step, so a wrong guess costs only compute.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Proposer(Protocol):
    name: str
    """The method's name (``speculative={"method": name}``), for logs and metrics."""

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        """At most ``k`` tokens guessed to follow ``token_ids`` (prompt then output), maybe none."""
        ...
