"""W8A8: the int8 x int8 GEMM against its float references, calibration observers on synthetic
data, the tiny model's logits against its float self, and save -> load giving identical outputs."""

from __future__ import annotations

import json

import pytest
import torch

from tests.model_utils import prompt_logits
from tests.quantization.helpers import tiny_loaded, write_tiny_checkpoint
from tokenmill import LLM, SamplingParams
from tokenmill.errors import InvalidParameterError
from tokenmill.loader import load_model
from tokenmill.quantization import W8A8Config, config_from_dict, quantize_model, save_quantized
from tokenmill.quantization import kernels
from tokenmill.quantization.linear import W8A8Linear, quantize_int8_per_channel, sqnr
from tokenmill.quantization.observers import (
    MinMaxObserver,
    MSEObserver,
    PercentileObserver,
    fake_quantize,
    make_observer,
)

DTYPES = [torch.float32, torch.bfloat16]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _weight(n: int = 192, k: int = 256, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=_gen(seed)) * 0.02


def _x(m: int, k: int, seed: int = 1, one_sided: bool = False) -> torch.Tensor:
    x = torch.randn(m, k, generator=_gen(seed))
    return x.abs() if one_sided else x


def _heavy_tailed(n: int, seed: int = 0) -> torch.Tensor:
    """Laplace(0, 1): a sharp peak and exponential tails, whose rare extremes stretch a min-max grid."""
    g = _gen(seed)
    return torch.empty(n).exponential_(generator=g) * (torch.randint(0, 2, (n,), generator=g) * 2 - 1)


def _calibrated(x: torch.Tensor, observer: str, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor]:
    obs = make_observer(observer, symmetric)
    obs.update(x)
    return obs.qparams()


# --------------------------------------------------------------------------- the int8 GEMM

@pytest.mark.parametrize("m,k,n", [(1, 64, 40), (16, 256, 192), (17, 576, 24), (33, 40, 7)])
def test_int8_int8_mm_is_exact(m, k, n):
    """oneDNN's s8 x s8 -> s32 on CPU takes any M (no M > 16 rule), any K and N, unaligned inputs."""
    x = torch.randint(-128, 128, (m, k), dtype=torch.int8, generator=_gen(0))
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=_gen(1))
    expected = x.int() @ w.int().T
    assert torch.equal(kernels.int8_int8_mm(x, w), expected)
    flat = torch.randint(-128, 128, (m * k + 3,), dtype=torch.int8, generator=_gen(2))
    unaligned = flat[3:].view(m, k)
    assert torch.equal(kernels.int8_int8_mm(unaligned, w), unaligned.int() @ w.int().T)


def _reference(layer: W8A8Linear, x: torch.Tensor) -> torch.Tensor:
    """What the layer should compute: its own quantized input times its own dequantized weight."""
    _, scale, zero = layer.quantize_input(x)
    return fake_quantize(x, scale, zero, layer.symmetric) @ layer.dequantize().T


def _make(w: torch.Tensor, dtype: torch.dtype, activation: str, symmetric: bool, calibration: torch.Tensor,
          observer: str = "minmax") -> W8A8Linear:
    qparams = _calibrated(calibration, observer, symmetric) if activation == "static" else None
    return W8A8Linear.from_float(w, None, dtype, qparams, symmetric)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("activation", ["dynamic", "static"])
@pytest.mark.parametrize("m", [1, 5, 33])
def test_kernel_matches_fake_quantized_reference(activation, symmetric, dtype, m):
    """The integer path (zero point and row sums included) equals the float computation on the
    same grids; a wrong zero-point correction shifts every output by z * s_x * s_w * rowsum."""
    x = _x(m, 256, one_sided=not symmetric) + 0.3
    layer = _make(_weight(), dtype, activation, symmetric, x)
    y = layer(x.to(dtype))
    ref = _reference(layer, x.to(dtype))
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert (y.float() - ref).abs().max().item() <= tol * ref.abs().max().item()
    if not symmetric:
        assert layer.quantize_input(x.to(dtype))[2].abs().max() > 0  # the zero point is exercised


