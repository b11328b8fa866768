"""Quantization-aware training: the straight-through gradient, fake quantization on exactly the
grid of the real quantized layers, prepare -> convert giving the fake-quant model's outputs, the
training forward matching the paged one, and a few steps lowering the loss on a tiny model."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from tests.model_utils import prompt_logits
from tests.quantization.helpers import tiny_loaded, write_tiny_checkpoint
from tokenmill import LLM, SamplingParams
from tokenmill.errors import InvalidParameterError
from tokenmill.loader import load_model
from tokenmill.quantization import save_quantized
from tokenmill.quantization.config import Int4WeightOnlyConfig, Int8WeightOnlyConfig
from tokenmill.quantization.linear import Int4Linear, Int8Linear
from tokenmill.quantization.qat import (
    FakeQuantLinear, QATConfig, convert_qat, fake_quantize_int4, fake_quantize_int8, int4_fake_quant,
    int8_fake_quant, prepare_qat, qat_config_from_dict, qat_finetune, qat_loss, training_logits)

IDS = list(range(3, 60, 3)) * 2


def _weight(n: int = 48, k: int = 96, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


def test_int4_straight_through_gradient_is_identity_inside_the_grid_and_zero_outside():
    w = torch.tensor([[-1.0, -0.36, -0.34, 0.0, 0.2, 0.69, 1.24, 1.26, 2.0]], requires_grad=True)
    scale, zero = torch.tensor([0.1]), torch.tensor([0.5])  # grid [0.5 - 0.8, 0.5 + 0.7] = [-0.3, 1.2], step 0.1
    out = int4_fake_quant(w, scale, zero)
    expected = [[-0.3, -0.3, -0.3, 0.0, 0.2, 0.7, 1.2, 1.2, 1.2]]
    assert torch.allclose(out.detach(), torch.tensor(expected), atol=1e-6)
    out.backward(torch.arange(1.0, 10.0)[None])
    # identity where rounding lands on the grid (within half a step of its ends), zero where it clamps
    assert w.grad.tolist() == [[0.0, 0.0, 3.0, 4.0, 5.0, 6.0, 7.0, 0.0, 0.0]]


def test_int8_straight_through_gradient_is_identity_inside_the_grid_and_zero_outside():
    w = torch.tensor([[0.5, -1.3, 1.274, 2.0], [0.01, -0.02, -1.28, -5.0]], requires_grad=True)
    scale = torch.tensor([0.01, 0.01])  # rows whose absmax exceeds 127 scale: some weights clamp
    out = int8_fake_quant(w, torch.round(w.detach() / scale[:, None]).clamp(-127, 127), scale)
    assert torch.allclose(out.detach(), torch.tensor([[0.5, -1.27, 1.27, 1.27], [0.01, -0.02, -1.27, -1.27]]))
    out.sum().backward()
    assert w.grad.tolist() == [[1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("group_size,k", [(32, 96), (64, 96), (128, 576)])
def test_fake_int4_is_the_int4_linear_dequantized_weight(group_size, k, dtype):
    w = _weight(k=k)
    expected = Int4Linear.from_float(w, None, dtype, group_size).dequantize()
    assert torch.equal(fake_quantize_int4(w, group_size, dtype), expected)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(1))
    layer = FakeQuantLinear(torch.nn.Parameter(w), None, 4, group_size, dtype)
    assert torch.allclose(layer(x), x @ expected.T, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fake_int8_is_the_int8_linear_dequantized_weight(dtype):
    w = _weight()
    assert torch.equal(fake_quantize_int8(w, dtype), Int8Linear.from_float(w, None, dtype).dequantize())


def test_fake_int4_gradient_reaches_every_weight():
    """Min-max groups put every weight inside the grid: the gradient is the float layer's."""
    w = torch.nn.Parameter(_weight())
    layer = FakeQuantLinear(w, None, 4, 32, torch.float32)
    x = torch.randn(4, 96, generator=torch.Generator().manual_seed(2))
    layer(x).square().sum().backward()
    expected = 2 * (x @ fake_quantize_int4(w.detach(), 32, torch.float32).T).T @ x
    assert torch.allclose(w.grad, expected, atol=1e-4)


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("weight,lm_head_int8", [("int4", True), ("int4", False), ("int8", True)])
def test_convert_gives_the_fake_quant_model_outputs(weight, lm_head_int8, tie, tmp_path):
    loaded = tiny_loaded(write_tiny_checkpoint(tmp_path, tie=tie))
    config = QATConfig(weight=weight, group_size=32, lm_head_int8=lm_head_int8)
    model = prepare_qat(loaded.model, config)
    fake = prompt_logits(model, IDS)
    kinds = {name: (m.bits, m.weight is model.embed.weight) for name, m in model.named_modules()
             if isinstance(m, FakeQuantLinear)}
    assert len(kinds) == 2 * 4 + 1 and kinds["lm_head"] == (8 if lm_head_int8 or weight == "int8" else 4, tie)
    convert_qat(model, config, progress=False)
    assert not any(isinstance(m, FakeQuantLinear) for m in model.modules())
    body = Int4Linear if weight == "int4" else Int8Linear
    assert isinstance(model.layers[0].mlp.gate_up, body) and isinstance(model.layers[1].attn.qkv, body)
    assert isinstance(model.lm_head, Int8Linear if lm_head_int8 or weight == "int8" else Int4Linear)
    expected_config = (Int8WeightOnlyConfig() if weight == "int8" else
                       Int4WeightOnlyConfig(group_size=32, lm_head_int8=lm_head_int8, range_search=False))
    assert model.quantization_config == expected_config
    assert torch.allclose(prompt_logits(model, IDS), fake, atol=2e-4, rtol=1e-4)


