"""BlockPool and its free queue: exact block ids, LRU eviction order, cache hits and evictions."""

from __future__ import annotations

import pytest

from tokenmill.engine.block_pool import Block, BlockPool, FreeBlockQueue, hash_block


def free_ids(pool: BlockPool) -> list[int]:
    return [block.block_id for block in pool.free_queue]


def ids(blocks: list[Block]) -> list[int]:
    return [block.block_id for block in blocks]


def test_fresh_pool_hands_out_blocks_in_id_order_and_never_the_null_block():
    pool = BlockPool(6, enable_caching=True)
    assert free_ids(pool) == [1, 2, 3, 4, 5]
    assert pool.num_free_blocks == 5 and pool.usage == 0.0
    assert ids(pool.get_new_blocks(2)) == [1, 2]
    assert ids(pool.get_new_blocks(3)) == [3, 4, 5]
    assert pool.usage == 1.0
    with pytest.raises(ValueError, match="cannot allocate 1 blocks: 0 free"):
        pool.get_new_blocks(1)
    assert pool.null_block.block_id == 0 and pool.null_block.ref_count == 0
    assert pool.null_block.prev_free is None


def test_pool_needs_a_block_besides_the_null_block():
    with pytest.raises(ValueError, match="num_blocks must be >= 2"):
        BlockPool(1, enable_caching=True)


def test_eviction_order_is_least_recently_freed_first_and_tail_blocks_before_head():
    pool = BlockPool(8, enable_caching=True)
    seq_a = pool.get_new_blocks(3)  # 1 2 3
    seq_b = pool.get_new_blocks(2)  # 4 5
    assert free_ids(pool) == [6, 7]
    pool.free_blocks(reversed(seq_a))
    pool.free_blocks(reversed(seq_b))
    assert free_ids(pool) == [6, 7, 3, 2, 1, 5, 4]
    assert ids(pool.get_new_blocks(7)) == [6, 7, 3, 2, 1, 5, 4]


def test_shared_block_is_freed_only_by_its_last_holder():
    pool = BlockPool(4, enable_caching=True)
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])
    assert block.ref_count == 2
    pool.free_blocks([block])
    assert block.ref_count == 1 and 1 not in free_ids(pool)
    pool.free_blocks([block])
    assert free_ids(pool) == [2, 3, 1]
    with pytest.raises(RuntimeError, match="block 1 freed with ref_count 0"):
        pool.free_blocks([block])


def test_free_queue_removes_from_the_middle_head_and_tail_in_constant_time():
    blocks = [Block(i) for i in range(1, 6)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    assert [b.block_id for b in queue] == [1, 2, 4, 5] and len(queue) == 4
    assert blocks[2].prev_free is None and blocks[2].next_free is None
    assert blocks[1].next_free is blocks[3] and blocks[3].prev_free is blocks[1]
    queue.remove(blocks[0])
    queue.remove(blocks[4])
    assert [b.block_id for b in queue] == [2, 4]
    queue.append(blocks[2])
    assert queue.popleft() is blocks[1]
    assert [b.block_id for b in queue] == [4, 3] and len(queue) == 2
    with pytest.raises(RuntimeError, match="not in the free queue"):
        queue.remove(blocks[0])
    with pytest.raises(RuntimeError, match="already in the free queue"):
        queue.append(blocks[3])
    queue.popleft(), queue.popleft()
    with pytest.raises(IndexError):
        queue.popleft()


def test_cache_hit_on_a_free_cached_block_takes_it_out_of_the_free_queue():
    pool = BlockPool(6, enable_caching=True)
    blocks = pool.get_new_blocks(3)  # 1 2 3
    h = hash_block(None, (1, 2, 3, 4), None)
    assert pool.cache_block(blocks[1], h)
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [4, 5, 3, 2, 1]
    hit = pool.get_cached_block(h)
    assert hit is blocks[1] and hit.ref_count == 0
    pool.touch([hit])
    assert hit.ref_count == 1 and free_ids(pool) == [4, 5, 3, 1] and pool.num_free_blocks == 4
    pool.free_blocks([hit])
    assert free_ids(pool) == [4, 5, 3, 1, 2]  # back at the tail: most recently used
    assert pool.get_cached_block(h) is hit and hit.block_hash == h


def test_popping_a_cached_block_evicts_it():
    pool = BlockPool(3, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    h = hash_block(None, (7, 7), None)
    pool.cache_block(a, h)
    pool.free_blocks([b, a])
    assert free_ids(pool) == [2, 1]
    assert ids(pool.get_new_blocks(1)) == [2]
    assert pool.get_cached_block(h) is a
    assert ids(pool.get_new_blocks(1)) == [1]
    assert pool.get_cached_block(h) is None and a.block_hash is None and pool.cached == {}


def test_second_block_with_a_cached_hash_stays_uncached():
    pool = BlockPool(4, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    h = hash_block(None, (1, 2), "tenant")
    assert pool.cache_block(a, h)
    assert pool.cache_block(a, h)  # again: no-op
    assert not pool.cache_block(b, h)
    assert b.block_hash is None and pool.get_cached_block(h) is a
    with pytest.raises(RuntimeError, match="already cached under another hash"):
        pool.cache_block(a, h + 1)
    pool.free_blocks([b])
    with pytest.raises(RuntimeError, match="only a held block can be cached"):
        pool.cache_block(b, h + 1)


def test_null_block_is_ignored_by_touch_free_and_cache():
    pool = BlockPool(3, enable_caching=True)
    pool.touch([pool.null_block])
    pool.free_blocks([pool.null_block, pool.null_block])
    assert not pool.cache_block(pool.null_block, 5)
    assert pool.null_block.ref_count == 0 and free_ids(pool) == [1, 2]


def test_caching_disabled_caches_nothing():
    pool = BlockPool(3, enable_caching=False)
    (a,) = pool.get_new_blocks(1)
    assert not pool.cache_block(a, 123)
    assert pool.get_cached_block(123) is None and a.block_hash is None


def test_reset_prefix_cache_waits_until_nothing_is_held():
    pool = BlockPool(4, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, 11)
    pool.cache_block(b, 22)
    pool.free_blocks([b])
    assert not pool.reset_prefix_cache()
    assert pool.get_cached_block(22) is b
    pool.free_blocks([a])
    assert pool.reset_prefix_cache()
    assert pool.cached == {} and a.block_hash is None and b.block_hash is None
    assert free_ids(pool) == [3, 2, 1]


def test_hash_chain_depends_on_parent_tokens_and_salt():
    h0 = hash_block(None, (1, 2, 3, 4), None)
    assert h0 == hash_block(None, (1, 2, 3, 4), None)
    assert h0 != hash_block(None, (1, 2, 3, 5), None)
    assert h0 != hash_block(None, (1, 2, 3, 4), "tenant-a")
    assert hash_block(None, (1, 2, 3, 4), "tenant-a") != hash_block(None, (1, 2, 3, 4), "tenant-b")
    h1 = hash_block(h0, (5, 6, 7, 8), None)
    assert h1 != hash_block(hash_block(None, (9, 9, 9, 9), None), (5, 6, 7, 8), None)
    assert h1 != hash_block(None, (5, 6, 7, 8), None)
