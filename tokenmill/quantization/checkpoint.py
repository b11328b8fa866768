"""Quantized checkpoints: a directory that ``LLM(dir)``, ``generate`` and ``serve`` load directly.

    out/
      config.json         the architecture in HF form, plus "quantization_config" (the method's
                          config) and "torch_dtype" (the dtype it was quantized for)
      model.safetensors   tokenmill's own (fused) parameter names: layers.3.attn.qkv.qweight,
                          layers.3.attn.qkv.scale, ..., embed.weight, norm.weight, lm_head.qweight
      tokenizer.json, tokenizer_config.json, chat_template.jinja (when the model has one)

``tokenmill.loader.load_model`` recognises the directory by ``quantization_config`` in
config.json; :func:`load_quantized` builds the model on the meta device, swaps in empty quantized
layers where the saved config says, and assigns the saved tensors: the outputs match the model
that was saved, bit for bit, when it is loaded in the dtype it was quantized for.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tokenmill.attention.backend import AttentionBackend
from tokenmill.config import ModelConfig
from tokenmill.errors import ModelFormatError
from tokenmill.loading.checkpoint import Checkpoint
from tokenmill.loading.hf_config import hf_model_config
from tokenmill.loading.tokenizer import Tokenizer
from tokenmill.models.base import CausalLM
from tokenmill.models.builder import LoadedModel, build_model
from tokenmill.quantization.targets import quantization_targets, set_module
from tokenmill.quantization.config import (
    Int4WeightOnlyConfig,
    Int8WeightOnlyConfig,
    QuantConfig,
    W8A8Config,
    config_from_dict,
)
from tokenmill.quantization.linear import Int4Linear, Int8Linear, QuantizedLinear, W8A8Linear

WEIGHTS_FILE = "model.safetensors"
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def save_quantized(loaded: LoadedModel, out_dir: str | Path) -> Path:
    """Write a quantized model (from :func:`~tokenmill.quantization.quantize`) as a loadable directory."""
    from safetensors.torch import save_file

    model = loaded.model
    config: QuantConfig | None = getattr(model, "quantization_config", None)
    if config is None:
        raise ModelFormatError("save_quantized: the model is not quantized (run quantize first)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf = hf_config_dict(loaded.config)
    hf["quantization_config"] = config.to_dict()
    hf["torch_dtype"] = DTYPE_NAMES[_compute_dtype(model)]
    (out / "config.json").write_text(json.dumps(hf, indent=2))
    state = {name: t.detach().to("cpu").contiguous() for name, t in model.state_dict().items()}
    save_file(state, str(out / WEIGHTS_FILE), metadata={"format": "pt", "producer": "tokenmill"})
    save_tokenizer(loaded.tokenizer, out)
    return out


def load_quantized(path: str | Path, dtype: torch.dtype, device: torch.device | str,
                   backend: AttentionBackend | None = None) -> tuple[CausalLM, ModelConfig]:
    """Build the model a :func:`save_quantized` directory holds, computing in ``dtype`` on ``device``
    (``backend``: the attention backend, a new PagedAttentionBackend by default)."""
    raw = json.loads((Path(path) / "config.json").read_text())
    model_config = hf_model_config(raw)
    quant_config = config_from_dict(raw["quantization_config"])
    model = build_model(Checkpoint(model_config, _read_tensors(Path(path) / WEIGHTS_FILE)), dtype, device,
                        adapt=lambda m: _swap_empty(m, quant_config, dtype), backend=backend)
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            module.prepare()
    model.quantization_config = quant_config
    return model, model_config


def _swap_empty(model: CausalLM, config: QuantConfig, dtype: torch.dtype) -> None:
    """On the meta model: put an empty quantized layer where the saved model has one. Layers of
    ``config.keep_layers`` get INT8 under the int4 methods and otherwise keep their float module
    (as :func:`~tokenmill.quantization.api.kept_module` made them)."""
    targets = quantization_targets(model, config)
    unknown = sorted(set(config.keep_layers) - {t.name for t in targets})
    if unknown:
        raise ModelFormatError(f"quantization_config.keep_layers names layers this model lacks: {', '.join(unknown)}")
    for target in targets:
        out_features, in_features = target.weight.shape
        bias = target.bias is not None
        kept = target.name in config.keep_layers
        if kept and not isinstance(config, Int4WeightOnlyConfig):
            continue
        int8_under_int4 = isinstance(config, Int4WeightOnlyConfig) and (
            kept or (config.lm_head_int8 and target.name == "lm_head"))
        if isinstance(config, Int4WeightOnlyConfig) and not int8_under_int4:
            module: nn.Module = Int4Linear.empty(in_features, out_features, bias, dtype, config.group_size)
        elif isinstance(config, Int8WeightOnlyConfig) or int8_under_int4:
            module = Int8Linear.empty(in_features, out_features, bias, dtype)
        elif isinstance(config, W8A8Config):
            module = W8A8Linear.empty(in_features, out_features, bias, dtype, config.activation == "static",
                                      config.symmetric)
        else:
            raise ModelFormatError(f"cannot load a checkpoint quantized with {config.method!r}")
        set_module(model, target.name, module)


def _read_tensors(file: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                yield name, f.get_tensor(name)
    except Exception as exc:  # safetensors raises its own error types for missing or corrupt files
        raise ModelFormatError(f"cannot read {file}: {exc}") from None


def _compute_dtype(model: CausalLM) -> torch.dtype:
    return model.embed.weight.dtype


# --------------------------------------------------------------------------- config.json and tokenizer

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
    if cfg.architecture == "gemma3":
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
