"""How the layers of one (KV group, sliding window) attend in one step: an :class:`AttentionPlan`.

A step's metadata (``tokenmill.attention.metadata``) builds one plan per (group, window) on the
first layer that asks and hands the same plan to every other layer: the plan only depends on
the step (block tables, lengths), not on the layer's keys. It splits the step's sequences in two:

    DecodeSeq    one new token: attended by the paged-decode kernel (all at once), or by SDPA
                 in padded batches of similar length (``decodes``)
    PrefillSeq   several new tokens (a prompt or a chunk of one): by the paged-prefill kernel
                 (all at once), or by SDPA one sequence at a time (``prefills``)

Each sequence's keys are given as ``blocks``, its block ids from the block holding its first
visible key (older ones fell out of the sliding window), and ``key_start`` / ``key_end``, the
first and last + 1 of its keys counted in those blocks' tokens::

    block_size 4, context 10, window 5:  first visible key of the new token at 9 is 5
    table [7, 2, 9] -> blocks [2, 9], key_start 1, key_end 6  (tokens 4..11 of the blocks: keys 5..9)

Invariants: ``decode_seqs`` and ``prefill_seqs`` are each in row order and together cover every
sequence of the step once; for each, ``0 <= key_start < key_end <= len(blocks) * block_size`` and
the positions of keys key_start .. key_end - 1 run from its first visible key to its context's
last token. The SDPA forms (``decodes``,
``prefills``) and the kernel forms (``kernel_decodes()``, ``kernel_prefills()``) are built
lazily, on the first ask of the path that needs them, then kept for the step's other layers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

DECODE_BUCKET_SLACK = 128
"""Most padding keys a one-token sequence takes to join a batch: on CPU one more SDPA call
costs about as much as attending this many keys."""


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


@dataclass(frozen=True)
class DecodeSeq:
    """A sequence with one new token in the step."""

    row: int
    """Its row in the flat batch."""
    blocks: list[int]
    """Its blocks from the one holding its first visible key."""
    key_start: int
    """First and last + 1 of its keys within those blocks' tokens."""
    key_end: int


@dataclass(frozen=True)
class PrefillSeq:
    """A sequence with several new tokens in the step (a whole prompt, or a chunk after cached tokens)."""

    start: int
    """First and last + 1 of its rows in the flat batch."""
    end: int
    context_len: int
    """Its cached tokens after the step, new ones included."""
    blocks: list[int]
    """Its blocks from the one holding its first visible key."""
    key_start: int
    """First and last + 1 of its keys within those blocks' tokens."""
    key_end: int

    @property
    def query_len(self) -> int:
        return self.end - self.start

    @property
    def first_key(self) -> int:
        """Position of its first visible key."""
        return self.context_len - self.key_end + self.key_start


@dataclass(frozen=True, eq=False)
class SeqAttention:
    """How one prefill chunk attends by SDPA: its rows, its keys and its mask."""

    start: int
    end: int
    """Rows of its new tokens in the flat batch."""
    slots: torch.Tensor | slice | None
    """Slots of its visible keys; None: the keys are its new tokens (a whole prompt)."""
    mask: torch.Tensor | None
    """[q_len, keys] boolean, True = attend; None with ``causal`` or when all keys are seen."""
    causal: bool

    @classmethod
    def build(cls, seq: PrefillSeq, window: int | None, block_size: int, device: torch.device) -> SeqAttention:
        ctx = seq.context_len
        if ctx == seq.query_len:  # a whole prompt: its keys are its new tokens
            mask = attention_mask(ctx, ctx, 0, window, device) if window is not None and window < ctx else None
            return cls(seq.start, seq.end, None, mask, mask is None)
        mask = attention_mask(seq.query_len, ctx, seq.first_key, window, device)
        return cls(seq.start, seq.end, key_slots(seq.blocks, seq.key_start, seq.key_end, block_size, device), mask,
                   False)


