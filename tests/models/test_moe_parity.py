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


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_continuations_match_hf(arch, tmp_path):
    hf = tiny_moe_model(arch, tmp_path, seed=2)
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", kv_cache_memory=2**22)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (5, 12, 23)]
    assert count_identical_to_hf(llm, hf, prompts, 16) == len(prompts)
