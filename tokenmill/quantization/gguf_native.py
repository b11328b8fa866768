"""A GGUF file's quantized linears run as they are stored: ``load_gguf_native(source, dtype, device)``.

    read       the checkpoint with ``native_types`` = every type of ``gguf_groups.NATIVE_TYPES``
               (loading/checkpoint.py): each linear module whose GGUF tensor(s) are of those types
               comes as codes, scale and min (q/k/v and gate/up joined, Llama q/k rows un-permuted),
               everything else (norms, F32/F16/BF16 tensors, other block types) as float
    adapt      on the meta model, a :class:`~tokenmill.quantization.grouped.GroupedLinear` of the
               right shape where the checkpoint has a grouped module; a tied LM head (SmolLM2 and
               Gemma 3 tie it to token_embd) becomes ``model.lm_head``, a GroupedLinear over the
               embedding's codes, while the lookup keeps a dequantized table
    pack       each grouped module's codes, scale and min into the kernel layout GroupedLinear holds
    build      float tensors cast to ``dtype`` as they arrive (float32 kept where the model keeps
               it, as in a dequantized load; the grouped scales and mins as packed), then each
               GroupedLinear prepared for the CPU kernel

``tokenmill.loader.load_model`` takes this path for a GGUF source on CPU with dtype "auto" where
:func:`native_unavailable` finds nothing missing; an explicit dtype loads the dequantized model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import torch

from tokenmill.errors import InvalidParameterError, ModelFormatError
from tokenmill.kernels import dispatch
from tokenmill.loading.checkpoint import GROUPED_FIELDS, GroupedLayout, read_checkpoint
from tokenmill.loading.gguf_groups import NATIVE_TYPES, GroupedWeight
from tokenmill.loading.sources import ModelSource
from tokenmill.models.base import CausalLM
from tokenmill.models.builder import LoadedModel, build_model
from tokenmill.quantization.grouped import GroupedLinear, pack_grouped
from tokenmill.quantization.targets import set_module

ACTIVATION_DTYPE = torch.bfloat16
"""What a natively loaded GGUF model computes in when nothing else is asked."""


def native_unavailable(device: torch.device) -> str | None:
    """Why a GGUF model cannot run natively on ``device`` in this process, or None when it can:
    on CPU, with tokenmill's CPU kernels built and their fast path (AVX-512 BF16) available."""
    if device.type != "cpu":
        return f"the grouped GGUF kernels run on CPU, not {device.type}"
    ops = dispatch.cpu_ops()
    if ops is None:
        return "tokenmill's CPU kernels are off or unavailable"
    if not ops.group_linear_fast():
        return "this CPU lacks AVX-512 BF16, which the grouped GGUF kernels need"
    return None


def load_gguf_native(source: ModelSource, dtype: torch.dtype = ACTIVATION_DTYPE,
                     device: torch.device | str = "cpu", cache_dir: Path | None = None) -> LoadedModel:
    """The model of the GGUF file ``source`` with every linear of a native type as a GroupedLinear
    over the file's own codes, computing in ``dtype`` (float32 or bfloat16) on ``device``.
    ``cache_dir``: where GGUF tokenizers are cached."""
    if dtype not in dispatch.KERNEL_DTYPES:
        raise InvalidParameterError(f"native GGUF weights compute in float32 or bfloat16, not {dtype}")
    if source.format != "gguf":
        raise InvalidParameterError(f"{source.path} is not a GGUF file")
    checkpoint, tokenizer = read_checkpoint(source, cache_dir, native_types=NATIVE_TYPES)
    grouped = checkpoint.grouped
    packed = dataclasses.replace(checkpoint, tensors=packed_tensors(checkpoint.tensors, grouped))
    model = build_model(packed, dtype, device, adapt=lambda m: swap_grouped(m, grouped))
    for module in model.modules():
        if isinstance(module, GroupedLinear):
            module.prepare()
    return LoadedModel(model, checkpoint.config, tokenizer, source)


def swap_grouped(model: CausalLM, layouts: dict[str, GroupedLayout]) -> None:
    """On the meta model: an empty GroupedLinear for each module of ``layouts``, checked against the
    shape the architecture gives it (ModelFormatError naming the module and its GGUF tensors)."""
    cfg = model.config
    for name, layout in layouts.items():
        parent, _, child = name.rpartition(".")
        old = getattr(model.get_submodule(parent) if parent else model, child)
        if old is None and name == "lm_head":  # tied: the head multiplies by the embedding matrix
            expected, bias = (cfg.vocab_size, cfg.hidden_size), False
        else:
            expected, bias = tuple(old.weight.shape), old.bias is not None
        got = (layout.out_features, layout.in_features)
        if got != expected:
            raise ModelFormatError(f"checkpoint does not fit the {cfg.architecture} model: {name} from "
                                   f"{', '.join(layout.sources)} is {got}, expected {expected}")
        set_module(model, name, GroupedLinear.empty(layout.in_features, layout.out_features, bias,
                                                    layout.group_size, layout.bits))
    # The scales and mins are the file's exact values (float16 or float32, as group_cpu_pack chose),
    # whatever the model computes in: the builder assigns them as stored.
    kept = {f"{name}.sz" for name in layouts}
    model.keeps_stored_dtype = lambda param_name: param_name in kept


def packed_tensors(tensors: Iterator[tuple[str, torch.Tensor]], layouts: dict[str, GroupedLayout],
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each grouped module's codes, scale and min turned into the
    GroupedLinear buffers ``packed`` and ``sz`` as they arrive (one module's codes held at a time)."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors:
        module, _, part = name.rpartition(".")
        if module not in layouts or part not in GROUPED_FIELDS:
            yield name, t
            continue
        pending.setdefault(module, {})[part] = t
        del t
        if len(pending[module]) == len(GROUPED_FIELDS):
            fields, layout = pending.pop(module), layouts[module]
            weight = GroupedWeight(fields["codes"], fields["scale"], fields["min"], layout.group_size, layout.bits)
            del fields
            packed = pack_grouped(weight)
            del weight  # the codes go as soon as they are packed: the model is not held twice
            yield f"{module}.packed", packed[0]
            yield f"{module}.sz", packed[1]
            del packed
