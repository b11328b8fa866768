"""Features with code of their own on CUDA, run there against the same computation: PyTorch's int8
weight-only GEMM, tinygemm's int4 and the int8 x int8 GEMM of W8A8 (against each layer's own
dequantized weight), and generation with speculative decoding, prefix caching, a quantized KV cache
and a quantized directory (against the same model without the feature). Each case also runs on CPU,
so the checks themselves are exercised where CI runs; the CUDA cases skip without a GPU and run on a
lent GPU machine through ``bench/cuda_check.sh``."""

from __future__ import annotations

import pytest
import torch

from tests.quantization.helpers import write_tiny_checkpoint
from tokenmill import LLM, SamplingParams
from tokenmill.quantization import Int4WeightOnlyConfig, quantize, save_quantized
from tokenmill.quantization.linear import Int4Linear, Int8Linear, W8A8Linear

NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=NO_CUDA)]
# float16 runs on CUDA only
DEVICE_DTYPES = [("cpu", torch.bfloat16), pytest.param("cuda", torch.bfloat16, marks=NO_CUDA),
                 pytest.param("cuda", torch.float16, marks=NO_CUDA)]

LAYERS = {
    "int8": lambda w, dtype: Int8Linear.from_float(w, None, dtype),
    "int4-g32": lambda w, dtype: Int4Linear.from_float(w, None, dtype, 32),
    "int4-g128": lambda w, dtype: Int4Linear.from_float(w, None, dtype, 128),
    "w8a8": lambda w, dtype: W8A8Linear.from_float(w, None, dtype),
}


def _relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES, ids=lambda v: str(v).replace("torch.", ""))
@pytest.mark.parametrize("method", sorted(LAYERS))
@pytest.mark.parametrize("m", [1, 5, 33])
def test_quantized_linear_multiplies_its_dequantized_weight(method, device, dtype, m):
    """Rows 1 and 5 take the few-row paths (the int8 x int8 GEMM pads under 17 rows on CUDA), 33 the
    many-row ones. W8A8 also rounds the activations to int8: a looser bound."""
    g = torch.Generator().manual_seed(m)
    weight = (torch.randn(384, 512, generator=g) * 0.02).to(device)
    layer = LAYERS[method](weight, dtype)
    assert layer.qweight.device.type == device
    x = torch.randn(m, 512, generator=g).to(device=device, dtype=dtype)
    y = layer(x)
    assert y.shape == (m, 384) and y.dtype == dtype and y.device.type == device
    ref = x.float() @ layer.dequantize().float().T
    assert _relative_error(y, ref) <= (2e-2 if method == "w8a8" else 1e-2)


@pytest.fixture(scope="module")
def tiny_src(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "src")


# prompts that repeat themselves, so that n-gram lookup drafts and some drafts are accepted
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7], [40, 41, 42, 43, 40, 41, 42], list(range(100, 140)),
           [3, 3, 3, 3, 3, 3]]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def _tokens(llm: LLM, prompts=PROMPTS) -> list[list[int]]:
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert llm.engine.num_used_blocks == 0 or llm.engine.config.enable_prefix_caching
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_speculative_decoding_and_prefix_caching_keep_greedy_output(tiny_src, device):
    """float32, where greedy speculation must be token-identical; prefix-cache hits too."""
    options = dict(device=device, dtype="float32", kv_cache_memory=2**23)
    expected = _tokens(LLM(str(tiny_src), enable_prefix_caching=False, **options))
    cached = LLM(str(tiny_src), **options)
    assert _tokens(cached) == expected
    again = cached.generate(PROMPTS, GREEDY)  # every prompt's full blocks now come from the cache
    assert [o.outputs[0].token_ids for o in again] == expected
    assert sum(o.num_cached_tokens for o in again) > 0
    for method in ("ngram", "layerskip"):
        spec = LLM(str(tiny_src), speculative={"method": method, "num_speculative_tokens": 3},
                   speculative_adaptive=False, **options)
        assert _tokens(spec) == expected, method
        assert spec.engine.num_used_blocks == 0 or spec.engine.config.enable_prefix_caching


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_a_quantized_kv_cache_follows_the_full_precision_one(tiny_src, device, kv_cache_dtype):
    """Keys and values rounded to 8 bits move logits a little: most greedy tokens stay, and every
    block comes back."""
    options = dict(device=device, dtype="bfloat16", kv_cache_memory=2**23, enable_prefix_caching=False)
    expected = _tokens(LLM(str(tiny_src), **options))
    llm = LLM(str(tiny_src), kv_cache_dtype=kv_cache_dtype, **options)
    got = _tokens(llm)
    same = sum(a == b for x, y in zip(got, expected) for a, b in zip(x, y))
    assert same >= 0.75 * sum(map(len, expected)), (same, got, expected)
    assert llm.engine.num_used_blocks == 0


@pytest.mark.parametrize("device", DEVICES)
def test_a_quantized_directory_generates_what_it_computes(tiny_src, device, tmp_path):
    """An int4 directory loads onto the device; its greedy tokens are the argmax of its own logits
    (the model run step by step on the same device), and the same as on CPU up to near-ties."""
    out = save_quantized(quantize(str(tiny_src), Int4WeightOnlyConfig(group_size=32), dtype="bfloat16",
                                  progress=False), tmp_path / "q")
    llm = LLM(str(out), device=device, dtype="bfloat16", kv_cache_memory=2**23, enable_prefix_caching=False)
    on_cpu = _tokens(LLM(str(out), device="cpu", dtype="bfloat16", kv_cache_memory=2**23,
                         enable_prefix_caching=False))
    got = _tokens(llm)
    same = sum(a == b for x, y in zip(got, on_cpu) for a, b in zip(x, y))
    assert same >= 0.75 * sum(map(len, on_cpu)), (same, got, on_cpu)
    assert next(llm.engine.runner.model.parameters()).device.type == device


@pytest.mark.parametrize("device", DEVICES)
def test_structured_pruning_and_distillation_run_on_the_device(tiny_src, device, tmp_path):
    """Calibration (with the refit's second moments) and a few distillation steps on the device: the
    pruned student keeps its new shape there and the distillation's loss stays finite."""
    from tokenmill.distillation.config import DistillConfig
    from tokenmill.distillation.distill import distill
    from tokenmill.paths import default_cache_dir
    from tokenmill.pruning.api import prune_model
    from tokenmill.pruning.config import StructuredConfig
    from tokenmill.quantization.api import load_float32

    teacher = load_float32(str(tiny_src), torch.device(device), default_cache_dir())
    student = load_float32(str(tiny_src), torch.device(device), default_cache_dir())
    calibration = [list(range(i, i + 48)) for i in range(0, 160, 40)]
    student.model, report = prune_model(student.model, StructuredConfig(intermediate_size=64, num_kv_heads=1),
                                        calibration=calibration, progress=False)
    student.config = student.model.config
    assert student.model.layers[0].mlp.down.weight.shape == (64, 64)
    assert student.model.layers[0].mlp.down.weight.device.type == device
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    config = DistillConfig(data=str(text), eval_tokens=0, batch_size=2, seq_len=32, train={"steps": 3, "lr": 1e-3})
    result = distill(teacher, student, config, tmp_path / "kd", progress=False)
    assert all(torch.isfinite(torch.tensor(v)).all() for v in result.log["loss"])
    assert (result.saved / "model.safetensors").exists()
