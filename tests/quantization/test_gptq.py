"""GPTQ against round-to-nearest: on the calibration inputs it must reduce the output error."""

from __future__ import annotations

import pytest
import torch

from tokenmill.errors import InvalidParameterError
from tokenmill.quantization import Int4GPTQConfig, Int4WeightOnlyConfig, quantize_model
from tokenmill.quantization.gptq import gptq_quantize
from tokenmill.quantization.linear import Int4Linear, pack_int4, quantize_int4_groupwise
from tests.model_utils import prompt_logits
from tests.quantization.helpers import tiny_loaded, write_tiny_checkpoint


def _correlated_inputs(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Inputs with a few dominant, correlated directions, as real activations have; one fixed
    distribution, ``seed`` picks the samples."""
    basis = torch.randn(k, k, generator=torch.Generator().manual_seed(0)) * torch.logspace(0, -2, k)[:, None]
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed + 1)) @ basis


@pytest.mark.parametrize("group_size", [32, 128])
def test_gptq_beats_rounding_on_its_calibration_inputs(group_size):
    k, n = 256, 48
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(1)) * 0.05
    x = _correlated_inputs(1024, k)
    q, scale, zero = gptq_quantize(w, x.T @ x, group_size, torch.float32)
    gptq = Int4Linear(pack_int4(q), scale, zero, k).prepare()
    rtn = Int4Linear.from_float(w, None, torch.float32, group_size)
    held_out = _correlated_inputs(256, k, seed=2)
    for inputs in (x, held_out):
        ref = inputs @ w.T
        err_gptq = (gptq(inputs) - ref).norm()
        err_rtn = (rtn(inputs) - ref).norm()
        assert err_gptq < 0.8 * err_rtn


def test_gptq_without_information_is_plain_rounding():
    """H = I (uncorrelated unit inputs) and no damping effect on the order: nothing to compensate
    across columns beyond rounding, so the result equals round-to-nearest up to the updated groups."""
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(3))
    q, scale, zero = gptq_quantize(w, torch.eye(64), 32, torch.float32, damping=1e-6)
    q_rtn, scale_rtn, zero_rtn = quantize_int4_groupwise(w, 32, torch.float32)
    assert torch.equal(q, q_rtn) and torch.allclose(scale, scale_rtn) and torch.allclose(zero, zero_rtn)


def test_gptq_model_is_closer_than_rounding(tmp_path):
    ids = list(range(5, 200, 3))
    calibration = [torch.randint(0, 256, (64,), generator=torch.Generator().manual_seed(s)).tolist()
                   for s in range(8)]
    errors = {}
    for name, config in (("rtn", Int4WeightOnlyConfig(group_size=32, lm_head_int8=False)),
                         ("gptq", Int4GPTQConfig(group_size=32, lm_head_int8=False, num_samples=8, seq_len=64))):
        loaded = tiny_loaded(write_tiny_checkpoint(tmp_path / name))
        reference = prompt_logits(loaded.model, ids)
        quantize_model(loaded.model, config, torch.float32, progress=False, calibration=calibration)
        assert isinstance(loaded.model.layers[1].mlp.down, Int4Linear)
        errors[name] = (prompt_logits(loaded.model, ids) - reference).norm().item()
    assert errors["gptq"] < errors["rtn"]


def test_gptq_needs_text_or_ids(tmp_path):
    loaded = tiny_loaded(write_tiny_checkpoint(tmp_path))
    with pytest.raises(InvalidParameterError, match="calibrates on text"):
        quantize_model(loaded.model, Int4GPTQConfig(), progress=False)
