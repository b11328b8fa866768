"""Paged KV cache and attention: against a float64 reference and HF
transformers end to end (tiny random Llama and Gemma 3 run in chunks through the paged cache)."""

from __future__ import annotations

import random

import pytest
import torch

from tokenmill.attention.kv_cache import PagedKVCache
from tokenmill.attention.metadata import PagedAttentionMetadata
from tokenmill.attention.paged import PagedAttentionBackend
from tokenmill.attention.plan import DecodeSeq, PrefillSeq

D = 16
NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=NO_CUDA)]
# CPU: tokenmill's paged-decode kernel for one-token sequences, or the PyTorch (SDPA) path
PATHS = ["cpu-kernel", "cpu-torch", pytest.param("cuda", marks=NO_CUDA)]


# (tokens already in cache, new tokens) per sequence
RAGGED = [(0, 5), (10, 1), (37, 8), (3, 1), (0, 1), (64, 1), (21, 19)]  # prompts, decodes, mid-context chunks
DECODES = [(5, 1), (17, 1), (40, 1), (0, 1), (63, 1)]
# decodes of very different lengths, split into several padded batches, around a prefill chunk
LONG_DECODES = [(999, 1), (19, 1), (299, 1), (70, 9), (599, 1), (4, 1), (700, 1)]
BATCHES = {"ragged": RAGGED, "decodes": DECODES, "long-decodes": LONG_DECODES, "one-decode": [(45, 1)],
           "one-chunk": [(30, 12)], "one-prompt": [(0, 33)]}


def fallen_out(num_blocks_in_table: int, computed: int, window: int | None, block_size: int) -> set[int]:
    """Blocks whose keys the first query after ``computed`` tokens can no longer see."""
    if window is None:
        return set()
    first_key = computed - window + 1
    return {j for j in range(num_blocks_in_table) if (j + 1) * block_size <= first_key}


