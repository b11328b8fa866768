"""One verb: ``quantize(model, config)`` swaps a model's linear layers for quantized ones.

A registry maps each config class to its handler; a handler receives the model and the list
of linear layers to replace (:func:`quantization_targets`) and swaps in a
:class:`~tokenmill.quantization.linear.QuantizedLinear` for each.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn
from tqdm import tqdm

from tokenmill.errors import InvalidParameterError
from tokenmill.models.base import CausalLM
from tokenmill.quantization.config import (
    Int4WeightOnlyConfig,
    Int8WeightOnlyConfig,
    QuantConfig,
    W8A8Config,
)
from tokenmill.quantization.linear import Int4Linear, Int8Linear, QuantizedLinear, W8A8Linear
from tokenmill.quantization.observers import MinMaxObserver, Observer, make_observer
from tokenmill.quantization.smoothing import smooth

if TYPE_CHECKING:
    from tokenmill.loading.model_loader import LoadedModel


@dataclass
class Target:
    """One linear layer to quantize: its module path and the float weight it computes with."""

    name: str
    """Path of the module in the model (``layers.3.mlp.gate_up``, ``lm_head``)."""
    weight: torch.Tensor
    bias: torch.Tensor | None


@dataclass
class QuantizeContext:
    """What a handler may need besides the model and config."""

    dtype: torch.dtype
    """dtype of the activations, scales and every float parameter left unquantized."""
    progress: bool = True
    tokenizer: object | None = None
    """The model's tokenizer, for handlers that calibrate on text."""
    cache_dir: Path | None = None
    calibration: list[list[int]] | None = None
    """Token ids of calibration sequences; None: handlers that calibrate draw them from the corpus."""


Handler = Callable[[CausalLM, QuantConfig, list[Target], QuantizeContext], None]
HANDLERS: dict[type[QuantConfig], Handler] = {}


def register(config_cls: type[QuantConfig]) -> Callable[[Handler], Handler]:
    def wrap(handler: Handler) -> Handler:
        HANDLERS[config_cls] = handler
        return handler
    return wrap


def quantization_targets(model: CausalLM, config: QuantConfig) -> list[Target]:
    """Every nn.Linear of the blocks (fused qkv and gate_up included), then the LM head when
    ``config.quantize_lm_head``: the model's own, or for tied embeddings the embedding matrix."""
    targets = [Target(name, m.weight, m.bias) for name, m in model.layers.named_modules(prefix="layers")
               if isinstance(m, nn.Linear)]
    if config.quantize_lm_head:
        head = model.lm_head
        targets.append(Target("lm_head", model.embed.weight if head is None else head.weight,
                              None if head is None else head.bias))
    return targets


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


