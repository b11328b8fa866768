"""The engine's side of speculative decoding: who drafts, how much, and what verification kept.

Before each step :meth:`Drafter.propose` gives every eligible decoding sequence a draft
(``Sequence.draft_token_ids``, ``draft_probs``); the scheduler gives it slots for its next token
plus the draft (from free blocks only), the runner returns the logits of all of those positions,
and :func:`~tokenmill.engine.spec.verify.verify` keeps the draft up to the first token the target
would not have produced, then one more: 1 to k + 1 tokens a step, distributed as plain decoding.

Eligible: a running sequence that decodes (its prompt done), whose request did not opt out
(``SamplingParams.speculative``), with room under ``max_tokens`` and the context window. Greedy and
random sampling, penalties, min_tokens, logprobs, n > 1 all draft; verification applies them to
each drafted position as plain decoding would.

How much (``speculative_adaptive``): each step the draft lengths maximise expected tokens per
second. A draft token at position j (1-based) of a sequence whose first drafted token is kept with
probability a, and each next one, given the one before, with probability c, is worth a * c**(j-1)
expected tokens (cost.Acceptance); adding it costs the step's extra time at one more batched token (and, for a draft model,
its forward passes), both learned from the engine's own steps (cost.py). Draft tokens go in order
of worth while they raise tokens / second; under load a step's time grows with every token and
the drafts shrink to none. A sequence left without a draft drifts back toward the pooled
acceptance rates, and every ``PROBE_EVERY`` steps each eligible sequence drafts one token whatever
the estimates say: a rate or a cost measured on a bad moment is measured again, at the price of
one cheap draft token per sequence every ``PROBE_EVERY`` steps. Last, the realised check
(gain.py): per decoding-batch size, drafting steps are measured against plain steps at the same
size (which run without the proposer), and where drafting does worse, whatever the model
predicted, steps run plain, with a drafting probe now and then (in which every eligible sequence
drafts at least one token: the estimates above learn nothing while nothing is drafted). Without
``speculative_adaptive`` every step drafts.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from tokenmill.engine.config import SpeculativeConfig
from tokenmill.engine.request import Sequence, SequenceStatus
from tokenmill.engine.spec.cost import Acceptance, CostCurve
from tokenmill.engine.spec.gain import RealisedGain
from tokenmill.engine.spec.proposer import Proposer

PROBE_EVERY = 128


@dataclass
class SpecCounters:
    """Totals since the engine started (vLLM's spec_decode counters)."""

    num_drafts: int = 0
    """Verifications (one per drafting sequence and step)."""
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    """[j]: verifications that kept the draft's token at position j (0-based)."""


class Drafter:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer, draft_cost: CostCurve | None = None) -> None:
        """``draft_cost``: the curve a draft-model proposer reports its forward passes to."""
        self.config, self.proposer = config, proposer
        self.counters = SpecCounters(accepted_per_position=[0] * config.num_speculative_tokens)
        self.step_cost = CostCurve()
        """Seconds of a step (model, sampling, verification) by its batched tokens."""
        self.draft_cost = draft_cost if draft_cost is not None else CostCurve()
        """Seconds of one draft-model forward pass by the number of sequences in it."""
        self.acceptance = Acceptance()
        self._drafting: set[str] = set()
        self._steps = 0
        self._draft_seconds = 0.0
        self.realised = RealisedGain()
        self._proposed = False
        """The proposer ran before this step (a drafting step, for the realised check)."""

    # ---- before the step ------------------------------------------------------------------------
    @staticmethod
    def eligible(seq: Sequence) -> bool:
        return (seq.status == SequenceStatus.RUNNING and seq.num_tokens - seq.num_computed_tokens == 1
                and seq.sampling.params.speculative)

    def propose(self, running: Iterable[Sequence], max_model_len: int, budget: int) -> None:
        """Set the draft of every running sequence: a proposal where eligible and worth it, else none."""
        running = list(running)
        self._steps += 1
        alive = {seq.seq_id for seq in running}
        for seq_id in self._drafting - alive:
            self.release(seq_id)
        seqs, caps = [], []
        decoding = sum(seq.num_tokens - seq.num_computed_tokens == 1 for seq in running)
        plain = self.config.speculative_adaptive and not self.realised.drafts(decoding)
        probe = self.config.speculative_adaptive and self.realised.probing(decoding)
        for seq in running:
            seq.draft_token_ids, seq.draft_probs, seq.draft_hidden = [], None, None
            if plain or not self.eligible(seq):
                continue
            room = max_model_len - seq.num_tokens  # drafted positions num_tokens .. must stay in the window
            max_tokens = seq.sampling.params.max_tokens
            if max_tokens is not None:  # the token after the draft is sampled anyway
                room = min(room, max_tokens - len(seq.output_token_ids) - 1)
            cap = min(self.config.num_speculative_tokens, room)
            if cap > 0:
                seqs.append(seq)
                caps.append(cap)
        start = time.perf_counter()
        if seqs and self.proposer.cheap and not probe and not any(self._sizes(seqs, caps, min(decoding, budget),
                                                                              decoding, relax=False)):
            seqs = []  # no draft of any length would pay: a plain step, without the lookups
        self._proposed = bool(seqs)
        if not seqs:
            self._draft_seconds = 0.0
            return
        # a cheap proposer looks up first and what it found is sized; a model is sized first and drafts
        # only what will be verified
        drafts = self.proposer.propose(seqs, caps) if self.proposer.cheap else None
        limits = [len(d.token_ids) for d in drafts] if drafts is not None else caps
        sizes = self._sizes(seqs, limits, min(decoding, budget), decoding)
        if probe:  # the realised check's probe: a draft it can measure, whatever the estimates say
            sizes = [max(n, min(1, c)) for n, c in zip(sizes, limits)]
        if drafts is None:
            drafts = self.proposer.propose(seqs, sizes)
        for seq, draft, n in zip(seqs, drafts, sizes):
            if n > 0:
                self._drafting.add(seq.seq_id)  # the proposer may hold state for it now
                seq.draft_token_ids = draft.token_ids[:n]
                seq.draft_probs = draft.probs
                seq.draft_hidden = draft.hidden[:n] if draft.hidden is not None else None
        self._draft_seconds = time.perf_counter() - start

    def _sizes(self, seqs: list[Sequence], caps: list[int], base_tokens: int, base_worth: int,
               relax: bool = True) -> list[int]:
        """Draft length per sequence (at most its cap) that maximises expected tokens per second;
        without drafts the step runs ``base_tokens`` and yields ``base_worth`` tokens. (Asked twice in a
        step of a cheap proposer: with the caps, whether any draft would pay, then with what it found;
        ``relax``: sequences left without a draft drift toward the pooled rate, once a step.)"""
        if not self.config.speculative_adaptive or not self.step_cost.known:
            return caps
        if self._steps % PROBE_EVERY == 0:
            return [min(1, c) for c in caps]
        rates = [self.acceptance.rates(seq.seq_id) for seq in seqs]  # (first, next given the one before)
        # every candidate draft token, most valuable first: (-worth, sequence index, position); position
        # j + 1 is worth position j's times the next-token rate, so the heap pops a sequence's in order
        heap = [(-rates[i][0], i, 1) for i in range(len(seqs)) if caps[i] > 0 and rates[i][0] > 0]
        heapq.heapify(heap)
        sizes = [0] * len(seqs)
        base_seconds = self.step_cost(base_tokens)
        worth = float(base_worth)  # every decoding sequence gets a token anyway
        best, best_sizes, added = worth / base_seconds if base_seconds > 0 else 0.0, list(sizes), 0
        while heap:
            neg, i, j = heapq.heappop(heap)
            sizes[i], worth, added = j, worth - neg, added + 1
            if j < caps[i] and rates[i][1] > 0:
                heapq.heappush(heap, (neg * rates[i][1], i, j + 1))
            seconds = self.step_cost(base_tokens + added) + self._draft_model_seconds(sizes)
            if seconds > 0 and worth / seconds > best:
                best, best_sizes = worth / seconds, list(sizes)
        for seq, n in zip(seqs, best_sizes):
            if n == 0 and relax:
                self.acceptance.relax(seq.seq_id)
        return best_sizes

    def _draft_model_seconds(self, sizes: list[int]) -> float:
        """A draft model's forward passes for these lengths: pass i runs every sequence with more than i."""
        if self.proposer.cheap:
            return 0.0
        return sum(self.draft_cost(sum(n > i for n in sizes)) for i in range(max(sizes, default=0)))

    # ---- after the step -------------------------------------------------------------------------
    def observe_step(self, num_batched_tokens: int, seconds: float, num_decoding: int = 0,
                     produced: int = 0) -> None:
        """A decode-only step: its batched tokens (every one a sampled row: decodes and drafts), the
        time drafting, the forward pass, sampling and verification took, and (for the realised
        check) how many sequences decoded and how many tokens they got."""
        self.step_cost.observe(num_batched_tokens, seconds - self._draft_seconds)
        if num_decoding:
            self.realised.observe(num_decoding, self._proposed, produced, seconds,
                                  num_batched_tokens - num_decoding, self._draft_seconds)

    @property
    def last_draft_seconds(self) -> float:
        return self._draft_seconds

    @property
    def wants_hidden(self) -> bool:
        """The proposer drafts from the target's hidden states (an EAGLE head)."""
        return getattr(self.proposer, "wants_hidden", False)

    def observe_hidden(self, scheduled: list, hidden: torch.Tensor) -> None:
        """The step's hidden states (``[new tokens, H]``, in ``scheduled`` order) for a proposer that
        wants them: each sequence's rows up to its draft now, the draft's rows once verified
        (:meth:`accepted`) and only those kept."""
        offset = 0
        for item in scheduled:
            rows = hidden[offset:offset + item.num_new_tokens]
            offset += item.num_new_tokens
            own = rows[:len(rows) - item.num_draft]
            if len(own):
                self.proposer.observe_hidden(item.seq.seq_id, item.seq.num_computed_tokens, own)
            if item.num_draft:
                item.draft_hidden = rows[len(rows) - item.num_draft:]

    def accepted(self, item, num_drafted: int, num_kept: int) -> None:
        """Count one verification of ``num_drafted`` tokens of ``item`` (a ScheduledSequence, before its
        ``num_computed_tokens`` moves) that kept ``num_kept``; the kept draft rows' hidden states go to
        a proposer that wants them."""
        seq_id = item.seq.seq_id
        if item.draft_hidden is not None and num_kept:
            self.proposer.observe_hidden(seq_id, item.seq.num_computed_tokens + 1, item.draft_hidden[:num_kept])
        c = self.counters
        c.num_drafts += 1
        c.num_draft_tokens += num_drafted
        c.num_accepted_tokens += num_kept
        for j in range(num_kept):
            c.accepted_per_position[j] += 1
        self.acceptance.observe(seq_id, num_drafted, num_kept)

    def finish(self, seq: Sequence) -> None:
        """A sequence ended (finished or aborted): a proposer that learns from outputs sees it, then
        its draft state goes."""
        remember = getattr(self.proposer, "finished", None)
        if remember is not None:
            remember(seq)
        self.release(seq.seq_id)

    def release(self, seq_id: str) -> None:
        """The sequence left the running set (finished, aborted, preempted): drop its draft state."""
        self._drafting.discard(seq_id)
        self.acceptance.forget(seq_id)
        self.proposer.release(seq_id)