def make_tables(batch, block_size: int, window: int | None, shuffled: bool,
                seed: int = 0) -> tuple[list[list[int]], int]:
    """Block ids from 1.. (consecutive per sequence, or shuffled over a pool twice as large), null
    block 0 where blocks fell out of the window; and the number of blocks of the pool."""
    need = [-(-(done + new) // block_size) for done, new in batch]
    num_blocks = 1 + 2 * sum(need)
    ids = list(range(1, num_blocks))
    if shuffled:
        random.Random(seed).shuffle(ids)
    tables, used = [], 0
    for (done, _), n in zip(batch, need):
        table = ids[used:used + n]
        used += n
        tables.append([0 if j in fallen_out(n, done, window, block_size) else b for j, b in enumerate(table)])
    return tables, num_blocks


def random_history(batch, heads: int, kv_heads: int, dtype, seed: int = 0, head_dim: int = D):
    """Per sequence: keys/values of all its positions [ctx, Hkv, D], and queries of its new tokens [n, H, D]."""
    g = torch.Generator().manual_seed(seed)
    ks = [torch.randn(done + new, kv_heads, head_dim, generator=g).to(dtype) for done, new in batch]
    vs = [torch.randn(done + new, kv_heads, head_dim, generator=g).to(dtype) for done, new in batch]
    qs = [torch.randn(new, heads, head_dim, generator=g).to(dtype) for _, new in batch]
    return ks, vs, qs


def reference(batch, ks, vs, qs, scale: float, window: int | None) -> torch.Tensor:
    """Naive float64 causal attention with sliding window, [T, H, D]."""
    out = []
    for (done, new), k, v, q in zip(batch, ks, vs, qs):
        group = q.shape[1] // k.shape[1]
        k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
        q_pos = torch.arange(done, done + new)[:, None]
        k_pos = torch.arange(done + new)[None, :]
        allowed = (k_pos <= q_pos) & ((q_pos - k_pos < window) if window is not None else True)
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        out.append(torch.einsum("hqk,khd->qhd", probs, v))
    return torch.cat(out)


def run_paged(batch, ks, vs, qs, block_size: int, window: int | None, shuffled: bool, dtype, device="cpu",
              kv_cache_dtype: str = "auto"):
    """Write each sequence's history into a paged cache, run one step; (output on CPU, cache, metadata).

    ``device``: a device, or a PATHS entry (cpu-kernel / cpu-torch choose the CPU decode path)."""
    use_kernel = {"cpu-kernel": True, "cpu-torch": False}.get(device)
    device = "cpu" if use_kernel is not None else device
    kv_heads, head_dim = ks[0].shape[1:]
    ks, vs, qs = ([t.to(device) for t in ts] for ts in (ks, vs, qs))
    tables, num_blocks = make_tables(batch, block_size, window, shuffled)
    cache = PagedKVCache(num_blocks, block_size, [0], kv_heads, head_dim, dtype, device, kv_cache_dtype)
    layer = cache.layer(0)
    for (done, _), table, k, v in zip(batch, tables, ks, vs):
        kept = [p for p in range(done) if table[p // block_size] != 0]
        if kept:
            slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in kept], device=device)
            layer.write(slots, k[kept], v[kept])
    meta = PagedAttentionMetadata.build([n for _, n in batch], [d + n for d, n in batch], [tables], block_size, device)
    new_k = torch.cat([k[d:] for (d, _), k in zip(batch, ks)])
    new_v = torch.cat([v[d:] for (d, _), v in zip(batch, vs)])
    out = PagedAttentionBackend(use_kernel).forward(torch.cat(qs), new_k, new_v, layer, meta, head_dim ** -0.5,
                                                    window)
    assert out.device == new_k.device
    return out.cpu(), cache, meta


@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (6, 1), (4, 4)], ids=["gqa", "mqa", "mha"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("window", [None, 4, 11], ids=lambda w: f"window{w}")
@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize("device", PATHS)
def test_float32_matches_reference(device, batch, window, block_size, heads, kv_heads):
    batch = BATCHES[batch]
    ks, vs, qs = random_history(batch, heads, kv_heads, torch.float32)
    expected = reference(batch, ks, vs, qs, D ** -0.5, window)
    for shuffled in (False, True):
        out, _, _ = run_paged(batch, ks, vs, qs, block_size, window, shuffled, torch.float32, device)
        assert (out.double() - expected).abs().max().item() <= 1e-5


@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (6, 1)], ids=["gqa", "mqa"])
@pytest.mark.parametrize("window", [None, 11], ids=lambda w: f"window{w}")
@pytest.mark.parametrize("batch", ["ragged", "decodes", "long-decodes"])
@pytest.mark.parametrize("device", PATHS)
def test_bfloat16_matches_reference(device, batch, window, heads, kv_heads):
    batch = BATCHES[batch]
    ks, vs, qs = random_history(batch, heads, kv_heads, torch.bfloat16)
    expected = reference(batch, ks, vs, qs, D ** -0.5, window)
    out, _, _ = run_paged(batch, ks, vs, qs, 4, window, True, torch.bfloat16, device)
    assert out.dtype == torch.bfloat16
    # outputs are averages of N(0, 1) values: a few bfloat16 roundings (2^-8) of q, p and the output
    assert (out.double() - expected).abs().max().item() <= 3e-2


def test_decodes_are_batched_by_length():
    ks, vs, qs = random_history(LONG_DECODES, 6, 2, torch.float32)
    _, _, meta = run_paged(LONG_DECODES, ks, vs, qs, 4, None, True, torch.float32)
    plan = meta.plan(0, None)
    # rows of the flat batch (the 9-token chunk takes rows 3..11), by context: 1000 | 701, 600 | 300 | 20, 5
    assert [d.rows.tolist() for d in plan.decodes] == [[0], [12, 14], [2], [1, 13]]
    assert plan.decodes[0].mask is None and plan.decodes[1].mask.shape == (2, 1, 1, 704)
    assert [(s.start, s.end) for s in plan.prefills] == [(3, 12)]
    assert meta.plan(0, None) is plan  # worked out once per step, shared by the layers