@dataclass(frozen=True, eq=False)
class DecodeBatch:
    """One-token sequences of similar context length, attended in one padded SDPA call."""

    rows: torch.Tensor | None
    """Their rows in the flat batch; None when they are all the rows, in order."""
    slots: torch.Tensor | slice
    """Slots of their keys; for several sequences [num_seqs * span], each sequence's blocks from
    its first visible key, padded with the null block to the longest (span = its tokens)."""
    mask: torch.Tensor | None
    """[num_seqs, 1, 1, span] boolean, True = attend; None when nothing is masked."""

    @classmethod
    def build(cls, seqs: list[DecodeSeq], block_size: int, device: torch.device) -> DecodeBatch:
        rows = torch.tensor([s.row for s in seqs], device=device)
        if len(seqs) == 1:
            s = seqs[0]
            return cls(rows, key_slots(s.blocks, s.key_start, s.key_end, block_size, device), None)
        padded = null_padded([s.blocks for s in seqs], torch.long)
        slots = (padded[:, :, None] * block_size + torch.arange(block_size)).flatten().to(device)
        lo = [s.key_start for s in seqs]
        hi = [s.key_end for s in seqs]
        span = padded.shape[1] * block_size
        if max(lo) == 0 and min(hi) == span:
            return cls(rows, slots, None)
        j = torch.arange(span)
        mask = (j >= torch.tensor(lo)[:, None]) & (j < torch.tensor(hi)[:, None])
        return cls(rows, slots, mask[:, None, None, :].to(device))


@dataclass(frozen=True, eq=False)
class KernelDecodes:
    """Every one-token sequence of a step, as the CPU paged-decode kernel takes them."""

    rows: torch.Tensor | None
    """Their rows in the flat batch; None when they are all the rows, in order."""
    block_tables: torch.Tensor
    """int32 [num_seqs, max_blocks]: blocks from each sequence's first visible key, null-padded."""
    key_start: torch.Tensor
    """int32 [num_seqs]: first and last + 1 of each sequence's keys within its blocks' tokens."""
    key_end: torch.Tensor

    @classmethod
    def build(cls, seqs: list[DecodeSeq], all_rows: bool) -> KernelDecodes:
        """``all_rows``: the sequences are every row of the step, in order."""
        return cls(None if all_rows else torch.tensor([s.row for s in seqs]),
                   null_padded([s.blocks for s in seqs], torch.int32),
                   torch.tensor([s.key_start for s in seqs], dtype=torch.int32),
                   torch.tensor([s.key_end for s in seqs], dtype=torch.int32))


@dataclass(frozen=True, eq=False)
class KernelPrefills:
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

    @classmethod
    def build(cls, seqs: list[PrefillSeq]) -> KernelPrefills:
        starts = [0]
        for s in seqs:
            starts.append(starts[-1] + s.query_len)
        if all(a.end == b.start for a, b in zip(seqs, seqs[1:])):
            rows: slice | torch.Tensor = slice(seqs[0].start, seqs[-1].end)
        else:
            rows = torch.cat([torch.arange(s.start, s.end) for s in seqs])
        return cls(rows, null_padded([s.blocks for s in seqs], torch.int32), torch.tensor(starts, dtype=torch.int32),
                   torch.tensor([s.key_start for s in seqs], dtype=torch.int32),
                   torch.tensor([s.key_end for s in seqs], dtype=torch.int32))


