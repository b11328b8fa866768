"""One call from a user's model argument to a ready model: ``load_model(model, dtype, device)``.

    model argument   name, GGUF file, HF directory, hub repo id (loading/sources.py), or a
                     ModelSource already resolved
    device, dtype    "auto" and names resolved as everywhere (tokenmill/device.py), except below
    dispatch         a directory written by ``tokenmill quantize`` (``quantization_config`` in its
                     config.json) -> tokenmill.quantization.checkpoint.load_quantized;
                     a GGUF file with dtype "auto" on CPU where the grouped kernels run ->
                     tokenmill.quantization.gguf_native.load_gguf_native: its quantized linears as
                     stored, bfloat16 activations; anything else (an explicit dtype asks for the
                     dequantized model) -> tokenmill.models.builder.load_float_model
    sparse           a directory written by ``tokenmill prune`` with an unstructured or N:M method
                     (``pruning_config`` in its config.json), loaded in bfloat16 on CPU: its pruned
                     linears stored without their zeros and run by the sparse kernel
                     (tokenmill.pruning.sparse_linear; bit-identical outputs, fewer bytes per token)

This is the facade layer: it sits above the quantization package, which is what lets it load
every kind of checkpoint while models/ and loading/ know nothing of quantization.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch

from tokenmill.device import resolve_device, resolve_dtype
from tokenmill.errors import InvalidParameterError
from tokenmill.loading.sources import ModelSource, resolve_model
from tokenmill.loading.tokenizer import Tokenizer
from tokenmill.models.builder import LoadedModel, load_float_model
from tokenmill.paths import default_cache_dir
from tokenmill.pruning.sparse_linear import sparsify
from tokenmill.quantization.checkpoint import load_quantized
from tokenmill.quantization.config import quantization_config_of
from tokenmill.quantization.gguf_native import ACTIVATION_DTYPE, load_gguf_native, native_unavailable

logger = logging.getLogger("tokenmill.loading")


def load_model(model: str | os.PathLike | ModelSource | None = None, dtype: str | torch.dtype = "auto",
               device: str | torch.device = "auto", cache_dir: str | os.PathLike | None = None) -> LoadedModel:
    """Load ``model`` (default: the default model) in ``dtype`` on ``device``.

    ``dtype`` "auto": a GGUF file on CPU runs its quantized weights natively with bfloat16
    activations where tokenmill's CPU kernels have their fast path (else, logged, it is
    dequantized to float32); anything else is float32 on CPU, bfloat16 on CUDA. An explicit
    dtype loads a GGUF file dequantized to it. A ``tokenmill quantize`` directory with "auto"
    computes in the dtype it was quantized for (its config's ``torch_dtype``) where the device
    runs it. ``cache_dir``: where named models, hub snapshots
    and GGUF tokenizers are cached (default ``~/.cache/tokenmill``)."""
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    resolved_device = resolve_device(device)
    resolved_dtype = resolve_dtype(dtype, resolved_device)
    source = model if isinstance(model, ModelSource) else resolve_model(model, cache)
    if source.format == "hf" and quantization_config_of(source.path) is not None:
        if _is_auto(dtype):
            resolved_dtype = _saved_compute_dtype(source.path, resolved_device) or resolved_dtype
        quantized, config = load_quantized(source.path, resolved_dtype, resolved_device)
        return LoadedModel(quantized, config, Tokenizer.from_hf_dir(source.path), source)
    if source.format == "gguf":
        why = native_unavailable(resolved_device) if _is_auto(dtype) else "an explicit dtype asks for that"
        if why is None:
            logger.info("GGUF %s: quantized weights run natively, %s activations", source.path.name,
                        str(ACTIVATION_DTYPE).removeprefix("torch."))
            return load_gguf_native(source, ACTIVATION_DTYPE, resolved_device, cache_dir=cache)
        logger.info("GGUF %s: quantized weights dequantized to %s (%s)", source.path.name,
                    str(resolved_dtype).removeprefix("torch."), why)
    loaded = load_float_model(source, resolved_dtype, resolved_device, cache_dir=cache)
    if source.format == "hf" and _unstructured_pruned(source.path):
        swapped = sparsify(loaded.model)
        if swapped:
            logger.info("%s: %d pruned linears run by the sparse kernel", source.path.name, len(swapped))
    return loaded


def load_draft(model: str | os.PathLike, dtype: str | torch.dtype, device: str | torch.device,
               cache_dir: str | os.PathLike | None, target_dtype: torch.dtype) -> LoadedModel:
    """A speculative draft model for a target that computes in ``target_dtype``. With ``dtype``
    "auto", a GGUF draft runs as stored (as a GGUF target does) and any other draft in the target's
    activation dtype: a float32 draft beside a bfloat16 target would read twice the bytes per
    token for guesses the target checks anyway. An explicit ``dtype`` is used as given."""
    if _is_auto(dtype):
        source = resolve_model(model, Path(cache_dir) if cache_dir else default_cache_dir())
        if source.format != "gguf":
            logger.info("draft %s: loaded in the target's %s", source.name, str(target_dtype).removeprefix("torch."))
            return load_model(source, target_dtype, device, cache_dir)
        model = source
    return load_model(model, dtype, device, cache_dir)


def _saved_compute_dtype(path: Path, device: torch.device) -> torch.dtype | None:
    """The compute dtype a quantized directory's config.json records, if ``device`` runs it."""
    name = json.loads((path / "config.json").read_text()).get("torch_dtype")
    try:
        return resolve_dtype(name, device) if isinstance(name, str) else None
    except InvalidParameterError:
        return None


def _unstructured_pruned(path: Path) -> bool:
    """Whether ``path``'s config.json says ``tokenmill prune`` zeroed weights in it (not structured pruning)."""
    import json

    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    method = (config.get("pruning_config") or {}).get("method")
    return method is not None and method != "structured"


def _is_auto(dtype: str | torch.dtype) -> bool:
    return isinstance(dtype, str) and dtype == "auto"
