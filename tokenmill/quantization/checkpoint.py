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

import torch
from torch import nn

from tokenmill.attention.backend import AttentionBackend
from tokenmill.config import ModelConfig
from tokenmill.errors import ModelFormatError
from tokenmill.loading.checkpoint import Checkpoint
from tokenmill.loading.hf_config import hf_model_config
from tokenmill.models.base import CausalLM
from tokenmill.models.builder import LoadedModel, build_model
from tokenmill.models.export import DTYPE_NAMES, WEIGHTS_FILE, hf_config_dict, save_tokenizer
from tokenmill.quantization.targets import quantization_targets, set_module
from tokenmill.quantization.config import (
    Int4WeightOnlyConfig,
    Int8WeightOnlyConfig,
    QuantConfig,
    W8A8Config,
    config_from_dict,
)
from tokenmill.quantization.linear import Int4Linear, Int8Linear, QuantizedLinear, W8A8Linear



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