def test_plan_gives_each_sequence_its_visible_blocks_and_key_range():
    """The example of tokenmill.attention.plan: block_size 4, window 5, a decode at position 9 of
    table [7, 2, 9] sees keys 5..9, tokens 1..5 of blocks [2, 9]."""
    meta = PagedAttentionMetadata.build([1, 3], [10, 7], [[[7, 2, 9], [3, 4]]], 4)
    plan = meta.plan(0, 5)
    assert plan.decode_seqs == [DecodeSeq(row=0, blocks=[2, 9], key_start=1, key_end=6)]
    # the chunk at positions 4..6: its first query (4) sees from key 0
    assert plan.prefill_seqs == [PrefillSeq(start=1, end=4, context_len=7, blocks=[3, 4], key_start=0, key_end=7)]
    assert plan.prefill_seqs[0].first_key == 0 and not plan.all_rows_decode
    k = plan.kernel_decodes()
    assert k.rows.tolist() == [0] and k.block_tables.tolist() == [[2, 9]]
    assert (k.key_start.tolist(), k.key_end.tolist()) == ([1], [6])
    p = plan.kernel_prefills()
    assert p.rows == slice(1, 4) and p.query_start.tolist() == [0, 3] and p.block_tables.tolist() == [[3, 4]]
    assert meta.plan(0, None).decode_seqs == [DecodeSeq(row=0, blocks=[7, 2, 9], key_start=0, key_end=10)]


