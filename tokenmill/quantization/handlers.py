"""The quantization methods: one handler per config class, in one table.

    HANDLERS
      Int8WeightOnlyConfig   quantize_int8_weight_only   INT8 per output channel
      Int4WeightOnlyConfig   quantize_int4_weight_only   INT4 groups, round to nearest (optionally
                                                         with a range search weighted by the
                                                         inputs' mean squares)
      Int4GPTQConfig         gptq.quantize_gptq          INT4 groups, GPTQ error compensation
      W8A8Config             quantize_w8a8               INT8 weights and activations, optionally
                                                         SmoothQuant first and a static grid

A handler receives the model, its config, the layers to replace (:func:`~tokenmill.quantization.
targets.quantization_targets`, less ``keep_layers``) and a :class:`~tokenmill.quantization.targets.
QuantizeContext`, and swaps a :class:`~tokenmill.quantization.linear.QuantizedLinear` in for each;
:func:`~tokenmill.quantization.api.quantize_model` picks it by ``type(config)``. A new method is
a config class (config.py), a handler and a row of :data:`HANDLERS`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tokenmill.models.base import CausalLM
from tokenmill.quantization import gptq
from tokenmill.quantization.calibration import calibrate_inputs, calibration_ids, input_absmax, input_mean_squares
from tokenmill.quantization.config import (
    Int4GPTQConfig,
    Int4WeightOnlyConfig,
    Int8WeightOnlyConfig,
    QuantConfig,
    W8A8Config,
)
from tokenmill.quantization.linear import Int4Linear, Int8Linear, QuantizedLinear, W8A8Linear
from tokenmill.quantization.smoothing import smooth
from tokenmill.quantization.targets import QuantizeContext, Target, cast_float_parameters, detached, replace_each

Handler = Callable[[CausalLM, QuantConfig, list[Target], QuantizeContext], None]


def quantize_int8_weight_only(model: CausalLM, config: Int8WeightOnlyConfig, targets: list[Target],
                              ctx: QuantizeContext) -> None:
    replace_each(model, targets, lambda t: Int8Linear.from_float(t.weight, t.bias, ctx.dtype, config.scale_search),
                 ctx.progress, "quantizing int8")


def quantize_int4_weight_only(model: CausalLM, config: Int4WeightOnlyConfig, targets: list[Target],
                              ctx: QuantizeContext) -> None:
    importance: dict[str, torch.Tensor] = {}
    if config.activation_weighted:
        samples = calibration_ids(ctx, config.num_samples, config.seq_len, "int4 activation_weighted")
        # calibrate in the dtype the model will run in (what its layers will see, and a float32
        # source runs several times slower); the weights are quantized from the source's tensors
        targets = detached(targets)
        cast_float_parameters(model, ctx.dtype)
        importance = input_mean_squares(model, [t.name for t in targets], samples, ctx.progress)

    def make(t: Target) -> QuantizedLinear:
        if t.name == "lm_head" and config.lm_head_int8:
            return Int8Linear.from_float(t.weight, t.bias, ctx.dtype, config.range_search)
        return Int4Linear.from_float(t.weight, t.bias, ctx.dtype, config.group_size, config.range_search,
                                     importance.get(t.name))

    replace_each(model, targets, make, ctx.progress, f"quantizing int4 g{config.group_size}")


def quantize_w8a8(model: CausalLM, config: W8A8Config, targets: list[Target], ctx: QuantizeContext) -> None:
    if config.smoothing_alpha is not None:
        targets = smooth_targets(model, config, targets, ctx)
    qparams = calibrate_inputs(model, [t.name for t in targets], config, ctx) if config.activation == "static" else {}
    replace_each(model, targets,
                 lambda t: W8A8Linear.from_float(t.weight, t.bias, ctx.dtype, qparams.get(t.name), config.symmetric),
                 ctx.progress, f"quantizing w8a8 ({config.activation})")


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


HANDLERS: dict[type[QuantConfig], Handler] = {
    Int8WeightOnlyConfig: quantize_int8_weight_only,
    Int4WeightOnlyConfig: quantize_int4_weight_only,
    Int4GPTQConfig: gptq.quantize_gptq,
    W8A8Config: quantize_w8a8,
}
"""Config class -> its handler; looked up by exact type (Int4GPTQConfig subclasses Int4WeightOnlyConfig)."""
