"""Paged KV cache: block storage, per-step paged metadata and the attention backend over it.

The pool of each KV group is preallocated from a memory budget as fixed-size blocks. A
sequence owns a block table; token ``p`` of the sequence lives in slot ``p % block_size`` of
block ``table[p // block_size]``::

    block_size = 4, table = [7, 2, 9]          context of 10 tokens
    positions:  0 1 2 3 | 4 5 6 7 | 8 9 . .
    blocks:        7    |    2    |    9
    slot of position p = table[p // 4] * 4 + p % 4     (position 9 -> 9 * 4 + 1 = 37)

Block 0 of every group is the null block: never written (zeros), a sliding-window group puts
it in the table where blocks fell out of the window, and batched decodes pad with it. Attention
never reads a key older than the window and masks the padding, so it only holds places.

Layers are split into KV groups (0: global layers; 1: sliding-window layers of hybrid models
such as Gemma 3); each group has its own pool and its own block ids. Storage is NHD,
``[num_blocks, block_size, kv_heads, head_dim]``, so a slot is one contiguous
``[kv_heads, head_dim]`` row: new tokens are written with one ``index_copy_``, a sequence's keys
read with one ``index_select`` over slots (or as a view of a slot range) that SDPA takes as a
strided ``[kv_heads, tokens, head_dim]`` view. HND needs a second copy to bring heads first, or
a gather along dim 1 that measured 50x slower on CPU; NHD is also the layout of the CUDA paged
kernels (flash-attn, FlashInfer).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tokenmill.attention.kv_quant import (
    SCALE_DTYPE,
    as_bytes,
    dequantize_rows,
    is_quantized,
    quantize_rows,
    row_bytes,
    storage_dtype,
)


def attention_mask(q_len: int, ctx_len: int, first_key: int, window: int | None,
                   device: torch.device) -> torch.Tensor | None:
    """Boolean [q_len, ctx_len - first_key] mask (True = attend) for new tokens at the end of the context.

    Query i sits at position ``ctx_len - q_len + i``; keys cover positions ``first_key .. ctx_len - 1``.
    A query sees key p when ``p <= its position`` and, on sliding-window layers, ``its position - p < window``.
    Returns None when every query may see every key (one decode token whose window covers the keys).
    """
    if q_len == 1 and (window is None or ctx_len - first_key <= window):
        return None
    q_pos = torch.arange(ctx_len - q_len, ctx_len, device=device)[:, None]
    k_pos = torch.arange(first_key, ctx_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= (q_pos - k_pos) < window
    return mask


@dataclass
class PagedLayer:
    """The KV storage of one layer, as the backend receives it from ``PagedKVCache.layer``."""

    keys: torch.Tensor
    """[num_blocks, block_size, kv_heads, head_dim], in the model's dtype or quantized (int8, fp8)."""
    values: torch.Tensor
    """Like keys."""
    group: int
    """KV group: which block tables and slot mapping of the metadata apply."""
    key_scales: torch.Tensor | None = None
    """Quantized storage: float16 [num_blocks, block_size, kv_heads], one scale per stored row."""
    value_scales: torch.Tensor | None = None
    key_slots: torch.Tensor = field(init=False, repr=False)
    """keys viewed as [num_blocks * block_size, kv_heads, head_dim], indexed by slot."""
    value_slots: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.key_slots = self.keys.flatten(0, 1)
        self.value_slots = self.values.flatten(0, 1)

    @property
    def quantized(self) -> bool:
        return self.key_scales is not None

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens' keys and values [T, kv_heads, head_dim] at ``slots`` (quantized
        storage: rounded to its grid, on CPU by tokenmill's kernel when built)."""
        if not self.quantized:
            self.key_slots.index_copy_(0, slots, k)
            self.value_slots.index_copy_(0, slots, v)
            return
        ops = _cpu_ops() if k.device.type == "cpu" and k.dtype in (torch.float32, torch.bfloat16) else None
        for x, rows, scales in ((k, self.key_slots, self.key_scales), (v, self.value_slots, self.value_scales)):
            if ops is not None:
                ops.write_quantized_kv(x.contiguous(), slots, rows, scales.flatten(0, 1))
                continue
            q, scale = quantize_rows(x, rows.dtype)
            as_bytes(rows).index_copy_(0, slots, as_bytes(q))
            scales.flatten(0, 1).index_copy_(0, slots, scale)

    def read(self, slots: torch.Tensor | slice, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at ``slots`` in ``dtype``: [n, kv_heads, head_dim] each (a view for a
        slot range of unquantized storage, else a gather)."""
        if not self.quantized:
            return _take(self.key_slots, slots), _take(self.value_slots, slots)
        k = _take(as_bytes(self.key_slots), slots).view(self.keys.dtype)
        v = _take(as_bytes(self.value_slots), slots).view(self.values.dtype)
        return (dequantize_rows(k, _take(self.key_scales.flatten(0, 1), slots), dtype),
                dequantize_rows(v, _take(self.value_scales.flatten(0, 1), slots), dtype))


class PagedKVCache:
    """Block storage of every layer; the block ids themselves are handed out elsewhere."""

    def __init__(self, num_blocks: int | list[int], block_size: int, layer_groups: list[int], num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                 kv_cache_dtype: str = "auto") -> None:
        """``dtype``: the model's; ``kv_cache_dtype``: ``auto`` (store in ``dtype``), ``int8`` or ``fp8``
        (quantized rows with float16 scales, see kv_quant)."""
        num_groups = max(layer_groups) + 1
        self.num_blocks = list(num_blocks) if isinstance(num_blocks, (list, tuple)) else [num_blocks] * num_groups
        if len(self.num_blocks) != num_groups or min(self.num_blocks) < 2:
            raise ValueError(f"need at least 2 blocks (null block + 1) for each of {num_groups} groups: {num_blocks}")
        self.block_size, self.layer_groups = block_size, list(layer_groups)
        # one tensor per group, [2 (keys, values), layers of the group, blocks, block_size, kv_heads, head_dim],
        # so that copy_blocks is one copy per group; zeroed so that the null block holds finite values
        self.kv_cache_dtype = kv_cache_dtype
        self.dtype = storage_dtype(kv_cache_dtype, dtype)
        self.storage = [torch.zeros(2, layer_groups.count(g), n, block_size, num_kv_heads, head_dim, dtype=self.dtype,
                                    device=device) for g, n in enumerate(self.num_blocks)]
        # quantized: one float16 scale per stored row, laid out like the rows without head_dim
        self.scales = [torch.zeros(s.shape[:-1], dtype=SCALE_DTYPE, device=device) for s in self.storage] \
            if is_quantized(self.dtype) else None
        index_in_group = [layer_groups[:i].count(g) for i, g in enumerate(layer_groups)]
        self.layers = [PagedLayer(self.storage[g][0, j], self.storage[g][1, j], g,
                                  *((self.scales[g][0, j], self.scales[g][1, j]) if self.scales else ()))
                       for g, j in zip(layer_groups, index_in_group)]

    def layer(self, index: int) -> PagedLayer:
        return self.layers[index]

    def copy_blocks(self, group: int, pairs: list[tuple[int, int]]) -> None:
        """Copy block ``src`` to block ``dst`` for each ``(src, dst)``, in every layer of ``group``
        (all sources are read before any destination is written)."""
        if not pairs:
            return
        store = as_bytes(self.storage[group])
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=store.device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=store.device)
        store.index_copy_(2, dst, store.index_select(2, src))
        if self.scales:
            self.scales[group].index_copy_(2, dst, self.scales[group].index_select(2, src))

    @staticmethod
    def bytes_per_block(block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                        num_layers: int) -> int:
        """Bytes of one block id across ``num_layers`` layers (keys and values; ``dtype`` the storage
        dtype, a quantized one with its scales)."""
        return 2 * num_layers * block_size * num_kv_heads * row_bytes(head_dim, dtype)

    @staticmethod
    def num_blocks_for_budget(budget_bytes: int, block_size: int, num_kv_heads: int, head_dim: int,
                              dtype: torch.dtype, num_layers: int) -> int:
        """Blocks of a pool shared by ``num_layers`` layers that fit in ``budget_bytes`` (null block
        included: ``(n - 1) * block_size`` tokens fit). Groups of equal block counts: pass all layers."""
        return budget_bytes // PagedKVCache.bytes_per_block(block_size, num_kv_heads, head_dim, dtype, num_layers)


def _take(slots_view: torch.Tensor, slots: torch.Tensor | slice) -> torch.Tensor:
    """Keys (or values) at ``slots``: a view for a slot range, else a gather; [n, kv_heads, head_dim]."""
    return slots_view[slots] if isinstance(slots, slice) else slots_view.index_select(0, slots)


@dataclass
class _SeqAttention:
    """How one prefill chunk attends: its rows, its keys and its mask."""

    start: int
    end: int
    """Rows of its new tokens in the flat batch."""
    slots: torch.Tensor | slice | None
    """Slots of its visible keys; None: the keys are its new tokens (a whole prompt)."""
    mask: torch.Tensor | None
    """[q_len, keys] boolean, True = attend; None with ``causal`` or when all keys are seen."""
    causal: bool


@dataclass
class _DecodeBatch:
    """Query-length-1 sequences of similar context length, attended in one padded SDPA call."""

    rows: torch.Tensor | None
    """Their rows in the flat batch; None when they are all the rows, in order."""
    slots: torch.Tensor | slice
    """Slots of their keys; for several sequences [num_seqs * span], each sequence's blocks from
    its first visible key, padded with the null block to the longest (span = its tokens)."""
    mask: torch.Tensor | None
    """[num_seqs, 1, 1, span] boolean, True = attend; None when nothing is masked."""


_Decode = tuple[int, list[int], int, int]
"""A one-token sequence of a step: (row in the flat batch, blocks from its first visible key,
first and last + 1 of its keys within those blocks' tokens)."""

def _null_padded(tables: list[list[int]], dtype: torch.dtype) -> torch.Tensor:
    """Block tables as one [num_seqs, longest] tensor, the shorter ones padded with the null block 0."""
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=dtype)


_Prefill = tuple[int, int, int, list[int], int, int]
"""A sequence of several new tokens: (first and last + 1 of its rows in the flat batch, its context
length, blocks from its first visible key, first and last + 1 of its keys within those blocks' tokens)."""


@dataclass
class _KernelDecodes:
    """Every one-token sequence of a step, as the CPU paged-decode kernel takes them."""

    rows: torch.Tensor | None
    """Their rows in the flat batch; None when they are all the rows, in order."""
    block_tables: torch.Tensor
    """int32 [num_seqs, max_blocks]: blocks from each sequence's first visible key, null-padded."""
    key_start: torch.Tensor
    """int32 [num_seqs]: first and last + 1 of each sequence's keys within its blocks' tokens."""
    key_end: torch.Tensor


@dataclass
class _KernelPrefills:
    """Every sequence of several new tokens of a step, as the CPU paged-prefill kernel takes them."""

    rows: slice | torch.Tensor
    """Their rows in the flat batch: a range when they follow each other, else an index."""
    block_tables: torch.Tensor
    """int32 [num_seqs, max_blocks]: blocks from each sequence's first visible key, null-padded."""
    query_start: torch.Tensor
    """int32 [num_seqs + 1]: offsets of each sequence's queries among those rows."""
    key_start: torch.Tensor
    """int32 [num_seqs]: first and last + 1 of each sequence's keys within its blocks' tokens."""
    key_end: torch.Tensor


@dataclass
class _Plan:
    prefill_seqs: list[_Prefill]
    """The sequences of several new tokens, by row (the kernel path takes them all at once)."""
    decode_seqs: list[_Decode]
    """The one-token sequences, by row, before batching (the kernel path takes them all at once)."""
    all_rows_decode: bool
    window: int | None
    meta: "PagedAttentionMetadata" = field(repr=False)
    _kernel: _KernelDecodes | None = field(default=None, repr=False)
    _kernel_prefills: _KernelPrefills | None = field(default=None, repr=False)
    _batches: list[_DecodeBatch] | None = field(default=None, repr=False)
    _prefills: list[_SeqAttention] | None = field(default=None, repr=False)

    @property
    def prefills(self) -> list[_SeqAttention]:
        """The sequences of several new tokens as SDPA takes them (slots, masks); built only when
        the SDPA path asks."""
        if self._prefills is None:
            self._prefills = [self.meta._seq_attention(s, self.window) for s in self.prefill_seqs]
        return self._prefills

    def kernel_prefills(self) -> _KernelPrefills:
        if self._kernel_prefills is None:
            seqs = self.prefill_seqs
            tables = _null_padded([blocks for _, _, _, blocks, _, _ in seqs], torch.int32)
            starts = [0]
            for start, end, _, _, _, _ in seqs:
                starts.append(starts[-1] + end - start)
            if all(a[1] == b[0] for a, b in zip(seqs, seqs[1:])):
                rows: slice | torch.Tensor = slice(seqs[0][0], seqs[-1][1])
            else:
                rows = torch.cat([torch.arange(start, end) for start, end, _, _, _, _ in seqs])
            self._kernel_prefills = _KernelPrefills(
                rows, tables, torch.tensor(starts, dtype=torch.int32),
                torch.tensor([lo for _, _, _, _, lo, _ in seqs], dtype=torch.int32),
                torch.tensor([hi for _, _, _, _, _, hi in seqs], dtype=torch.int32))
        return self._kernel_prefills

    @property
    def decodes(self) -> list[_DecodeBatch]:
        """The one-token sequences in padded SDPA batches of similar length; built only when the
        SDPA path asks (the CPU kernel does not need the padded slot index)."""
        if self._batches is None:
            self._batches = [self.meta._decode_batch(b) for b in _buckets(self.decode_seqs, self.meta.block_size)]
            if len(self._batches) == 1 and self.all_rows_decode:
                self._batches[0].rows = None  # every row is a decode, in order: the output needs no scatter
        return self._batches

    def kernel_decodes(self) -> _KernelDecodes:
        if self._kernel is None:
            seqs = self.decode_seqs
            tables = _null_padded([blocks for _, blocks, _, _ in seqs], torch.int32)
            rows = None if self.all_rows_decode else torch.tensor([row for row, _, _, _ in seqs])
            self._kernel = _KernelDecodes(rows, tables, torch.tensor([lo for _, _, lo, _ in seqs], dtype=torch.int32),
                                          torch.tensor([hi for _, _, _, hi in seqs], dtype=torch.int32))
        return self._kernel


@dataclass
class PagedAttentionMetadata:
    """One step over a paged cache: the flat batch of new tokens plus, per KV group,
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
                if 0 in table[(ctx - n) // block_size:(ctx - 1) // block_size + 1]:
                    raise ValueError("new tokens would be written into the null block 0")
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
        decodes, prefills = [], []
        for i, ctx in enumerate(self.context_lens):
            start, end = self.query_start_loc[i], self.query_start_loc[i + 1]
            # keys older than the window of the first new query are never seen
            first_key = 0 if window is None else max(0, ctx - (end - start) - window + 1)
            first_block = first_key // bs
            blocks = tables[i][first_block:(ctx - 1) // bs + 1]
            lo, hi = first_key - first_block * bs, ctx - first_block * bs
            if end - start == 1:
                decodes.append((start, blocks, lo, hi))
            else:
                prefills.append((start, end, ctx, blocks, lo, hi))
        return _Plan(prefills, decodes, len(decodes) == self.query_start_loc[-1], window, self)

    def _seq_attention(self, seq: _Prefill, window: int | None) -> _SeqAttention:
        start, end, ctx, blocks, lo, hi = seq
        if ctx == end - start:  # a whole prompt: its keys are its new tokens
            mask = attention_mask(ctx, ctx, 0, window, self.device) if window is not None and window < ctx else None
            return _SeqAttention(start, end, None, mask, mask is None)
        first_key = ctx - hi + lo
        mask = attention_mask(end - start, ctx, first_key, window, self.device)
        return _SeqAttention(start, end, self._slots(blocks, lo, hi), mask, False)

    def _decode_batch(self, seqs: list[_Decode]) -> _DecodeBatch:
        rows = torch.tensor([row for row, _, _, _ in seqs], device=self.device)
        if len(seqs) == 1:
            _, blocks, lo, hi = seqs[0]
            return _DecodeBatch(rows, self._slots(blocks, lo, hi), None)
        padded = _null_padded([blocks for _, blocks, _, _ in seqs], torch.long)
        max_blocks = padded.shape[1]
        slots = (padded[:, :, None] * self.block_size + torch.arange(self.block_size)).flatten().to(self.device)
        lo = [lo for _, _, lo, _ in seqs]
        hi = [hi for _, _, _, hi in seqs]
        span = max_blocks * self.block_size
        if max(lo) == 0 and min(hi) == span:
            return _DecodeBatch(rows, slots, None)
        j = torch.arange(span)
        mask = (j >= torch.tensor(lo)[:, None]) & (j < torch.tensor(hi)[:, None])
        return _DecodeBatch(rows, slots, mask[:, None, None, :].to(self.device))

    def _slots(self, blocks: list[int], lo: int, hi: int) -> torch.Tensor | slice:
        """Slots of tokens lo:hi of ``blocks``: a range when the ids are consecutive, else an index."""
        bs = self.block_size
        if blocks[-1] - blocks[0] == len(blocks) - 1 and blocks == list(range(blocks[0], blocks[-1] + 1)):
            return slice(blocks[0] * bs + lo, blocks[0] * bs + hi)
        slots = torch.tensor(blocks)[:, None] * bs + torch.arange(bs)
        return slots.flatten()[lo:hi].to(self.device)


DECODE_BUCKET_SLACK = 128
"""Most padding keys a one-token sequence takes to join a batch: on CPU one more SDPA call
costs about as much as attending this many keys."""


def _buckets(decodes: list[_Decode], block_size: int) -> list[list[_Decode]]:
    """Split one-token sequences into padded batches: longest first, a new batch when a sequence
    is more than ``DECODE_BUCKET_SLACK`` keys shorter than the batch's longest."""
    buckets: list[list[_Decode]] = []
    longest = 0
    for seq in sorted(decodes, key=lambda s: -len(s[1])):
        span = len(seq[1]) * block_size
        if buckets and longest - span <= DECODE_BUCKET_SLACK:
            buckets[-1].append(seq)
        else:
            buckets.append([seq])
            longest = span
    return [sorted(bucket) for bucket in buckets]  # rows in order again


_EMPTY = torch.empty(0)


def _cpu_ops():
    """The compiled CPU kernels, or None (not built, or TOKENMILL_CPU_KERNELS=0)."""
    from tokenmill.kernels import cpu_ops

    return cpu_ops.load()


def _or_empty(t: torch.Tensor | None) -> torch.Tensor:
    return _EMPTY if t is None else t


class PagedAttentionBackend:
    """Attention over a ``PagedKVCache`` with ``scaled_dot_product_attention`` (CPU and CUDA),
    and on CPU tokenmill's paged-decode and paged-prefill kernels when they are built.

    Every new key/value is written with one ``index_copy_`` into the slot view of the pool, and
    keys are read back by slot (a view of a slot range when a sequence's block ids are
    consecutive, else one ``index_select``). Sequences with one new token are attended in
    batches of similar length: their keys gathered and padded to the longest, the query heads
    of one KV head folded into the query length (GQA without repeating keys), one SDPA call
    per batch. Prefill chunks go one SDPA call per sequence.

    On CPU, one-token sequences instead go to ``tokenmill/kernels/cpu/paged_attention.cpp``
    (``use_cpu_kernel``, default: when it builds): it reads keys and values in place from the
    blocks, all sequences in one call, without the gather copy and the padding. Likewise every
    sequence of several new tokens (whole prompts too: their keys were just written) goes to
    ``prefill_attention.cpp`` in one call, when the cache is stored in the model's dtype (a
    quantized cache keeps SDPA for them): causal flash attention that skips the masked key blocks.
    ``use_cpu_kernel=False``: no C++ kernel at all.
    """

    def __init__(self, use_cpu_kernel: bool | None = None) -> None:
        self.use_cpu_kernel = use_cpu_kernel

    def _cpu_kernels(self, q: torch.Tensor):
        """The compiled CPU kernels when they apply to this call, else None. (Not kept on the
        backend: a model holding it must stay deep-copyable.)"""
        if q.device.type != "cpu" or self.use_cpu_kernel is False or q.dtype not in (torch.float32, torch.bfloat16):
            return None
        kernels = _cpu_ops()
        if self.use_cpu_kernel and kernels is None:
            raise RuntimeError("use_cpu_kernel=True but the CPU kernels could not be built (see the log)")
        if kernels is None or not kernels.supports_head_dim(q.shape[-1]):
            return None
        return kernels

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: PagedLayer,
                meta: PagedAttentionMetadata, scale: float, sliding_window: int | None) -> torch.Tensor:
        slots = meta.slot_mapping[cache.group]
        cache.write(slots, k, v)
        plan = meta.plan(cache.group, sliding_window)
        if cache.quantized and plan.prefill_seqs:  # new tokens attend to the values as stored
            k, v = cache.read(slots, q.dtype)
        kernels = self._cpu_kernels(q) if plan.decode_seqs or plan.prefill_seqs else None
        if not plan.decode_seqs:
            out = None
        elif kernels is not None:
            d = plan.kernel_decodes()
            qd = q if d.rows is None else q.index_select(0, d.rows)
            o = kernels.paged_decode_attention(qd.contiguous(), cache.keys, cache.values,
                                               _or_empty(cache.key_scales), _or_empty(cache.value_scales),
                                               d.block_tables, d.key_start, d.key_end, scale, False)
            if d.rows is None:
                return o
            out = torch.empty_like(q)
            out.index_copy_(0, d.rows, o)
        elif len(plan.decodes) == 1 and plan.decodes[0].rows is None:
            return self._decodes(q, cache, plan.decodes[0], scale)
        else:
            out = torch.empty_like(q)
            for d in plan.decodes:
                out.index_copy_(0, d.rows, self._decodes(q.index_select(0, d.rows), cache, d, scale))
        if not plan.prefill_seqs:
            return out if out is not None else torch.empty_like(q)
        if kernels is not None and not cache.quantized and cache.keys.dtype == q.dtype:
            # every prefill of the step in one call, keys and values read in place (its new ones included)
            p = plan.kernel_prefills()
            qp = q[p.rows] if isinstance(p.rows, slice) else q.index_select(0, p.rows)
            o = kernels.paged_prefill_attention(qp.contiguous(), cache.keys, cache.values, p.block_tables,
                                                p.query_start, p.key_start, p.key_end, sliding_window or 0, scale,
                                                False)
            if out is None and isinstance(p.rows, slice) and p.rows.start == 0 and p.rows.stop == q.shape[0]:
                return o
            out = torch.empty_like(q) if out is None else out
            if isinstance(p.rows, slice):
                out[p.rows] = o
            else:
                out.index_copy_(0, p.rows, o)
            return out
        out = torch.empty_like(q) if out is None else out
        gqa = q.shape[1] != k.shape[1]
        for s in plan.prefills:
            if s.slots is None:
                key, value = k[s.start:s.end], v[s.start:s.end]
            else:
                key, value = cache.read(s.slots, q.dtype)
            o = F.scaled_dot_product_attention(q[s.start:s.end].transpose(0, 1)[None], key.transpose(0, 1)[None],
                                               value.transpose(0, 1)[None], attn_mask=s.mask, is_causal=s.causal,
                                               scale=scale, enable_gqa=gqa)  # [1, H, q_len, D]
            out[s.start:s.end] = o[0].transpose(0, 1)
        return out

    @staticmethod
    def _decodes(q: torch.Tensor, cache: PagedLayer, d: _DecodeBatch, scale: float) -> torch.Tensor:
        """q [B, H, D] of B one-token sequences -> [B, H, D]."""
        b, h, dim = q.shape
        kv_heads = cache.keys.shape[2]
        key, value = cache.read(d.slots, q.dtype)
        key = key.view(b, -1, kv_heads, dim).transpose(1, 2)
        value = value.view(b, -1, kv_heads, dim).transpose(1, 2)
        # the h / kv_heads query heads of one KV head become its query rows: [B, Hkv, group, D]
        o = F.scaled_dot_product_attention(q.reshape(b, kv_heads, h // kv_heads, dim), key, value,
                                           attn_mask=d.mask, scale=scale)
        return o.reshape(b, h, dim)
