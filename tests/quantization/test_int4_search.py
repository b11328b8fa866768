"""INT4 range search (llama.cpp make_qkx / AWQ clip search) against plain min-max parameters."""

from __future__ import annotations

import pytest
import torch

from tokenmill.errors import InvalidParameterError
from tokenmill.kernels import dispatch
from tokenmill.quantization import Int4WeightOnlyConfig, quantize_model
from tokenmill.quantization.config import Int4GPTQConfig, config_from_dict
from tokenmill.quantization.linear import (
    Int4Linear,
    int4_fit_params,
    int4_group_error,
    int4_group_params,
    int4_round,
    int4_search_params,
    quantize_int4_groupwise,
)
from tests.model_utils import prompt_logits
from tests.quantization.helpers import tiny_loaded, write_tiny_checkpoint


def heavy_tailed_groups(rows: int, groups: int, size: int, seed: int = 0) -> torch.Tensor:
    """Student-t weights (a few outliers per group, as trained weights have) [rows, groups, size]."""
    g = torch.Generator().manual_seed(seed)
    normal = torch.randn(rows, groups, size, generator=g)
    chi2 = torch.randn(rows, groups, size, 3, generator=g).pow(2).sum(-1)
    return 0.02 * normal / (chi2 / 3).sqrt()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("size", [32, 64, 128])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("kernel", [True, False], ids=["default", "pytorch"])
def test_search_never_increases_a_groups_error(dtype, size, weighted, kernel, monkeypatch):
    """Both forms: the CPU kernel (where the kernels are built) and PyTorch's (CUDA, kernels off)."""
    if not kernel:
        monkeypatch.setattr(dispatch, "for_tensors", lambda *tensors: None)
    w = heavy_tailed_groups(64, 6, size)
    importance = torch.rand(1, 6, size, generator=torch.Generator().manual_seed(1)) ** 4 if weighted else None
    plain = int4_group_error(w, *int4_group_params(w, dtype), importance)
    searched = int4_group_error(w, *int4_search_params(w, dtype, importance), importance)
    assert (searched <= plain).all()
    assert searched.sum() < 0.85 * plain.sum()  # and it does find better ranges on heavy-tailed weights


def test_fit_recovers_the_parameters_of_weights_on_a_grid():
    q = torch.randint(0, 16, (8, 4, 32), generator=torch.Generator().manual_seed(0))
    q[..., 0], q[..., 1] = 0, 15  # two distinct levels at least
    scale, zero = torch.rand(8, 4) + 0.1, torch.randn(8, 4)
    w = (q - 8) * scale[..., None] + zero[..., None]
    fitted_scale, fitted_zero = int4_fit_params(w, q, None)
    assert torch.allclose(fitted_scale, scale, atol=1e-5) and torch.allclose(fitted_zero, zero, atol=1e-5)
    assert torch.equal(int4_round(w, *int4_search_params(w, torch.float32)), q)


def test_constant_groups_stay_exact():
    w = torch.full((4, 2, 32), 0.25)
    scale, zero = int4_search_params(w, torch.float32)
    assert torch.isfinite(scale).all() and int4_group_error(w, scale, zero).max() < 1e-12


def test_importance_protects_the_columns_it_weights():
    """One input channel carries most of the activation energy: weighting by it keeps that column
    nearly exact where the unweighted search clips it, and the layer's output error falls."""
    k, n = 128, 64
    w = heavy_tailed_groups(n, 1, k, seed=2).view(n, k)
    w[:, 5] = w[:, 5].sign() * w.abs().amax(dim=1)  # the column fed by the hot channel is the outlier
    x = torch.randn(512, k, generator=torch.Generator().manual_seed(3))
    x[:, 5] *= 30
    mean_square = (x * x).mean(dim=0)
    errors = {}
    for name, importance in (("plain", None), ("weighted", mean_square)):
        layer = Int4Linear.from_float(w, None, torch.float32, 64, range_search=True, importance=importance)
        errors[name] = (layer(x) - x @ w.T).norm().item()
    assert errors["weighted"] < 0.7 * errors["plain"]