def test_the_forward_runs_on_the_int8_gemm(monkeypatch):
    calls = []
    real = kernels.int8_int8_mm

    def spy(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        calls.append((x.dtype, w.dtype))
        return real(x, w)

    monkeypatch.setattr(kernels, "int8_int8_mm", spy)
    layer = W8A8Linear.from_float(_weight(), None, torch.bfloat16)
    layer(_x(4, 256).bfloat16())
    assert calls == [(torch.int8, torch.int8)]


# SQNR (dB) of the layer output against the float x @ w^T on Gaussian weights and inputs:
# dynamic per token ~39.5, static per tensor ~38.7-39.2 (int8 weights alone give ~42).
SQNR_RANDOM = {"dynamic": 38.0, "static-minmax": 37.5, "static-percentile": 37.5, "static-mse": 37.5}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("method", sorted(SQNR_RANDOM))
def test_sqnr_on_random_weights(method, symmetric, dtype):
    w, x = _weight(256, 512), _x(16, 512)
    activation, _, observer = method.partition("-")
    layer = _make(w, dtype, activation, symmetric, x, observer or "minmax")
    assert sqnr(x @ w.T, layer(x.to(dtype))) >= SQNR_RANDOM[method] - (0.5 if dtype == torch.bfloat16 else 0)


def test_asymmetric_static_wins_on_one_sided_inputs():
    """Inputs >= 0 (after a ReLU-like gate) use half of a symmetric grid and all of an asymmetric one."""
    w, x = _weight(256, 512), _x(16, 512, one_sided=True)
    sym, asym = (_make(w, torch.float32, "static", s, x) for s in (True, False))
    assert sqnr(x @ w.T, asym(x)) >= sqnr(x @ w.T, sym(x)) + 2.0


def test_static_inputs_beyond_the_calibrated_range_are_clipped_not_wrapped():
    w = _weight()
    layer = _make(w, torch.float32, "static", True, _x(8, 256))
    x = _x(2, 256) * 100
    q, _, _ = layer.quantize_input(x)
    assert q.min() == -127 and q.max() == 127
    assert (layer(x) - _reference(layer, x)).abs().max() <= 1e-4 * _reference(layer, x).abs().max()


def test_bias_and_leading_dimensions():
    w, b = _weight(), torch.randn(192, generator=_gen(5))
    layer = W8A8Linear.from_float(w, b, torch.float32)
    x = _x(6, 256).view(2, 3, 256)
    y = layer(x)
    assert y.shape == (2, 3, 192)
    assert torch.allclose(y.view(6, 192), _reference(layer, x.view(6, 256)) + b, atol=1e-4)


# --------------------------------------------------------------------------- observers

def test_minmax_asymmetric_grid_by_hand():
    """Range [-1, 3]: scale = 4 / 255, zero = round(-128 + 1 / scale) = -64; the ends land on the grid's ends."""
    x = torch.linspace(-1.0, 3.0, 101)
    obs = MinMaxObserver(symmetric=False)
    obs.update(x)
    scale, zero = obs.qparams()
    assert scale.shape == () and abs(scale.item() - 4 / 255) < 1e-7 and zero.item() == -64
    dq = fake_quantize(x, scale, zero, False)
    assert (dq - x).abs().max() <= scale / 2 + 1e-6
    assert fake_quantize(torch.zeros(1), scale, zero, False).item() == 0.0  # zero is exact


def test_minmax_symmetric_per_channel_is_the_weight_quantizer():
    w = _weight()
    obs = MinMaxObserver(symmetric=True, axis=0)
    obs.update(w)
    scale, zero = obs.qparams()
    assert scale.shape == (192,) and torch.equal(zero, torch.zeros(192, dtype=torch.int32))
    assert torch.allclose(scale, quantize_int8_per_channel(w, torch.float32)[1])


def test_observers_accumulate_over_updates():
    """Ranges merge across batches; the kept sample weighs each batch by its size, so a later
    small batch of large values does not pull the percentile up (a sample biased toward recent
    batches would: 1,000 of its 4,096 slots would come from the last batch)."""
    minmax = MinMaxObserver(symmetric=False, axis=-1)
    percentile = PercentileObserver(99.0, symmetric=True, max_samples=4096)
    batches = [_x(1000, 4, seed=s) for s in range(9)] + [_x(100, 4, seed=9) * 10]
    for batch in batches:
        minmax.update(batch)
        percentile.update(batch)
    everything = torch.cat(batches)
    scale, _ = minmax.qparams()
    assert scale.shape == (4,)
    assert torch.allclose(scale, (everything.amax(0) - everything.amin(0)) / 255)
    true_bound = everything.abs().flatten().quantile(0.99)
    assert abs(percentile.qparams()[0].item() * 127 / true_bound.item() - 1) < 0.15


@pytest.mark.parametrize("axis", [None, 0])
def test_percentile_and_mse_clip_heavy_tails(axis):
    """On heavy-tailed values the clipping observers pick a tighter range and a lower MSE than min-max."""
    x = _heavy_tailed(4 * 200_000).view(4, -1) if axis == 0 else _heavy_tailed(200_000)
    errors, scales = {}, {}
    for name, obs in (("minmax", MinMaxObserver(True, axis)), ("percentile", PercentileObserver(99.99, True, axis)),
                      ("mse", MSEObserver(True, axis))):
        obs.update(x)
        scale, zero = obs.qparams()
        dims = [d for d in range(x.dim()) if d != axis] if axis is not None else list(range(x.dim()))
        shape = [-1 if d == axis else 1 for d in range(x.dim())]
        errors[name] = (fake_quantize(x, scale.view(shape), zero.view(shape), True) - x).pow(2).mean(dims)
        scales[name] = scale
    for name in ("percentile", "mse"):
        assert (scales[name] < scales["minmax"]).all(), name
        assert (errors[name] < 0.97 * errors["minmax"]).all(), name
    assert (errors["mse"] <= errors["percentile"] * 1.02).all()


def test_mse_keeps_the_full_range_of_uniform_values():
    """Nothing to gain by clipping a uniform distribution: the search stays at (nearly) min-max."""
    x = torch.rand(100_000, generator=_gen(0)) * 2 - 1
    obs = MSEObserver(symmetric=True)
    obs.update(x)
    assert obs.qparams()[0].item() * 127 > 0.95


def test_observer_needs_data():
    with pytest.raises(RuntimeError, match="before any update"):
        MSEObserver().qparams()


# --------------------------------------------------------------------------- config and CLI

def test_config_round_trips_and_rejects():
    config = W8A8Config(activation="static", observer="percentile", percentile=99.9, symmetric=False,
                        calibration_samples=4)
    assert config_from_dict(config.to_dict()) == config
    with pytest.raises(InvalidParameterError, match="unknown key"):
        config_from_dict({"method": "w8a8", "group_size": 64})
    with pytest.raises(InvalidParameterError, match="static activations only"):
        W8A8Config(observer="mse")
    with pytest.raises(InvalidParameterError, match="activation"):
        W8A8Config(activation="per-token")
    with pytest.raises(InvalidParameterError, match="percentile"):
        W8A8Config(activation="static", observer="percentile", percentile=40.0)


# --------------------------------------------------------------------------- whole (tiny) models

IDS = list(range(3, 40, 2)) * 2
CALIBRATION = [torch.randint(0, 256, (64,), generator=_gen(s)).tolist() for s in range(4)]
CONFIGS = {
    "dynamic": W8A8Config(),
    "dynamic-unsmoothed": W8A8Config(smoothing_alpha=None),
    "dynamic-asym": W8A8Config(symmetric=False),
    "static-minmax": W8A8Config(activation="static"),
    "static-percentile-asym": W8A8Config(activation="static", observer="percentile", symmetric=False),
    "static-mse": W8A8Config(activation="static", observer="mse"),
}
# logits SQNR (dB) of the quantized tiny model against its float self (int8 weight-only: 30)
LOGIT_SQNR = {"dynamic": 28.0, "dynamic-unsmoothed": 28.0, "dynamic-asym": 28.0, "static-minmax": 22.0,
              "static-percentile-asym": 22.0, "static-mse": 22.0}


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_quantized_logits_stay_close(name, tie, tmp_path):
    loaded = tiny_loaded(write_tiny_checkpoint(tmp_path, tie=tie))
    reference = prompt_logits(loaded.model, IDS)
    quantize_model(loaded.model, CONFIGS[name], torch.float32, progress=False, calibration=CALIBRATION)
    model = loaded.model
    layers = [m for m in model.modules() if isinstance(m, W8A8Linear)]
    assert len(layers) == 2 * 4 + 1 and not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert isinstance(model.lm_head, W8A8Linear)
    assert all(m.static == (CONFIGS[name].activation == "static") for m in layers)
    assert sqnr(reference, prompt_logits(model, IDS)) >= LOGIT_SQNR[name]


@pytest.mark.parametrize("config", [W8A8Config(activation="static"), W8A8Config()], ids=["static", "smoothing"])
def test_calibrating_configs_need_text_or_ids(config, tmp_path):
    loaded = tiny_loaded(write_tiny_checkpoint(tmp_path))
    with pytest.raises(InvalidParameterError, match="calibrates on text"):
        quantize_model(loaded.model, config, progress=False)


def test_unsmoothed_dynamic_needs_no_calibration(tmp_path):
    loaded = tiny_loaded(write_tiny_checkpoint(tmp_path))
    norm = loaded.model.norm.weight.clone()
    quantize_model(loaded.model, W8A8Config(smoothing_alpha=None), progress=False)
    assert isinstance(loaded.model.lm_head, W8A8Linear) and torch.equal(loaded.model.norm.weight, norm)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ["dynamic", "static-percentile-asym"])