def test_new_keys_land_in_their_slots():
    batch = RAGGED
    ks, vs, qs = random_history(batch, 6, 2, torch.float32)
    _, cache, meta = run_paged(batch, ks, vs, qs, 4, None, True, torch.float32)
    layer = cache.layer(0)
    for i, ((done, new), k, v) in enumerate(zip(batch, ks, vs)):
        table = meta.block_tables[0][i]
        for p in range(done + new):
            assert torch.equal(layer.keys[table[p // 4], p % 4], k[p])
            assert torch.equal(layer.values[table[p // 4], p % 4], v[p])
    assert layer.keys[0].abs().sum().item() == 0  # the null block is never written


def test_metadata_slots_positions_and_last_tokens():
    meta = PagedAttentionMetadata.build([3, 1, 2], [3, 9, 6], [[[5], [2, 7, 4], [1, 8]], [[3], [6, 0, 2], [4, 5]]], 4)
    assert meta.query_start_loc == [0, 3, 4, 6]
    assert meta.slot_mapping[0].tolist() == [20, 21, 22, 4 * 4 + 0, 8 * 4 + 0, 8 * 4 + 1]
    assert meta.slot_mapping[1].tolist() == [12, 13, 14, 2 * 4 + 0, 5 * 4 + 0, 5 * 4 + 1]
    assert meta.slot_mapping[0].dtype == torch.int64
    assert meta.positions().tolist() == [0, 1, 2, 8, 4, 5]
    assert meta.last_token_indices() == [2, 3, 5]
    with pytest.raises(ValueError, match="cannot hold 9 tokens"):
        PagedAttentionMetadata.build([1], [9], [[[1, 2]]], 4)
    with pytest.raises(ValueError, match="null block"):
        PagedAttentionMetadata.build([2], [9], [[[0, 3, 0]]], 4)
    PagedAttentionMetadata.build([1], [9], [[[0, 0, 3]]], 4)  # fallen-out blocks may be null


def test_copy_blocks_copies_every_layer_of_the_group_only():
    cache = PagedKVCache([8, 6], 4, [0, 1, 0, 1], 2, D, torch.float32)
    for store in cache.storage:
        store.copy_(torch.randn_like(store))
    before = [s.clone() for s in cache.storage]
    cache.copy_blocks(0, [(1, 2), (2, 3), (5, 6)])  # sources read before writing: 3 gets the old block 2
    for layer in (0, 2):
        for tensor, old in ((cache.layer(layer).keys, before[0][0]), (cache.layer(layer).values, before[0][1])):
            j = layer // 2
            assert torch.equal(tensor[2], old[j, 1]) and torch.equal(tensor[3], old[j, 2])
            assert torch.equal(tensor[6], old[j, 5]) and torch.equal(tensor[1], old[j, 1])
            assert torch.equal(tensor[[0, 4, 5, 7]], old[j, [0, 4, 5, 7]])
    assert torch.equal(cache.storage[1], before[1])
    cache.copy_blocks(1, [])
    assert cache.layer(1).keys.shape == (6, 4, 2, D) and cache.layer(3).group == 1


def test_budget_sizing():
    per_block = PagedKVCache.bytes_per_block(16, 3, 64, torch.bfloat16, 30)
    assert per_block == 2 * 30 * 16 * 3 * 64 * 2
    assert PagedKVCache.num_blocks_for_budget(1 << 30, 16, 3, 64, torch.bfloat16, 30) == (1 << 30) // per_block
    n = PagedKVCache.num_blocks_for_budget(10 * per_block + per_block - 1, 16, 3, 64, torch.bfloat16, 30)
    assert n == 10
    cache = PagedKVCache(n, 16, [0] * 30, 3, 64, torch.bfloat16)
    assert sum(s.numel() * s.element_size() for s in cache.storage) == n * per_block
    with pytest.raises(ValueError):
        PagedKVCache([4], 16, [0, 1], 3, 64, torch.bfloat16)


# ---- end to end: tiny random HF models run in chunks through the paged cache ----

transformers = pytest.importorskip("transformers")

from tokenmill.loading.checkpoint import open_hf  # noqa: E402
from tokenmill.models.builder import build_model  # noqa: E402

from tests.models.test_parity_tiny import CONFIGS  # noqa: E402  (the same tiny models)


class ConsecutiveBlocks:
    """Test-side block bookkeeping: sequence i owns blocks ``1 + i * per_seq ...`` in every group
    (in reverse order when ``reverse``, so that gathers are not plain slices); on sliding-window
    groups, blocks out of the window are replaced by the null block."""

    def __init__(self, per_seq: int, block_size: int, windows: list[int | None], reverse: bool) -> None:
        self.per_seq, self.block_size, self.windows, self.reverse = per_seq, block_size, windows, reverse

    def tables(self, computed: list[int], total: list[int]) -> list[list[list[int]]]:
        per_group = []
        for window in self.windows:
            tables = []
            for i, (done, ctx) in enumerate(zip(computed, total)):
                n = -(-ctx // self.block_size)
                ids = [1 + i * self.per_seq + (self.per_seq - 1 - j if self.reverse else j) for j in range(n)]
                dropped = fallen_out(n, done, window, self.block_size)
                tables.append([0 if j in dropped else b for j, b in enumerate(ids)])
            per_group.append(tables)
        return per_group


def _hf_model(name: str, path):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[name](), dtype=torch.float32).eval()
    with torch.no_grad():  # random norm weights and biases, so that every parameter matters
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(torch.randn_like(p) * 0.3 + (1.0 if name != "gemma3" else 0.0))
    model.save_pretrained(path)
    return model


@torch.inference_mode()
def paged_logits(model, prompts: list[list[int]], chunks: list[list[int]], block_size: int,
                 reverse: bool, device: str = "cpu") -> list[torch.Tensor]:
    """Logits of every position of every prompt, all prompts advancing together: sequence i takes
    ``chunks[i][step % len]`` new tokens per step (1 = a decode step fed the known next token)."""
    cfg = model.config
    groups = [1 if cfg.sliding_window and cfg.layer_type(i) == "sliding" and "full" in cfg.layer_types else 0
              for i in range(cfg.num_layers)]
    windows = [None, cfg.sliding_window][:max(groups) + 1]
    per_seq = -(-max(map(len, prompts)) // block_size)
    blocks = ConsecutiveBlocks(per_seq, block_size, windows, reverse)
    cache = PagedKVCache(1 + per_seq * len(prompts), block_size, groups, cfg.num_kv_heads, cfg.head_dim,
                         torch.float32, device)
    done, out, step = [0] * len(prompts), [[] for _ in prompts], 0
    while any(d < len(p) for d, p in zip(done, prompts)):
        active = [i for i, p in enumerate(prompts) if done[i] < len(p)]
        lens = [min(chunks[i][step % len(chunks[i])], len(prompts[i]) - done[i]) for i in active]
        tokens = [t for i, n in zip(active, lens) for t in prompts[i][done[i]:done[i] + n]]
        total = [done[i] + n for i, n in zip(active, lens)]
        tables = blocks.tables([done[i] for i in active], total)
        meta = PagedAttentionMetadata.build(lens, total, tables, block_size, device)
        hidden = model(torch.tensor(tokens, device=device), meta.positions(device), cache, meta)
        logits = model.compute_logits(hidden).cpu()
        for i, n, start in zip(active, lens, meta.query_start_loc):
            out[i].append(logits[start:start + n])
            done[i] += n
        step += 1
    return [torch.cat(o) for o in out]


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("device", DEVICES)
def test_tiny_model_logits_match_hf_through_paged_cache(device, name, tmp_path):
    hf = _hf_model(name, tmp_path)
    ours = build_model(open_hf(tmp_path), torch.float32, device)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 320, (n,), generator=g).tolist() for n in (40, 23, 31)]
    with torch.no_grad():
        expected = [hf(torch.tensor([p])).logits[0] for p in prompts]
    chunks = [[7, 1, 1, 5], [1, 9, 1], [13, 1, 1, 1, 3]]  # mixed prefill chunks and decodes in one step
    for block_size, reverse in ((4, False), (16, True), (1, True)):
        got = paged_logits(ours, prompts, chunks, block_size, reverse, device)
        for g_, e in zip(got, expected):
            assert (g_ - e).abs().max().item() <= 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel_decode_does_not_depend_on_the_batch(dtype):
    """A one-token sequence gets bit-identical attention alone or among others (batch invariance)."""
    ks, vs, qs = random_history(LONG_DECODES, 6, 2, dtype)
    together, _, meta = run_paged(LONG_DECODES, ks, vs, qs, 4, None, True, dtype, "cpu-kernel")
    for i, seq in enumerate(LONG_DECODES):
        if seq[1] != 1:
            continue
        alone, _, _ = run_paged([seq], [ks[i]], [vs[i]], [qs[i]], 4, None, True, dtype, "cpu-kernel")
        row = meta.query_start_loc[i]
        assert torch.equal(alone[0], together[row])


# ---- head sizes of real models (the kernel's bfloat16 dot-product path needs head_dim % 32 == 0) ----

@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 9, 3), (128, 8, 2), (256, 4, 1), (80, 4, 2)],
                         ids=["smollm2", "gqa128", "gemma3", "d80"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("device", PATHS)
def test_real_head_sizes_match_reference(device, dtype, head_dim, heads, kv_heads):
    batch = LONG_DECODES
    ks, vs, qs = random_history(batch, heads, kv_heads, dtype, head_dim=head_dim)
    expected = reference(batch, ks, vs, qs, head_dim ** -0.5, None)
    out, _, _ = run_paged(batch, ks, vs, qs, 16, None, True, dtype, device)
    assert (out.double() - expected).abs().max().item() <= (1e-5 if dtype == torch.float32 else 3e-2)
