"""SparseBF16Linear and sparsify (tokenmill.pruning.sparse_linear): a tiny random model pruned 50%
by magnitude gives bit-identical logits after sparsify, layer by layer and through the one-call
decode stack, and the same greedy tokens through tokenmill.LLM; the layer's fallback without the
kernel gives the same outputs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.kernel_utils import require_kernels
from tests.model_utils import prompt_logits
from tests.models.test_fused_decode import Sequences
from tests.models.test_parity_tiny import _hf_model
from tests.pruning.helpers import write_tiny
from tokenmill.kernels.linear_spec import LinearKind
from tokenmill.loading.checkpoint import open_hf
from tokenmill.models.builder import build_model
from tokenmill.pruning import sparse_linear
from tokenmill.pruning.sparse_linear import SparseBF16Linear, sparsify

ops = require_kernels()
pytestmark = pytest.mark.skipif(not ops.sparse_linear_fast(),
                                reason="no AVX-512 BF16 + VBMI2 on this CPU: the sparse kernel has no fast path here")


def _magnitude_prune(model: nn.Module, sparsity: float = 0.5) -> None:
    """Zero the smallest |w| of every row of every block linear, as pruning does (w *= keep: -0.0
    where w was negative)."""
    with torch.no_grad():
        for module in model.layers.modules():
            if type(module) is nn.Linear:
                w = module.weight
                k = int(w.shape[1] * sparsity)
                drop = w.abs().float().topk(k, dim=1, largest=False).indices
                w *= torch.ones_like(w).scatter_(1, drop, 0)


def _pruned_model(tmp_path, name: str = "llama"):
    _hf_model(name, tmp_path)
    model = build_model(open_hf(tmp_path), torch.bfloat16, "cpu")
    _magnitude_prune(model)
    return model


def test_layer_matches_the_dense_linear_with_and_without_the_kernel(monkeypatch):
    dense = nn.Linear(96, 40, bias=True).bfloat16()
    with torch.no_grad():
        dense.weight[torch.rand(40, 96) < 0.6] = 0
    layer = SparseBF16Linear.from_dense(dense)
    assert layer.nonzeros == int((dense.weight != 0).sum()) and layer.density == layer.nonzeros / (40 * 96)
    x = torch.randn(2, 5, 96).bfloat16()
    with torch.inference_mode():
        want = ops.bf16_packed_linear(x.reshape(10, 96), ops.bf16_pack(dense.weight), 40, dense.bias,
                                      path=ops.KernelPath.VECTOR).view(2, 5, 40)
        assert torch.equal(layer(x), want)
        spec = layer.cpu_kernel_spec()
        assert spec.kind is LinearKind.SPARSE_BF16 and spec.weight is layer.values and spec.offsets is layer.offsets
        assert torch.equal(spec.native(ops)(x.reshape(10, 96)), want.view(10, 40))  # as the decode stack runs it
        monkeypatch.setattr(sparse_linear, "_sparse_ops", lambda x=None: None)  # no kernel: the dense fallback
        rebuilt = layer.dense_weight()
        assert torch.equal(rebuilt, dense.weight) and not torch.signbit(rebuilt[rebuilt == 0]).any()  # +0.0
        assert layer.cpu_kernel_spec() is None
        assert torch.equal(layer(x), torch.nn.functional.linear(x, dense.weight, dense.bias))


def test_pack_without_the_kernels_is_the_kernels_pack(monkeypatch):
    dense = nn.Linear(64, 33, bias=False).bfloat16()
    with torch.no_grad():
        dense.weight[torch.rand(33, 64) < 0.5] = 0
    built = SparseBF16Linear.from_dense(dense)
    monkeypatch.setattr(sparse_linear.dispatch, "cpu_ops", lambda: None)
    portable = SparseBF16Linear.from_dense(dense)
    for a, b in zip(built.buffers(), portable.buffers()):
        bits = (lambda t: t.view(torch.int16)) if a.dtype == torch.bfloat16 else (lambda t: t)
        assert a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def test_sparsify_swaps_only_sparse_enough_block_linears(tmp_path):
    _hf_model("llama", tmp_path)
    model = build_model(open_hf(tmp_path), torch.bfloat16, "cpu")
    with torch.no_grad():
        model.layers[0].mlp.down.weight[:, ::2] = 0  # 50%
        model.layers[1].attn.o.weight[:, ::5] = 0   # 20%
    assert sparsify(model, min_sparsity=0.3) == ["layers.0.mlp.down"]
    assert type(model.layers[0].mlp.down) is SparseBF16Linear and type(model.layers[1].attn.o) is nn.Linear
    float_model = build_model(open_hf(tmp_path), torch.float32, "cpu")
    _magnitude_prune(float_model)
    assert sparsify(float_model) == []  # float32: the dense kernel it would replace is not bfloat16's


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_sparsified_model_gives_identical_logits_layer_by_layer(name, tmp_path):
    model = _pruned_model(tmp_path, name)
    ids = torch.randint(0, 320, (23,), generator=torch.Generator().manual_seed(3)).tolist()
    before = prompt_logits(model, ids, chunk=5)
    swapped = sparsify(model)
    assert len(swapped) == 4 * len(model.layers)
    assert torch.equal(prompt_logits(model, ids, chunk=5), before)


def test_sparsified_model_runs_the_decode_stack_bit_identically(tmp_path):
    dense, sparse = _pruned_model(tmp_path), _pruned_model(tmp_path)
    sparsify(sparse)
    runs = [Sequences(dense, "auto"), Sequences(sparse, "auto")]
    outs = [seqs.step(seqs.tokens) for seqs in runs]  # prefill
    assert torch.equal(outs[0], outs[1])
    fused = sparse.fused_decoder(runs[1].cache)
    assert fused is not None and all(type(m) is SparseBF16Linear for m in fused.linears)
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        new = [[int(t)] for t in torch.randint(0, 320, (3,), generator=g)]
        assert torch.equal(runs[0].step(new), runs[1].step(new))
    assert all(torch.equal(a, b) for a, b in zip(runs[0].cache.storage, runs[1].cache.storage))


def test_greedy_generation_is_unchanged(tmp_path):
    from tokenmill import LLM, SamplingParams

    llm = LLM(str(write_tiny(tmp_path)), dtype="bfloat16", device="cpu")
    model = llm.engine.runner.model
    _magnitude_prune(model)
    prompts = ["hello there", "a b c d e f", "x"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert sparsify(model)
    after = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert after == before


def test_loader_runs_a_pruned_directory_on_the_sparse_kernel(tmp_path):
    """A directory ``tokenmill prune`` wrote with an N:M method loads (bfloat16, CPU) with its pruned
    linears on the sparse kernel and the same logits as the dense model with zeros; structured
    and unpruned directories keep plain linears."""
    from tests.pruning.helpers import calibration, load_tiny
    from tokenmill.loader import load_model
    from tokenmill.pruning.api import prune_model, save_pruned
    from tokenmill.pruning.config import WandaConfig

    loaded = load_tiny(write_tiny(tmp_path / "src"))
    model, report = prune_model(loaded.model, WandaConfig(sparsity="2:4"), calibration=calibration(), progress=False)
    out = save_pruned(loaded, report, tmp_path / "pruned", torch.bfloat16)
    sparse = load_model(str(out), "bfloat16", "cpu").model
    kinds = {type(m) for m in sparse.layers.modules() if isinstance(m, (nn.Linear, SparseBF16Linear))}
    assert kinds == {SparseBF16Linear}
    dense = build_model(open_hf(out), torch.bfloat16, "cpu")
    ids = calibration(1, 40, seed=5)[0]
    assert torch.equal(prompt_logits(sparse, ids), prompt_logits(dense, ids))
    plain = load_model(str(tmp_path / "src"), "bfloat16", "cpu").model
    assert not any(isinstance(m, SparseBF16Linear) for m in plain.modules())
