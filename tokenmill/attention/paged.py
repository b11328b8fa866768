"""Attention over a paged KV cache: :class:`PagedAttentionBackend`, the backend of CPU and CUDA.

It receives a layer's storage (``tokenmill.attention.kv_cache``) and the step's metadata
(``tokenmill.attention.metadata``), writes the new keys and values, and attends along the
step's :class:`~tokenmill.attention.plan.AttentionPlan` for the layer's (KV group, window): on
CPU by tokenmill's C++ kernels when ``tokenmill.kernels.dispatch`` has them, else by PyTorch's
``scaled_dot_product_attention``. Both read the same keys and give the same result within
float rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.attention.kv_cache import PagedLayer
from tokenmill.attention.metadata import PagedAttentionMetadata
from tokenmill.attention.plan import DecodeBatch
from tokenmill.kernels import dispatch

_EMPTY = torch.empty(0)


def _or_empty(t: torch.Tensor | None) -> torch.Tensor:
    """The kernels take an empty tensor for an absent one (the scales of an unquantized cache)."""
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
        """None: the C++ kernels where they apply; True: likewise, raising where they could not be
        built; False: never. (The compiled module itself is not kept on the backend, asked of
        ``dispatch`` per call instead: a model holding the backend must stay deep-copyable.)"""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: PagedLayer,
                meta: PagedAttentionMetadata, scale: float, sliding_window: int | None) -> torch.Tensor:
        slots = meta.slot_mapping[cache.group]
        cache.write(slots, k, v)
        plan = meta.plan(cache.group, sliding_window)
        if cache.quantized and plan.prefill_seqs:  # new tokens attend to the values as stored
            k, v = cache.read(slots, q.dtype)
        kernels = dispatch.for_attention(q, self.use_cpu_kernel) if plan.decode_seqs or plan.prefill_seqs else None
        if not plan.decode_seqs:
            out = None
        elif kernels is not None:
            d = plan.kernel_decodes()
            qd = q if d.rows is None else q.index_select(0, d.rows)
            o = kernels.paged_decode_attention(qd.contiguous(), cache.keys, cache.values,
                                               _or_empty(cache.key_scales), _or_empty(cache.value_scales),
                                               d.block_tables, d.key_start, d.key_end, scale)
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
                                                p.query_start, p.key_start, p.key_end, sliding_window or 0, scale)
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
    def _decodes(q: torch.Tensor, cache: PagedLayer, d: DecodeBatch, scale: float) -> torch.Tensor:
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
