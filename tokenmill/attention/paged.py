"""Paged KV cache: block storage, per-step paged metadata and the attention backend over it.

The pool of each KV group is preallocated from a memory budget as fixed-size blocks. A
sequence owns a block table; token ``p`` of the sequence lives in slot ``p % block_size`` of
block ``table[p // block_size]``::

    block_size = 4, table = [7, 2, 9]          context of 10 tokens
    positions:  0 1 2 3 | 4 5 6 7 | 8 9 . .
    blocks:        7    |    2    |    9
    slot of position p = table[p // 4] * 4 + p % 4     (position 9 -> 9 * 4 + 1 = 37)

Block 0 of every group is the null block: it is never written, and a sliding-window group
puts it in the table where blocks fell out of the window. Attention never reads a key older
than the window, so those entries are only placeholders.

Layers are split into KV groups (0: global layers; 1: sliding-window layers of hybrid models
such as Gemma 3); each group has its own pool and its own block ids. Storage is NHD,
``[num_blocks, block_size, kv_heads, head_dim]``: it was measured faster on CPU than HND
(one ``index_select`` over whole blocks yields keys that SDPA reads as a strided view), and it
is the layout of the CUDA paged kernels (flash-attn, FlashInfer).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tokenmill.attention.backend import attention_mask


@dataclass
class PagedLayer:
    """The KV storage of one layer, as the backend receives it from ``PagedKVCache.layer``."""

    keys: torch.Tensor
    """[num_blocks, block_size, kv_heads, head_dim]."""
    values: torch.Tensor
    """Like keys."""
    group: int
    """KV group: which block tables and slot mapping of the metadata apply."""


class PagedKVCache:
    """Block storage of every layer; the block ids themselves are handed out elsewhere."""

    def __init__(self, num_blocks: int | list[int], block_size: int, layer_groups: list[int], num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        num_groups = max(layer_groups) + 1
        self.num_blocks = list(num_blocks) if isinstance(num_blocks, (list, tuple)) else [num_blocks] * num_groups
        if len(self.num_blocks) != num_groups or min(self.num_blocks) < 2:
            raise ValueError(f"need at least 2 blocks (null block + 1) for each of {num_groups} groups: {num_blocks}")
        self.block_size, self.layer_groups = block_size, list(layer_groups)
        # one tensor per group, [2 (keys, values), layers of the group, blocks, block_size, kv_heads, head_dim],
        # so that copy_blocks is one copy per group; zeroed so that the null block holds finite values
        self.storage = [torch.zeros(2, layer_groups.count(g), n, block_size, num_kv_heads, head_dim, dtype=dtype,
                                    device=device) for g, n in enumerate(self.num_blocks)]
        index_in_group = [layer_groups[:i].count(g) for i, g in enumerate(layer_groups)]
        self.layers = [PagedLayer(self.storage[g][0, j], self.storage[g][1, j], g)
                       for g, j in zip(layer_groups, index_in_group)]

    def layer(self, index: int) -> PagedLayer:
        return self.layers[index]

    def copy_blocks(self, group: int, pairs: list[tuple[int, int]]) -> None:
        """Copy block ``src`` to block ``dst`` for each ``(src, dst)``, in every layer of ``group``
        (all sources are read before any destination is written)."""
        if not pairs:
            return
        store = self.storage[group]
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=store.device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=store.device)
        store.index_copy_(2, dst, store.index_select(2, src))

    @staticmethod
    def bytes_per_block(block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                        num_layers: int) -> int:
        """Bytes of one block id across ``num_layers`` layers (keys and values)."""
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()

    @staticmethod
    def num_blocks_for_budget(budget_bytes: int, block_size: int, num_kv_heads: int, head_dim: int,
                              dtype: torch.dtype, num_layers: int) -> int:
        """Blocks of a pool shared by ``num_layers`` layers that fit in ``budget_bytes`` (null block
        included: ``(n - 1) * block_size`` tokens fit). Groups of equal block counts: pass all layers."""
        return budget_bytes // PagedKVCache.bytes_per_block(block_size, num_kv_heads, head_dim, dtype, num_layers)


@dataclass
class _SeqAttention:
    """How one prefill chunk attends: its rows, its keys and its mask."""

    start: int
    end: int
    """Rows of its new tokens in the flat batch."""
    blocks: torch.Tensor | slice | None
    """Blocks holding its keys (a slice when their ids are consecutive); None: the keys are its new tokens."""
    key_lo: int
    key_hi: int
    """Its keys within the gathered tokens."""
    mask: torch.Tensor | None
    """[q_len, key_hi - key_lo] boolean, True = attend; None with ``causal`` or when all keys are seen."""
    causal: bool


@dataclass
class _DecodeBatch:
    """The query-length-1 sequences of a step, attended in one padded SDPA call."""

    rows: torch.Tensor | None
    """Their rows in the flat batch; None when every row is a decode, in order."""
    blocks: torch.Tensor | slice
    """[num_decodes * max_blocks] block ids, each sequence padded with the null block (a slice for one
    sequence with consecutive ids)."""
    max_blocks: int
    key_lo: int
    key_hi: int
    """Keys sliced from the gathered tokens (one sequence; else the mask does it)."""
    mask: torch.Tensor | None
    """[num_decodes, 1, 1, max_blocks * block_size] boolean, True = attend; None when nothing is masked."""


@dataclass
class _Plan:
    decodes: _DecodeBatch | None
    prefills: list[_SeqAttention]


@dataclass
class PagedAttentionMetadata:
    """One step over a paged cache: the flat batch of ``AttentionMetadata`` plus, per KV group,
    the block tables and the slot of every new token.

    The parts of the attention that depend only on the step (which blocks to gather, masks)
    are worked out once per (group, window) by the first layer that asks and shared by the rest.
    """

    query_start_loc: list[int]
    """B + 1 offsets of each sequence's new tokens in the flat batch."""
    context_lens: list[int]
    """Per sequence: cached tokens after this step (prefix already in cache + new tokens)."""
    block_tables: list[list[list[int]]]
    """Per group, per sequence: its block ids, covering at least its context."""
    slot_mapping: list[torch.Tensor]
    """Per group: int64 [T], ``block_id * block_size + offset`` of each new token."""
    block_size: int
    device: torch.device
    _plans: dict[tuple[int, int | None], _Plan] = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)

    def query_len(self, i: int) -> int:
        return self.query_start_loc[i + 1] - self.query_start_loc[i]

    def positions(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Absolute position of every new token, [T]."""
        parts = [torch.arange(c - self.query_len(i), c) for i, c in enumerate(self.context_lens)]
        return torch.cat(parts).to(device)

    def last_token_indices(self) -> list[int]:
        """Index in the flat batch of each sequence's last new token (where its next token is sampled)."""
        return [end - 1 for end in self.query_start_loc[1:]]

    @classmethod
    def build(cls, query_lens: list[int], context_lens: list[int], block_tables_per_group: list[list[list[int]]],
              block_size: int, device: torch.device | str = "cpu") -> "PagedAttentionMetadata":
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        slot_mapping = []
        for tables in block_tables_per_group:
            slots: list[int] = []
            for table, ctx, n in zip(tables, context_lens, query_lens):
                if len(table) * block_size < ctx:
                    raise ValueError(f"block table of {len(table)} blocks cannot hold {ctx} tokens")
                slots.extend(table[p // block_size] * block_size + p % block_size for p in range(ctx - n, ctx))
            slot_mapping.append(torch.tensor(slots, dtype=torch.long, device=device))
        return cls(starts, list(context_lens), [[list(t) for t in tables] for tables in block_tables_per_group],
                   slot_mapping, block_size, torch.device(device))

    def plan(self, group: int, window: int | None) -> _Plan:
        key = (group, window)
        if key not in self._plans:
            self._plans[key] = self._make_plan(group, window)
        return self._plans[key]

    def _make_plan(self, group: int, window: int | None) -> _Plan:
        bs, tables = self.block_size, self.block_tables[group]
        decode_ids, prefills = [], []
        for i, ctx in enumerate(self.context_lens):
            start, end = self.query_start_loc[i], self.query_start_loc[i + 1]
            if end - start == 1:
                decode_ids.append(i)
                continue
            if ctx == end - start:  # a whole prompt: its keys are its new tokens
                mask = attention_mask(ctx, ctx, 0, window, self.device) if window is not None and window < ctx else None
                prefills.append(_SeqAttention(start, end, None, 0, ctx, mask, mask is None))
                continue
            # keys older than the window of the first new query are never seen
            first_key = 0 if window is None else max(0, ctx - (end - start) - window + 1)
            first_block = first_key // bs
            blocks = self._block_selector(tables[i][first_block:(ctx - 1) // bs + 1])
            mask = attention_mask(end - start, ctx, first_key, window, self.device)
            prefills.append(_SeqAttention(start, end, blocks, first_key - first_block * bs, ctx - first_block * bs,
                                          mask, False))
        decodes = self._decode_batch(decode_ids, tables, window) if decode_ids else None
        return _Plan(decodes, prefills)

    def _decode_batch(self, ids: list[int], tables: list[list[int]], window: int | None) -> _DecodeBatch:
        bs = self.block_size
        runs, lo, hi = [], [], []
        for i in ids:
            ctx = self.context_lens[i]
            first_key = 0 if window is None else max(0, ctx - window)
            first_block = first_key // bs
            runs.append(tables[i][first_block:(ctx - 1) // bs + 1])
            lo.append(first_key - first_block * bs)
            hi.append(ctx - first_block * bs)
        max_blocks = max(len(r) for r in runs)
        all_rows = len(ids) == len(self.context_lens) and self.query_start_loc[-1] == len(ids)
        rows = None if all_rows else torch.tensor([self.query_start_loc[i] for i in ids], device=self.device)
        if len(ids) == 1:
            return _DecodeBatch(rows, self._block_selector(runs[0]), max_blocks, lo[0], hi[0], None)
        flat = [b for r in runs for b in r + [0] * (max_blocks - len(r))]
        blocks = torch.tensor(flat, dtype=torch.long, device=self.device)
        mask = None
        if max(lo) > 0 or min(hi) < max_blocks * bs:
            j = torch.arange(max_blocks * bs)
            mask = (j >= torch.tensor(lo)[:, None]) & (j < torch.tensor(hi)[:, None])
            mask = mask[:, None, None, :].to(self.device)
        return _DecodeBatch(rows, blocks, max_blocks, 0, max_blocks * bs, mask)

    def _block_selector(self, blocks: list[int]) -> torch.Tensor | slice:
        """A slice of the pool when the ids are consecutive (a view, no copy), else an index tensor."""
        if blocks[-1] - blocks[0] == len(blocks) - 1 and blocks == list(range(blocks[0], blocks[-1] + 1)):
            return slice(blocks[0], blocks[-1] + 1)
        return torch.tensor(blocks, dtype=torch.long, device=self.device)


def _gather(store: torch.Tensor, blocks: torch.Tensor | slice) -> torch.Tensor:
    """Tokens of ``blocks`` in order, [n * block_size, kv_heads, head_dim]."""
    picked = store[blocks] if isinstance(blocks, slice) else store.index_select(0, blocks)
    return picked.flatten(0, 1)


class PagedAttentionBackend:
    """Attention over a ``PagedKVCache`` with ``scaled_dot_product_attention`` (CPU and CUDA).

    Every new key/value is written with one ``index_copy_`` into the flattened pool. Sequences
    with one new token are attended together: their blocks gathered and padded to the longest,
    query heads of one KV head folded into the query length (GQA without repeating keys),
    one SDPA call. Prefill chunks go one SDPA call per sequence.
    """

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: PagedLayer,
                meta: PagedAttentionMetadata, scale: float, sliding_window: int | None) -> torch.Tensor:
        keys, values = cache.keys, cache.values
        slots = meta.slot_mapping[cache.group]
        keys.view(-1, *keys.shape[2:]).index_copy_(0, slots, k)
        values.view(-1, *values.shape[2:]).index_copy_(0, slots, v)
        plan = meta.plan(cache.group, sliding_window)
        d = plan.decodes
        if d is not None and not plan.prefills and d.rows is None:
            return self._decodes(q, keys, values, d, scale)
        out = torch.empty_like(q)
        if d is not None:
            out.index_copy_(0, d.rows, self._decodes(q.index_select(0, d.rows), keys, values, d, scale))
        gqa = q.shape[1] != k.shape[1]
        for s in plan.prefills:
            query = q[s.start:s.end].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
            if s.blocks is None:
                key, value = k[s.start:s.end], v[s.start:s.end]
            else:
                key = _gather(keys, s.blocks)[s.key_lo:s.key_hi]
                value = _gather(values, s.blocks)[s.key_lo:s.key_hi]
            o = F.scaled_dot_product_attention(query, key.transpose(0, 1).unsqueeze(0),
                                               value.transpose(0, 1).unsqueeze(0), attn_mask=s.mask,
                                               is_causal=s.causal, scale=scale, enable_gqa=gqa)
            out[s.start:s.end] = o[0].transpose(0, 1)
        return out

    @staticmethod
    def _decodes(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, d: _DecodeBatch,
                 scale: float) -> torch.Tensor:
        """q [B, H, D] of B one-token sequences -> [B, H, D]."""
        b, h, dim = q.shape
        kv_heads = keys.shape[2]
        key = _gather(keys, d.blocks).view(b, -1, kv_heads, dim)[:, d.key_lo:d.key_hi].transpose(1, 2)
        value = _gather(values, d.blocks).view(b, -1, kv_heads, dim)[:, d.key_lo:d.key_hi].transpose(1, 2)
        # the h / kv_heads query heads of one KV head become its query rows: [B, Hkv, group, D]
        o = F.scaled_dot_product_attention(q.reshape(b, kv_heads, h // kv_heads, dim), key, value,
                                           attn_mask=d.mask, scale=scale)
        return o.reshape(b, h, dim)
