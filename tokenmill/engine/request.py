"""The request object: created on arrival, updated by every stage, until it finishes.

One sample of a request is one :class:`Sequence` (``n > 1`` makes several). A sequence's
progress is ``num_computed_tokens`` against ``len(all_token_ids)``: the scheduler hands it
``all_token_ids[num_computed_tokens:]`` to compute next.

Token lists are append-only: ``all_token_ids`` (prompt, then output) and the sampler's
``output_token_ids`` grow together through :meth:`Sequence.append_token` and are never rebuilt.
What a step hands out is only what is new since the last: ``num_sent_tokens`` and
``num_sent_chars`` mark how far the sample's tokens and text have been reported.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from tokenmill.engine.outputs import TokenLogprobs
from tokenmill.engine.sampler import SamplingState
from tokenmill.loading.detokenizer import IncrementalDetokenizer
from tokenmill.lora.adapter import LoRAAdapter
from tokenmill.sampling_params import SamplingParams


class SequenceStatus(enum.IntEnum):
    """Ordered: every status above PREEMPTED is finished."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def finished(self) -> bool:
        return self > SequenceStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return {SequenceStatus.FINISHED_STOPPED: "stop", SequenceStatus.FINISHED_LENGTH: "length",
                SequenceStatus.FINISHED_ABORTED: "abort", SequenceStatus.FINISHED_ERROR: "error"}.get(self)


@dataclass
class Sequence:
    """One sample being generated."""

    request_id: str
    index: int
    prompt_token_ids: list[int]
    sampling: SamplingState
    detokenizer: IncrementalDetokenizer
    status: SequenceStatus = SequenceStatus.WAITING
    priority: int = 0
    """Lower is more important (as vLLM): scheduled first, preempted last."""
    arrival_time: float = field(default_factory=time.monotonic)
    cache_salt: str | None = None
    """Mixed into prefix-cache hashes: requests with different salts never share cached blocks."""
    lora: LoRAAdapter | None = None
    """The LoRA adapter it runs with (the weights it started with, whatever the name means later)."""
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1
    """Prompt tokens served from the prefix cache when first scheduled; -1 until then."""
    scheduled_time: float | None = None
    """When the scheduler first gave it a slot (the end of its wait in the queue)."""
    text: str = ""
    """Output text, cut at a matched stop string."""
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprobs] | None = None
    """One entry per output token, when asked for."""
    num_sent_tokens: int = 0
    """Output tokens (and logprobs) already handed out in a step's delta."""
    num_sent_chars: int = 0
    """Characters of ``text`` already handed out."""
    finish_sent: bool = False
    """Its finish has been handed out."""
    draft_token_ids: list[int] = field(default_factory=list)
    """Tokens a proposer guessed to follow ``all_token_ids`` (speculative decoding), to be
    verified in the next step; empty when not drafting. Never part of ``all_token_ids``."""
    draft_probs: torch.Tensor | None = None
    """``[>= len(draft_token_ids), V]``: the distributions the draft tokens were drawn from (rejection
    sampling), None for drafts chosen deterministically."""
    draft_hidden: torch.Tensor | None = None
    """``[len(draft_token_ids), H]``: the model's own final hidden states at the sequence's last token
    and at each draft token but the last, with their KV written, computed while drafting by a draft
    that is the model itself (spec/shortlist.py); verification reuses them. None otherwise."""
    all_token_ids: list[int] = field(init=False)
    """Prompt then output token ids; append-only."""

    def __post_init__(self) -> None:
        self.all_token_ids = [*self.prompt_token_ids, *self.sampling.output_token_ids]

    @property
    def output_token_ids(self) -> list[int]:
        return self.sampling.output_token_ids

    def append_token(self, token_id: int) -> None:
        self.sampling.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def tokens_with_draft(self) -> list[int]:
        """``all_token_ids`` then the draft: what a drafting step computes over."""
        return self.all_token_ids + self.draft_token_ids if self.draft_token_ids else self.all_token_ids

    @property
    def seq_id(self) -> str:
        """Key of this sample's KV blocks."""
        return f"{self.request_id}#{self.index}"


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    sequences: list[Sequence]
    arrival_time: float = field(default_factory=time.monotonic)
    cache_salt: str | None = None
    """Mixed into prefix-cache hashes: requests with different salts never share cached blocks."""
    first_token_time: float | None = None
    finish_time: float | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_sent_prompt_logprobs: int = 0
    """Prompt logprob entries already handed out."""

    @property
    def finished(self) -> bool:
        return all(s.status.finished for s in self.sequences)
