"""A float model written as a Hugging Face checkpoint directory: what HF transformers, ``LLM(dir)``,
``serve``, ``quantize``, ``prune`` and ``distill`` all load.

    out/
      config.json         the architecture in HF form (new shapes included: a pruned model's
                          head count, FFN width, layer count), "torch_dtype", and what made it
                          (e.g. "pruning_config") under keys HF ignores
      model.safetensors   HF tensor names (model.layers.3.self_attn.q_proj.weight, ...): tokenmill's
                          fused q/k/v and gate/up split back, Gemma's norm multipliers stored as w
                          for HF's (1 + w)
      tokenizer.json, tokenizer_config.json, chat_template.jinja (as a quantized checkpoint's)

This is the inverse of ``loading/weights.py``'s renaming and fusing: reading the directory back
with ``open_hf`` gives the same tensors.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from tokenmill.config import ModelConfig
from tokenmill.errors import ModelFormatError
from tokenmill.loading.weights import HF_LAYER_NAMES_GEMMA3, HF_LAYER_NAMES_LLAMA, HF_MOE_NAMES, HF_TOP
from tokenmill.loading.hf_config import hf_model_config
from tokenmill.loading.tokenizer import Tokenizer
from tokenmill.models.base import CausalLM

WEIGHTS_FILE = "model.safetensors"
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)\.(weight|bias)$")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate|up|down)$")
MIXTRAL_EXPERT_NAMES = ("block_sparse_moe", {"gate": "w1", "up": "w3", "down": "w2"})
QWEN_EXPERT_NAMES = ("mlp", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"})
"""Where a routed expert's projections go in HF's per-expert layout: Mixtral's, and the others'."""


def _moe_hf_names(mixtral: bool) -> dict[str, str]:
    """Canonical -> HF names of an MoE layer's router and shared expert (Mixtral's or the others')."""
    out = {"mlp.router": "block_sparse_moe.gate" if mixtral else "mlp.gate"}
    out.update({ours: theirs for theirs, ours in HF_MOE_NAMES.items() if ours.startswith("mlp.shared")})
    return out


def canonical_tensors(model: CausalLM) -> dict[str, torch.Tensor]:
    """The model's parameters under tokenmill's canonical, unfused names (``layers.3.attn.q.weight``,
    ``layers.3.mlp.gate.weight``, ...: what a :class:`~tokenmill.loading.checkpoint.Checkpoint`
    carries and ``build_model`` fuses), detached, on their device, in their dtype."""
    cfg = model.config
    if getattr(model, "quantization_config", None) is not None:
        raise ModelFormatError("the model is quantized: save it with save_quantized")
    q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        if not t.is_floating_point():
            raise ModelFormatError(f"{name} is not a float tensor ({t.dtype})")
        t = t.detach()
        m = _LAYER.match(name)
        part = m.group(2) if m else None
        if part == "attn.qkv":
            pieces = zip(("attn.q", "attn.k", "attn.v"), t.split([q_size, kv_size, kv_size]))
        elif part == "mlp.gate_up":
            pieces = zip(("mlp.gate", "mlp.up"), t.chunk(2))
        elif part is not None and part.endswith(".gate_up"):  # an MoE expert's or the shared expert's
            stem = part.removesuffix(".gate_up")
            pieces = zip((f"{stem}.gate", f"{stem}.up"), t.chunk(2))
        else:
            out[name] = t
            continue
        for canonical, piece in pieces:
            out[f"layers.{m.group(1)}.{canonical}.{m.group(3)}"] = piece
    return out


