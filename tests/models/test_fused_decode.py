"""The one-call CPU decode stack (tokenmill.models.fused_decode) gives bit-identical hidden states
and KV cache contents to the layer-by-layer path, for every tiny model family, dense and
quantized linears, float32 and bfloat16, plain and quantized KV caches, mixture-of-experts layers
(with the same routing counted); and steps it cannot take (prefill chunks, gradients,
capacity-factor routing) keep the layer-by-layer path."""

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


# Mixture-of-experts models: their MoE layers run in the stack (no-drop routing), bit-identical.

MOE_ARCHS = ["mixtral", "qwen2_moe", "qwen3_moe"]
"""Mixtral (softmax, top-2, renormalised); Qwen2-MoE (shared expert with a sigmoid gate, top-2
not renormalised, layer 1 dense via mlp_only_layers); Qwen3-MoE (QK-norm, top-3 renormalised)."""


def _moe_model(arch: str, dtype: torch.dtype, weights: str, tmp_path, quantizable: bool = False):
    """A tiny ``arch`` model, its linears quantized as ``weights`` says (``quantizable``: expert
    widths the int8 kernel takes even if the model stays dense)."""
    from tests.models import moe_helpers

    with pytest.MonkeyPatch.context() as patch:
        if (quantizable or QUANT[weights] is not None) and arch.startswith("qwen"):
            # the int8 kernel takes whole 16-column blocks: Qwen experts 48 and 80 wide, not 40 and 72
            config = moe_helpers.moe_hf_config

            def wider(arch, **overrides):
                cfg = config(arch, **overrides)
                cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size = 48, 80
                return cfg

            patch.setattr(moe_helpers, "moe_hf_config", wider)
        moe_helpers.tiny_moe_model(arch, tmp_path)
    model = build_model(open_hf(tmp_path), dtype, "cpu")
    if QUANT[weights] is not None:
        quantize_model(model, QUANT[weights], dtype, progress=False)
    return model


def _moe_layers(model) -> list[int]:
    return [i for i in range(model.config.num_layers) if model.config.is_moe_layer(i)]


class ManySequences(Sequences):
    """``count`` sequences (prompts of 5 to 30 tokens) in one paged cache of shuffled blocks."""

    def __init__(self, model, count: int, kv_cache_dtype: str = "auto") -> None:
        cfg = model.config
        self.model = model
        groups, self.windows = layer_groups(cfg)
        per_seq = 10
        self.cache = PagedKVCache(count * per_seq + 1, BLOCK, groups, cfg.num_kv_heads, cfg.head_dim,
                                  model.embed.weight.dtype, kv_cache_dtype=kv_cache_dtype)
        blocks = (torch.randperm(count * per_seq, generator=torch.Generator().manual_seed(0)) + 1).tolist()
        self.tables = [blocks[i * per_seq:(i + 1) * per_seq] for i in range(count)]
        g = torch.Generator().manual_seed(1)
        self.tokens = [torch.randint(0, 320, (5 + (7 * i) % 26,), generator=g).tolist() for i in range(count)]
        self.lens = [0] * count


