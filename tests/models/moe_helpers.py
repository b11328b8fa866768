"""Tiny random mixture-of-experts HF checkpoints (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE), in
transformers' per-expert layout (what ``save_pretrained`` writes) or its fused 3-D layout."""

from __future__ import annotations

import torch

from tests.model_utils import save_byte_tokenizer

COMMON = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False,
              bos_token_id=None, eos_token_id=256, pad_token_id=None)
ARCHITECTURES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"]


def moe_hf_config(arch: str, **overrides):
    import transformers

    if arch == "mixtral":
        return transformers.MixtralConfig(**COMMON, num_local_experts=6, num_experts_per_tok=2, **overrides)
    if arch == "qwen2_moe":
        return transformers.Qwen2MoeConfig(**COMMON, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=40,
                                           shared_expert_intermediate_size=72, norm_topk_prob=False,
                                           **{"mlp_only_layers": [1], **overrides})
    if arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**COMMON, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=40,
                                           norm_topk_prob=True, **overrides)
    if arch == "olmoe":
        return transformers.OlmoeConfig(**COMMON, num_experts=6, num_experts_per_tok=2, clip_qkv=2.0, **overrides)
    raise ValueError(arch)


def tiny_moe_model(arch: str, path, layout: str = "per_expert", seed: int = 0, **overrides):
    """A random tiny ``arch`` model saved at ``path`` (with a byte tokenizer); ``layout``
    "per_expert" (save_pretrained) or "fused" (``experts.gate_up_proj`` / ``down_proj`` 3-D
    tensors, as transformers holds them). Returns the HF model (float32, eval)."""
    import transformers
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(moe_hf_config(arch, **overrides),
                                                          dtype=torch.float32).eval()
    with torch.no_grad():  # every parameter random (routers start at zero in some families), norms near 1
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn_like(p) * 0.3 + 1.0)
            else:
                p.copy_(torch.randn_like(p) * (0.5 if ".gate.weight" in name else 0.08))
    if layout == "per_expert":
        model.save_pretrained(path)
    else:
        path.mkdir(parents=True, exist_ok=True)
        model.config.save_pretrained(path)
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        assert any(k.endswith("experts.gate_up_proj") for k in state), sorted(state)[:20]
        save_file(state, str(path / "model.safetensors"))
    save_byte_tokenizer(path)
    return model
