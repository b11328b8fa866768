"""GGUF metadata -> ModelConfig, for the architectures tokenmill runs."""

from __future__ import annotations

from typing import Any

from tokenmill.config import ModelConfig, MoESpec
from tokenmill.errors import ModelFormatError, UnsupportedModelError

# GGUF general.architecture -> (tokenmill family, per-architecture switches)
GGUF_ARCHITECTURES: dict[str, dict[str, Any]] = {
    "llama": {"family": "llama"},
    "mistral": {"family": "llama"},
    "qwen2": {"family": "llama", "attention_bias": True},
    "qwen3": {"family": "llama", "qk_norm": True},
    "gemma3": {"family": "gemma3", "qk_norm": True, "hidden_act": "gelu_tanh"},
    "qwen2moe": {"family": "llama", "attention_bias": True, "norm_topk": False},
    "qwen3moe": {"family": "llama", "qk_norm": True, "norm_topk": True},
    "olmoe": {"family": "llama", "qk_norm": True, "qk_norm_per_head": False, "norm_topk": False},
}
"""Mixtral comes as ``llama`` with ``llama.expert_count``: its experts' weights are renormalised."""

GEMMA3_GLOBAL_EVERY = 6
"""Gemma 3 makes every sixth layer global, the rest sliding-window (GGUF does not record it)."""
GEMMA3_LOCAL_ROPE_THETA = 10000.0


def gguf_model_config(metadata: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
    arch = metadata.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"unsupported model architecture {arch!r}; tokenmill runs {', '.join(sorted(GGUF_ARCHITECTURES))}")
    spec = GGUF_ARCHITECTURES[arch]

    def get(key: str, default: Any = None, required: bool = False) -> Any:
        value = metadata.get(f"{arch}.{key}", default)
        if required and value is None:
            raise ModelFormatError(f"GGUF metadata lacks {arch}.{key}")
        return value

    hidden = get("embedding_length", required=True)
    heads = get("attention.head_count", required=True)
    n_layers = get("block_count", required=True)
    head_dim = get("attention.key_length") or hidden // heads
    scaling_type = get("rope.scaling.type")
    if scaling_type not in (None, "none"):
        raise UnsupportedModelError(f"unsupported RoPE scaling {scaling_type!r} in {arch} GGUF")
    vocab = get("vocab_size") or len(metadata.get("tokenizer.ggml.tokens", ())) or None
    if vocab is None:
        raise ModelFormatError("GGUF metadata gives no vocabulary size")
    fields: dict[str, Any] = dict(
        architecture=spec["family"], vocab_size=vocab, hidden_size=hidden,
        intermediate_size=get("feed_forward_length", required=True), num_layers=n_layers, num_heads=heads,
        num_kv_heads=get("attention.head_count_kv") or heads, head_dim=head_dim,
        max_position_embeddings=get("context_length", 4096),
        rms_norm_eps=get("attention.layer_norm_rms_epsilon", 1e-6), rope_theta=get("rope.freq_base", 10000.0),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias=spec.get("attention_bias", False) and "blk.0.attn_q.bias" in tensor_names,
        qk_norm=spec.get("qk_norm", False), qk_norm_per_head=spec.get("qk_norm_per_head", True),
        clip_qkv=get("attention.clamp_kqv"), hidden_act=spec.get("hidden_act", "silu"),
        bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=metadata.get("tokenizer.ggml.eos_token_id"),
    )
    if get("expert_count"):
        fields["moe"] = _moe_spec(get, spec, n_layers, tensor_names, fields["intermediate_size"])
    window = get("attention.sliding_window")
    if spec["family"] == "gemma3":
        fields.update(
            sliding_window=window, rope_local_theta=GEMMA3_LOCAL_ROPE_THETA,
            layer_types=tuple("full" if (i + 1) % GEMMA3_GLOBAL_EVERY == 0 else "sliding" for i in range(n_layers)),
            # Gemma 3 27B scales queries by hidden/heads, the other sizes by head_dim
            query_pre_attn_scalar=hidden // heads if n_layers == 62 else head_dim)
    elif window:
        fields.update(sliding_window=window, layer_types=("sliding",) * n_layers)
    return ModelConfig(**fields)


def _moe_spec(get, spec: dict[str, Any], n_layers: int, tensor_names: set[str], ffn: int) -> MoESpec:
    """The experts of an MoE GGUF: llama.cpp's ``expert_*`` keys; MoE layers are those with a
    router (``blk.N.ffn_gate_inp``), the shared expert is there when its tensors are."""
    layers = tuple(i for i in range(n_layers) if f"blk.{i}.ffn_gate_inp.weight" in tensor_names)
    shared = get("expert_shared_feed_forward_length") or 0
    if not shared and any(n.endswith("ffn_gate_shexp.weight") for n in tensor_names):
        raise ModelFormatError("GGUF has shared-expert tensors but no expert_shared_feed_forward_length")
    norm = get("expert_weights_norm")
    return MoESpec(
        num_experts=get("expert_count"), top_k=get("expert_used_count", required=True),
        expert_intermediate_size=get("expert_feed_forward_length") or ffn,
        norm_topk_prob=bool(norm) if norm is not None else spec.get("norm_topk", True),
        shared_expert_intermediate_size=shared,
        shared_expert_gate=bool(shared) and any(n.endswith("ffn_gate_inp_shexp.weight") for n in tensor_names),
        layers=None if len(layers) == n_layers else layers)


def permutes_rope_rows(metadata: dict[str, Any]) -> bool:
    """llama.cpp's converter interleaves q/k rows for the Llama architecture only."""
    return metadata.get("general.architecture") in ("llama", "mistral")
