"""SmoothQuant: folding is exact in float, it raises SQNR where inputs have outlier channels, its
config validates, smoothed checkpoints round-trip, and on SmolLM2 it brings W8A8 near bf16."""

from __future__ import annotations

import pytest
import torch

from tests.model_utils import prompt_logits
from tests.parity import check_logprobs_close
from tests.quantization.helpers import small_config, tiny_loaded, write_tiny_checkpoint
from tokenmill import LLM, SamplingParams
from tokenmill.attention.paged import PagedAttentionBackend
from tokenmill.errors import InvalidParameterError
from tokenmill.loader import load_model
from tokenmill.models.base import CausalLM
from tokenmill.models.registry import MODEL_CLASSES
from tokenmill.quantization import W8A8Config, config_from_dict, quantize_model, save_quantized
from tokenmill.quantization.calibration import input_absmax
from tokenmill.quantization.config import SMOOTHABLE_LAYERS
from tokenmill.quantization.linear import W8A8Linear, sqnr
from tokenmill.quantization.observers import make_observer
from tokenmill.quantization.smoothing import smooth, smoothing_factors, smoothing_folds
from tokenmill.quantization.targets import QuantizeContext

IDS = list(range(3, 60, 3)) * 2
CALIBRATION = [torch.randint(0, 256, (48,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(3)]
ARCHITECTURES = {
    "llama-gqa-tied": {},
    "llama-mha-untied": {"num_kv_heads": 4, "tie_word_embeddings": False},
    "qwen2-bias": {"attention_bias": True},
    "qwen3-qk-norm": {"qk_norm": True, "num_kv_heads": 1},
    "gemma3": {"architecture": "gemma3", "qk_norm": True, "hidden_act": "gelu_tanh", "sliding_window": 16,
               "layer_types": ("sliding", "full"), "rope_local_theta": 10000.0, "rope_theta": 1e6,
               "query_pre_attn_scalar": 16.0},
}


def random_model(seed: int = 0, **overrides) -> CausalLM:
    """A small model of the given family with random weights and a few loud input channels:
    norm weights near 1 (Gemma's held as the multiplier 1 + w, as tokenmill does) with every
    16th channel 8x, so that the inputs of qkv, gate_up and the head have outliers to smooth."""
    g = torch.Generator().manual_seed(seed)
    cfg = small_config(**overrides)
    model = MODEL_CLASSES[cfg.architecture](cfg, PagedAttentionBackend())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
                if p.shape[0] == cfg.hidden_size:
                    p[::16] *= 8
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (0.5 if name.startswith("embed") else 0.08))
    return model.eval().requires_grad_(False)


def _ctx() -> QuantizeContext:
    return QuantizeContext(torch.float32, progress=False, calibration=CALIBRATION)


def _smooth_all(model: CausalLM, alpha: float = 0.5) -> None:
    names = [f.consumer for f in smoothing_folds(model, head=True)]
    smooth(model, input_absmax(model, names, W8A8Config(), _ctx()), alpha)


# --------------------------------------------------------------------------- exact in float

@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_folding_leaves_the_float_model_unchanged(arch):
    """Every fold (norms into qkv and gate_up, up rows into down, v rows into o, final norm into
    the head) cancels exactly: the logits match to float32 rounding, though the weights moved."""
    model = random_model(**ARCHITECTURES[arch])
    reference = prompt_logits(model, IDS)
    before = {name: p.clone() for name, p in model.named_parameters()}
    embed = model.embed.weight.clone()
    _smooth_all(model)
    after = dict(model.named_parameters())
    for name in ("layers.0.attn_norm.weight", "layers.1.ffn_norm.weight", "layers.0.attn.qkv.weight",
                 "layers.1.mlp.gate_up.weight", "layers.0.mlp.down.weight", "layers.1.attn.o.weight", "norm.weight"):
        assert (after[name] - before[name]).abs().max() > 1e-3, name
    assert torch.equal(model.embed.weight, embed)  # a tied head got its own scaled copy
    assert model.lm_head is not None
    smoothed = prompt_logits(model, IDS)
    assert (smoothed - reference).abs().max().item() <= 1e-4 * reference.abs().max().item()


def test_gqa_heads_of_a_group_share_their_factor():
    """Query heads h and h + 1 read the same v channel (2 heads per KV head), so the o columns
    they feed are scaled by one factor; the fold would not cancel otherwise."""
    model = random_model()
    o_before = model.layers[0].attn.o.weight.clone()
    _smooth_all(model)
    ratio = (model.layers[0].attn.o.weight / o_before)[0]  # s per input channel of o
    head_dim = model.config.head_dim
    per_head = ratio.view(model.config.num_heads, head_dim)
    assert torch.allclose(per_head[0], per_head[1], rtol=1e-5) and torch.allclose(per_head[2], per_head[3], rtol=1e-5)
    assert not torch.allclose(per_head[0], per_head[2], rtol=1e-3)


def test_smoothing_factors_by_hand():
    s = smoothing_factors(torch.tensor([4.0, 1.0, 0.0]), torch.tensor([1.0, 4.0, 1.0]), 0.5)
    assert torch.allclose(s[:2], torch.tensor([2.0, 0.5]))
    assert s[2] > 0  # a channel never seen non-zero gets a small positive factor, not 0
    assert torch.allclose(smoothing_factors(torch.tensor([9.0]), torch.tensor([3.0]), 1.0), torch.tensor([9.0]))


# --------------------------------------------------------------------------- what it buys

def _outlier_inputs(m: int = 64, k: int = 512, seed: int = 0) -> torch.Tensor:
    """Gaussian inputs whose every 64th channel is 40x louder, as in an LLM's residual stream."""
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    x[:, ::64] *= 40
    return x


@pytest.mark.parametrize("activation", ["dynamic", "static"])
def test_smoothing_raises_sqnr_on_outlier_channels(activation):
    """Per-token (and per-tensor) int8 grids are stretched by the loud channels; dividing them by
    s and multiplying the weight's columns by s gains >= 6 dB (measured: ~14 dynamic, ~16 static)."""
    w = torch.randn(256, 512, generator=torch.Generator().manual_seed(1)) * 0.02
    x = _outlier_inputs()
    reference = x @ w.T
    s = smoothing_factors(x.abs().amax(dim=0), w.abs().amax(dim=0), 0.5)

    def layer_sqnr(weight: torch.Tensor, inputs: torch.Tensor) -> float:
        qparams = None
        if activation == "static":
            obs = make_observer("minmax", True)
            obs.update(inputs)
            qparams = obs.qparams()
        return sqnr(reference, W8A8Linear.from_float(weight, None, torch.float32, qparams)(inputs))

    plain, smoothed = layer_sqnr(w, x), layer_sqnr(w * s, x / s)
    assert smoothed >= plain + 6.0, (plain, smoothed)


# logits SQNR (dB) of dynamic W8A8 against the float model, on the random models above (8x channels in
# every norm): unsmoothed 25.5-27.4, smoothed (alpha 0.5) 30.2-31.4, a gain of 4.1-5.1 dB in each family
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_smoothing_raises_the_logits_sqnr_of_each_family(arch):
    scores = []
    for alpha in (None, 0.5):
        model = random_model(**ARCHITECTURES[arch])
        reference = prompt_logits(model, IDS)
        quantize_model(model, W8A8Config(smoothing_alpha=alpha), torch.float32, progress=False, calibration=CALIBRATION)
        scores.append(sqnr(reference, prompt_logits(model, IDS)))
    assert scores[1] >= scores[0] + 2.0, scores


# --------------------------------------------------------------------------- config

def test_config_validates_smoothing_fields():
    config = W8A8Config(smoothing_alpha=0.8, smoothing_layers=["qkv", "gate_up"])
    assert config.smoothing_layers == ("qkv", "gate_up")
    assert config_from_dict(config.to_dict()) == config
    assert W8A8Config().smoothing_alpha == 0.5 and W8A8Config().smoothing_layers == SMOOTHABLE_LAYERS
    assert W8A8Config(smoothing_alpha=None).smoothing_alpha is None
    with pytest.raises(InvalidParameterError, match=r"smoothing_alpha must be in \[0, 1\]"):
        W8A8Config(smoothing_alpha=1.5)
    with pytest.raises(InvalidParameterError, match="unknown \\['up'\\]"):
        W8A8Config(smoothing_layers=("qkv", "up"))
    with pytest.raises(InvalidParameterError, match="a list of layer kinds"):
        W8A8Config(smoothing_layers="qkv")


# --------------------------------------------------------------------------- through quantize and a checkpoint

def test_smoothing_moves_only_the_listed_layers(tmp_path):
    loaded = tiny_loaded(write_tiny_checkpoint(tmp_path))
    model = loaded.model
    attn_norm, ffn_norm, final = (model.layers[0].attn_norm.weight.clone(), model.layers[0].ffn_norm.weight.clone(),
                                  model.norm.weight.clone())
    quantize_model(model, W8A8Config(smoothing_layers=("qkv",)), torch.float32, progress=False,
                   calibration=CALIBRATION)
    assert not torch.equal(model.layers[0].attn_norm.weight, attn_norm)
    assert torch.equal(model.layers[0].ffn_norm.weight, ffn_norm) and torch.equal(model.norm.weight, final)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("activation", ["dynamic", "static"])
def test_smoothed_checkpoint_round_trips(activation, tie, dtype, tmp_path):
    """The folded norms and weights are ordinary parameters; save -> load gives the same logits."""
    loaded = tiny_loaded(write_tiny_checkpoint(tmp_path / "src", tie=tie, bias=True))
    config = W8A8Config(activation=activation, observer="percentile" if activation == "static" else "minmax")
    norm = loaded.model.norm.weight.clone()
    quantize_model(loaded.model, config, dtype, progress=False, calibration=CALIBRATION)
    assert not torch.equal(loaded.model.norm.weight.float(), norm)
    before = prompt_logits(loaded.model, IDS)
    out = save_quantized(loaded, tmp_path / "q")
    reloaded = load_model(out, dtype, "cpu")
    assert reloaded.model.quantization_config == config
    assert torch.equal(prompt_logits(reloaded.model, IDS), before)


# --------------------------------------------------------------------------- SmolLM2

PPL_TOKENS = 2048
# perplexity change vs bf16 on the first 2048 corpus tokens (measured: no smoothing +5.7%,
# smoothing calibrated on 4 sequences +1.0%, on the default 16 +0.8%); the bound sits between, with
# room for kernel rounding differences
MAX_PPL_CHANGE = 0.025
SMOLLM2_CALIBRATION = 4  # sequences of 512 tokens: a third of the default's calibration time


@pytest.mark.real_model
def test_smollm2_w8a8_smoothed_perplexity_and_round_trip(tmp_path):
    from tokenmill.eval.corpus import read_tokens
    from tokenmill.eval.corpus import fetch_corpus
    from tokenmill.eval.perplexity import perplexity
    from tokenmill.quantization import quantize

    base = load_model("smollm2-135m-instruct", torch.bfloat16, "cpu")
    ids = read_tokens(base.tokenizer, fetch_corpus(), PPL_TOKENS)  # as bench/quantization.py and eval do
    reference = perplexity(base.model, ids, context=512, stride=256, progress=False).perplexity
    loaded = quantize("smollm2-135m-instruct", W8A8Config(calibration_samples=SMOLLM2_CALIBRATION), dtype="bfloat16",
                      progress=False)
    change = perplexity(loaded.model, ids, context=512, stride=256, progress=False).perplexity / reference - 1
    assert change < MAX_PPL_CHANGE, change

    prompt = loaded.tokenizer.encode("The capital of France is")
    expected: list[int] = []
    expected_top: list[list[int]] = []
    for _ in range(12):  # greedy, by hand, through the in-memory quantized model (whole prompt each time)
        logits = prompt_logits(loaded.model, prompt + expected)[-1]
        expected.append(int(logits.argmax()))
        expected_top.append(torch.topk(logits, 5).indices.tolist())
    out = save_quantized(loaded, tmp_path / "q")
    llm = LLM(str(out), dtype="bfloat16", device="cpu", kv_cache_memory=2**24)
    result = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5))
    sample = result[0].outputs[0]
    # the engine decodes through the KV cache (another attention kernel than a whole-prompt pass):
    # in bfloat16 the two may part at a near-tie (SmolLM2 here has one, 15.125 vs 15.0625 at token
    # 6), never elsewhere
    check_logprobs_close(sample.token_ids, [[t for t, _ in lp.top] for lp in sample.logprobs], expected, expected_top)
    assert sample.token_ids[:5] == expected[:5]
