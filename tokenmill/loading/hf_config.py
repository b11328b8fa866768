"""HF ``config.json`` -> ModelConfig, and the ``quantization_config`` a tokenmill-quantized one carries."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenmill.config import ModelConfig, MoESpec, RopeScaling
from tokenmill.errors import ModelFormatError, UnsupportedModelError

HF_MODEL_TYPES: dict[str, dict[str, Any]] = {
    "llama": {"family": "llama"},
    "mistral": {"family": "llama", "sliding": True},
    "qwen2": {"family": "llama", "attention_bias": True},
    "qwen3": {"family": "llama", "qk_norm": True},
    "gemma3_text": {"family": "gemma3", "qk_norm": True},
    "mixtral": {"family": "llama", "sliding": True, "moe": "mixtral"},
    "qwen2_moe": {"family": "llama", "attention_bias": True, "moe": "qwen"},
    "qwen3_moe": {"family": "llama", "qk_norm": True, "moe": "qwen"},
    "olmoe": {"family": "llama", "qk_norm": True, "qk_norm_per_head": False, "moe": "olmoe"},
}


def _rope(cfg: dict[str, Any], layer_type: str) -> dict[str, Any]:
    """RoPE parameters, from transformers 5's ``rope_parameters`` or 4's ``rope_theta``/``rope_scaling``."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and layer_type in params:
        params = params[layer_type]
    if not isinstance(params, dict):
        params = dict(cfg.get("rope_scaling") or {})
        params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    return params


def _rope_scaling(params: dict[str, Any]) -> RopeScaling | None:
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise UnsupportedModelError(f"unsupported RoPE scaling type {kind!r}")
    return RopeScaling(factor=params["factor"], low_freq_factor=params["low_freq_factor"],
                       high_freq_factor=params["high_freq_factor"],
                       original_max_position_embeddings=params["original_max_position_embeddings"])


def _first(value: Any) -> Any:
    return value[0] if isinstance(value, list) else value


def hf_model_config(cfg: dict[str, Any]) -> ModelConfig:
    if cfg.get("model_type") == "gemma3" and "text_config" in cfg:
        cfg = {**cfg["text_config"], "model_type": "gemma3_text",
               "tie_word_embeddings": cfg.get("tie_word_embeddings", True)}
    model_type = cfg.get("model_type")
    if model_type not in HF_MODEL_TYPES:
        raise UnsupportedModelError(
            f"unsupported model_type {model_type!r}; tokenmill runs {', '.join(sorted(HF_MODEL_TYPES))}")
    spec = HF_MODEL_TYPES[model_type]
    try:
        heads = cfg["num_attention_heads"]
        fields: dict[str, Any] = dict(
            architecture=spec["family"], vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"], num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=cfg.get("tie_word_embeddings", spec["family"] == "gemma3"),
            attention_bias=cfg.get("attention_bias", spec.get("attention_bias", False)),
            qk_norm=spec.get("qk_norm", False), qk_norm_per_head=spec.get("qk_norm_per_head", True),
            clip_qkv=cfg.get("clip_qkv"),
            bos_token_id=_first(cfg.get("bos_token_id")), eos_token_id=_first(cfg.get("eos_token_id")),
        )
    except KeyError as exc:
        raise ModelFormatError(f"config.json lacks {exc.args[0]!r}") from None
    act = cfg.get("hidden_activation") or cfg.get("hidden_act", "silu")
    fields["hidden_act"] = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}.get(act)
    if fields["hidden_act"] is None:
        raise UnsupportedModelError(f"unsupported activation {act!r}")
    if "moe" in spec:
        fields["moe"] = _moe_spec(cfg, spec["moe"], fields["num_layers"])
    if spec["family"] == "gemma3":
        _gemma3_fields(cfg, fields)
    else:
        rope = _rope(cfg, "full_attention")
        fields.update(rope_theta=rope.get("rope_theta", 10000.0), rope_scaling=_rope_scaling(rope))
        window = cfg.get("sliding_window") if spec.get("sliding") or cfg.get("use_sliding_window") else None
        if window:
            fields.update(sliding_window=window, layer_types=("sliding",) * fields["num_layers"])
    return ModelConfig(**fields)


def _moe_spec(cfg: dict[str, Any], kind: str, num_layers: int) -> MoESpec:
    """The MoE part of a Mixtral / Qwen2-MoE / Qwen3-MoE / OLMoE config.json (transformers' defaults
    where a key is absent)."""
    try:
        experts = cfg["num_experts"] if "num_experts" in cfg else cfg["num_local_experts"]  # either name
        if kind == "mixtral":
            return MoESpec(num_experts=experts, top_k=cfg.get("num_experts_per_tok", 2),
                           expert_intermediate_size=cfg["intermediate_size"], norm_topk_prob=True)
        if kind == "olmoe":
            return MoESpec(num_experts=experts, top_k=cfg.get("num_experts_per_tok", 8),
                           expert_intermediate_size=cfg["intermediate_size"],
                           norm_topk_prob=cfg.get("norm_topk_prob", False))
        step, dense = cfg.get("decoder_sparse_step", 1) or 1, set(cfg.get("mlp_only_layers") or ())
        layers = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
        qwen2 = cfg.get("model_type") == "qwen2_moe"
        shared = cfg.get("shared_expert_intermediate_size", 5632) if qwen2 else 0
        return MoESpec(num_experts=experts, top_k=cfg.get("num_experts_per_tok", 4 if qwen2 else 8),
                       expert_intermediate_size=cfg["moe_intermediate_size"],
                       norm_topk_prob=cfg.get("norm_topk_prob", False),
                       shared_expert_intermediate_size=shared, shared_expert_gate=bool(shared),
                       layers=None if len(layers) == num_layers else layers)
    except KeyError as exc:
        raise ModelFormatError(f"config.json of a {cfg.get('model_type')} model lacks {exc.args[0]!r}") from None


def _gemma3_fields(cfg: dict[str, Any], fields: dict[str, Any]) -> None:
    n = fields["num_layers"]
    types = cfg.get("layer_types")
    if types is None:
        every = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6
        types = ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n)]
    global_rope, local_rope = _rope(cfg, "full_attention"), _rope(cfg, "sliding_attention")
    if "rope_parameters" not in cfg:
        local_rope = {"rope_theta": cfg.get("rope_local_base_freq", 10000.0)}
    if cfg.get("final_logit_softcapping") or cfg.get("attn_logit_softcapping"):
        raise UnsupportedModelError("Gemma 3 logit soft-capping is not supported")
    fields.update(
        rope_theta=global_rope.get("rope_theta", 1_000_000.0), rope_scaling=_rope_scaling(global_rope),
        rope_local_theta=local_rope.get("rope_theta", 10000.0), sliding_window=cfg.get("sliding_window"),
        layer_types=tuple("full" if t == "full_attention" else "sliding" for t in types),
        query_pre_attn_scalar=cfg.get("query_pre_attn_scalar", fields["head_dim"]))


def quantization_config_of(path: str | Path) -> dict[str, Any] | None:
    """The ``quantization_config`` saved in a directory's config.json (a checkpoint written by
    ``tokenmill quantize``); None for an ordinary checkpoint, a GGUF file or an unreadable config."""
    try:
        raw = json.loads((Path(path) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return raw.get("quantization_config") if isinstance(raw, dict) else None
