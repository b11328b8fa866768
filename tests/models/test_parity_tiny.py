"""Tiny random Llama / Qwen2 / Qwen3 / Mistral / Gemma 3 models built here, saved as HF
checkpoints, loaded by tokenmill: full-prompt logits match HF transformers (float32, 1e-3)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tokenmill.loading.checkpoint import open_hf  # noqa: E402
from tokenmill.models.builder import build_model  # noqa: E402
from tests.model_utils import prompt_logits  # noqa: E402

COMMON = dict(vocab_size=320, hidden_size=64, intermediate_size=112, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5)

CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**COMMON, tie_word_embeddings=False),
    "llama3-rope-scaling": lambda: transformers.LlamaConfig(
        **COMMON, tie_word_embeddings=True, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64}),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON, tie_word_embeddings=False),
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, head_dim=24, tie_word_embeddings=True),
    "mistral": lambda: transformers.MistralConfig(**COMMON, sliding_window=16, tie_word_embeddings=False),
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **{**COMMON, "num_hidden_layers": 4, "num_key_value_heads": 1}, head_dim=32, sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        query_pre_attn_scalar=24),
}


def _hf_model(name: str, tmp_path):
    torch.manual_seed(0)
    config = CONFIGS[name]()
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # random norm weights and biases, so that every parameter matters
        for pname, p in model.named_parameters():
            if "norm" in pname or pname.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.3 + (1.0 if "norm" in pname and name != "gemma3" else 0.0))
    model.save_pretrained(tmp_path)
    return model


DEVICES = [("cpu", torch.float32), ("cpu", torch.bfloat16), ("cuda", torch.float32), ("cuda", torch.bfloat16),
           ("cuda", torch.float16)]


@pytest.mark.parametrize("device,dtype", DEVICES, ids=lambda v: str(v).replace("torch.", ""))
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_tiny_model_logits_match_hf(name, device, dtype, tmp_path):
    """float32: max |diff| <= 1e-3 against HF in float32. bfloat16/float16: against HF run in the
    same dtype on the same device, within what rounding of 16-bit activations allows."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    hf = _hf_model(name, tmp_path).to(device=device, dtype=dtype)
    ours = build_model(open_hf(tmp_path), dtype, device)
    ids = torch.randint(0, 320, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        expected = hf(torch.tensor([ids], device=device)).logits[0].float()
    # 16-bit: bfloat16 keeps 8 bits of mantissa; a few roundings per layer differ between kernels
    tolerance = 1e-3 if dtype == torch.float32 else 5e-2 * expected.abs().max().item()
    got = prompt_logits(ours, ids)
    assert (got - expected).abs().max().item() <= tolerance
    # chunked prefill through the KV cache gives the same logits as one pass
    chunked = prompt_logits(ours, ids, chunk=7)
    assert (chunked - expected).abs().max().item() <= tolerance