def _fused_and_reference(seqs: Sequences, new: list[list[int]], lora=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The step through the stack, then again layer by layer from the same cache: (fused, reference)
    hidden states; asserts the caches they leave are equal too. Leaves use_fused_decode True."""
    model = seqs.model
    lens, before = list(seqs.lens), _snapshot(seqs.cache)
    model.use_fused_decode = True
    fused = seqs.step(new, lora)
    after_fused = _snapshot(seqs.cache)
    for s, b in zip(seqs.cache.storage + (seqs.cache.scales or []), before):
        s.copy_(b)
    seqs.lens = lens
    model.use_fused_decode = False
    try:
        reference = seqs.step(new, lora)
    finally:
        model.use_fused_decode = True
    assert all(torch.equal(a, b) for a, b in zip(after_fused, _snapshot(seqs.cache)))
    return fused, reference


@pytest.mark.parametrize("batch", [1, 6])
@pytest.mark.parametrize("weights", sorted(QUANT))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_fused_moe_decode_is_bit_identical(arch, dtype, weights, batch, tmp_path):
    """Decode steps of an MoE model through the stack: hidden states, logits and KV cache equal to
    the layer path's, with dense, int8 and int4 experts; at batch 6 several experts are active
    and some run over several rows."""
    model = _moe_model(arch, dtype, weights, tmp_path)
    seqs = ManySequences(model, batch)
    seqs.step(seqs.tokens)  # prefill: layer-by-layer
    fused_decoder = model.fused_decoder(seqs.cache)
    assert fused_decoder is not None, "the stack should apply to this MoE model"
    assert len(fused_decoder.moe) == len(_moe_layers(model))
    g = torch.Generator().manual_seed(2)
    busiest = 0
    for _ in range(3):
        new = [[int(t)] for t in torch.randint(0, 320, (batch,), generator=g)]
        model.expert_stats.drain()
        fused, reference = _fused_and_reference(seqs, new)
        busiest = max(busiest, max(max(row) for row in model.expert_stats.drain().tokens_per_expert))
        assert torch.equal(fused, reference)
        assert torch.equal(model.compute_logits(fused), model.compute_logits(reference))
        assert torch.isfinite(fused).all()
    if batch > 1:
        assert busiest >= 2, "some expert should have run over several rows"


@pytest.mark.parametrize("scoring,top_k,norm", [("sigmoid", 2, False), ("sigmoid", 3, True), ("softmax", 5, True),
                                                 ("softmax", 6, False)])
def test_fused_moe_routing_variants_are_bit_identical(scoring, top_k, norm, tmp_path):
    """Sigmoid router scores, and top-k past 4 renormalised (a row sum PyTorch vectorizes on
    some machines: the stack asks at::sum for it), as SparseMoE computes them."""
    import dataclasses

    model = _moe_model("qwen2_moe", torch.bfloat16, "dense", tmp_path)
    for i in _moe_layers(model):
        mlp = model.layers[i].mlp
        mlp.spec = dataclasses.replace(mlp.spec, scoring=scoring, top_k=top_k, norm_topk_prob=norm)
    seqs = ManySequences(model, 4)
    seqs.step(seqs.tokens)
    assert model.fused_decoder(seqs.cache) is not None
    g = torch.Generator().manual_seed(4)
    for _ in range(2):
        new = [[int(t)] for t in torch.randint(0, 320, (4,), generator=g)]
        model.expert_stats.drain()
        fused, reference = _fused_and_reference(seqs, new)
        assert torch.equal(fused, reference)
        routed = model.expert_stats.drain()
        assert routed.routed_tokens == 2 * 4 * len(_moe_layers(model))  # both steps, both paths
        assert sum(map(sum, routed.tokens_per_expert)) == 2 * 4 * top_k * len(_moe_layers(model))


def test_olmoe_keeps_the_layer_path(tmp_path):
    """OLMoE clips q/k/v and norms whole projections: the stack does not take it."""
    model = _moe_model("olmoe", torch.float32, "dense", tmp_path)
    seqs = ManySequences(model, 2)
    seqs.step(seqs.tokens)
    assert model.fused_decoder(seqs.cache) is None


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_fused_moe_steps_count_routing_as_the_layer_path(arch, tmp_path):
    """ExpertStats after decode steps through the stack: the same tokens per expert, routed tokens
    and (to float rounding) router entropy as after the same steps layer by layer."""
    model = _moe_model(arch, torch.bfloat16, "dense", tmp_path)
    seqs = ManySequences(model, 5)
    seqs.step(seqs.tokens)
    assert model.fused_decoder(seqs.cache) is not None
    g = torch.Generator().manual_seed(3)
    for _ in range(2):
        new = [[int(t)] for t in torch.randint(0, 320, (5,), generator=g)]
        model.expert_stats.drain()
        lens, before = list(seqs.lens), _snapshot(seqs.cache)
        seqs.step(new)
        fused = model.expert_stats.drain()
        for s, b in zip(seqs.cache.storage, before):
            s.copy_(b)
        seqs.lens = lens
        model.use_fused_decode = False
        seqs.step(new)
        model.use_fused_decode = True
        reference = model.expert_stats.drain()
        assert fused.tokens_per_expert == reference.tokens_per_expert
        assert fused.dropped_per_expert == reference.dropped_per_expert
        assert fused.routed_tokens == reference.routed_tokens == 5 * len(_moe_layers(model))
        assert fused.entropy_sum == pytest.approx(reference.entropy_sum, rel=1e-6)


def test_capacity_factor_keeps_the_layer_path(tmp_path, monkeypatch):
    """Capacity-factor routing drops by what else is in the batch: only the layer path does it,
    whether the factor is set before the first decode step or after the stack was built."""
    from tokenmill.models.fused_decode import FusedDecoder

    model = _moe_model("mixtral", torch.float32, "dense", tmp_path)
    seqs = ManySequences(model, 3)
    seqs.step(seqs.tokens)
    assert model.fused_decoder(seqs.cache) is not None
    model.set_moe_capacity(0.5)
    assert model.fused_decoder(seqs.cache) is None  # the stack built before is dropped
    calls = []
    monkeypatch.setattr(FusedDecoder, "run", lambda self, *a: calls.append(a) or a[0])
    model.expert_stats.drain()
    seqs.step([[1], [2], [3]])
    assert calls == []
    assert model.expert_stats.drain().dropped > 0  # capacity 1 per expert for 6 assignments over 6 experts

    other = _moe_model("qwen2_moe", torch.float32, "dense", tmp_path / "other")
    other.set_moe_capacity(1.0)
    seqs = ManySequences(other, 3)
    seqs.step(seqs.tokens)
    assert other.fused_decoder(seqs.cache) is None


def test_swapped_or_changed_experts_rebuild_the_stack(tmp_path):
    model = _moe_model("qwen2_moe", torch.bfloat16, "dense", tmp_path, quantizable=True)
    seqs = ManySequences(model, 3)
    seqs.step(seqs.tokens)
    first = model.fused_decoder(seqs.cache)
    assert first is not None and model.fused_decoder(seqs.cache) is first
    with torch.no_grad():  # an expert's packed weight changed in place
        model.layers[2].mlp.experts[3].down.weight.mul_(0.5)
    second = model.fused_decoder(seqs.cache)
    assert second is not None and second is not first
    fused, reference = _fused_and_reference(seqs, [[1], [2], [3]])
    assert torch.equal(fused, reference)
    shared = model.layers[0].mlp.shared.gate_up
    shared.weight.data = shared.weight.data * 2  # another tensor under the same parameter, same version
    third = model.fused_decoder(seqs.cache)
    assert third is not None and third is not second
    with torch.no_grad():  # the router replaced
        model.layers[0].mlp.router.weight = torch.nn.Parameter(torch.randn_like(model.layers[0].mlp.router.weight))
    fourth = model.fused_decoder(seqs.cache)
    assert fourth is not None and fourth is not third
    fused, reference = _fused_and_reference(seqs, [[4], [5], [6]])
    assert torch.equal(fused, reference)
    quantize_model(model, Int8WeightOnlyConfig(), torch.bfloat16, progress=False)  # every expert swapped
    fifth = model.fused_decoder(seqs.cache)
    assert fifth is not None and fifth is not fourth and model.fused_decoder(seqs.cache) is fifth
    fused, reference = _fused_and_reference(seqs, [[7], [8], [9]])
    assert torch.equal(fused, reference)


def attention_adapter(cfg, name: str, seed: int, rank: int = 8):
    """A LoRA adapter with random weights on the attention projections of every layer (adapters
    never target an MoE layer's MLP)."""
    from tokenmill.lora.adapter import LoRAAdapter, projection_shape

    g = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(cfg.num_layers):
        for proj in ("attn.q", "attn.k", "attn.v", "attn.o"):
            out, inp = projection_shape(cfg, proj)
            weights[f"layers.{layer}.{proj}"] = (torch.randn(rank, inp, generator=g) * 0.1,
                                                 torch.randn(out, rank, generator=g) * 0.1)
    return LoRAAdapter(name, "", weights, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_fused_moe_decode_with_attention_lora_is_bit_identical(dtype, tmp_path):
    from tokenmill.lora.slots import LoRABatch, LoRASlots

    model = _moe_model("mixtral", dtype, "dense", tmp_path)
    slots = LoRASlots(model.config, 2, 8, dtype, "cpu")
    for i in range(2):
        slots.assign(i, attention_adapter(model.config, f"a{i}", seed=i))
    seqs = ManySequences(model, 3)
    seqs.step(seqs.tokens)
    assert model.fused_decoder(seqs.cache) is not None
    batch = LoRABatch(slots.modules, torch.tensor([0, -1, 1], dtype=torch.int32))
    g = torch.Generator().manual_seed(2)
    for _ in range(2):
        new = [[int(t)] for t in torch.randint(0, 320, (3,), generator=g)]
        fused, reference = _fused_and_reference(seqs, new, batch)
        assert torch.equal(fused, reference)