def set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def quantize_model(model: CausalLM, config: QuantConfig, dtype: torch.dtype | None = None,
                   progress: bool = True, tokenizer: object | None = None, cache_dir: Path | None = None,
                   calibration: list[list[int]] | None = None) -> CausalLM:
    """Quantize ``model`` in place with the handler registered for ``type(config)``.

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
    targets = quantization_targets(model, config)
    kept = keep_in_higher_precision(model, config, targets, dtype)
    handler(model, config, [t for t in targets if t.name not in kept], ctx)
    cast_float_parameters(model, dtype)
    model.quantization_config = config
    return model


def cast_float_parameters(model: CausalLM, dtype: torch.dtype) -> None:
    """Float parameters to ``dtype``, except those the model keeps in float32 (RoPE buffers stay)."""
    for name, param in model.named_parameters():
        if not model.keeps_float32(name) and param.is_floating_point():
            param.data = param.data.to(dtype)


def replace_each(model: CausalLM, targets: list[Target], make: Callable[[Target], QuantizedLinear],
                 progress: bool, desc: str) -> None:
    """Swap every target for ``make(target)``, one at a time, with a progress bar."""
    for target in tqdm(targets, desc=desc, disable=not progress, unit="layer"):
        set_module(model, target.name, make(target))


@register(Int8WeightOnlyConfig)
def _int8_weight_only(model: CausalLM, config: Int8WeightOnlyConfig, targets: list[Target],
                      ctx: QuantizeContext) -> None:
    replace_each(model, targets, lambda t: Int8Linear.from_float(t.weight, t.bias, ctx.dtype, config.scale_search),
                 ctx.progress, "quantizing int8")


@register(Int4WeightOnlyConfig)
def _int4_weight_only(model: CausalLM, config: Int4WeightOnlyConfig, targets: list[Target],
                      ctx: QuantizeContext) -> None:
    importance: dict[str, torch.Tensor] = {}
    if config.activation_weighted:  # the int4 helpers live in gptq.py, which imports this module
        from tokenmill.quantization.gptq import input_mean_squares

        samples = calibration_ids(ctx, config.num_samples, config.seq_len, "int4 activation_weighted")
        importance = input_mean_squares(model, [t.name for t in targets], samples, ctx.progress)

    def make(t: Target) -> QuantizedLinear:
        if t.name == "lm_head" and config.lm_head_int8:
            return Int8Linear.from_float(t.weight, t.bias, ctx.dtype, config.range_search)
        return Int4Linear.from_float(t.weight, t.bias, ctx.dtype, config.group_size, config.range_search,
                                     importance.get(t.name))

    replace_each(model, targets, make, ctx.progress, f"quantizing int4 g{config.group_size}")


def calibration_ids(ctx: QuantizeContext, num_samples: int, seq_len: int, method: str) -> list[list[int]]:
    """``ctx.calibration``, or else ``num_samples`` sequences of ``seq_len`` tokens from the end of
    the corpus (perplexity, measured on its start, never reaches them)."""
    if ctx.calibration is not None:
        return ctx.calibration
    if ctx.tokenizer is None:
        raise InvalidParameterError(f"{method} calibrates on text: quantize a model name or a LoadedModel "
                                    "(which carry a tokenizer), or pass calibration token ids")
    from tokenmill.eval.corpus import fetch_corpus

    text = fetch_corpus(ctx.cache_dir).read_text(encoding="utf-8")
    need = num_samples * seq_len
    ids = ctx.tokenizer.encode(text[-8 * need:], add_special_tokens=False)[-need:]
    if len(ids) < need:
        raise InvalidParameterError(f"the corpus gave {len(ids)} calibration tokens, {need} needed")
    return [ids[i:i + seq_len] for i in range(0, need, seq_len)]


def observe_inputs(model: CausalLM, observers: dict[str, Observer], samples: list[list[int]], desc: str,
                   progress: bool) -> None:
    """Run ``samples`` (token ids) through the float model, feeding the input of each layer named
    in ``observers`` to its observer.

    A tied LM head has no module of its own; its input is the output of the final norm."""
    from tokenmill.eval.perplexity import SequenceRunner

    handles = []
    for name, observer in observers.items():
        if name == "lm_head" and model.lm_head is None:
            handles.append(model.norm.register_forward_hook(lambda m, args, out, o=observer: o.update(out)))
        else:
            handles.append(model.get_submodule(name).register_forward_pre_hook(
                lambda m, args, o=observer: o.update(args[0])))
    runner = SequenceRunner(model, max(len(s) for s in samples))
    try:
        with torch.inference_mode():
            for ids in tqdm(samples, desc=desc, disable=not progress, unit="seq"):
                hidden = runner.hidden(ids)
                if "lm_head" in observers:
                    model.compute_logits(hidden)
    finally:
        for handle in handles:
            handle.remove()


def calibrate_inputs(model: CausalLM, names: list[str], config: W8A8Config, ctx: QuantizeContext,
                     ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The static activation grid of each layer in ``names``: its calibration inputs fed to its
    own ``config.observer`` -> {name: (scale, zero_point)} per tensor."""
    samples = calibration_ids(ctx, config.calibration_samples, config.seq_len, "w8a8 static")
    observers = {name: make_observer(config.observer, config.symmetric, None, config.percentile) for name in names}
    observe_inputs(model, observers, samples, f"calibrating w8a8 ({config.observer})", ctx.progress)
    return {name: observer.qparams() for name, observer in observers.items()}  # ordinary tensors, not inference ones