def test_save_then_load_gives_identical_outputs(name, dtype, tmp_path):
    loaded = tiny_loaded(write_tiny_checkpoint(tmp_path / "src", bias=True))
    quantize_model(loaded.model, CONFIGS[name], dtype, progress=False, calibration=CALIBRATION)
    before = prompt_logits(loaded.model, IDS)
    out = save_quantized(loaded, tmp_path / "q")
    assert json.loads((out / "config.json").read_text())["quantization_config"] == CONFIGS[name].to_dict()
    reloaded = load_model(out, dtype, "cpu")
    assert reloaded.model.quantization_config == CONFIGS[name]
    head = reloaded.model.lm_head
    assert isinstance(head, W8A8Linear) and head.static == (name != "dynamic")
    assert head.symmetric == CONFIGS[name].symmetric
    assert torch.equal(prompt_logits(reloaded.model, IDS), before)


def test_cli_quantize_w8a8_then_generate(tmp_path):
    from tokenmill.cli import main

    src = write_tiny_checkpoint(tmp_path / "src")
    assert main(["quantize", str(src), "--method", "w8a8", "--asymmetric", "--out", str(tmp_path / "q"),
                 "--dtype", "float32"]) == 0
    saved = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert saved["method"] == "w8a8" and saved["activation"] == "dynamic" and saved["symmetric"] is False
    loaded = load_model(tmp_path / "q", torch.float32, "cpu")
    ids = IDS[:8]
    expected = []
    for _ in range(5):
        expected.append(int(prompt_logits(loaded.model, ids + expected)[-1].argmax()))
    llm = LLM(str(tmp_path / "q"), dtype="float32", device="cpu", kv_cache_memory=2**22)
    result = llm.generate([ids], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert result[0].outputs[0].token_ids == expected


# --------------------------------------------------------------------------- real weights

# SQNR (dB) on SmolLM2's own weights with Laplace inputs: dynamic ~35.9-37.1, static (MSE) ~34.5-36.6
SQNR_REAL = {"dynamic": 35.0, "static": 33.5}
REAL_LAYERS = ["layers.0.attn.qkv", "layers.14.mlp.gate_up", "layers.29.mlp.down", "layers.7.attn.o"]


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2-135m-instruct", torch.float32, "cpu").model


@pytest.mark.real_model
@pytest.mark.parametrize("layer", REAL_LAYERS)
def test_sqnr_on_real_weights(smollm2, layer):
    w = smollm2.get_submodule(layer).weight
    x = _heavy_tailed(16 * w.shape[1], seed=3).view(16, -1)
    for method, threshold in SQNR_REAL.items():
        qparams = _calibrated(x, "mse", True) if method == "static" else None
        layer_q = W8A8Linear.from_float(w, None, torch.bfloat16, qparams)
        assert sqnr(x @ w.T, layer_q(x.bfloat16())) >= threshold, method