def test_training_forward_matches_the_paged_forward(tmp_path):
    model = tiny_loaded(write_tiny_checkpoint(tmp_path)).model
    batch = torch.tensor([IDS[:20], IDS[5:25]])
    logits = training_logits(model, batch)
    assert logits.requires_grad is False  # a float model's parameters as loaded
    for row in range(2):
        assert torch.allclose(logits[row], prompt_logits(model, batch[row].tolist()), atol=1e-5)


def test_a_few_steps_lower_the_loss_and_the_result_saves_and_serves(tmp_path):
    loaded = tiny_loaded(write_tiny_checkpoint(tmp_path / "ckpt"))
    text = ("the quick brown fox jumps over the lazy dog. " * 40).encode()
    ids = list(text)
    teacher = copy.deepcopy(loaded.model)
    config = QATConfig(group_size=32, steps=30, lr=3e-3, warmup_steps=2, seq_len=32, batch_size=2,
                       distill_weight=0.5)
    model = prepare_qat(loaded.model, config)
    batch = torch.tensor([ids[:32], ids[40:72]])

    def loss() -> float:
        with torch.no_grad():
            return qat_loss(training_logits(model, batch), batch, training_logits(teacher, batch), 0.5)[0].item()

    before = loss()
    log = qat_finetune(model, ids, config, teacher, progress=False)
    assert len(log.loss) == len(log.ce) == len(log.kl) == 30
    assert loss() < 0.7 * before
    assert sum(log.ce[-5:]) < 0.7 * sum(log.ce[:5])
    assert torch.equal(model.embed.weight, teacher.embed.weight)  # frozen by default
    convert_qat(model, config, progress=False)
    out = save_quantized(loaded, tmp_path / "qat")
    llm = LLM(str(out), dtype="float32", device="cpu", kv_cache_memory=2**22)
    quantized = llm.generate([IDS[:8]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    converted = prompt_logits(model, IDS[:8])
    assert quantized[0].outputs[0].token_ids[0] == int(converted[-1].argmax())


def test_qat_finetune_checks_its_inputs(tmp_path):
    model = tiny_loaded(write_tiny_checkpoint(tmp_path)).model
    with pytest.raises(InvalidParameterError, match="prepare_qat"):
        qat_finetune(model, IDS, QATConfig(distill_weight=0.0))
    prepare_qat(model, QATConfig())
    with pytest.raises(InvalidParameterError, match="teacher"):
        qat_finetune(model, IDS, QATConfig(seq_len=8))
    with pytest.raises(InvalidParameterError, match="at least seq_len"):
        qat_finetune(model, IDS[:5], QATConfig(seq_len=8, distill_weight=0.0))
    with pytest.raises(InvalidParameterError, match="already prepared"):
        prepare_qat(model, QATConfig())


@pytest.mark.parametrize("data,match", [
    ({"group_size": 48}, "group_size"), ({"weight": "int2"}, "weight"), ({"steps": 0}, "steps"),
    ({"lr": -1.0}, "lr"), ({"distill_weight": 1.5}, "distill_weight"), ({"seq_len": 1}, "seq_len"),
    ({"learning_rate": 1e-4}, "unknown key.*learning_rate")])
def test_config_rejects_bad_values(data, match):
    with pytest.raises(InvalidParameterError, match=match):
        qat_config_from_dict(data)


def test_qat_command_writes_a_quantized_checkpoint(tmp_path, capsys):
    from tokenmill.cli import main

    checkpoint = write_tiny_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "qat"
    assert main(["qat", str(checkpoint), "--group-size", "32", "--steps", "2", "--seq-len", "16",
                 "--dtype", "float32", "--out", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    saved = json.loads((out / "config.json").read_text())["quantization_config"]
    assert saved["method"] == "int4" and saved["group_size"] == 32 and saved["range_search"] is False
    reloaded = load_model(str(out), torch.float32, "cpu")
    assert isinstance(reloaded.model.layers[0].mlp.down, Int4Linear)
    assert isinstance(reloaded.model.lm_head, Int8Linear)


def test_qat_command_rejects_a_bad_group_size(tmp_path, capsys):
    from tokenmill.cli import main

    assert main(["qat", "any-model", "--group-size", "48", "--out", str(tmp_path)]) == 2
    assert "group_size" in capsys.readouterr().err
