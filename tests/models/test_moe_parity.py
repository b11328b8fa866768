"""MoE models against HF transformers on tiny random configs of each architecture (Mixtral,
Qwen2-MoE with its shared expert and a dense layer, Qwen3-MoE, OLMoE), from both checkpoint
layouts: logits within 1e-3 in float32 and identical greedy continuations."""

from __future__ import annotations

import pytest
import torch

from tokenmill import LLM
from tokenmill.loading.checkpoint import open_hf
from tokenmill.models.builder import build_model
from tokenmill.models.moe import SparseMoE
from tests.model_utils import prompt_logits
from tests.models.moe_helpers import ARCHITECTURES, tiny_moe_model
from tests.parity import count_identical_to_hf

IDS = torch.randint(0, 256, (41,), generator=torch.Generator().manual_seed(1)).tolist()


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_logits_match_hf(arch, layout, tmp_path):
    hf = tiny_moe_model(arch, tmp_path, layout)
    ours = build_model(open_hf(tmp_path), torch.float32, "cpu")
    assert any(isinstance(m, SparseMoE) for m in ours.modules())
    with torch.no_grad():
        expected = hf(torch.tensor([IDS])).logits[0]
    got = prompt_logits(ours, IDS)
    assert (got - expected).abs().max().item() <= 1e-3
    chunked = prompt_logits(ours, IDS, chunk=7)  # chunked prefill: the same
    assert (chunked - expected).abs().max().item() <= 1e-3


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_continuations_match_hf(arch, layout, tmp_path):
    hf = tiny_moe_model(arch, tmp_path, layout, seed=2)
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", kv_cache_memory=2**22)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (5, 12, 23)]
    assert count_identical_to_hf(llm, hf, prompts, 16) == len(prompts)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_save_hf_writes_what_transformers_loads(arch, tmp_path):
    """tokenmill's HF export of an MoE model (the per-expert layout) loads in transformers with
    the same logits, and in tokenmill again."""
    import transformers

    from tokenmill.loader import load_model
    from tokenmill.models.export import save_hf

    tiny_moe_model(arch, tmp_path / "src")
    loaded = load_model(tmp_path / "src", "float32", "cpu")
    save_hf(loaded.model, loaded.config, loaded.tokenizer, tmp_path / "out")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf(torch.tensor([IDS])).logits[0]
    assert (prompt_logits(loaded.model, IDS) - expected).abs().max().item() <= 1e-3
    again = load_model(tmp_path / "out", "float32", "cpu")
    assert again.config == loaded.config
    # the same weights (float32 matmuls may round differently with the tensors' alignment)
    assert all(torch.equal(t, again.model.state_dict()[n]) for n, t in loaded.model.state_dict().items())
    torch.testing.assert_close(prompt_logits(again.model, IDS), prompt_logits(loaded.model, IDS), rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_gguf_stacked_experts_match_hf(arch, tmp_path):
    """The model as llama.cpp lays it out in GGUF (stacked expert tensors, routers as
    ffn_gate_inp, Qwen2-MoE's shared expert and gate) gives HF's logits."""
    from tokenmill.loader import load_model
    from tests.models.moe_helpers import write_moe_gguf

    hf = tiny_moe_model(arch, tmp_path / "hf")
    path = write_moe_gguf(hf, arch, tmp_path / "m.gguf")
    ours = load_model(path, "float32", "cpu")
    reference = load_model(tmp_path / "hf", "float32", "cpu").config
    assert ours.config.moe == reference.moe
    with torch.no_grad():
        expected = hf(torch.tensor([IDS])).logits[0]
    assert (prompt_logits(ours.model, IDS) - expected).abs().max().item() <= 1e-3


def test_gguf_quantized_experts_load_dequantized(tmp_path):
    """Q8_0 stacked experts: loaded (dequantized), close to the float model."""
    from gguf import GGMLQuantizationType

    from tokenmill.loader import load_model
    from tokenmill.quantization.linear import sqnr
    from tests.models.moe_helpers import write_moe_gguf

    hf = tiny_moe_model("mixtral", tmp_path / "hf")
    path = write_moe_gguf(hf, "mixtral", tmp_path / "m.gguf", expert_type=GGMLQuantizationType.Q8_0)
    with torch.no_grad():
        expected = hf(torch.tensor([IDS])).logits[0]
    for dtype, least in (("float32", 30), ("auto", 20)):  # auto: bfloat16 activations
        ours = load_model(path, dtype, "cpu")
        assert sqnr(expected, prompt_logits(ours.model, IDS).float()) >= least, dtype
