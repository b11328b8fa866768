"""Block tables over a BlockPool: prefix-cache hits, copy-on-write forks, sliding-window freeing.

A block table maps a sequence's token positions to KV slots: position p lives in block
``table[p // block_size]``, slot ``p % block_size``. With block_size 4 and 10 tokens::

    tokens   a b c d | e f g h | i j
    table    [  5    ,   9     ,  2  ]      token j: block 2, slot 1
             full     full      partial: never cached, never shared except by fork

How the scheduler and the engine drive it, step by step::

    admit     hit = get_computed_blocks(seq_id, token_ids, salt)   # seq.num_computed_tokens = hit
              allocate_slots(seq_id, token_ids, n)                 # False: free(seq_id), retry later
    running   allocate_slots(seq_id, token_ids, n)                 # False: preempt someone, retry
    runner    copies = take_pending_copies()                       # do them before the forward pass
    after     cache_blocks(seq_id, token_ids, num_computed_tokens) # blocks that became full enter the cache
    finished  free(seq_id)                                         # also abort and preempt-by-recompute

``num_computed_tokens`` is tracked here too, in step with the scheduler's own count on the
Sequence: get_computed_blocks sets it to the hit, and allocate_slots advances it by
``num_new_tokens`` (the scheduler has committed to computing them this step). That is the
number allocate_slots builds on, so the scheduler need not pass it.

Blocks enter the prefix cache only in cache_blocks, called after the forward pass wrote
their KV. A block can therefore never be a cache hit before it holds its KV (not even for
another sequence admitted in the same step, nor after a step that failed). Without
cache_blocks calls nothing is ever cached: everything else works, there are just no hits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from tokenmill.engine.block_pool import PROCESS_HASHER, Block, BlockHasher, BlockPool
from tokenmill.engine.config import CacheConfig


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups, counted in prompt tokens (for metrics)."""

    queries: int = 0
    """Tokens looked up (the full length of each token list passed to get_computed_blocks)."""
    hits: int = 0
    """Tokens found computed."""

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass(slots=True)
class _SeqBlocks:
    """One sequence's blocks and hashes."""

    blocks: list[Block] = field(default_factory=list)
    """The block table; blocks[:num_null_blocks] are the null block (outside the sliding window)."""
    block_hashes: list[int] = field(default_factory=list)
    """Chained hash of each full block known so far (index i: block i); may run ahead of blocks."""
    num_computed_tokens: int = 0
    num_cached_blocks: int = 0
    """Blocks [0, num_cached_blocks) have been offered to the prefix cache."""
    num_null_blocks: int = 0
    salt: str | None = None


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Block tables for one group of layers that share them (one pool).

    Invariants (enforced here and checked by the property tests):
      - a block's ref_count equals the number of block tables holding it;
      - a table covers exactly its sequence's num_computed_tokens:
        ``len(blocks) == ceil(num_computed_tokens / block_size)``;
      - block i is cached only if it is full and its hash is the chain over tokens
        [0, (i + 1) * block_size) and the salt;
      - a block shared by several tables is either full (never written again) or was shared
        by fork; a sequence about to write into a shared block first gets its own copy
        (copy-on-write), so no sequence ever writes into a block another one reads;
      - with a sliding window, the table's first num_null_blocks entries are the null block
        and no query that is still to come attends to them.

    A sliding window of W tokens means a query at position p attends to positions
    ``p - W + 1 .. p`` (itself included, as in HF's Gemma 3 and Mistral). Once the next query
    is at position ``num_computed_tokens``, blocks ending before ``num_computed_tokens - W + 1``
    are dead; allocate_slots frees them. W = 6, block_size 4, 13 tokens computed::

        positions   0-3    4-7    8-11   12-15
        table      [ 0 ,    0 ,     7 ,     3 ]     next query 13 sees 8..13
                    null   null
    """

    def __init__(self, num_blocks: int, block_size: int,
                 enable_prefix_caching: bool = CacheConfig.enable_prefix_caching,
                 sliding_window: int | None = None, hasher: BlockHasher = PROCESS_HASHER) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.enable_prefix_caching = enable_prefix_caching
        self.hasher = hasher
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self._null = self.pool.null_block
        self._seqs: dict[str, _SeqBlocks] = {}
        self._pending_copies: list[tuple[int, int]] = []
        self._stats = PrefixCacheStats()

    # ---- reading ----

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """A snapshot of the counters since construction."""
        return replace(self._stats)

    def block_table(self, seq_id: str) -> list[int]:
        """Block ids, position p in ``table[p // block_size]``; 0 is the null block. [] if unknown."""
        seq = self._seqs.get(seq_id)
        return [block.block_id for block in seq.blocks] if seq else []

    def num_computed_tokens(self, seq_id: str) -> int:
        """Tokens computed or scheduled this step, as this manager counts them; 0 if unknown."""
        seq = self._seqs.get(seq_id)
        return seq.num_computed_tokens if seq else 0

    # ---- prefix cache ----

    def find_longest_cache_hit(self, token_ids: Sequence[int], salt: str | None = None,
                               max_hit_tokens: int | None = None) -> int:
        """Tokens get_computed_blocks would report, without recording anything."""
        if not self.enable_prefix_caching:
            return 0
        max_blocks = self._max_hit_blocks(token_ids, max_hit_tokens)
        hashes = self._extend_hashes([], token_ids, salt, max_blocks)
        return self._find_hit(hashes, max_blocks)[0] * self.block_size

    def get_computed_blocks(self, seq_id: str, token_ids: Sequence[int], salt: str | None = None,
                            max_hit_tokens: int | None = None) -> int:
        """Start a sequence on the longest cached prefix of full blocks of ``token_ids``.

        The hit blocks become the sequence's first blocks (touched, so they cannot be evicted)
        and the returned number of tokens counts as computed. The whole list is never a hit:
        the last token must run through the model to give logits, so the hit is at most
        ``len(token_ids) - 1`` rounded down to a block boundary (and at most max_hit_tokens,
        which KVCacheCoordinator uses). With a sliding window a hit only needs the blocks
        covering the last ``sliding_window - 1`` tokens before it; earlier entries are null.
        The salt is remembered for the blocks this sequence caches later.

        If the following allocate_slots fails, free(seq_id) gives the hit blocks back."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already holds blocks; free it first")
        seq = _SeqBlocks(salt=salt)
        self._seqs[seq_id] = seq
        if not self.enable_prefix_caching:
            return 0
        self._extend_hashes(seq.block_hashes, token_ids, salt, len(token_ids) // self.block_size)
        num_hit, first = self._find_hit(seq.block_hashes, self._max_hit_blocks(token_ids, max_hit_tokens))
        hit_blocks = [self.pool.get_cached_block(h) for h in seq.block_hashes[first:num_hit]]
        self.pool.touch(hit_blocks)
        seq.blocks = [self._null] * first + hit_blocks
        seq.num_null_blocks = first
        seq.num_cached_blocks = num_hit
        seq.num_computed_tokens = num_hit * self.block_size
        self._stats.queries += len(token_ids)
        self._stats.hits += seq.num_computed_tokens
        return seq.num_computed_tokens

    def cache_blocks(self, seq_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Enter the sequence's blocks that are full within its first ``num_computed_tokens``
        tokens (their KV written) into the prefix cache. Call it after each forward pass with
        the sequence's updated count. A no-op for an unknown (freed, aborted) sequence."""
        seq = self._seqs.get(seq_id)
        if seq is None or not self.enable_prefix_caching:
            return
        if num_computed_tokens > seq.num_computed_tokens:
            raise ValueError(f"sequence {seq_id!r}: {num_computed_tokens} tokens computed, but only "
                             f"{seq.num_computed_tokens} were allocated")
        num_full = num_computed_tokens // self.block_size
        if num_full <= seq.num_cached_blocks:
            return
        self._extend_hashes(seq.block_hashes, token_ids, seq.salt, num_full)
        for i in range(seq.num_cached_blocks, num_full):
            self.pool.cache_block(seq.blocks[i], seq.block_hashes[i])  # null block: ignored
        seq.num_cached_blocks = num_full

    def reset_prefix_cache(self) -> bool:
        """Forget all cached blocks; False (and nothing done) while any sequence holds blocks."""
        return self.pool.reset_prefix_cache()

    # ---- allocation ----

    def can_allocate(self, seq_id: str, num_tokens_total: int) -> bool:
        """Whether allocate_slots could make the table cover ``num_tokens_total`` tokens now."""
        seq = self._seqs.get(seq_id) or _SeqBlocks()
        return self._num_blocks_short(seq, num_tokens_total) <= 0

    def allocate_slots(self, seq_id: str, token_ids: Sequence[int], num_new_tokens: int) -> bool:
        """Make the table cover ``num_computed_tokens + num_new_tokens`` tokens and count them
        as computed (the caller computes them this step).

        In order: blocks that fell out of the sliding window are freed (null in the table); a
        shared block the new tokens are written into is replaced by a fresh one, with a
        pending copy (old id, new id) when it already holds KV; new blocks are appended.
        Returns False and changes nothing when the pool cannot supply the blocks.
        ``token_ids`` is the sequence's token list; it must hold the tokens being computed."""
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        seq = self._seqs.get(seq_id) or _SeqBlocks()
        total = seq.num_computed_tokens + num_new_tokens
        if total > len(token_ids):
            raise ValueError(f"sequence {seq_id!r}: cannot compute {total} tokens of {len(token_ids)}")
        if self._num_blocks_short(seq, total) > 0:
            return False
        self._seqs[seq_id] = seq
        self._free_outside_window(seq)
        self._copy_on_write(seq, total)
        missing = _cdiv(total, self.block_size) - len(seq.blocks)
        if missing > 0:
            seq.blocks.extend(self.pool.get_new_blocks(missing))
        seq.num_computed_tokens = total
        return True

    def uncount(self, seq_id: str, num_tokens: int) -> None:
        """Count the sequence's tokens back to ``num_tokens``, keeping every block and what was
        written in them: a draft wrote the KV of tokens past them, which the step that verifies the
        draft allocates again (the same blocks) and reuses. A no-op for an unknown sequence."""
        self._count_back(seq_id, num_tokens, keep_blocks=True)

    def truncate(self, seq_id: str, num_tokens: int) -> None:
        """Forget the sequence's tokens from ``num_tokens`` on (rejected draft tokens): its count
        goes back to ``num_tokens`` and the blocks past them return to the pool. Tokens already
        offered to the prefix cache cannot be dropped (cache_blocks runs after verification, so a
        rejected token never is). A no-op for an unknown (freed, aborted) sequence."""
        self._count_back(seq_id, num_tokens, keep_blocks=False)

    def _count_back(self, seq_id: str, num_tokens: int, keep_blocks: bool) -> None:
        seq = self._seqs.get(seq_id)
        if seq is None:
            return
        if not seq.num_cached_blocks * self.block_size <= num_tokens <= seq.num_computed_tokens:
            raise ValueError(f"sequence {seq_id!r}: cannot {'count back' if keep_blocks else 'truncate'} to "
                             f"{num_tokens} tokens (computed {seq.num_computed_tokens}, cached "
                             f"{seq.num_cached_blocks * self.block_size})")
        keep = _cdiv(num_tokens, self.block_size)
        if not keep_blocks and keep < len(seq.blocks):
            tail = seq.blocks[keep:]
            del seq.blocks[keep:]
            self.pool.free_blocks(reversed(tail))
        seq.num_computed_tokens = num_tokens

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child shares every parent block (for n > 1 samples of one prompt). Whichever of
        the two first writes into a shared partial block gets its own copy then (see
        allocate_slots and take_pending_copies)."""
        parent = self._seqs[parent_id]
        if child_id in self._seqs:
            raise ValueError(f"sequence {child_id!r} already exists")
        num_full = parent.num_computed_tokens // self.block_size  # later tokens may differ in the child
        child = _SeqBlocks(blocks=list(parent.blocks), block_hashes=parent.block_hashes[:num_full],
                           num_computed_tokens=parent.num_computed_tokens,
                           num_cached_blocks=parent.num_cached_blocks,
                           num_null_blocks=parent.num_null_blocks, salt=parent.salt)
        self.pool.touch(child.blocks)
        self._seqs[child_id] = child

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """Copy-on-write copies recorded since the last call, as (src block id, dst block id).

        The runner must copy every KV slot of src into dst, for every layer of this group, in
        list order, before the forward pass of the step that allocated them (a src block may be
        freed and handed out again in that same step; its new owner writes it only during the
        forward pass). Call it once per step."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def free(self, seq_id: str) -> None:
        """Give back all the sequence's blocks, tail first (evicted first). Idempotent."""
        seq = self._seqs.pop(seq_id, None)
        if seq is not None:
            self.pool.free_blocks(reversed(seq.blocks))

    # ---- internals ----

    def _extend_hashes(self, hashes: list[int], token_ids: Sequence[int], salt: str | None,
                       num_blocks: int) -> list[int]:
        """Append the chained hashes of full blocks len(hashes) .. num_blocks - 1."""
        return self.hasher.extend(hashes, token_ids, self.block_size, salt, num_blocks)

    def _max_hit_blocks(self, token_ids: Sequence[int], max_hit_tokens: int | None) -> int:
        limit = len(token_ids) - 1
        if max_hit_tokens is not None:
            limit = min(limit, max_hit_tokens)
        return max(limit, 0) // self.block_size

    def _first_visible_block(self, num_tokens: int) -> int:
        """First block a query at position num_tokens can attend to (all blocks before it are dead)."""
        if self.sliding_window is None:
            return 0
        return max(num_tokens - self.sliding_window + 1, 0) // self.block_size

    def _find_hit(self, hashes: list[int], max_blocks: int) -> tuple[int, int]:
        """(k, first): the largest k <= max_blocks whose needed blocks [first, k) are all cached.

        Full attention needs every block before the hit; a sliding window only those the
        next query (position k * block_size) can see. One pass, tracking the run of
        consecutive cached blocks ending at block i."""
        best, run = 0, 0
        for i in range(min(max_blocks, len(hashes))):
            if self.pool.get_cached_block(hashes[i]) is None:
                if self.sliding_window is None:
                    break
                run = 0
                continue
            run += 1
            k = i + 1
            if run >= k - self._first_visible_block(k * self.block_size):
                best = k
        return best, self._first_visible_block(best * self.block_size)

    def _shared_write_targets(self, seq: _SeqBlocks, total: int) -> list[int]:
        """Indices of held blocks that tokens [num_computed, total) are written into and that
        another table also holds."""
        start = seq.num_computed_tokens // self.block_size
        stop = min(len(seq.blocks), _cdiv(total, self.block_size))
        return [i for i in range(start, stop) if seq.blocks[i].ref_count > 1]

    def _num_blocks_short(self, seq: _SeqBlocks, total: int) -> int:
        """Blocks missing from the pool to cover ``total`` tokens (<= 0: enough), counting the
        ones freeing the dead sliding-window blocks would give back."""
        needed = max(_cdiv(total, self.block_size) - len(seq.blocks), 0)
        needed += len(self._shared_write_targets(seq, total))
        dead = seq.blocks[seq.num_null_blocks:self._first_visible_block(seq.num_computed_tokens)]
        returned = sum(1 for block in dead if block.ref_count == 1)
        return needed - self.pool.num_free_blocks - returned

    def _free_outside_window(self, seq: _SeqBlocks) -> None:
        first = self._first_visible_block(seq.num_computed_tokens)
        if first <= seq.num_null_blocks:
            return
        dead = seq.blocks[seq.num_null_blocks:first]
        seq.blocks[seq.num_null_blocks:first] = [self._null] * len(dead)
        seq.num_null_blocks = first
        self.pool.free_blocks(reversed(dead))

    def _copy_on_write(self, seq: _SeqBlocks, total: int) -> None:
        for i in self._shared_write_targets(seq, total):
            shared = seq.blocks[i]
            (own,) = self.pool.get_new_blocks(1)
            if i * self.block_size < seq.num_computed_tokens:
                self._pending_copies.append((shared.block_id, own.block_id))
            self.pool.free_blocks([shared])
            seq.blocks[i] = own


class KVCacheCoordinator:
    """Several KVCacheManagers, one per group of layers with its own block tables (a hybrid
    model such as Gemma 3: one group of global-attention layers, one of sliding-window layers).

    A sequence lives in every group or in none: it is admitted (allocate_slots succeeds) only
    if every group can allocate, its cache hit is the longest one valid in every group, and
    free frees it everywhere. Per-group results (block tables, copies) come as lists indexed
    like ``groups``.
    """

    def __init__(self, groups: list[KVCacheManager]) -> None:
        if not groups:
            raise ValueError("a coordinator needs at least one group")
        self.groups = groups

    @property
    def num_free_blocks(self) -> int:
        """The scarcest group's free blocks."""
        return min(g.num_free_blocks for g in self.groups)

    @property
    def usage(self) -> float:
        """The fullest group's usage."""
        return max(g.usage for g in self.groups)

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Every group records the same (common) hits; the first group's counters."""
        return self.groups[0].prefix_cache_stats

    def block_table(self, seq_id: str) -> list[list[int]]:
        return [g.block_table(seq_id) for g in self.groups]

    def num_computed_tokens(self, seq_id: str) -> int:
        return self.groups[0].num_computed_tokens(seq_id)

    def get_computed_blocks(self, seq_id: str, token_ids: Sequence[int], salt: str | None = None) -> int:
        """The longest hit valid in every group, recorded in every group.

        A sliding-window hit does not stay valid when cut shorter (the window before the
        shorter point may be evicted), so this looks for a common fixed point: each group's
        hit below the current bound, until every group agrees."""
        hit = len(token_ids)
        while True:
            lowest = min(g.find_longest_cache_hit(token_ids, salt, hit) for g in self.groups)
            if lowest == hit:
                break
            hit = lowest
        for g in self.groups:
            g.get_computed_blocks(seq_id, token_ids, salt, max_hit_tokens=hit)
        return hit

    def cache_blocks(self, seq_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        for g in self.groups:
            g.cache_blocks(seq_id, token_ids, num_computed_tokens)

    def can_allocate(self, seq_id: str, num_tokens_total: int) -> bool:
        return all(g.can_allocate(seq_id, num_tokens_total) for g in self.groups)

    def allocate_slots(self, seq_id: str, token_ids: Sequence[int], num_new_tokens: int) -> bool:
        """All groups or none: False, with nothing changed in any group, if one is short."""
        total = self.num_computed_tokens(seq_id) + num_new_tokens
        if not self.can_allocate(seq_id, total):
            return False
        for g in self.groups:
            if not g.allocate_slots(seq_id, token_ids, num_new_tokens):
                raise RuntimeError(f"group could not allocate after can_allocate said it could ({seq_id!r})")
        return True

    def fork(self, parent_id: str, child_id: str) -> None:
        for g in self.groups:
            g.fork(parent_id, child_id)

    def truncate(self, seq_id: str, num_tokens: int) -> None:
        for g in self.groups:
            g.truncate(seq_id, num_tokens)

    def uncount(self, seq_id: str, num_tokens: int) -> None:
        for g in self.groups:
            g.uncount(seq_id, num_tokens)

    def take_pending_copies(self) -> list[list[tuple[int, int]]]:
        return [g.take_pending_copies() for g in self.groups]

    def free(self, seq_id: str) -> None:
        for g in self.groups:
            g.free(seq_id)

    def reset_prefix_cache(self) -> bool:
        return all([g.reset_prefix_cache() for g in self.groups])
