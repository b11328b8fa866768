"""Per-expert quantization of an MoE model: every expert's linears int8 / int4, routers and the
shared expert's gate kept in float; saved and loaded back with identical outputs."""

from __future__ import annotations

import pytest
import torch

from tokenmill.loader import load_model
from tokenmill.models.moe import Gate
from tokenmill.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig, quantize, save_quantized
from tokenmill.quantization.linear import Int4Linear, Int8Linear, sqnr
from tests.model_utils import prompt_logits
from tests.models.moe_helpers import tiny_moe_model

IDS = list(range(3, 60))
CASES = {"int8": (Int8WeightOnlyConfig(), Int8Linear, 28.0), "int4": (Int4WeightOnlyConfig(group_size=32), Int4Linear, 8.0)}


@pytest.mark.parametrize("method", sorted(CASES))
@pytest.mark.parametrize("arch", ["mixtral", "olmoe"])
def test_experts_quantize_save_and_load(arch, method, tmp_path):
    config, cls, min_sqnr = CASES[method]
    tiny_moe_model(arch, tmp_path / "src")
    reference = prompt_logits(load_model(tmp_path / "src", "float32", "cpu").model, IDS)
    loaded = quantize(str(tmp_path / "src"), config, dtype="float32", progress=False)
    moe = loaded.model.layers[0].mlp
    assert all(isinstance(e.gate_up, cls) and isinstance(e.down, cls) for e in moe.experts)
    assert isinstance(moe.router, Gate) and moe.router.weight.dtype == torch.float32
    before = prompt_logits(loaded.model, IDS)
    assert sqnr(reference, before) >= min_sqnr
    out = save_quantized(loaded, tmp_path / "q")
    again = load_model(out, "auto", "cpu")
    assert again.config == loaded.config
    assert torch.equal(prompt_logits(again.model, IDS), before)
