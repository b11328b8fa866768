"""The one-call CPU decode stack (tokenmill.models.fused_decode) gives bit-identical hidden states
and KV cache contents to the layer-by-layer path, for every tiny model family, dense and
quantized linears, float32 and bfloat16, plain and quantized KV caches; and steps it cannot take
(prefill chunks, gradients) keep the layer-by-layer path."""

from __future__ import annotations

import pytest
import torch

from tokenmill.attention.kv_cache import PagedKVCache
from tokenmill.attention.metadata import PagedAttentionMetadata
from tokenmill.config import layer_groups
from tokenmill.loading.checkpoint import open_hf
from tokenmill.models.builder import build_model
from tokenmill.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig, quantize_model
from tests.kernel_utils import require_kernels
from tests.models.test_parity_tiny import CONFIGS, _hf_model

ops = require_kernels()
BLOCK = 4
QUANT = {"dense": None, "int8": Int8WeightOnlyConfig(), "int4": Int4WeightOnlyConfig(group_size=32)}


def _model(name: str, dtype: torch.dtype, weights: str, tmp_path):
    _hf_model(name, tmp_path)
    model = build_model(open_hf(tmp_path), dtype, "cpu")
    if QUANT[weights] is not None:
        quantize_model(model, QUANT[weights], dtype, progress=False)
    return model


class Sequences:
    """Three sequences with shuffled block tables in one paged cache, stepped together."""

    def __init__(self, model, kv_cache_dtype: str) -> None:
        cfg = model.config
        self.model = model
        groups, self.windows = layer_groups(cfg)
        self.cache = PagedKVCache(40, BLOCK, groups, cfg.num_kv_heads, cfg.head_dim, model.embed.weight.dtype,
                                  kv_cache_dtype=kv_cache_dtype)
        blocks = (torch.randperm(39, generator=torch.Generator().manual_seed(0)) + 1).tolist()
        self.tables = [blocks[0:13], blocks[13:26], blocks[26:39]]
        g = torch.Generator().manual_seed(1)
        self.tokens = [torch.randint(0, 320, (n,), generator=g).tolist() for n in (5, 17, 30)]
        self.lens = [0, 0, 0]

    def step(self, new: list[list[int]], lora=None) -> torch.Tensor:
        ctx = [n + len(t) for n, t in zip(self.lens, new)]
        meta = PagedAttentionMetadata.build([len(t) for t in new], ctx, [self.tables] * len(self.windows), BLOCK)
        ids = torch.tensor([i for t in new for i in t])
        with torch.inference_mode():
            hidden = self.model(ids, meta.positions(), self.cache, meta, lora)
        self.lens = ctx
        return hidden


def _snapshot(cache: PagedKVCache) -> list[torch.Tensor]:
    return [s.clone() for s in cache.storage] + ([s.clone() for s in cache.scales] if cache.scales else [])


@pytest.mark.parametrize("kv", ["auto", "int8"])
@pytest.mark.parametrize("weights", sorted(QUANT))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_fused_decode_is_bit_identical(name, dtype, weights, kv, tmp_path):
    if kv == "int8" and weights != "dense":
        pytest.skip("the KV cache dtype is independent of the weights: once per model is enough")
    model = _model(name, dtype, weights, tmp_path)
    seqs = Sequences(model, kv)
    seqs.step(seqs.tokens)  # prefill: layer-by-layer
    if not ops.supports_head_dim(model.config.head_dim):
        assert model.fused_decoder(seqs.cache) is None  # no paged-decode kernel for it: the layer path
        pytest.skip(f"the paged-decode kernel does not take head_dim {model.config.head_dim}")
    assert model.fused_decoder(seqs.cache) is not None, "the stack should apply to this model"
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        new = [[int(t)] for t in torch.randint(0, 320, (3,), generator=g)]
        lens = list(seqs.lens)
        before = _snapshot(seqs.cache)
        model.use_fused_decode = True
        fused = seqs.step(new)
        after_fused = _snapshot(seqs.cache)
        for s, b in zip(seqs.cache.storage + (seqs.cache.scales or []), before):
            s.copy_(b)  # the same step again, layer by layer, from the same cache
        seqs.lens = lens
        model.use_fused_decode = False
        reference = seqs.step(new)
        assert torch.equal(fused, reference)
        assert all(torch.equal(a, b) for a, b in zip(after_fused, _snapshot(seqs.cache)))
        assert torch.isfinite(fused).all()


