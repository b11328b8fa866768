"""Quantized KV cache (int8 and fp8 e4m3 rows with float16 scales): rounding bounds, attention
over a quantized pool on every path against a float64 reference of the stored values, memory
capacity, and the engine and perplexity end to end."""

from __future__ import annotations

import pytest
import torch

from tokenmill.attention.kv_cache import PagedKVCache
from tokenmill.attention.kv_quant import dequantize_rows, quantize_rows, row_bytes, storage_dtype
from tokenmill.errors import InvalidParameterError

from tests.attention.test_paged import BATCHES, PATHS, random_history, reference, run_paged

KINDS = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_rows_round_within_their_grid(kind):
    x = torch.randn(500, 3, 64) * torch.logspace(-3, 2, 500)[:, None, None]  # rows of very different sizes
    x[7] = 0.0
    q, scale = quantize_rows(x, KINDS[kind])
    assert q.dtype == KINDS[kind] and scale.dtype == torch.float16 and scale.shape == (500, 3)
    back = dequantize_rows(q, scale, torch.float32)
    assert torch.equal(back[7], torch.zeros(3, 64))
    amax = x.abs().amax(-1, keepdim=True)
    err = (back - x).abs()
    if kind == "int8":  # half a step of amax / 127, the float16 scale a hair larger
        assert (err <= amax / 127 * 0.5 * 1.01 + 1e-7).all()
    else:  # e4m3: 3 mantissa bits, relative error <= 2^-4 above the subnormals (2^-6 of the scale)
        assert (err <= x.abs() * 2 ** -4 + amax / 448 * 2 ** -9 + 1e-7).all()


def test_unknown_kv_cache_dtype_is_rejected():
    with pytest.raises(InvalidParameterError, match="kv_cache_dtype"):
        storage_dtype("int4", torch.bfloat16)
    from tokenmill.engine.config import CacheConfig

    with pytest.raises(InvalidParameterError, match="kv_cache_dtype"):
        CacheConfig(kv_cache_dtype="float8")