@dataclass
class AttentionPlan:
    """The step's sequences as the layers of one (KV group, sliding window) attend to them."""

    prefill_seqs: list[PrefillSeq]
    """The sequences of several new tokens, by row (the kernel path takes them all at once)."""
    decode_seqs: list[DecodeSeq]
    """The one-token sequences, by row, before batching (the kernel path takes them all at once)."""
    all_rows_decode: bool
    """Every row of the step is a one-token sequence."""
    window: int | None
    block_size: int
    device: torch.device
    _kernel_decodes: KernelDecodes | None = field(default=None, init=False, repr=False)
    _kernel_prefills: KernelPrefills | None = field(default=None, init=False, repr=False)
    _decodes: list[DecodeBatch] | None = field(default=None, init=False, repr=False)
    _prefills: list[SeqAttention] | None = field(default=None, init=False, repr=False)

    @classmethod
    def build(cls, query_start_loc: list[int], context_lens: list[int], block_tables: list[list[int]],
              block_size: int, window: int | None, device: torch.device) -> AttentionPlan:
        """The plan of a step (``query_start_loc``, ``context_lens`` as in the metadata) over one
        group's ``block_tables``, for layers with sliding ``window`` (None: global)."""
        decodes, prefills = [], []
        for i, ctx in enumerate(context_lens):
            start, end = query_start_loc[i], query_start_loc[i + 1]
            # keys older than the window of the first new query are never seen
            first_key = 0 if window is None else max(0, ctx - (end - start) - window + 1)
            first_block = first_key // block_size
            blocks = block_tables[i][first_block:(ctx - 1) // block_size + 1]
            lo, hi = first_key - first_block * block_size, ctx - first_block * block_size
            if end - start == 1:
                decodes.append(DecodeSeq(row=start, blocks=blocks, key_start=lo, key_end=hi))
            else:
                prefills.append(PrefillSeq(start=start, end=end, context_len=ctx, blocks=blocks, key_start=lo,
                                           key_end=hi))
        return cls(prefills, decodes, len(decodes) == query_start_loc[-1], window, block_size, device)

    @property
    def prefills(self) -> list[SeqAttention]:
        """The sequences of several new tokens as SDPA takes them (slots, masks); built only when
        the SDPA path asks."""
        if self._prefills is None:
            self._prefills = [SeqAttention.build(s, self.window, self.block_size, self.device)
                              for s in self.prefill_seqs]
        return self._prefills

    @property
    def decodes(self) -> list[DecodeBatch]:
        """The one-token sequences in padded SDPA batches of similar length; built only when the
        SDPA path asks (the CPU kernel does not need the padded slot index)."""
        if self._decodes is None:
            batches = [DecodeBatch.build(b, self.block_size, self.device)
                       for b in decode_buckets(self.decode_seqs, self.block_size)]
            if len(batches) == 1 and self.all_rows_decode:
                # every row is a decode, in order: the output needs no scatter
                batches[0] = dataclasses.replace(batches[0], rows=None)
            self._decodes = batches
        return self._decodes

    def kernel_decodes(self) -> KernelDecodes:
        """The one-token sequences as the paged-decode kernel takes them (also the decode stack's)."""
        if self._kernel_decodes is None:
            self._kernel_decodes = KernelDecodes.build(self.decode_seqs, self.all_rows_decode)
        return self._kernel_decodes

    def kernel_prefills(self) -> KernelPrefills:
        """The sequences of several new tokens as the paged-prefill kernel takes them."""
        if self._kernel_prefills is None:
            self._kernel_prefills = KernelPrefills.build(self.prefill_seqs)
        return self._kernel_prefills


def null_padded(tables: list[list[int]], dtype: torch.dtype) -> torch.Tensor:
    """Block tables as one [num_seqs, longest] tensor, the shorter ones padded with the null block 0."""
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=dtype)


def key_slots(blocks: list[int], key_start: int, key_end: int, block_size: int,
              device: torch.device) -> torch.Tensor | slice:
    """Slots of tokens key_start:key_end of ``blocks``: a range when the ids are consecutive, else an index."""
    if blocks[-1] - blocks[0] == len(blocks) - 1 and blocks == list(range(blocks[0], blocks[-1] + 1)):
        return slice(blocks[0] * block_size + key_start, blocks[0] * block_size + key_end)
    slots = torch.tensor(blocks)[:, None] * block_size + torch.arange(block_size)
    return slots.flatten()[key_start:key_end].to(device)


def decode_buckets(decodes: list[DecodeSeq], block_size: int) -> list[list[DecodeSeq]]:
    """Split one-token sequences into padded batches: longest first, a new batch when a sequence
    is more than ``DECODE_BUCKET_SLACK`` keys shorter than the batch's longest; each batch in row order."""
    buckets: list[list[DecodeSeq]] = []
    longest = 0
    for seq in sorted(decodes, key=lambda s: -len(s.blocks)):
        span = len(seq.blocks) * block_size
        if buckets and longest - span <= DECODE_BUCKET_SLACK:
            buckets[-1].append(seq)
        else:
            buckets.append([seq])
            longest = span
    return [sorted(bucket, key=lambda s: s.row) for bucket in buckets]