def input_absmax(model: CausalLM, names: list[str], config: W8A8Config, ctx: QuantizeContext,
                 ) -> dict[str, torch.Tensor]:
    """max |x| per input channel of each layer in ``names`` over the calibration text: {name: [K]}."""
    samples = calibration_ids(ctx, config.calibration_samples, config.seq_len, "w8a8 smoothing")
    observers = {name: MinMaxObserver(symmetric=True, axis=-1) for name in names}
    observe_inputs(model, observers, samples, "calibrating smoothing", ctx.progress)
    return {name: torch.maximum(-o.lo, o.hi).clone() for name, o in observers.items()}


def smooth_targets(model: CausalLM, config: W8A8Config, targets: list[Target], ctx: QuantizeContext,
                   ) -> list[Target]:
    """SmoothQuant the float model in place (:mod:`~tokenmill.quantization.smoothing`): the
    targets of the kinds in ``config.smoothing_layers``. -> ``targets``, with a smoothed tied LM
    head pointing at its own scaled copy of the embedding matrix."""
    names = [t.name for t in targets if smoothed_kind(t.name) in config.smoothing_layers]
    if not names:
        return targets
    smooth(model, input_absmax(model, names, config, ctx), config.smoothing_alpha)
    head = model.lm_head  # None when a tied head was left unsmoothed
    return [Target(t.name, head.weight, head.bias) if t.name == "lm_head" and head is not None else t
            for t in targets]


def smoothed_kind(name: str) -> str:
    """``layers.3.attn.qkv`` -> ``qkv``; ``lm_head`` -> ``lm_head``."""
    return name.rpartition(".")[2]


@register(W8A8Config)
def _w8a8(model: CausalLM, config: W8A8Config, targets: list[Target], ctx: QuantizeContext) -> None:
    if config.smoothing_alpha is not None:
        targets = smooth_targets(model, config, targets, ctx)
    qparams = calibrate_inputs(model, [t.name for t in targets], config, ctx) if config.activation == "static" else {}
    replace_each(model, targets,
                 lambda t: W8A8Linear.from_float(t.weight, t.bias, ctx.dtype, qparams.get(t.name), config.symmetric),
                 ctx.progress, f"quantizing w8a8 ({config.activation})")


def quantize(model: str | os.PathLike | CausalLM | LoadedModel | None, config: QuantConfig,
             dtype: str | torch.dtype = "bfloat16", device: str = "cpu", progress: bool = True,
             cache_dir: str | os.PathLike | None = None):
    """Quantize a model: a :class:`CausalLM` or a ``LoadedModel`` in place (returned), or a model
    argument as anywhere else (name, GGUF file, HF directory), loaded in float32 and returned
    quantized to ``dtype`` as a ``LoadedModel`` ready for :func:`save_quantized`.
    """
    from tokenmill.device import resolve_device, resolve_dtype

    from tokenmill.loading.model_loader import LoadedModel, load_model

    if isinstance(model, CausalLM):
        target_dtype = resolve_dtype(dtype, model.embed.weight.device)
        return quantize_model(model, config, target_dtype, progress)
    if isinstance(model, LoadedModel):
        target_dtype = resolve_dtype(dtype, model.model.embed.weight.device)
        quantize_model(model.model, config, target_dtype, progress, model.tokenizer)
        return model
    from tokenmill.attention.paged import PagedAttentionBackend
    from tokenmill.loading.sources import resolve_model
    from tokenmill.paths import default_cache_dir

    resolved = resolve_device(device)
    target_dtype = resolve_dtype(dtype, resolved)
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    loaded = load_model(resolve_model(model, cache), PagedAttentionBackend(), torch.float32, resolved, cache_dir=cache)
    quantize_model(loaded.model, config, target_dtype, progress, loaded.tokenizer, cache)
    return loaded


from tokenmill.quantization import gptq  # noqa: E402, F401  (registers the int4-gptq handler; it builds on this module)
