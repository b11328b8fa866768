"""SQNR of each method on real SmolLM2-135M weights (the shipped GGUF, loaded by tokenmill).

The GGUF is Q4_1 (4-bit, groups of 32, asymmetric), so INT4 g32 lands back on nearly the same
grid (SQNR ~47 dB) while coarser groups re-round it (~19-22 dB)."""

from __future__ import annotations

import pytest
import torch

from tokenmill.loader import load_model
from tokenmill.quantization.linear import Int4Linear, Int8Linear, sqnr

pytestmark = pytest.mark.real_model

THRESHOLDS = {"int8": 38.0, 32: 40.0, 64: 18.0, 128: 17.0}
LAYERS = ["layers.0.attn.qkv", "layers.14.mlp.gate_up", "layers.29.mlp.down", "layers.7.attn.o"]


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2-135m-instruct", torch.float32, "cpu").model


@pytest.mark.parametrize("layer", LAYERS)
def test_sqnr_on_real_weights(smollm2, layer):
    w = smollm2.get_submodule(layer).weight
    x = torch.randn(8, w.shape[1], generator=torch.Generator().manual_seed(0))
    int8 = Int8Linear.from_float(w, None, torch.bfloat16)
    assert sqnr(w, int8.dequantize()) >= THRESHOLDS["int8"]
    assert sqnr(x @ w.T, int8(x.bfloat16())) >= THRESHOLDS["int8"] - 2
    for group in (32, 64, 128):
        int4 = Int4Linear.from_float(w, None, torch.bfloat16, group)
        assert sqnr(w, int4.dequantize()) >= THRESHOLDS[group], group
        assert sqnr(x @ w.T, int4(x.bfloat16())) >= min(THRESHOLDS[group] - 2, 38), group


def test_sqnr_of_the_lm_head(smollm2):
    w = smollm2.embed.weight  # tied: the head multiplies by the embedding matrix
    assert sqnr(w, Int8Linear.from_float(w, None, torch.bfloat16).dequantize()) >= 36.0
