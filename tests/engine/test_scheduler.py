"""Exact schedules (which sequences, how many tokens each) for chunked prefill, preemption,
priority and abort, with a fake model: the test plays the runner by advancing
num_computed_tokens and appending a token to every sequence that completes."""

from __future__ import annotations

import itertools


from tokenmill.engine.request import Sequence, SequenceStatus
from tokenmill.engine.sampler import SamplingState
from tokenmill.engine.config import SchedulerConfig
from tokenmill.engine.scheduler import Scheduler
from tokenmill.sampling_params import SamplingParams

BLOCK = 4


class FakeKV:
    """Counts blocks of BLOCK tokens per sequence; prefix hits come from a fixed table.

    It reads each sequence's num_computed_tokens from the sequence itself (``seqs``)."""

    def __init__(self, num_blocks: int, hits: dict[str, int] | None = None) -> None:
        self.free_blocks, self.tables, self.hits = num_blocks, {}, hits or {}
        self.seqs: dict[str, Sequence] = {}

    def get_computed_blocks(self, seq_id, token_ids, salt=None) -> int:
        hit = self.hits.get(seq_id, 0)
        self.tables[seq_id] = -(-hit // BLOCK)
        self.free_blocks -= self.tables[seq_id]
        return hit

    def allocate_slots(self, seq_id, token_ids, num_new_tokens) -> bool:
        have = self.tables.get(seq_id, 0)
        need = -(-(self.seqs[seq_id].num_computed_tokens + num_new_tokens) // BLOCK) - have
        if need > self.free_blocks:
            return False
        self.free_blocks -= max(need, 0)
        self.tables[seq_id] = have + max(need, 0)
        return True

    def free(self, seq_id) -> None:
        self.free_blocks += self.tables.pop(seq_id, 0)


_clock = itertools.count()


def make_seq(name: str, prompt_len: int, priority: int = 0) -> Sequence:
    state = SamplingState.create(SamplingParams(max_tokens=100), list(range(prompt_len)))
    return Sequence(name, 0, list(range(prompt_len)), state, detokenizer=None, priority=priority,
                    arrival_time=float(next(_clock)))


def build(num_blocks=100, hits=None, **config) -> Scheduler:
    return Scheduler(SchedulerConfig(**config), FakeKV(num_blocks, hits))


def add(sched: Scheduler, *seqs: Sequence) -> None:
    for seq in seqs:
        sched.kv.seqs[seq.seq_id] = seq
        sched.add(seq)


def run_step(sched: Scheduler) -> list[tuple[str, int]]:
    """Schedule one step and play the model; returns [(request id, tokens)]."""
    out = sched.schedule()
    for item in out.scheduled:
        completes = item.completes
        item.seq.num_computed_tokens += item.num_new_tokens
        if completes:
            item.seq.append_token(7)
    return [(item.seq.request_id, item.num_new_tokens) for item in out.scheduled]


def test_decodes_first_then_prompt_chunks():
    sched = build(max_num_batched_tokens=10)
    a, b = make_seq("a", 6), make_seq("b", 25)
    add(sched, a)
    add(sched, b)
    assert run_step(sched) == [("a", 6), ("b", 4)]        # a's whole prompt, b gets what is left
    assert run_step(sched) == [("a", 1), ("b", 9)]        # a decodes first, b's prompt continues
    assert run_step(sched) == [("a", 1), ("b", 9)]
    assert run_step(sched) == [("a", 1), ("b", 3)]        # b's last chunk: b samples its first token
    assert b.output_token_ids == [7]
    assert run_step(sched) == [("a", 1), ("b", 1)]


def test_prefill_chunk_cap_and_no_chunking():
    sched = build(max_num_batched_tokens=16, max_prefill_chunk=5)
    a = make_seq("a", 12)
    add(sched, a)
    assert [run_step(sched) for _ in range(4)] == [[("a", 5)], [("a", 5)], [("a", 2)], [("a", 1)]]
    whole = build(max_num_batched_tokens=8, enable_chunked_prefill=False)
    x, y = make_seq("x", 6), make_seq("y", 5)
    add(whole, x)
    add(whole, y)
    assert run_step(whole) == [("x", 6)]                  # y (5) does not fit the 2 tokens left
    assert run_step(whole) == [("x", 1), ("y", 5)]


def test_max_num_seqs():
    sched = build(max_num_seqs=2)
    seqs = [make_seq(n, 3) for n in "abc"]
    add(sched, *seqs)
    assert run_step(sched) == [("a", 3), ("b", 3)]
    sched.finish(seqs[0])
    seqs[0].status = SequenceStatus.FINISHED_STOPPED
    assert run_step(sched) == [("b", 1), ("c", 3)]


def test_preempts_latest_when_pool_runs_dry_and_recomputes():
    # 4 blocks of 4 tokens: a and b hold 2 blocks each after their prompts (8 and 5 tokens... )
    sched = build(num_blocks=4)
    a, b = make_seq("a", 8), make_seq("b", 7)
    add(sched, a)
    add(sched, b)
    assert run_step(sched) == [("a", 8), ("b", 7)]        # 2 + 2 blocks: pool full
    # a (9 tokens) needs a third block: b, the latest, is preempted and requeued
    assert run_step(sched) == [("a", 1)]
    assert b.status == SequenceStatus.PREEMPTED and b.num_computed_tokens == 0
    assert sched.num_preemptions == 1
    sched.finish(a)
    a.status = SequenceStatus.FINISHED_STOPPED
    assert run_step(sched) == [("b", 8)]                  # b recomputes prompt + its sampled token
    assert b.status == SequenceStatus.RUNNING


def test_priority_policy_orders_admission_and_preemption():
    sched = build(num_blocks=4, policy="priority")
    low, high = make_seq("low", 8, priority=5), make_seq("high", 7, priority=0)
    add(sched, low)
    add(sched, high)
    assert run_step(sched) == [("high", 7), ("low", 8)]   # more important first
    # high (8 tokens) needs a 3rd block: the low-priority one is preempted though it came first
    assert run_step(sched) == [("high", 1)]
    assert low.status == SequenceStatus.PREEMPTED


def test_fcfs_ignores_priority():
    sched = build(policy="fcfs")
    first, second = make_seq("first", 3, priority=9), make_seq("second", 3, priority=0)
    add(sched, first)
    add(sched, second)
    assert run_step(sched) == [("first", 3), ("second", 3)]


def test_abort_waiting_and_running_frees_everything():
    sched = build(num_blocks=10, max_num_seqs=1)
    a, b = make_seq("a", 8), make_seq("b", 8)
    add(sched, a)
    add(sched, b)
    assert run_step(sched) == [("a", 8)]
    b.status = SequenceStatus.FINISHED_ABORTED           # abort while waiting
    sched.finish(b)
    a.status = SequenceStatus.FINISHED_ABORTED           # abort while running
    sched.finish(a)
    assert run_step(sched) == []
    assert not sched.has_unfinished()
    assert sched.kv.free_blocks == 10 and not sched.kv.tables


def test_prefix_hit_skips_cached_tokens():
    sched = build(hits={"b#0": 8})
    b = make_seq("b", 10)
    add(sched, b)
    out_plan = run_step(sched)
    assert out_plan == [("b", 2)]


def test_sequence_too_big_for_the_pool_fails_instead_of_deadlocking():
    sched = build(num_blocks=2)                          # 8 tokens of KV in all
    big, small = make_seq("big", 20), make_seq("small", 3)
    add(sched, big, small)
    assert run_step(sched) == [("small", 3)]             # big can never fit: failed, small goes on
    assert big.status == SequenceStatus.FINISHED_ERROR
    assert sched.kv.tables == {"small#0": 1}
