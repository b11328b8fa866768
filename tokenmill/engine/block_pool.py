"""The KV cache's block pool: reference counts, the prefix cache and an O(1) LRU free list.

The KV cache is ``num_blocks`` blocks of ``block_size`` token slots, allocated once. This
module only does the bookkeeping (no tensors): who holds which block, and which full
blocks are remembered for prefix caching.

A block is in one of four states::

    state          ref_count   in the free queue   in the prefix cache
    free           0           yes                 no
    free, cached   0           yes                 yes     touch (a cache hit) → held, cached
    held           >= 1        no                  no      cache_block → held, cached
    held, cached   >= 1        no                  yes

    free_blocks, ref_count reaching 0: held (cached or not) → free (cached or not), at the tail
    get_new_blocks: free (cached or not), from the head → held; a cached block is evicted

The free queue is a doubly linked list threaded through the blocks themselves (vLLM v1's
design), so taking a cached block out of the middle on a cache hit is O(1)::

    head ⇄ [7] ⇄ [3] ⇄ [12] ⇄ [5] ⇄ tail
           ▲                     ▲
           popleft: evicted next append: just freed (most recently used)

Sequences free their blocks in reverse order (tail block first), so a sequence's tail
blocks are evicted before its head blocks, which are the prefixes most worth keeping.

Invariants, enforced here:
  - block 0 is the null block: never handed out, never in the free queue, ref_count stays 0;
  - any other block is in the free queue exactly when its ref_count is 0;
  - ``cached[h] is block`` exactly when ``block.block_hash == h``; a free block keeps its
    hash (it can still be a cache hit) until get_new_blocks pops it, which evicts it;
  - one block per hash: a second block computed with the same content (two sequences that
    prefilled the same prompt in the same step) stays uncached and is freed as a plain block.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

class BlockHasher:
    """The identity of a full block: a hash chained over every token before it, and the salt.

    ::

        tokens   [t0 ........ t15] [t16 ....... t31] [t32 ....... t47] [t48 t49]
        hash     h0 = H(root, t0..t15, salt)
                                   h1 = H(h0, t16..t31, salt)
                                                     h2 = H(h1, t32..t47, salt)
                                                                       partial: no hash

    Equal hashes mean the same tokens from position 0 up to the block's end (and the same
    salt), so the KV the block holds can be reused. The salt (a tenant or cache-isolation
    key) makes a block from another salt a miss even when its tokens agree.

    Collision risk, and the choice made: ``H`` is Python's builtin ``hash`` of a tuple of ints
    (xxHash based, about 61 bits once chained): fast on the hot path. With N cached blocks the
    chance that any two collide is about N**2 / 2**62 (1e-10 at a million blocks); a collision
    would serve one block's KV for another's tokens. The chain starts from a root derived from
    a secret ``key`` and the salt enters as a keyed blake2b digest of it, so a client cannot
    compute hashes to craft a collision on purpose.

    The key is random per process by default. Processes given the same key (``CacheConfig.
    prefix_hash_key``; a scale-out front and its replicas, tokenmill/scaleout/) compute the same
    hashes for the same tokens and salt: Python hashes ints and tuples of ints identically in
    every process of one build (str and bytes hashing is randomized, and ``hash(None)`` is an
    address before Python 3.12: the salt, or its absence, enters as an int), so a router can
    match a request's blocks against a replica's cached ones.
    """

    def __init__(self, key: bytes | str | None = None) -> None:
        key = os.urandom(16) if key is None else key.encode() if isinstance(key, str) else key
        self._key = hashlib.blake2b(key, digest_size=32).digest()  # any length in, blake2b's key size out
        self.root = self._digest(b"root")
        self._salts: dict[str, int] = {}

    def _digest(self, data: bytes) -> int:
        return int.from_bytes(hashlib.blake2b(data, key=self._key, digest_size=8).digest(), "little")

    def salt_id(self, salt: str | None) -> int:
        """The salt as the int that enters the hash (memoized); 0 for none (never ``None`` itself:
        before Python 3.12, ``hash(None)`` is its address, different in every process)."""
        if salt is None:
            return 0
        value = self._salts.get(salt)
        if value is None:
            if len(self._salts) > 65536:
                self._salts.clear()
            value = self._salts[salt] = self._digest(b"salt\0" + salt.encode())
        return value

    def __call__(self, parent_hash: int | None, token_ids: tuple[int, ...], salt: str | None) -> int:
        return hash((self.root if parent_hash is None else parent_hash, token_ids, self.salt_id(salt)))

    def extend(self, hashes: list[int], token_ids: Sequence[int], block_size: int, salt: str | None,
               num_blocks: int) -> list[int]:
        """Append to ``hashes`` (the chain of ``token_ids``' first blocks) the hashes of blocks
        len(hashes) .. num_blocks - 1 -> ``hashes``."""
        salt_id, root = self.salt_id(salt), self.root
        parent = hashes[-1] if hashes else root
        for i in range(len(hashes), num_blocks):
            parent = hash((parent, tuple(token_ids[i * block_size:(i + 1) * block_size]), salt_id))
            hashes.append(parent)
        return hashes

    def chain(self, token_ids: Sequence[int], block_size: int, salt: str | None = None) -> list[int]:
        """The hashes of every full block of ``token_ids``, in order."""
        return self.extend([], token_ids, block_size, salt, len(token_ids) // block_size)


PROCESS_HASHER = BlockHasher()
"""The default hasher: a random key per process (hashes never leave it)."""


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...], salt: str | None) -> int:
    """:class:`BlockHasher` with this process's random key."""
    return PROCESS_HASHER(parent_hash, token_ids, salt)


@dataclass(slots=True, eq=False)
class Block:
    """One block of ``block_size`` KV slots. Compared by identity."""

    block_id: int
    ref_count: int = 0
    """How many block tables hold this block."""
    block_hash: int | None = None
    """Set while the block is in the prefix cache (full, and not evicted)."""
    prev_free: Block | None = field(default=None, repr=False)
    """Free-queue links; both None when the block is not in the queue."""
    next_free: Block | None = field(default=None, repr=False)


class FreeBlockQueue:
    """Doubly linked list of free blocks, threaded through ``prev_free``/``next_free``.

    Two sentinel blocks (id -1) bound it, so no operation has an empty-list special case.
    A block is in the queue exactly when its ``prev_free`` is set.
    """

    def __init__(self, blocks: Iterable[Block] = ()) -> None:
        self._head = Block(-1)
        self._tail = Block(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Block]:
        """Head (evicted next) to tail; for tests and debugging."""
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free

    def popleft(self) -> Block:
        block = self._head.next_free
        if block is self._tail:
            raise IndexError("pop from an empty free block queue")
        self.remove(block)
        return block

    def append(self, block: Block) -> None:
        if block.prev_free is not None:
            raise RuntimeError(f"block {block.block_id} is already in the free queue")
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free, block.next_free = last, self._tail
        self._tail.prev_free = block
        self._len += 1

    def remove(self, block: Block) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None:
            raise RuntimeError(f"block {block.block_id} is not in the free queue")
        prev.next_free, nxt.prev_free = nxt, prev
        block.prev_free = block.next_free = None
        self._len -= 1


class BlockPool:
    """All the blocks of one KV cache group, the free queue and the prefix cache (hash → block)."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.cached: dict[int, Block] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody holds, cached or not: all can be handed out."""
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of the usable blocks (all but the null block) held by some sequence."""
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    def get_new_blocks(self, n: int) -> list[Block]:
        """n blocks from the free-queue head, each with ref_count 1; a cached one is evicted."""
        if n > len(self.free_queue):
            raise ValueError(f"cannot allocate {n} blocks: {len(self.free_queue)} free")
        blocks = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                del self.cached[block.block_hash]
                block.block_hash = None
            block.ref_count = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[Block]) -> None:
        """One more holder for each block; a free one (a cache hit) leaves the free queue."""
        for block in blocks:
            if block is self.null_block:
                continue
            if block.ref_count == 0:
                self.free_queue.remove(block)
            block.ref_count += 1

    def free_blocks(self, blocks: Iterable[Block]) -> None:
        """One holder fewer for each block; one reaching 0 joins the free-queue tail.

        Pass a sequence's blocks in reverse order, so its tail blocks are evicted first."""
        for block in blocks:
            if block is self.null_block:
                continue
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block.block_id} freed with ref_count {block.ref_count}")
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue.append(block)

    def get_cached_block(self, block_hash: int) -> Block | None:
        return self.cached.get(block_hash)

    def cache_block(self, block: Block, block_hash: int) -> bool:
        """Enter a held, full block into the prefix cache; False if caching is off or the hash
        is already cached by another block (which stays the one served)."""
        if not self.enable_caching or block is self.null_block:
            return False
        if block.ref_count == 0:
            raise RuntimeError(f"block {block.block_id} is free; only a held block can be cached")
        if block.block_hash is not None:
            if block.block_hash != block_hash:
                raise RuntimeError(f"block {block.block_id} is already cached under another hash")
            return True
        if block_hash in self.cached:
            return False
        block.block_hash = block_hash
        self.cached[block_hash] = block
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (after a weight update, say). Refused (False) while any
        block is held: the sequences holding them would go on caching blocks whose KV was
        computed before the reset. Free or finish every sequence first."""
        if self.num_free_blocks != self.num_blocks - 1:
            return False
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()
        return True
