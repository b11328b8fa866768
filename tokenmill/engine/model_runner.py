"""The model runner: one forward pass over the new tokens of a batch of sequences.

Input: one :class:`SequenceInput` per sequence (its new tokens, how many tokens before them the
KV cache already holds, its block tables, which logits it wants). The runner knows nothing of
requests or scheduling: the engine, perplexity evaluation and quantization calibration all run
the model through it. The tokens of all sequences are concatenated (ragged, no padding) with
their positions and a PagedAttentionMetadata::

    sequence     A (prefill chunk)       B (decode)   C (decode)
    computed     0                       7            12
    new tokens   a0 a1 a2 a3             b7           c12
    flat batch   [a0 a1 a2 a3 b7 c12]    positions [0 1 2 3 7 12]

Output (:class:`RunnerOutput`): the float32 logits of the last new token of every sequence that
samples, plus the logits of every new position of the sequences that want them all (prompt
logprobs). :meth:`ModelRunner.hidden` returns the final hidden states instead, for callers that
score or observe a whole sequence.

Two ways to get a runner: over a KV cache whose blocks someone else hands out (the engine: its
KV cache manager fills the block tables), or :meth:`ModelRunner.for_sequences`, over a throwaway
cache of its own that holds one whole sequence of up to ``max_len`` tokens at a time in blocks
1, 2, ... (block 0 is the null block); each :meth:`~ModelRunner.hidden` call overwrites it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from tokenmill.attention.kv_cache import PagedKVCache
from tokenmill.attention.metadata import PagedAttentionMetadata
from tokenmill.config import layer_groups
from tokenmill.engine.config import CacheConfig
from tokenmill.errors import InvalidParameterError
from tokenmill.lora.slots import LoRABatch, LoRASlots
from tokenmill.models.base import CausalLM


DECODE_ROWS_MAX = 8
"""Steps whose sequences all have at most this many new tokens run as one decode row per token
(ModelRunner._metadata)..."""
DECODE_ROWS_EXTRA_BYTES = 64 << 20
"""... unless the rows would read more than this many KV bytes beyond what one query block per
sequence reads (each row reads its sequence's keys and values again): about what the one-call
decode path saves (3 ms of interpreter time) at DRAM speed."""


@dataclass(frozen=True, slots=True)
class SequenceInput:
    """One sequence's share of a forward pass."""

    token_ids: list[int]
    """The new tokens, at positions ``num_computed ..``; their keys and values are written to the cache."""
    num_computed: int
    """Tokens of the sequence before them whose KV the cache already holds (and attention reads)."""
    block_tables: list[list[int]]
    """Per KV group, the sequence's block ids, covering at least ``num_computed + len(token_ids)`` tokens."""
    samples: bool
    """Return the logits of the last new token (the sequence samples its next token)."""
    all_logits: bool = False
    """Also return the logits of every new token (prompt logprobs)."""
    num_sample_rows: int = 1
    """With ``samples``: the logits of this many last new tokens (a drafting sequence verifies
    each of its drafted tokens and samples after the last: 1 + drafts)."""
    lora_slot: int = -1
    """The slot of its LoRA adapter in the runner's ``lora_slots``; -1: the base model alone."""
    hidden_before: torch.Tensor | None = None
    """``[m, H]``: final hidden states of the m tokens just before ``token_ids`` (their KV in the
    cache), computed earlier in the step (a draft that is the model itself); they come first among
    the sample rows, as if recomputed."""


@dataclass
class RunnerOutput:
    sample_logits: torch.Tensor
    """[rows, vocab] float32: each sampling sequence's ``num_sample_rows`` rows, in input order."""
    sample_rows: list[int]
    """Index in the input of each sampling sequence, in the order of ``sample_logits``."""
    all_logits: dict[int, torch.Tensor]
    """Index in the input -> [len(token_ids), vocab] for the sequences with ``all_logits``."""
    hidden: torch.Tensor | None = None
    """[total new tokens, hidden]: the final hidden states (before the final norm) of every new
    token, in input order, when asked for (``execute(..., with_hidden=True)``)."""


class ModelRunner:
    """Runs ``model`` over ``cache``, whose block ids the callers hand out."""

    def __init__(self, model: CausalLM, cache: PagedKVCache, device: torch.device,
                 lora_slots: LoRASlots | None = None) -> None:
        self.model, self.cache, self.device = model, cache, device
        self.lora_slots = lora_slots
        """The adapters' weights that inputs' ``lora_slot`` index (multi-LoRA serving), else None."""
        self.max_len = 0
        """Longest whole sequence :meth:`hidden` takes: 0 unless made by :meth:`for_sequences`."""
        self._table: list[int] = []
        self._num_groups = max(cache.layer_groups) + 1
        # storage[g]: [keys and values, layers of the group, blocks, block_size, kv_heads, head_dim]
        self._kv_token_bytes = sum(t.shape[0] * t.shape[1] * t[0, 0, 0, 0].numel() * t.element_size()
                                   for t in cache.storage)
        """Bytes of keys and values one token holds, all layers (per-row re-reads in _metadata)."""

    @classmethod
    def for_sequences(cls, model: CausalLM, max_len: int, block_size: int = CacheConfig.block_size,
                      kv_cache_dtype: str = "auto") -> ModelRunner:
        """A runner over a throwaway paged KV cache of its own, for whole sequences of up to
        ``max_len`` tokens (:meth:`hidden`), on the model's device, in the model's dtype
        (``kv_cache_dtype`` ``int8``/``fp8``: keys and values stored quantized)."""
        cfg, weight = model.config, model.embed.weight
        groups, _ = layer_groups(cfg)
        num_blocks = -(-max_len // block_size) + 1
        cache = PagedKVCache(num_blocks, block_size, groups, cfg.num_kv_heads, cfg.head_dim, weight.dtype,
                             weight.device, kv_cache_dtype)
        runner = cls(model, cache, weight.device)
        runner.max_len, runner._table = max_len, list(range(1, num_blocks))
        return runner

    @torch.inference_mode()
    def execute(self, inputs: list[SequenceInput], with_hidden: bool = False) -> RunnerOutput:
        """One forward pass over every input's new tokens -> the logits they asked for (and, with
        ``with_hidden``, every new token's final hidden state: a speculative head's input)."""
        tokens: list[int] = []
        for item in inputs:
            tokens.extend(item.token_ids)
        starts = list(itertools.accumulate((len(item.token_ids) for item in inputs), initial=0))
        hidden = self._forward(tokens, self._metadata(inputs), self._lora_batch(inputs, len(tokens)))
        rows = [i for i, item in enumerate(inputs) if item.samples]
        picked = [p for i in rows for p in range(starts[i + 1] - inputs[i].num_sample_rows, starts[i + 1])]
        if any(inputs[i].hidden_before is not None for i in rows):  # rows computed earlier go first
            pieces = []
            for i in rows:
                item = inputs[i]
                own = hidden[starts[i]:starts[i + 1]]
                if item.hidden_before is not None:
                    own = torch.cat([item.hidden_before.to(own.dtype), own])
                pieces.append(own[len(own) - item.num_sample_rows:])
            # the head's kernel as for one row per sampling sequence: these rows' layers ran one row per
            # sequence too (the draft's passes, then this step), so they get plain decoding's bits
            logits = self.model.compute_logits(torch.cat(pieces), len(rows))
        else:  # rows the layers ran together (a verification's k + 1 a sequence): the fastest head kernel
            logits = self.model.compute_logits(hidden[picked])
        full = {i: self.model.compute_logits(hidden[starts[i]:starts[i + 1]])
                for i, item in enumerate(inputs) if item.all_logits}
        return RunnerOutput(logits, rows, full, hidden if with_hidden else None)

    def _lora_batch(self, inputs: list[SequenceInput], num_tokens: int) -> LoRABatch | None:
        """Each token's adapter slot, when some input has an adapter; else None (the base model alone)."""
        if all(item.lora_slot < 0 for item in inputs):
            return None
        if self.lora_slots is None:
            raise RuntimeError("an input has a lora_slot but this runner has no lora_slots")
        slots = torch.empty(num_tokens, dtype=torch.int32)
        start = 0
        for item in inputs:
            slots[start:start + len(item.token_ids)] = item.lora_slot
            start += len(item.token_ids)
        return LoRABatch(self.lora_slots.modules, slots.to(self.device))

    def _metadata(self, inputs: list[SequenceInput]) -> PagedAttentionMetadata:
        """The step's attention metadata. A step whose sequences all bring at most ``DECODE_ROWS_MAX``
        new tokens (decodes, speculative verifications, short prompt tails) is described as one
        decode row per token: token i of a sequence with c computed tokens attends to keys 0..c + i
        of its own blocks (causal, its new keys written before the layer attends). That is the
        attention a one-token decode at that position computes, by the same kernel, and the step
        takes the one-call decode path (fused_decode) where it applies."""
        short = max(len(item.token_ids) for item in inputs) <= DECODE_ROWS_MAX and self._kv_token_bytes * sum(
            (len(item.token_ids) - 1) * (item.num_computed + len(item.token_ids)) for item in inputs) \
            <= DECODE_ROWS_EXTRA_BYTES
        query_lens, context_lens, tables = [], [], []
        for item in inputs:
            n = len(item.token_ids)
            if short:
                query_lens.extend([1] * n)
                context_lens.extend(range(item.num_computed + 1, item.num_computed + n + 1))
                tables.extend([item.block_tables] * n)
            else:
                query_lens.append(n)
                context_lens.append(item.num_computed + n)
                tables.append(item.block_tables)
        per_group = [list(group) for group in zip(*tables)]
        return PagedAttentionMetadata.build(query_lens, context_lens, per_group, self.cache.block_size, self.device)

    def sequence_metadata(self, n: int) -> PagedAttentionMetadata:
        """The step metadata of a whole sequence of ``n`` tokens (positions 0..n-1) in this
        runner's own blocks (a :meth:`for_sequences` runner)."""
        if not 0 < n <= self.max_len:
            raise InvalidParameterError(f"sequence of {n} tokens; this runner takes 1..{self.max_len}")
        return PagedAttentionMetadata.build([n], [n], [[self._table]] * self._num_groups, self.cache.block_size,
                                            self.device)

    @torch.inference_mode()
    def hidden(self, ids: list[int]) -> torch.Tensor:
        """Final hidden states [len(ids), hidden] (before the final norm) of the whole sequence
        ``ids``, computed from scratch over this runner's own blocks (a :meth:`for_sequences` runner)."""
        return self._forward(ids, self.sequence_metadata(len(ids)))

    def _forward(self, tokens: list[int], meta: PagedAttentionMetadata, lora: LoRABatch | None = None) -> torch.Tensor:
        input_ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        return self.model(input_ids, meta.positions(self.device), self.cache, meta, lora)