def hf_state_dict(model: CausalLM, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The model's parameters under HF names, unfused, on CPU, in ``dtype`` (default: the
    embedding's dtype; float32-kept norms follow it too). Gemma's norm multipliers are stored as
    the w of HF's (1 + w)."""
    cfg = model.config
    dtype = dtype or model.embed.weight.dtype
    table = HF_LAYER_NAMES_GEMMA3 if cfg.architecture == "gemma3" else HF_LAYER_NAMES_LLAMA
    to_hf = {ours: theirs for theirs, ours in table.items()}
    experts = None  # an MoE model's (HF prefix, projection names) of its routed experts
    if cfg.moe is not None:
        mixtral = hf_config_dict(cfg)["model_type"] == "mixtral"
        to_hf.update(_moe_hf_names(mixtral))
        experts = MIXTRAL_EXPERT_NAMES if mixtral else QWEN_EXPERT_NAMES
    top = {ours: theirs for theirs, ours in HF_TOP.items()}
    out: dict[str, torch.Tensor] = {}
    for name, t in canonical_tensors(model).items():
        t = t.to("cpu")
        if cfg.architecture == "gemma3" and name.endswith("norm.weight"):
            t = t.float() - 1.0
        m = _LAYER.match(name)
        if m is None:
            stem, _, kind = name.rpartition(".")
            if stem not in top:
                raise ModelFormatError(f"no HF name for {name}")
            out[f"{top[stem]}.{kind}"] = t
        elif m.group(2) in to_hf:
            out[f"model.layers.{m.group(1)}.{to_hf[m.group(2)]}.{m.group(3)}"] = t
        elif (e := _EXPERT.match(m.group(2))) and experts is not None:
            expert, proj = e.groups()
            out[f"model.layers.{m.group(1)}.{experts[0]}.experts.{expert}.{experts[1][proj]}.{m.group(3)}"] = t
        else:
            raise ModelFormatError(f"no HF name for {name}")
    return {name: t.to(dtype).contiguous() for name, t in out.items()}


def save_hf(model: CausalLM, config: ModelConfig, tokenizer, out_dir: str | Path, dtype: torch.dtype | None = None,
            extra: dict[str, Any] | None = None) -> Path:
    """Write ``model`` (float, unquantized) as an HF checkpoint directory -> its path.

    ``extra``: further config.json entries (what made the model: ``pruning_config``, ``distillation``)."""
    from safetensors.torch import save_file

    state = hf_state_dict(model, dtype)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf = hf_config_dict(config)
    hf["torch_dtype"] = DTYPE_NAMES[next(iter(state.values())).dtype]
    hf["architectures"] = ["Gemma3ForCausalLM" if config.architecture == "gemma3" else
                           {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                            "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM",
                            "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                            "olmoe": "OlmoeForCausalLM"}[hf["model_type"]]]
    hf.update(extra or {})
    (out / "config.json").write_text(json.dumps(hf, indent=2))
    save_file(state, str(out / WEIGHTS_FILE), metadata={"format": "pt", "producer": "tokenmill"})
    save_tokenizer(tokenizer, out)
    return out


def hf_config_dict(cfg: ModelConfig) -> dict[str, Any]:
    """An HF ``config.json`` that :func:`~tokenmill.loading.hf_config.hf_model_config` reads back
    as ``cfg`` (checked: a config it cannot express is an error, not a silent change)."""
    out: dict[str, Any] = {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings, "attention_bias": cfg.attention_bias,
        "hidden_act": {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh"}[cfg.hidden_act],
        "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        out["rope_scaling"] = {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                                   "high_freq_factor": s.high_freq_factor,
                                   "original_max_position_embeddings": s.original_max_position_embeddings}
    if cfg.moe is not None:
        _moe_fields(cfg, out)
    elif cfg.architecture == "gemma3":
        out.update(model_type="gemma3_text", hidden_activation=out.pop("hidden_act"),
                   rope_local_base_freq=cfg.rope_local_theta, sliding_window=cfg.sliding_window,
                   query_pre_attn_scalar=cfg.query_pre_attn_scalar,
                   layer_types=[f"{cfg.layer_type(i)}_attention" for i in range(cfg.num_layers)])
    elif cfg.qk_norm:
        out["model_type"] = "qwen3"
    elif cfg.sliding_window:
        out.update(model_type="mistral", sliding_window=cfg.sliding_window)
    else:
        out["model_type"] = "qwen2" if cfg.attention_bias else "llama"
    if hf_model_config(out) != cfg:
        raise ModelFormatError(f"cannot express this model's configuration as an HF config.json: {cfg}")
    return out


def _moe_fields(cfg: ModelConfig, out: dict[str, Any]) -> None:
    """The MoE model types: Mixtral where it fits (every layer MoE, renormalised top-k, experts of the
    dense MLP's width, no shared expert, no QK-norm), else OLMoE / Qwen3-MoE / Qwen2-MoE."""
    moe = cfg.moe
    if cfg.clip_qkv is not None:
        out["clip_qkv"] = cfg.clip_qkv
    mixtral = (moe.layers is None and moe.norm_topk_prob and not moe.shared_expert_intermediate_size
               and not cfg.qk_norm and not cfg.attention_bias and moe.expert_intermediate_size == cfg.intermediate_size
               and moe.scoring == "softmax")
    if mixtral:
        out.update(model_type="mixtral", num_local_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
                   sliding_window=cfg.sliding_window)
        return
    out.update(num_experts=moe.num_experts, num_experts_per_tok=moe.top_k, norm_topk_prob=moe.norm_topk_prob)
    if cfg.qk_norm and not cfg.qk_norm_per_head:
        out["model_type"] = "olmoe"
        out["intermediate_size"] = moe.expert_intermediate_size
        return
    dense = [i for i in range(cfg.num_layers) if not cfg.is_moe_layer(i)]
    out.update(model_type="qwen3_moe" if cfg.qk_norm else "qwen2_moe", moe_intermediate_size=moe.expert_intermediate_size,
               mlp_only_layers=dense, decoder_sparse_step=1)
    if not cfg.qk_norm:
        out["shared_expert_intermediate_size"] = moe.shared_expert_intermediate_size


def save_tokenizer(tokenizer: Tokenizer, out: Path) -> None:
    """tokenizer.json (the exact pipeline in use, GGUF-derived ones included), the special
    tokens in tokenizer_config.json, and the chat template in chat_template.jinja."""
    backend = tokenizer._backend  # the tokenizers.Tokenizer; Tokenizer has no public save yet
    backend.save(str(out / "tokenizer.json"))
    names = {"bos_token": tokenizer.bos_token_id, "eos_token": tokenizer.eos_token_id,
             "pad_token": tokenizer.pad_token_id}
    special = {name: backend.id_to_token(i) for name, i in names.items() if i is not None}
    (out / "tokenizer_config.json").write_text(json.dumps(special, indent=2))
    extra = sorted(tokenizer.stop_token_ids - {tokenizer.eos_token_id})
    if extra:  # further end-of-generation ids, read back as generation_config's eos_token_id list
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos + extra}))
    if tokenizer.chat_template is not None:
        (out / "chat_template.jinja").write_text(tokenizer.chat_template)
