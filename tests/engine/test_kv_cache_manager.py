"""KVCacheManager and KVCacheCoordinator: exact block tables, prefix hits, salts, forks with
copy-on-write, sliding windows; then a stateful property test against a simple model."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tokenmill.engine.block_pool import hash_block
from tokenmill.engine.kv_cache_manager import KVCacheCoordinator, KVCacheManager

BS = 4


def toks(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def compute(kv, seq_id: str, tokens: list[int], n: int) -> None:
    """One step of a fake model: allocate n slots, 'compute' them, cache the blocks that filled."""
    assert kv.allocate_slots(seq_id, tokens, n)
    kv.cache_blocks(seq_id, tokens, kv.num_computed_tokens(seq_id))


def prefill(kv, seq_id: str, tokens: list[int], salt: str | None = None) -> int:
    hit = kv.get_computed_blocks(seq_id, tokens, salt)
    compute(kv, seq_id, tokens, len(tokens) - hit)
    return hit


def refs(kv: KVCacheManager, *block_ids: int) -> list[int]:
    return [kv.pool.blocks[b].ref_count for b in block_ids]


def free_ids(kv: KVCacheManager) -> list[int]:
    return [block.block_id for block in kv.pool.free_queue]


def test_allocate_and_append_across_block_boundaries():
    kv = KVCacheManager(10, BS)
    tokens = toks(10)
    assert prefill(kv, "a", tokens) == 0
    assert kv.block_table("a") == [1, 2, 3] and kv.num_computed_tokens("a") == 10
    assert kv.num_free_blocks == 6 and kv.usage == pytest.approx(3 / 9)
    for expected in ([1, 2, 3], [1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 4]):  # tokens 11, 12, 13, 14
        tokens.append(7)
        compute(kv, "a", tokens, 1)
        assert kv.block_table("a") == expected
    b = toks(9, start=500)  # chunked prefill: 5 tokens, then 4
    assert kv.get_computed_blocks("b", b) == 0
    assert kv.allocate_slots("b", b, 5) and kv.block_table("b") == [5, 6]
    assert kv.allocate_slots("b", b, 4) and kv.block_table("b") == [5, 6, 7]
    with pytest.raises(ValueError, match="cannot compute 10 tokens of 9"):
        kv.allocate_slots("b", b, 1)


def test_prefix_hit_is_exactly_the_cached_full_block_prefix():
    kv = KVCacheManager(10, BS)
    a = toks(10)
    prefill(kv, "a", a)
    kv.free("a")
    assert free_ids(kv) == [4, 5, 6, 7, 8, 9, 3, 2, 1]
    b = a[:9] + [999, 998]
    assert kv.get_computed_blocks("b", b) == 8
    assert kv.block_table("b") == [1, 2] and refs(kv, 1, 2) == [1, 1]
    assert free_ids(kv) == [4, 5, 6, 7, 8, 9, 3]
    assert kv.allocate_slots("b", b, 3) and kv.block_table("b") == [1, 2, 4]
    c = a[:6] + [5, 5, 5]
    assert kv.get_computed_blocks("c", c) == 4 and kv.block_table("c") == [1]
    assert refs(kv, 1, 2) == [2, 1]
    stats = kv.prefix_cache_stats
    assert (stats.queries, stats.hits) == (10 + 11 + 9, 8 + 4)
    assert stats.hit_rate == pytest.approx(12 / 30)


def test_hit_never_covers_the_whole_prompt():
    kv = KVCacheManager(10, BS)
    a = toks(8)
    prefill(kv, "a", a)
    kv.free("a")
    assert kv.get_computed_blocks("same", a) == 4  # the last token must be recomputed: block 1 is not used
    assert kv.block_table("same") == [1]
    assert kv.allocate_slots("same", a, 4) and kv.block_table("same") == [1, 3]
    assert kv.get_computed_blocks("longer", a + [1]) == 8
    assert kv.get_computed_blocks("one", a[:1]) == 0


def test_salt_isolates_tenants():
    kv = KVCacheManager(12, BS)
    a = toks(10)
    prefill(kv, "a", a, salt="tenant-1")
    kv.free("a")
    assert kv.get_computed_blocks("other", a, salt="tenant-2") == 0
    assert kv.get_computed_blocks("unsalted", a) == 0
    assert kv.get_computed_blocks("same", a, salt="tenant-1") == 8
    assert kv.block_table("same") == [1, 2]
    assert kv.block_table("other") == [] and kv.block_table("unsalted") == []


def test_blocks_are_cached_only_by_cache_blocks():
    kv = KVCacheManager(10, BS)
    a = toks(10)
    kv.get_computed_blocks("a", a)
    assert kv.allocate_slots("a", a, 10)
    assert kv.find_longest_cache_hit(a + [0]) == 0  # KV not written yet: no hit, even in this step
    kv.cache_blocks("a", a, 10)
    assert kv.find_longest_cache_hit(a + [0]) == 8
    kv.cache_blocks("gone", a, 10)  # unknown (aborted) sequence: no-op
    with pytest.raises(ValueError, match="11 tokens computed, but only 10 were allocated"):
        kv.cache_blocks("a", a + [0], 11)


def test_caching_disabled_never_hits():
    kv = KVCacheManager(10, BS, enable_prefix_caching=False)
    a = toks(10)
    prefill(kv, "a", a)
    kv.free("a")
    assert kv.get_computed_blocks("b", a) == 0
    assert kv.prefix_cache_stats.queries == 0 and kv.pool.cached == {}


def test_fork_shares_blocks_and_copy_on_write_records_the_copy():
    kv = KVCacheManager(10, BS)
    parent = toks(6)
    prefill(kv, "p", parent)
    kv.fork("p", "c")
    assert kv.block_table("c") == [1, 2] and refs(kv, 1, 2) == [2, 2]
    assert kv.num_computed_tokens("c") == 6
    child = parent + [50]
    compute(kv, "c", child, 1)  # writes into the shared partial block 2: copy it first
    assert kv.block_table("c") == [1, 3] and kv.block_table("p") == [1, 2]
    assert refs(kv, 1, 2, 3) == [2, 1, 1]
    assert kv.take_pending_copies() == [(2, 3)]
    assert kv.take_pending_copies() == []
    parent.append(60)
    compute(kv, "p", parent, 1)  # block 2 is its own now: no copy
    assert kv.block_table("p") == [1, 2] and kv.take_pending_copies() == []
    with pytest.raises(ValueError, match="already exists"):
        kv.fork("p", "c")
    kv.free("p")
    kv.free("c")
    assert kv.num_free_blocks == 9


def test_fork_at_a_block_boundary_needs_no_copy():
    kv = KVCacheManager(10, BS)
    parent = toks(8)
    prefill(kv, "p", parent)
    kv.fork("p", "c")
    compute(kv, "c", parent + [1], 1)
    compute(kv, "p", parent + [2], 1)
    assert kv.block_table("c") == [1, 2, 3] and kv.block_table("p") == [1, 2, 4]
    assert refs(kv, 1, 2, 3, 4) == [2, 2, 1, 1] and kv.take_pending_copies() == []


def test_not_enough_blocks_returns_false_and_changes_nothing():
    kv = KVCacheManager(5, BS)
    parent = toks(6)
    prefill(kv, "p", parent)
    kv.fork("p", "c")
    prefill(kv, "b", toks(8, start=300))
    assert kv.num_free_blocks == 0
    child = parent + [1]
    assert not kv.can_allocate("c", 7)
    assert not kv.allocate_slots("c", child, 1)  # copy-on-write needs a block
    assert kv.block_table("c") == [1, 2] and kv.num_computed_tokens("c") == 6
    assert refs(kv, 1, 2) == [2, 2] and kv.take_pending_copies() == []
    assert not kv.allocate_slots("new", toks(3), 3)
    assert kv.block_table("new") == [] and kv.num_computed_tokens("new") == 0
    kv.free("b")
    assert kv.allocate_slots("c", child, 1)
    assert kv.block_table("c") == [1, 4] and kv.take_pending_copies() == [(2, 4)]


def test_free_is_idempotent_and_gives_back_every_block():
    kv = KVCacheManager(6, BS)
    prefill(kv, "a", toks(9))
    kv.free("a")
    kv.free("a")
    kv.free("never-seen")
    assert kv.num_free_blocks == 5 and free_ids(kv) == [4, 5, 3, 2, 1]
    kv.get_computed_blocks("b", toks(9))
    with pytest.raises(ValueError, match="already holds blocks"):
        kv.get_computed_blocks("b", toks(9))


def test_sliding_window_frees_blocks_out_of_the_window():
    kv = KVCacheManager(8, BS, sliding_window=6)
    tokens = toks(12)
    prefill(kv, "a", tokens)
    assert kv.block_table("a") == [1, 2, 3]
    tables = []
    for _ in range(6):  # tokens 13 .. 18
        tokens.append(0)
        compute(kv, "a", tokens, 1)
        tables.append(kv.block_table("a"))
    # the query at position 12 sees 7..12: block 0 is dead; at 13 it sees 8..13: block 1 too;
    # at 17 it sees 12..17: block 2 too
    assert tables == [[0, 2, 3, 4], [0, 0, 3, 4], [0, 0, 3, 4], [0, 0, 3, 4], [0, 0, 3, 4, 5], [0, 0, 0, 4, 5]]
    assert free_ids(kv) == [6, 7, 1, 2, 3]
    assert kv.pool.blocks[1].block_hash is not None  # freed, still cached until evicted


def test_sliding_window_frees_dead_blocks_before_asking_for_new_ones():
    kv = KVCacheManager(5, BS, sliding_window=4)
    tokens = toks(16)
    prefill(kv, "a", tokens)
    assert kv.num_free_blocks == 0
    assert kv.can_allocate("a", 17)
    compute(kv, "a", tokens + [0], 1)
    assert kv.block_table("a") == [0, 0, 0, 4, 3] and free_ids(kv) == [2, 1]


@pytest.mark.parametrize("window, table_a, hit, table_b", [
    # sliding: blocks 0 and 1 died early, so x evicts them; the window before 20 (15..19) is still cached
    (6, [0, 0, 3, 4, 5], 20, [0, 0, 0, 4, 5]),
    # full attention: a's tail blocks are evicted first, the hit is the head that survived
    (None, [1, 2, 3, 4, 5], 12, [1, 2, 3]),
])
def test_sliding_window_hit_needs_only_the_window(window, table_a, hit, table_b):
    kv = KVCacheManager(8, BS, sliding_window=window)
    a = toks(20)
    kv.get_computed_blocks("a", a)
    for n in (8, 8, 4):
        compute(kv, "a", a, n)
    assert kv.block_table("a") == table_a
    kv.free("a")
    prefill(kv, "x", toks(16, start=900))  # takes 4 of the 7 free blocks
    assert kv.get_computed_blocks("b", a + [1]) == hit
    assert kv.block_table("b") == table_b
    kv.free("x")
    compute(kv, "b", a + [1], 21 - hit)
    assert kv.block_table("b")[:len(table_b)] == table_b


def test_coordinator_takes_the_minimum_hit_over_groups():
    full, sliding = KVCacheManager(16, BS), KVCacheManager(16, BS, sliding_window=6)
    a = toks(20)
    prefill(full, "warm", a)  # the full group has all of a cached
    prefill(sliding, "warm", a[:12])  # the sliding group only its first 12 tokens
    full.free("warm")
    sliding.free("warm")
    coord = KVCacheCoordinator([full, sliding])
    assert full.find_longest_cache_hit(a + [1]) == 20 and sliding.find_longest_cache_hit(a + [1]) == 12
    assert coord.get_computed_blocks("b", a + [1]) == 12
    assert coord.block_table("b") == [[1, 2, 3], [0, 2, 3]]
    assert coord.num_computed_tokens("b") == 12
    assert coord.allocate_slots("b", a + [1], 9)
    assert coord.block_table("b") == [[1, 2, 3, 6, 7, 8], [0, 2, 3, 4, 5, 6]]
    assert coord.prefix_cache_stats.hits == 12
    coord.free("b")
    assert coord.block_table("b") == [[], []] and coord.num_free_blocks == 15


def test_coordinator_hit_is_a_common_fixed_point_across_block_sizes():
    full, sliding = KVCacheManager(16, 4), KVCacheManager(16, 8, sliding_window=6)
    a = toks(20)
    prefill(full, "warm", a[:12])  # full: 12 tokens (3 blocks of 4)
    prefill(sliding, "warm", a[:17])  # sliding: 16 tokens (2 blocks of 8)
    coord = KVCacheCoordinator([full, sliding])
    # round 1: min(12, 16) = 12; round 2: the sliding group at <= 12 gives 8; round 3: both give 8
    assert coord.get_computed_blocks("b", a) == 8
    assert coord.block_table("b") == [[1, 2], [1]]


def test_coordinator_admits_only_if_every_group_can_allocate():
    coord = KVCacheCoordinator([KVCacheManager(16, BS), KVCacheManager(3, BS, sliding_window=6)])
    tokens = toks(12)
    assert coord.get_computed_blocks("a", tokens) == 0
    assert not coord.can_allocate("a", 12)
    assert not coord.allocate_slots("a", tokens, 12)
    assert coord.block_table("a") == [[], []] and coord.num_computed_tokens("a") == 0
    assert [g.num_free_blocks for g in coord.groups] == [15, 2]
    assert coord.allocate_slots("a", tokens, 8)
    assert coord.block_table("a") == [[1, 2], [1, 2]] and coord.usage == 1.0
    coord.fork("a", "b")
    assert coord.take_pending_copies() == [[], []]
    coord.free("a")
    coord.free("b")
    assert [g.num_free_blocks for g in coord.groups] == [15, 2]
    assert coord.reset_prefix_cache()


# ---- property test: random workloads against a simple model ----

NUM_BLOCKS = 10
PREFIXES = ([], [0, 1, 2, 0, 1, 2, 0, 1], [0, 1, 2, 0, 1, 2, 0, 1, 2, 2, 2, 1], [1] * 9)
tokens_st = st.lists(st.integers(0, 2), max_size=8)


@dataclass
class ModelSeq:
    tokens: list[int]
    salt: str | None
    num_computed: int
    num_offered: int
    """Blocks [0, num_offered) were offered to the cache (each block once, when it filled)."""


class KVCacheMachine(RuleBasedStateMachine):
    """Plays scheduler and runner. The fake KV store holds, in each slot, the identity of the
    token written there: (salt, all tokens up to and including it). Every step reads back what
    the step's queries attend to, so a wrong hit, a block overwritten by another sequence or a
    bad copy-on-write shows up as a wrong read."""

    sliding_window: int | None = None

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BS, sliding_window=self.sliding_window)
        self.seqs: dict[str, ModelSeq] = {}
        self.store = {b: [None] * BS for b in range(NUM_BLOCKS)}
        self.cached: dict[tuple, int] = {}
        """The model's prefix cache: (salt, tokens of a full-block prefix) -> block id."""
        self.ids = 0

    # -- the reference --

    def first_visible(self, num_tokens: int) -> int:
        w = self.sliding_window
        return 0 if w is None else max(num_tokens - w + 1, 0) // BS

    def key(self, salt, tokens, end):
        return (salt, tuple(tokens[:end]))

    def reference_hit(self, tokens, salt) -> tuple[int, list[int]]:
        best = 0
        for k in range(1, (len(tokens) - 1) // BS + 1):
            if all(self.key(salt, tokens, (i + 1) * BS) in self.cached
                   for i in range(self.first_visible(k * BS), k)):
                best = k
        first = self.first_visible(best * BS)
        table = [0] * first + [self.cached[self.key(salt, tokens, (i + 1) * BS)] for i in range(first, best)]
        return best * BS, table

    def snapshot(self):
        pool = self.kv.pool
        return ({s: self.kv.block_table(s) for s in self.seqs}, [b.ref_count for b in pool.blocks],
                [b.block_id for b in pool.free_queue], dict(pool.cached), list(self.kv._pending_copies))

    # -- driving --

    def new_id(self) -> str:
        self.ids += 1
        return f"s{self.ids}"

    def step(self, sid: str, n: int, cache: bool) -> bool:
        seq, kv = self.seqs[sid], self.kv
        before = self.snapshot()
        old_table = kv.block_table(sid)
        if not kv.allocate_slots(sid, seq.tokens, n):
            assert self.snapshot() == before
            return False
        table = kv.block_table(sid)
        nc, total = seq.num_computed, seq.num_computed + n
        assert len(table) == -(-total // BS)
        assert table[:self.first_visible(nc)] == [0] * self.first_visible(nc)
        changed = [i for i in range(len(table)) if i >= len(old_table) or table[i] != old_table[i]]
        died = {old_table[i] for i in changed if i < len(old_table) and table[i] == 0}
        for bid in {table[i] for i in changed} - {0}:  # fresh from the pool: loses its hash
            # it was free, or it is this sequence's own block that fell out of the window just now
            assert before[1][bid] == 0 or (bid in died and before[1][bid] == 1)
            self.cached = {k: b for k, b in self.cached.items() if b != bid}
        for src, dst in self.kv.take_pending_copies():
            assert old_table[table.index(dst)] == src
            self.store[dst] = list(self.store[src])
        for p in range(nc, total):
            self.store[table[p // BS]][p % BS] = self.key(seq.salt, seq.tokens, p + 1)
        lo = 0 if self.sliding_window is None else max(nc - self.sliding_window + 1, 0)
        for p in range(lo, total):
            assert table[p // BS] != 0
            assert self.store[table[p // BS]][p % BS] == self.key(seq.salt, seq.tokens, p + 1), p
        seq.num_computed = total
        if cache:
            kv.cache_blocks(sid, seq.tokens, total)
            for i in range(seq.num_offered, total // BS):
                key = self.key(seq.salt, seq.tokens, (i + 1) * BS)
                if table[i] != 0 and key not in self.cached and table[i] not in self.cached.values():
                    self.cached[key] = table[i]
            seq.num_offered = max(seq.num_offered, total // BS)
        return True

    # -- rules --

    @precondition(lambda self: len(self.seqs) < 6)
    @rule(prefix=st.sampled_from(PREFIXES), suffix=tokens_st, salt=st.sampled_from([None, "t"]),
          chunk=st.integers(1, 24), cache=st.booleans())
    def admit(self, prefix, suffix, salt, chunk, cache):
        tokens = (prefix + suffix) or [0]
        sid = self.new_id()
        expected_hit, expected_table = self.reference_hit(tokens, salt)
        assert self.kv.get_computed_blocks(sid, tokens, salt) == expected_hit
        assert self.kv.block_table(sid) == expected_table
        self.seqs[sid] = ModelSeq(list(tokens), salt, expected_hit, expected_hit // BS)
        if not self.step(sid, min(chunk, len(tokens) - expected_hit), cache):
            self.kv.free(sid)  # not admitted: give the hit back
            del self.seqs[sid]

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), token=st.integers(0, 2), cache=st.booleans(), preempt=st.booleans())
    def run(self, data, token, cache, preempt):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        seq = self.seqs[sid]
        if seq.num_computed == len(seq.tokens):
            seq.tokens.append(token)  # decoding: the token sampled last step
        n = data.draw(st.integers(1, len(seq.tokens) - seq.num_computed))
        if not self.step(sid, n, cache) and preempt:
            self.kv.free(sid)
            del self.seqs[sid]

    @precondition(lambda self: self.seqs and len(self.seqs) < 6)
    @rule(data=st.data())
    def fork(self, data):
        pid = data.draw(st.sampled_from(sorted(self.seqs)))
        parent, cid = self.seqs[pid], self.new_id()
        self.kv.fork(pid, cid)
        self.seqs[cid] = ModelSeq(parent.tokens[:parent.num_computed], parent.salt, parent.num_computed,
                                  parent.num_offered)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def finish_or_abort(self, data):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        self.kv.free(sid)
        self.kv.free(sid)
        del self.seqs[sid]

    @rule()
    def reset_prefix_cache(self):
        assert self.kv.reset_prefix_cache() == (not self.seqs)
        if not self.seqs:
            self.cached.clear()

    # -- invariants --

    @invariant()
    def ref_counts_match_tables_and_nothing_leaks(self):
        pool = self.kv.pool
        held = Counter(b for s in self.seqs for b in self.kv.block_table(s) if b != 0)
        assert [b.ref_count for b in pool.blocks] == [0] + [held[i] for i in range(1, NUM_BLOCKS)]
        queue = [b.block_id for b in pool.free_queue]
        assert len(queue) == len(set(queue)) == len(pool.free_queue) == self.kv.num_free_blocks
        assert set(queue) == {i for i in range(1, NUM_BLOCKS) if held[i] == 0}
        for sid, seq in self.seqs.items():
            assert self.kv.num_computed_tokens(sid) == seq.num_computed

    @invariant()
    def prefix_cache_matches_the_model(self):
        pool = self.kv.pool
        assert sorted(b.block_id for b in pool.cached.values()) == sorted(self.cached.values())
        assert all(block.block_hash == h for h, block in pool.cached.items())
        for (salt, tokens), bid in self.cached.items():
            h = None
            for i in range(0, len(tokens), BS):
                h = hash_block(h, tokens[i:i + BS], salt)
            assert pool.get_cached_block(h).block_id == bid

    def teardown(self):
        for sid in list(self.seqs):
            self.kv.free(sid)
        self.seqs.clear()
        self.ref_counts_match_tables_and_nothing_leaks()
        assert self.kv.num_free_blocks == NUM_BLOCKS - 1


class SlidingWindowMachine(KVCacheMachine):
    sliding_window = 6


TestKVCacheManagerModel = KVCacheMachine.TestCase
TestKVCacheManagerModel.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestSlidingWindowModel = SlidingWindowMachine.TestCase
TestSlidingWindowModel.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