def test_search_off_is_plain_min_max():
    w = heavy_tailed_groups(16, 4, 32).view(16, 128)
    q, scale, zero = quantize_int4_groupwise(w, 32, torch.float32, range_search=False)
    assert torch.equal(q[:, :32].amin(dim=1), torch.zeros(16, dtype=torch.int32))
    assert torch.equal(q[:, :32].amax(dim=1), torch.full((16,), 15, dtype=torch.int32))


def test_activation_weighted_rtn_is_closer_on_a_model(tmp_path):
    ids = list(range(5, 200, 3))
    calibration = [torch.randint(0, 256, (64,), generator=torch.Generator().manual_seed(s)).tolist()
                   for s in range(4)]
    errors = {}
    for name, config in (("minmax", Int4WeightOnlyConfig(group_size=64, range_search=False, lm_head_int8=False)),
                         ("weighted", Int4WeightOnlyConfig(group_size=64, activation_weighted=True, lm_head_int8=False,
                                                           num_samples=4, seq_len=64))):
        loaded = tiny_loaded(write_tiny_checkpoint(tmp_path / name))
        reference = prompt_logits(loaded.model, ids)
        quantize_model(loaded.model, config, torch.float32, progress=False, calibration=calibration)
        errors[name] = (prompt_logits(loaded.model, ids) - reference).norm().item()
    assert errors["weighted"] < errors["minmax"]


def test_activation_weighting_by_default_is_on_where_calibration_text_is(tmp_path):
    """None (the default) resolves, when quantizing, to weighted with calibration ids (or a
    tokenizer) and to plain range search for a bare model; the model records what was done."""
    calibration = [list(range(5, 69))]
    config = Int4WeightOnlyConfig(num_samples=1, seq_len=64)
    assert config.activation_weighted is None
    bare = tiny_loaded(write_tiny_checkpoint(tmp_path / "bare")).model
    quantize_model(bare, config, torch.float32, progress=False)
    assert bare.quantization_config.activation_weighted is False
    fed = tiny_loaded(write_tiny_checkpoint(tmp_path / "fed")).model
    quantize_model(fed, config, torch.float32, progress=False, calibration=calibration)
    assert fed.quantization_config.activation_weighted is True
    assert not torch.equal(bare.layers[0].mlp.down.scale, fed.layers[0].mlp.down.scale)  # the weighting did something
    plain = tiny_loaded(write_tiny_checkpoint(tmp_path / "plain")).model
    quantize_model(plain, Int4WeightOnlyConfig(range_search=False), torch.float32, progress=False, calibration=calibration)
    assert plain.quantization_config.activation_weighted is False


def test_activation_weighted_needs_text_or_ids(tmp_path):
    loaded = tiny_loaded(write_tiny_checkpoint(tmp_path))
    with pytest.raises(InvalidParameterError, match="calibrates on text"):
        quantize_model(loaded.model, Int4WeightOnlyConfig(activation_weighted=True), progress=False)


@pytest.mark.parametrize("bad,match", [
    ({"range_search": "yes"}, "range_search must be true or false"),
    ({"activation_weighted": 1}, "activation_weighted must be true or false"),
    ({"range_search": False, "activation_weighted": True}, "needs range_search"),
    ({"num_samples": 0}, "num_samples must be positive"),
    ({"seq_len": -1}, "seq_len must be positive"),
])
def test_int4_options_are_validated(bad, match):
    with pytest.raises(InvalidParameterError, match=match):
        Int4WeightOnlyConfig(**bad)


@pytest.mark.parametrize("bad,match", [({"act_order": "no"}, "act_order must be true or false"),
                                       ({"block_size": 0}, "block_size must be positive"),
                                       ({"damping": 1.5}, "damping must be in")])
def test_gptq_options_are_validated(bad, match):
    with pytest.raises(InvalidParameterError, match=match):
        Int4GPTQConfig(**bad)


def test_options_round_trip_through_dicts():
    for config in (Int4WeightOnlyConfig(range_search=False), Int4WeightOnlyConfig(activation_weighted=True),
                   Int4GPTQConfig(act_order=False, range_search=False)):
        assert config_from_dict(config.to_dict()) == config
    with pytest.raises(InvalidParameterError, match="'actorder'"):
        config_from_dict({"method": "int4-gptq", "actorder": True})
