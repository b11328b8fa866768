"""One verb: ``quantize(model, config)`` swaps a model's linear layers for quantized ones.

:func:`quantize_model` finds the config's handler in :data:`~tokenmill.quantization.handlers.HANDLERS`,
swaps :func:`kept_module` in for the layers of ``config.keep_layers``, hands the handler the other
linear layers (:func:`~tokenmill.quantization.targets.quantization_targets`), then casts the float
parameters left to the compute dtype. :func:`quantize` also takes a model argument (name, file,
directory) or a ``LoadedModel``.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from tokenmill.device import resolve_device, resolve_dtype
from tokenmill.errors import InvalidParameterError
from tokenmill.loading.sources import resolve_model
from tokenmill.models.base import CausalLM
from tokenmill.models.builder import LoadedModel, load_float_model
from tokenmill.paths import default_cache_dir
from tokenmill.quantization.config import Int4WeightOnlyConfig, QuantConfig, quantization_config_of
from tokenmill.quantization.handlers import HANDLERS
from tokenmill.quantization.linear import Int8Linear, QuantizedLinear
from tokenmill.quantization.targets import (
    QuantizeContext,
    Target,
    cast_float_parameters,
    quantization_targets,
    set_module,
)


def kept_module(config: QuantConfig, target: Target, dtype: torch.dtype) -> QuantizedLinear | None:
    """What a layer named in ``config.keep_layers`` becomes: INT8 weight-only for the int4 methods,
    None for int8 and w8a8 (the float nn.Linear stays, cast to the model dtype; a tied head stays
    the embedding matrix)."""
    if isinstance(config, Int4WeightOnlyConfig):
        return Int8Linear.from_float(target.weight, target.bias, dtype, config.range_search)
    return None


def keep_in_higher_precision(model: CausalLM, config: QuantConfig, targets: list[Target],
                             dtype: torch.dtype) -> set[str]:
    """Swap in :func:`kept_module` for each layer of ``config.keep_layers``: -> their names.

    Raises InvalidParameterError naming the layers that are not among ``targets``."""
    names = [t.name for t in targets]
    unknown = sorted(set(config.keep_layers) - set(names))
    if unknown:
        raise InvalidParameterError(
            f"keep_layers: unknown layer(s) {', '.join(unknown)}; this model's quantizable layers are "
            f"{', '.join(n for n in names if n.startswith('layers.0.'))}, ... (blocks 0 to {len(model.layers) - 1})"
            f"{', lm_head' if 'lm_head' in names else ' (the LM head is not quantized)'}")
    for target in targets:
        if target.name in config.keep_layers and (module := kept_module(config, target, dtype)) is not None:
            set_module(model, target.name, module)
    return set(config.keep_layers)


def quantize_model(model: CausalLM, config: QuantConfig, dtype: torch.dtype | None = None,
                   progress: bool = True, tokenizer: object | None = None, cache_dir: Path | None = None,
                   calibration: list[list[int]] | None = None) -> CausalLM:
    """Quantize ``model`` in place with the handler of ``type(config)`` in HANDLERS.

    The result computes in ``dtype`` (default: the model's current dtype); float parameters
    left unquantized (embedding, norms) are cast to it, except those the model keeps in float32.
    Calibrating methods use ``calibration`` (token ids) or else text from the corpus, which
    needs ``tokenizer``. Layers in ``config.keep_layers`` are swapped for :func:`kept_module`
    first and left out of the targets the handler receives.
    """
    handler = HANDLERS.get(type(config))
    if handler is None:
        raise InvalidParameterError(f"no quantization handler for {type(config).__name__}")
    if getattr(model, "quantization_config", None) is not None:
        raise InvalidParameterError("model is already quantized")
    dtype = dtype or model.embed.weight.dtype
    ctx = QuantizeContext(dtype, progress, tokenizer, cache_dir, calibration)
    config = config.resolved(has_calibration=tokenizer is not None or calibration is not None)
    targets = quantization_targets(model, config)
    kept = keep_in_higher_precision(model, config, targets, dtype)
    handler(model, config, [t for t in targets if t.name not in kept], ctx)
    cast_float_parameters(model, dtype)
    model.quantization_config = config
    return model


def quantize(model: str | os.PathLike | CausalLM | LoadedModel | None, config: QuantConfig,
             dtype: str | torch.dtype = "bfloat16", device: str = "cpu", progress: bool = True,
             cache_dir: str | os.PathLike | None = None):
    """Quantize a model: a :class:`CausalLM` or a ``LoadedModel`` in place (returned), or a model
    argument as anywhere else (name, GGUF file, HF directory), loaded in float32 and returned
    quantized to ``dtype`` as a ``LoadedModel`` ready for :func:`save_quantized`.
    """
    if isinstance(model, CausalLM):
        target_dtype = resolve_dtype(dtype, model.embed.weight.device)
        return quantize_model(model, config, target_dtype, progress)
    if isinstance(model, LoadedModel):
        target_dtype = resolve_dtype(dtype, model.model.embed.weight.device)
        quantize_model(model.model, config, target_dtype, progress, model.tokenizer,
                       Path(cache_dir) if cache_dir else None)
        return model
    resolved = resolve_device(device)
    target_dtype = resolve_dtype(dtype, resolved)
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    loaded = load_float32(model, resolved, cache)
    quantize_model(loaded.model, config, target_dtype, progress, loaded.tokenizer, cache)
    return loaded


def load_float32(model: str | os.PathLike | None, device: torch.device, cache_dir: Path) -> LoadedModel:
    """A model argument (name, GGUF file, HF directory) loaded in float32 on ``device``, to be
    quantized. A tokenmill-quantized directory is refused with InvalidParameterError."""
    source = resolve_model(model, cache_dir)
    if source.format == "hf" and quantization_config_of(source.path) is not None:
        raise InvalidParameterError(f"{source.path} is already quantized: quantize a float model "
                                    "(a name, GGUF file or HF directory)")
    return load_float_model(source, torch.float32, device, cache_dir=cache_dir)