def test_prefill_steps_and_gradients_keep_the_layer_path(tmp_path, monkeypatch):
    model = _model("llama", torch.float32, "dense", tmp_path)
    seqs = Sequences(model, "auto")
    calls = []
    from tokenmill.models.fused_decode import FusedDecoder

    monkeypatch.setattr(FusedDecoder, "run", lambda self, *a: calls.append(a) or a[0])
    seqs.step(seqs.tokens)  # prompts: not a decode step
    assert calls == []
    seqs.step([[1], [2], [3]])
    assert len(calls) == 1
    meta = PagedAttentionMetadata.build([1, 1, 1], [n + 1 for n in seqs.lens], [seqs.tables], BLOCK)
    with torch.enable_grad():  # training (QAT) goes through PyTorch's autograd
        model(torch.tensor([4, 5, 6]), meta.positions(), seqs.cache, meta)
    assert len(calls) == 1


def test_swapped_linears_rebuild_the_stack(tmp_path):
    model = _model("llama", torch.float32, "dense", tmp_path)
    seqs = Sequences(model, "auto")
    first = model.fused_decoder(seqs.cache)
    assert first is not None and model.fused_decoder(seqs.cache) is first
    quantize_model(model, Int8WeightOnlyConfig(), progress=False)
    second = model.fused_decoder(seqs.cache)
    assert second is not None and second is not first


def test_weights_changed_in_place_rebuild_the_stack(tmp_path):
    """A bfloat16 stack multiplies by packed copies of the dense weights: a weight modified in
    place (loading a checkpoint into the model, merging an adapter) must not leave it stale."""
    model = _model("llama", torch.bfloat16, "dense", tmp_path)
    seqs = Sequences(model, "auto")
    seqs.step(seqs.tokens)
    first = model.fused_decoder(seqs.cache)
    assert first is not None and model.fused_decoder(seqs.cache) is first
    with torch.no_grad():
        model.layers[0].mlp.down.weight.mul_(0.5)
    second = model.fused_decoder(seqs.cache)
    assert second is not None and second is not first
    lens, before = list(seqs.lens), _snapshot(seqs.cache)
    fused = seqs.step([[1], [2], [3]])
    for s, b in zip(seqs.cache.storage, before):
        s.copy_(b)
    seqs.lens = lens
    model.use_fused_decode = False
    assert torch.equal(fused, seqs.step([[1], [2], [3]]))


def random_adapter(cfg, name: str, seed: int, rank: int = 8):
    """A LoRA adapter with random weights on every projection of every layer."""
    from tokenmill.lora.adapter import PROJECTIONS, LoRAAdapter, projection_shape

    g = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(cfg.num_layers):
        for proj in PROJECTIONS:
            out, inp = projection_shape(cfg, proj)
            weights[f"layers.{layer}.{proj}"] = (torch.randn(rank, inp, generator=g) * 0.1,
                                                 torch.randn(out, rank, generator=g) * 0.1)
    return LoRAAdapter(name, "", weights, name)


@pytest.mark.parametrize("int8", [False, True], ids=["slots-model-dtype", "slots-int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_fused_decode_with_lora_is_bit_identical(name, dtype, int8, tmp_path):
    """Decode steps mixing two adapters and the base take the stack, with each token's LoRA update,
    bit-identical to the layer-by-layer path."""
    from tokenmill.lora.slots import LoRABatch, LoRASlots

    model = _model(name, dtype, "dense", tmp_path)
    slots = LoRASlots(model.config, 2, 8, dtype, "cpu", int8=int8)
    for i in range(2):
        slots.assign(i, random_adapter(model.config, f"a{i}", seed=i))
    seqs = Sequences(model, "auto")
    seqs.step(seqs.tokens)
    assert model.fused_decoder(seqs.cache) is not None
    batch = LoRABatch(slots.modules, torch.tensor([0, -1, 1], dtype=torch.int32))
    g = torch.Generator().manual_seed(2)
    for _ in range(2):
        new = [[int(t)] for t in torch.randint(0, 320, (3,), generator=g)]
        lens, before = list(seqs.lens), _snapshot(seqs.cache)
        model.use_fused_decode = True
        fused = seqs.step(new, batch)
        for st, b in zip(seqs.cache.storage, before):
            st.copy_(b)
        seqs.lens = lens
        model.use_fused_decode = False
        assert torch.equal(fused, seqs.step(new, batch))
        for st, b in zip(seqs.cache.storage, before):
            st.copy_(b)
        seqs.lens = lens
        plain = seqs.step(new)  # the adapters change the adapted rows only
        assert torch.equal(fused[1], plain[1]) and not torch.equal(fused[0], plain[0])