def dequantized_history(ks, vs, dtype, kind):
    """What a quantized pool stores for these keys and values, back in ``dtype``."""
    return ([dequantize_rows(*quantize_rows(t, KINDS[kind]), dtype) for t in ts] for ts in (ks, vs))


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(16, 6, 2), (64, 9, 3), (128, 4, 1)])
@pytest.mark.parametrize("window", [None, 11], ids=lambda w: f"window{w}")
@pytest.mark.parametrize("batch", ["ragged", "long-decodes", "one-prompt"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("device", PATHS)
def test_attention_over_quantized_pool_matches_reference(device, dtype, batch, window, head_dim, heads, kv_heads,
                                                         kind):
    """Every token, the step's own included, attends to the values as the pool stores them."""
    batch = BATCHES[batch]
    ks, vs, qs = random_history(batch, heads, kv_heads, dtype, head_dim=head_dim)
    kq, vq = dequantized_history(ks, vs, dtype, kind)
    expected = reference(batch, kq, vq, qs, head_dim ** -0.5, window)
    out, cache, _ = run_paged(batch, ks, vs, qs, 4, window, True, dtype, device, kv_cache_dtype=kind)
    assert cache.layer(0).keys.dtype == KINDS[kind] and out.dtype == dtype
    assert (out.double() - expected).abs().max().item() <= (1e-5 if dtype == torch.float32 else 3e-2)


@pytest.mark.parametrize("kind", ["auto", "int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_portable_path_agrees_with_avx512_path(dtype, kind):
    """The kernel's portable loop (machines without AVX-512) computes the same attention."""
    from tests.kernel_utils import require_kernels

    kernels = require_kernels()
    g = torch.Generator().manual_seed(3)
    blocks, bs, kv_heads, head_dim = 40, 16, 2, 64
    k = torch.randn(blocks, bs, kv_heads, head_dim, generator=g)
    v = torch.randn(blocks, bs, kv_heads, head_dim, generator=g)
    if kind == "auto":
        (kc, ksc), (vc, vsc) = (k.to(dtype), torch.empty(0)), (v.to(dtype), torch.empty(0))
    else:
        (kc, ksc), (vc, vsc) = quantize_rows(k, KINDS[kind]), quantize_rows(v, KINDS[kind])
    tables = torch.randperm(blocks - 1, generator=g)[:36].add(1).view(3, 12).to(torch.int32)
    start, end = torch.tensor([0, 5, 17], dtype=torch.int32), torch.tensor([190, 6, 150], dtype=torch.int32)
    q = torch.randn(3, 6, head_dim, generator=g).to(dtype)
    fast = kernels.paged_decode_attention(q, kc, vc, ksc, vsc, tables, start, end, 0.125)
    portable = kernels.paged_decode_attention(q, kc, vc, ksc, vsc, tables, start, end, 0.125,
                                              path=kernels.KernelPath.PORTABLE)
    assert (fast.double() - portable.double()).abs().max().item() <= (1e-5 if dtype == torch.float32 else 2e-2)


def test_quantized_pool_holds_1_9x_the_tokens_of_bfloat16():
    bf16 = PagedKVCache.bytes_per_block(16, 3, 64, torch.bfloat16, 30)
    for kind in KINDS.values():
        per_block = PagedKVCache.bytes_per_block(16, 3, 64, kind, 30)
        assert per_block == 2 * 30 * 16 * 3 * (64 + 2) == 2 * 30 * 16 * 3 * row_bytes(64, kind)
        budget = 256 << 20
        ratio = PagedKVCache.num_blocks_for_budget(budget, 16, 3, 64, kind, 30) / \
            PagedKVCache.num_blocks_for_budget(budget, 16, 3, 64, torch.bfloat16, 30)
        assert ratio >= 1.9
        cache = PagedKVCache(10, 16, [0] * 30, 3, 64, torch.bfloat16, "cpu", "int8" if kind == torch.int8 else "fp8")
        stored = sum(t.numel() * t.element_size() for t in cache.storage + cache.scales)
        assert stored == 10 * per_block < 10 * bf16


def test_copy_blocks_copies_the_scales_too():
    cache = PagedKVCache(6, 4, [0, 0], 2, 16, torch.float32, "cpu", "int8")
    layer = cache.layer(1)
    slots = torch.arange(4, 8)  # block 1
    layer.write(slots, torch.randn(4, 2, 16), torch.randn(4, 2, 16))
    cache.copy_blocks(0, [(1, 3)])
    for which in ("keys", "values", "key_scales", "value_scales"):
        assert torch.equal(getattr(layer, which)[3], getattr(layer, which)[1])
    k1, v1 = layer.read(slots, torch.float32)
    k3, v3 = layer.read(torch.arange(12, 16), torch.float32)
    assert torch.equal(k1, k3) and torch.equal(v1, v3)


# ---- end to end ----

transformers = pytest.importorskip("transformers")

from tokenmill import LLM, SamplingParams  # noqa: E402

from tests.model_utils import save_byte_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def tiny_dir64(tmp_path_factory):
    """A tiny Llama with head_dim 64 (the kernel's vector paths), peaked logits."""
    path = tmp_path_factory.mktemp("tiny-llama-d64")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                                      tie_word_embeddings=True, eos_token_id=256, bos_token_id=None)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(25)
    model.save_pretrained(path)
    save_byte_tokenizer(path)
    return path


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_engine_generates_with_a_quantized_cache(tiny_dir64, kind):
    budget = 256 << 10  # small enough that max_num_seqs x max_model_len does not cap it
    plain = LLM(str(tiny_dir64), dtype="bfloat16", kv_cache_memory=budget, max_num_seqs=8)
    quant = LLM(str(tiny_dir64), dtype="bfloat16", kv_cache_memory=budget, max_num_seqs=8, kv_cache_dtype=kind)
    assert quant.engine.kv_capacity_tokens >= 1.9 * plain.engine.kv_capacity_tokens
    prompts = ["hello world, this is a longer prompt " * 3, "The quick brown fox", "1 2 3 4 5 6 7", "def f(x):"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    got = [o.outputs[0].token_ids for o in quant.generate(prompts, params)]
    assert sum(a == b for a, b in zip(expected, got)) >= 3, (expected, got)
    assert quant.engine.num_used_blocks == 0


def test_smollm2_perplexity_with_int8_kv_cache_within_1_percent(smollm2_gguf):
    from tokenmill.eval.corpus import read_tokens
    from tokenmill.eval.corpus import fetch_corpus
    from tokenmill.eval.perplexity import perplexity
    from tokenmill.loader import load_model

    loaded = load_model(str(smollm2_gguf), torch.bfloat16, "cpu")
    ids = read_tokens(loaded.tokenizer, fetch_corpus(), 1024)  # measured: int8 +0.03%, fp8 +0.15%
    base = perplexity(loaded.model, ids, progress=False).perplexity
    for kind, bound in (("int8", 0.01), ("fp8", 0.03)):
        ppl = perplexity(loaded.model, ids, progress=False, kv_cache_dtype=kind).perplexity
        assert ppl != base  # the quantized cache is really in the path
        assert abs(ppl / base - 1) <= bound, (kind, ppl, base)


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_write_stores_exactly_what_quantize_rows_gives(kind, dtype):
    """The C++ write (used on CPU when built) and the torch rounding (everywhere else) agree bit for bit."""
    from tests.kernel_utils import require_kernels

    kernels = require_kernels()
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(37, 3, 64, generator=g) * torch.logspace(-6, 3, 37)[:, None, None]).to(dtype)
    x[4] = 0.0
    slots = torch.randperm(80, generator=g)[:37]
    rows = torch.zeros(80, 3, 64, dtype=KINDS[kind])
    scales = torch.zeros(80, 3, dtype=torch.float16)
    kernels.write_quantized_kv(x, slots, rows, scales)
    q, scale = quantize_rows(x, KINDS[kind])
    assert torch.equal(rows[slots].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(scales[slots], scale)
    with pytest.raises(RuntimeError, match="slot out of range"):
        kernels.write_quantized_kv(x[:1], torch.tensor([80]), rows, scales)
