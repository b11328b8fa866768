"""The scheduler: every step fills one token budget, with no separate prefill and decode phases.

Each step moves sequences' ``num_computed_tokens`` toward ``num_tokens``::

    budget = max_num_batched_tokens
    1. running sequences, most important first: each gets what it still lacks
       (1 token when decoding, the rest of its prompt, capped, when prefilling);
       when the KV pool runs dry, the least important running sequence is preempted
       (its blocks freed, recomputed later), never the one being served before it
    2. speculative decoding: the scheduled decoding sequences with a draft get slots for it
       too, from free blocks and the budget left (never by preempting; not in a step that preempted)
    3. if nobody was preempted: waiting sequences, most important first, get their
       prompt (after the prefix-cache hit) in chunks of what the budget has left

So a long prompt is cut into chunks and never blocks running decodes (no head-of-line
blocking). Importance is (priority, arrival time) under the 'priority' policy and arrival
time alone under 'fcfs'; lower is more important. A preempted sequence keeps its arrival
time, so it goes back to the front of the queue.
"""

from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass, field
from typing import Protocol, Sequence as Seq

from tokenmill.engine.config import SchedulerConfig
from tokenmill.engine.request import Sequence, SequenceStatus


class KVManager(Protocol):
    def get_computed_blocks(self, seq_id: str, token_ids: Seq[int], salt: str | None = None) -> int: ...
    def allocate_slots(self, seq_id: str, token_ids: Seq[int], num_new_tokens: int) -> bool: ...
    def free(self, seq_id: str) -> None: ...


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int
    """Tokens ``tokens_with_draft()[num_computed_tokens : num_computed_tokens + num_new_tokens]`` run this step."""
    num_draft: int = 0
    """Drafted tokens verified this step: the last ``num_draft`` new tokens (speculative decoding)."""
    draft_hidden: object = None
    """The target's hidden states of the drafted tokens (for a head that drafts from them), until verified."""

    @property
    def completes(self) -> bool:
        """After this step the sequence has computed all its tokens (and its draft), so a new token is
        sampled. Read before the step's bookkeeping moves ``num_computed_tokens``."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens + self.num_draft


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    failed: list[Sequence] = field(default_factory=list)
    """Sequences that cannot fit the KV pool even alone; finished with an error."""
    prefix_hit_tokens: int = 0

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVManager, max_loras: int = 0) -> None:
        """``max_loras``: most distinct LoRA adapters among the running sequences (a waiting one with
        another adapter waits until one finishes; skipped over, not blocking those behind it)."""
        self.config, self.kv, self.max_loras = config, kv, max_loras
        self.running: list[Sequence] = []
        self._waiting: list[tuple[tuple, int, Sequence]] = []
        self._tiebreak = itertools.count()
        self.num_preemptions = 0

    # ---- queue ------------------------------------------------------------------------------------
    def _key(self, seq: Sequence) -> tuple:
        rank = seq.priority if self.config.policy == "priority" else 0
        return (rank, seq.arrival_time)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING if seq.status != SequenceStatus.PREEMPTED else seq.status
        heapq.heappush(self._waiting, (self._key(seq), next(self._tiebreak), seq))

    def add_running(self, seq: Sequence) -> None:
        """A sequence whose KV is already in place (a forked n > 1 sample) joins the running set."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    @property
    def prompt_tokens_left(self) -> int:
        """Prompt tokens of the running and waiting sequences not computed yet (waiting ones may
        still hit the prefix cache): the prefill work queued."""
        seqs = [*self.running, *(s for *_, s in self._waiting if not s.status.finished)]
        return sum(max(len(s.prompt_token_ids) - s.num_computed_tokens, 0) for s in seqs)

    @property
    def num_waiting(self) -> int:
        return sum(1 for *_, s in self._waiting if not s.status.finished)

    def has_unfinished(self) -> bool:
        return bool(self.running) or self.num_waiting > 0

    def _peek_waiting(self) -> Sequence | None:
        while self._waiting and self._waiting[0][2].status.finished:  # aborted while waiting
            heapq.heappop(self._waiting)
        return self._waiting[0][2] if self._waiting else None

    def finish(self, seq: Sequence) -> None:
        """Release a sequence that finished (or was aborted) and its KV blocks; idempotent."""
        self.kv.free(seq.seq_id)
        if seq in self.running:
            self.running.remove(seq)

    # ---- one step ---------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        self.running.sort(key=self._key)
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status == SequenceStatus.PREEMPTED:
                continue
            n = self._chunk(seq, budget)
            if n == 0:
                continue
            if self._allocate_or_preempt(seq, n, out):
                out.scheduled.append(ScheduledSequence(seq, n))
                budget -= n
        budget = self._extend_drafts(out, budget)
        if not out.preempted:
            self._admit_waiting(budget, out)
        return out

    def _chunk(self, seq: Sequence, budget: int) -> int:
        remaining = seq.num_tokens - seq.num_computed_tokens
        if remaining > 1 and self.config.max_prefill_chunk:
            remaining = min(remaining, self.config.max_prefill_chunk)
        if remaining > budget and not self.config.enable_chunked_prefill:
            return 0
        return min(remaining, budget)

    def _extend_drafts(self, out: SchedulerOutput, budget: int) -> int:
        """After every running sequence has its tokens: the drafts of the scheduled decoding ones,
        in the same order, cut to what the budget and the free blocks hold (a draft never preempts,
        and none is made in a step that preempted). Sequences left without slots lose their draft.
        -> the budget left."""
        extended = set()
        for item in out.scheduled:
            seq, draft = item.seq, item.seq.draft_token_ids
            decoding = item.num_new_tokens == 1 and seq.num_tokens - seq.num_computed_tokens == 1
            if not draft or not decoding or out.preempted:
                continue
            del draft[budget:]
            while draft and not self.kv.allocate_slots(seq.seq_id, seq.tokens_with_draft(), len(draft)):
                draft.pop()  # as much of it as the free blocks hold (all or nothing per call)
            if draft:
                item.num_new_tokens += len(draft)
                item.num_draft = len(draft)
                budget -= len(draft)
                extended.add(id(seq))
        for seq in self.running:
            if id(seq) not in extended:
                seq.draft_token_ids.clear()
        return budget

    def _allocate_or_preempt(self, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        """Make room for ``n`` more tokens of ``seq``, preempting less important running sequences."""
        scheduled = {id(s.seq) for s in out.scheduled}
        while not self.kv.allocate_slots(seq.seq_id, seq.all_token_ids, n):
            victims = [s for s in self.running if s is not seq and id(s) not in scheduled
                       and s.status == SequenceStatus.RUNNING]
            if not victims:
                if len(self.running) == 1 and not out.scheduled:  # alone and still too big: give up on it
                    self.finish(seq)
                    seq.status = SequenceStatus.FINISHED_ERROR
                    out.failed.append(seq)
                else:
                    self._preempt(seq, out)
                return False
            self._preempt(max(victims, key=self._key), out)
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        seq.draft_token_ids.clear()
        self.kv.free(seq.seq_id)
        self.running.remove(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.PREEMPTED
        self.num_preemptions += 1
        out.preempted.append(seq)
        self.add(seq)

    def _admit_waiting(self, budget: int, out: SchedulerOutput) -> None:
        adapters = {id(s.lora) for s in self.running if s.lora is not None}
        deferred = []  # waiting entries whose adapter would exceed max_loras: back in the queue after
        try:
            self._admit(budget, out, adapters, deferred)
        finally:
            for entry in deferred:
                heapq.heappush(self._waiting, entry)

    def _admit(self, budget: int, out: SchedulerOutput, adapters: set[int], deferred: list) -> None:
        while budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self._peek_waiting()
            if seq is None:
                return
            if seq.lora is not None and id(seq.lora) not in adapters and len(adapters) >= self.max_loras:
                deferred.append(heapq.heappop(self._waiting))
                continue
            hit = self.kv.get_computed_blocks(seq.seq_id, seq.all_token_ids, seq.cache_salt)
            seq.num_computed_tokens = hit
            n = self._chunk(seq, budget)
            if n == 0 or not self.kv.allocate_slots(seq.seq_id, seq.all_token_ids, n):
                self.kv.free(seq.seq_id)  # give back the cache hit's blocks; retry next step
                seq.num_computed_tokens = 0
                if not self.running and not out.scheduled and n > 0:
                    self._fail_waiting(seq, out)
                    continue
                return
            heapq.heappop(self._waiting)
            seq.status = SequenceStatus.RUNNING
            if seq.num_cached_tokens < 0:
                seq.num_cached_tokens = hit
                seq.scheduled_time = time.monotonic()
            self.running.append(seq)
            if seq.lora is not None:
                adapters.add(id(seq.lora))
            out.scheduled.append(ScheduledSequence(seq, n))
            out.prefix_hit_tokens += hit
            budget -= n

    def _fail_waiting(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Nothing runs and this sequence still cannot get blocks: the pool is too small for it."""
        heapq.heappop(self._waiting)
        seq.status = SequenceStatus.FINISHED_ERROR
        out.failed.append(seq)
