"""Hardware ceilings (measured small here, cached as JSON) and the per-step cost of a model."""

from __future__ import annotations

import json

import pytest
import torch

from tokenmill.attention.paged import PagedAttentionBackend
from tokenmill.benchmark import hardware
from tokenmill.benchmark.hardware import (
    HardwareCeilings,
    ModelCost,
    load_or_measure,
    measure,
    plot_roofline,
)
from tokenmill.config import ModelConfig
from tokenmill.models.registry import MODEL_CLASSES

TINY = {"bandwidth_bytes": 4 << 20, "matmul_n": 128, "min_time": 0.02}


def tiny_model(tied: bool, dtype=torch.float32):
    cfg = ModelConfig(architecture="llama", vocab_size=320, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=tied)
    return MODEL_CLASSES["llama"](cfg, PagedAttentionBackend()).to(dtype)


@pytest.mark.parametrize("tied", [True, False])
def test_model_cost_counts_matmul_weights_and_the_bytes_a_step_reads(tied) -> None:
    model = tiny_model(tied)
    cost = ModelCost.of(model)
    per_layer = 64 * (64 + 2 * 32) + 64 * 64 + 3 * 64 * 128  # q,k,v + o + gate,up,down
    assert cost.matmul_params == 2 * per_layer + 320 * 64
    assert cost.matmul_params == sum(p.numel() for p in model.parameters() if p.dim() == 2) - (0 if tied else 320 * 64)
    params = sum(p.numel() for p in model.parameters()) - (0 if tied else 320 * 64)  # untied embedding: gathered only
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert cost.weight_bytes == 4 * params + buffers
    assert cost.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4  # k and v x layers x kv heads x head dim x fp32
    assert cost.bytes_read(100) == cost.weight_bytes + 100 * cost.kv_bytes_per_token
    assert cost.flops(8) == 16 * cost.matmul_params


def test_model_cost_follows_the_dtype() -> None:
    f32, bf16 = ModelCost.of(tiny_model(True)), ModelCost.of(tiny_model(True, torch.bfloat16))
    assert bf16.kv_bytes_per_token * 2 == f32.kv_bytes_per_token
    assert bf16.weight_bytes < f32.weight_bytes and bf16.matmul_params == f32.matmul_params


def test_measure_gives_positive_ceilings_per_dtype() -> None:
    c = measure(torch.device("cpu"), **TINY)
    assert c.memory_bandwidth == max(c.copy_bandwidth, c.read_bandwidth) > 0
    assert set(c.matmul_flops) == {"float32", "bfloat16"} and min(c.matmul_flops.values()) > 0
    assert c.peak_flops(torch.bfloat16) == c.matmul_flops["bfloat16"]
    assert c.device.startswith("cpu:") and "threads" in c.device
    with pytest.raises(KeyError):
        c.peak_flops("float16")


def test_ceilings_are_measured_once_and_cached(tmp_path, monkeypatch) -> None:
    path = tmp_path / "hardware.json"
    calls = []

    def fake_measure(device, **kwargs):
        calls.append(device)
        return HardwareCeilings(hardware.device_key(device), 2e10, 2e10, 1e10, {"float32": 1e11}, f"t{len(calls)}")

    monkeypatch.setattr(hardware, "measure", fake_measure)
    first = load_or_measure(torch.device("cpu"), path)
    second = load_or_measure(torch.device("cpu"), path)
    assert first == second and len(calls) == 1
    assert json.loads(path.read_text())[first.device]["memory_bandwidth"] == 2e10
    third = load_or_measure(torch.device("cpu"), path, remeasure=True)
    assert len(calls) == 2 and third.measured_at == "t2"
    path.write_text("not json")
    assert load_or_measure(torch.device("cpu"), path).measured_at == "t3"  # a corrupt cache is measured again


def test_roofline_plot(tmp_path) -> None:
    c = HardwareCeilings("cpu:test", 2e10, 2e10, 1e10, {"float32": 1e11, "bfloat16": 5e10}, "now")
    png = plot_roofline(c, [("decode", 2.0, 3e10), ("prefill", 80.0, 9e10)], tmp_path / "roof.png")
    assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 10_000
