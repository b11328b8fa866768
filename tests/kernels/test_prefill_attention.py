"""The paged prefill attention kernel against a float64 reference: whole prompts, chunks after a
cached prefix, sliding windows, GQA / MQA / MHA, scattered block tables, float32 and bfloat16;
and its results independent of the other sequences of the call and of the thread count."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from tests.kernel_utils import require_kernels

ops = require_kernels()
DTYPES = [torch.float32, torch.bfloat16]

# (tokens already in cache, new tokens) per sequence: whole prompts, chunks after a prefix
SEQS = [(0, 37), (50, 20), (0, 2), (13, 64), (0, 70), (90, 3)]


class Case:
    """Sequences written into a paged cache with scattered block ids; their queries as one batch."""

    def __init__(self, seqs, heads: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                 window: int | None, seed: int = 0, shuffled: bool = True) -> None:
        g = torch.Generator().manual_seed(seed)
        self.seqs, self.window, self.scale = seqs, window, head_dim ** -0.5
        self.ks = [torch.randn(d + n, kv_heads, head_dim, generator=g).to(dtype) for d, n in seqs]
        self.vs = [torch.randn(d + n, kv_heads, head_dim, generator=g).to(dtype) for d, n in seqs]
        self.qs = [torch.randn(n, heads, head_dim, generator=g).to(dtype) for _, n in seqs]
        need = [-(-(d + n) // block_size) for d, n in seqs]
        num_blocks = 1 + 2 * sum(need)
        ids = list(range(1, num_blocks))
        if shuffled:
            random.Random(seed).shuffle(ids)
        self.key_cache = torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
        self.value_cache = torch.zeros_like(self.key_cache)
        tables, starts, key_start, key_end, used = [], [0], [], [], 0
        for (done, new), n, k, v in zip(seqs, need, self.ks, self.vs):
            table = ids[used:used + n]
            used += n
            for p in range(done + new):
                self.key_cache[table[p // block_size], p % block_size] = k[p]
                self.value_cache[table[p // block_size], p % block_size] = v[p]
            # like the backend's plan: the table from the block of the first visible key
            first_key = 0 if window is None else max(0, done - window + 1)
            first_block = first_key // block_size
            tables.append(table[first_block:])
            key_start.append(first_key - first_block * block_size)
            key_end.append(done + new - first_block * block_size)
            starts.append(starts[-1] + new)
        width = max(len(t) for t in tables)
        self.block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        self.query_start = torch.tensor(starts, dtype=torch.int32)
        self.key_start = torch.tensor(key_start, dtype=torch.int32)
        self.key_end = torch.tensor(key_end, dtype=torch.int32)
        self.q = torch.cat(self.qs)

    def run(self, path: str = "FASTEST") -> torch.Tensor:
        return ops.paged_prefill_attention(self.q, self.key_cache, self.value_cache, self.block_tables,
                                           self.query_start, self.key_start, self.key_end, self.window or 0,
                                           self.scale, path=ops.KernelPath[path])

    def _allowed(self, done: int, new: int) -> torch.Tensor:
        q_pos = torch.arange(done, done + new)[:, None]
        k_pos = torch.arange(done + new)[None, :]
        allowed = k_pos <= q_pos
        if self.window is not None:
            allowed &= q_pos - k_pos < self.window
        return allowed

    def reference(self) -> torch.Tensor:
        """Naive float64 attention, [T, H, D]."""
        out = []
        for (done, new), k, v, q in zip(self.seqs, self.ks, self.vs, self.qs):
            group = q.shape[1] // k.shape[1]
            k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
            scores = torch.einsum("qhd,khd->hqk", q.double(), k) * self.scale
            probs = scores.masked_fill(~self._allowed(done, new), float("-inf")).softmax(-1)
            out.append(torch.einsum("hqk,khd->qhd", probs, v))
        return torch.cat(out)

    def sdpa(self) -> torch.Tensor:
        """PyTorch's SDPA in the inputs' dtype, [T, H, D]."""
        out = []
        for (done, new), k, v, q in zip(self.seqs, self.ks, self.vs, self.qs):
            o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                               v.transpose(0, 1)[None], attn_mask=self._allowed(done, new),
                                               scale=self.scale, enable_gqa=True)
            out.append(o[0].transpose(0, 1))
        return torch.cat(out)


def _err(got: torch.Tensor, expected: torch.Tensor) -> float:
    return (got.double() - expected).abs().max().item()


def check(case: Case, got: torch.Tensor) -> None:
    expected = case.reference()
    assert got.shape == case.q.shape and got.dtype == case.q.dtype
    if case.q.dtype == torch.float32:
        assert _err(got, expected) <= 1e-5
    else:
        # bfloat16: within the rounding SDPA itself makes (its weights and output rounded to 2^-8):
        # the largest error about as large (one output rounding apart), the mean error no larger
        sdpa = case.sdpa()
        assert _err(got, expected) <= max(1.5 * _err(sdpa, expected), 2 ** -8)
        mean, sdpa_mean = ((x.double() - expected).abs().mean().item() for x in (got, sdpa))
        assert mean <= 1.05 * sdpa_mean


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (6, 1), (4, 4)], ids=["gqa", "mqa", "mha"])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("window", [None, 7, 50], ids=lambda w: f"window{w}")
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_matches_reference(dtype, window, block_size, heads, kv_heads):
    case = Case(SEQS, heads, kv_heads, 64, block_size, dtype, window)
    check(case, case.run())


@pytest.mark.parametrize("head_dim", [16, 32, 80, 96, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_head_dims(dtype, head_dim):
    case = Case(SEQS[:4], 4, 2, head_dim, 4, dtype, 11)
    check(case, case.run())


@pytest.mark.parametrize("window", [None, 5], ids=lambda w: f"window{w}")
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_portable_path(dtype, window):
    case = Case(SEQS, 6, 2, 32, 4, dtype, window)
    check(case, case.run(path="PORTABLE"))


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_consecutive_blocks_and_one_sequence(dtype):
    case = Case([(0, 100)], 9, 3, 64, 16, dtype, None, shuffled=False)
    check(case, case.run())


def test_long_prompt_smollm2_shape():
    """A 512-token prompt in SmolLM2-135M's attention shape (9 query heads, 3 KV heads, head_dim 64)."""
    case = Case([(0, 512)], 9, 3, 64, 16, torch.bfloat16, None)
    check(case, case.run())


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_sequence_does_not_depend_on_the_others(dtype):
    case = Case(SEQS, 9, 3, 64, 4, dtype, 50)
    together = case.run()
    starts = case.query_start.tolist()
    for i, seq in enumerate(SEQS):
        # the same cache and queries, sequence i alone in the call
        one = Case.__new__(Case)
        one.__dict__.update(case.__dict__)
        one.block_tables = case.block_tables[i:i + 1]
        one.key_start, one.key_end = case.key_start[i:i + 1], case.key_end[i:i + 1]
        one.query_start = torch.tensor([0, seq[1]], dtype=torch.int32)
        one.q = case.q[starts[i]:starts[i + 1]].contiguous()
        assert torch.equal(one.run(), together[starts[i]:starts[i + 1]])


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_thread_count_does_not_change_results(dtype):
    case = Case(SEQS + [(0, 300)], 9, 3, 64, 16, dtype, None)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = case.run()
        torch.set_num_threads(2)
        two = case.run()
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_rejects_bad_ranges():
    case = Case(SEQS[:2], 4, 2, 32, 4, torch.float32, None)
    with pytest.raises(RuntimeError):
        ops.paged_prefill_attention(case.q, case.key_cache, case.value_cache, case.block_tables,
                                    case.query_start, case.key_start, case.key_end + 1000, 0, case.scale)
    with pytest.raises(RuntimeError):
        ops.paged_prefill_attention(case.q[:-1].contiguous(), case.key_cache, case.value_cache, case.block_tables,
                                    case.query_start, case.key_start, case.key_end, 0, case.scale)
