"""A model checkpoint on disk -> its architecture, its tensors under canonical names, its tokenizer.

Pure reading: nothing here builds a model. Two formats::

    GGUF file      metadata -> ModelConfig (gguf_config), tensors dequantized to float
                   (gguf_file, dequant), Llama q/k rows un-permuted, rope_freqs kept aside;
                   asked for ``native_types``, the linear weights of those types come in grouped
                   form instead (gguf_groups), already fused: see :attr:`Checkpoint.grouped`
    HF directory   config.json -> ModelConfig (hf_config), *.safetensors in file order,
                   Gemma's (1 + w) norms folded to w + 1

Both come out as a :class:`Checkpoint` whose tensors are an iterator under tokenmill's canonical,
unfused names (weights.py), read one at a time as they are consumed, so that a model is never
held twice in memory. ``models/builder.py`` fuses them and assigns them to a model.

A directory written by ``tokenmill quantize`` (``quantization_config`` in its config.json) is an
HF directory too, but its tensors are already fused and quantized: :func:`read_checkpoint`
refuses it, and ``tokenmill.loader.load_model`` hands it to the quantization package.
"""

from __future__ import annotations

import json
import logging
import re
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch
from gguf import GGMLQuantizationType

from tokenmill.config import ModelConfig
from tokenmill.errors import ModelFormatError
from tokenmill.loading.gguf_config import gguf_model_config, permutes_rope_rows
from tokenmill.loading.dequant import FLOAT_TYPES
from tokenmill.loading.gguf_file import GGUFFile
from tokenmill.loading.gguf_groups import CODE_BITS, GROUP_SIZES, GroupedWeight
from tokenmill.loading.hf_config import hf_model_config, quantization_config_of
from tokenmill.loading.sources import ModelSource
from tokenmill.loading.tokenizer import Tokenizer
from tokenmill.loading.weights import (
    FUSED_INTO,
    FUSED_PARTS,
    GGUF_EXPERTS,
    gguf_name,
    hf_name,
    map_tensors,
    split_stacked_experts,
    unpermute_rope_rows,
)

logger = logging.getLogger("tokenmill.loading")
GROUPED_FIELDS = ("codes", "scale", "min")
"""The tensors of a grouped linear in a checkpoint: ``<module>.codes``, ``<module>.scale``, ``<module>.min``."""


@dataclass(frozen=True)
class GroupedLayout:
    """A linear module whose weight the checkpoint holds in grouped form, known before any data is read."""

    out_features: int
    in_features: int
    group_size: int
    bits: int
    sources: tuple[str, ...]
    """The GGUF tensors joined into it, in row order (q, k, v; gate, up; or one)."""


@dataclass
class Checkpoint:
    """A model's architecture and its tensors under canonical (unfused) names, read lazily."""

    config: ModelConfig
    tensors: Iterator[tuple[str, torch.Tensor]]
    """(canonical name, tensor) pairs, each read from disk when the iterator reaches it; consumed once."""
    rope_freq_factors: torch.Tensor | None = None
    """Per-frequency divisors of the global RoPE (GGUF's rope_freqs, e.g. Llama 3.1 scaling)."""
    grouped: dict[str, GroupedLayout] = field(default_factory=dict)
    """Module path (fused: ``layers.0.attn.qkv``, ``lm_head``) -> layout, for the linears whose weight
    comes as the codes, scale and min of a :class:`~tokenmill.loading.gguf_groups.GroupedWeight`
    (``<module>.codes`` ...) instead of a float ``<module>.weight``. A tied LM head is one of them
    when the token embedding is of a native type: the embedding comes as a float table too."""


def read_checkpoint(source: ModelSource, cache_dir: Path | None = None,
                    native_types: Collection[GGMLQuantizationType] = ()) -> tuple[Checkpoint, Tokenizer]:
    """The checkpoint and tokenizer of a GGUF file or an (unquantized) HF directory.

    The checkpoint is opened first: an unsupported architecture is the error to report, not its
    tokenizer's. ``cache_dir``: where GGUF tokenizer pipelines are cached (Gemma's merges take
    about 2 s to derive). ``native_types``: GGUF only, see :func:`open_gguf`. Raises
    ModelFormatError for a tokenmill-quantized directory."""
    if source.format == "gguf":
        gguf = GGUFFile(source.path)
        checkpoint = open_gguf(gguf, native_types)
        tokenizer_cache = cache_dir / "tokenizers" if cache_dir else None
        return checkpoint, Tokenizer.from_gguf_metadata(gguf.metadata, cache_dir=tokenizer_cache)
    if quantization_config_of(source.path) is not None:
        raise ModelFormatError(
            f"{source.path} is a tokenmill-quantized checkpoint: its tensors are already quantized; "
            "load it with tokenmill.loader.load_model or LLM")
    checkpoint = open_hf(source.path)
    return checkpoint, Tokenizer.from_hf_dir(source.path)


def open_gguf(gguf: GGUFFile, native_types: Collection[GGMLQuantizationType] = ()) -> Checkpoint:
    """The checkpoint of an open GGUF file, its tensors dequantized to float as they are read.

    With ``native_types`` (a subset of ``gguf_groups.NATIVE_TYPES``), each linear module all of
    whose parts are of those types (q, k and v of ``attn.qkv``, gate and up of ``mlp.gate_up``, or
    the one tensor of ``attn.o``, ``mlp.down``, ``lm_head``; a tied LM head is the token embedding)
    comes instead as the ``codes``, ``scale`` and ``min`` of its parts' joined GroupedWeight, listed
    in :attr:`Checkpoint.grouped`. Logs one line per ggml type on ``tokenmill.loading``."""
    names = set(gguf.tensor_names)
    config = gguf_model_config(gguf.metadata, names)
    permute = permutes_rope_rows(gguf.metadata)

    def transform(name: str, t: torch.Tensor) -> torch.Tensor:  # rows first: float or grouped tensors
        if permute and name.endswith("attn.q.weight"):
            return unpermute_rope_rows(t, config.num_heads)
        if permute and name.endswith("attn.k.weight"):
            return unpermute_rope_rows(t, config.num_kv_heads)
        return t

    grouped, parts = _grouped_layouts(gguf, config.tie_word_embeddings, frozenset(native_types))

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        pending: dict[str, dict[int, GroupedWeight]] = {}
        for name in gguf.tensor_names:
            if m := GGUF_EXPERTS.match(name):  # [experts, out, in] -> one weight per expert
                layer, projection = m.groups()
                stacked = gguf.load_tensor(name)
                for expert in range(stacked.shape[0]):
                    yield f"layers.{layer}.mlp.experts.{expert}.{projection}.weight", stacked[expert].clone()
                del stacked
                continue
            canonical = gguf_name(name)
            if canonical is None:
                continue
            if canonical.endswith("mlp.shared_gate.weight"):  # llama.cpp stores the [1, hidden] gate as [hidden]
                yield canonical, gguf.load_tensor(name).reshape(1, -1)
                continue
            if name in parts:
                module, index = parts[name]
                pending.setdefault(module, {})[index] = gguf.load_grouped(name).map_rows(
                    lambda t: transform(canonical, t))
                if len(pending[module]) == len(grouped[module].sources):
                    joined = pending.pop(module)
                    fields = GroupedWeight.concat([joined[i] for i in range(len(joined))])
                    del joined  # hold no reference once the consumer has them: a model is not held twice
                    for part in GROUPED_FIELDS:
                        yield f"{module}.{part}", getattr(fields, part)
                    del fields
                if canonical != "embed.weight":  # the tied head's embedding is also the lookup table
                    continue
            yield canonical, transform(canonical, gguf.load_tensor(name))

    _log_types(gguf, parts)
    freq_factors = gguf.load_tensor("rope_freqs.weight") if "rope_freqs.weight" in names else None
    return Checkpoint(config, tensors(), freq_factors, grouped)


_LINEAR_WEIGHT = re.compile(r"^(layers\.\d+)\.(attn\.[qkvo]|mlp\.gate|mlp\.up|mlp\.down)\.weight$")


def _linear_part(canonical: str, tied: bool) -> tuple[str, int, int] | None:
    """(module path, index of the part, parts in the module) of a canonical linear weight, else None."""
    if canonical == "lm_head.weight" or (tied and canonical == "embed.weight"):
        return "lm_head", 0, 1
    m = _LINEAR_WEIGHT.match(canonical)
    if m is None:
        return None
    prefix, part = m.groups()
    fused, index = FUSED_INTO.get(part, (part, 0))
    return f"{prefix}.{fused}", index, FUSED_PARTS.get(fused, 1)


def _grouped_layouts(gguf: GGUFFile, tied: bool, native_types: frozenset[GGMLQuantizationType],
                     ) -> tuple[dict[str, GroupedLayout], dict[str, tuple[str, int]]]:
    """From the tensor directory alone: the modules loaded in grouped form, and each of their GGUF
    tensors' (module, part index). A module with a part missing, of another type, or of mismatched
    widths stays float (the builder reports what does not fit the model)."""
    modules: dict[str, dict[int, str]] = {}
    sizes: dict[str, int] = {}
    for name in gguf.tensor_names:
        canonical = gguf_name(name)
        where = None if canonical is None else _linear_part(canonical, tied)
        if where is not None:
            modules.setdefault(where[0], {})[where[1]] = name
            sizes[where[0]] = where[2]
    grouped, parts = {}, {}
    for module, found in modules.items():
        if len(found) != sizes[module]:
            continue
        sources = tuple(found[i] for i in range(len(found)))
        info = [gguf.tensor_info(n) for n in sources]
        if not all(q in native_types and len(shape) == 2 for q, shape in info) or len({s[1] for _, s in info}) != 1:
            continue
        grouped[module] = GroupedLayout(out_features=sum(s[0] for _, s in info), in_features=info[0][1][1],
                                        group_size=min(GROUP_SIZES[q] for q, _ in info),
                                        bits=max(CODE_BITS[q] for q, _ in info), sources=sources)
        parts.update({n: (module, i) for i, n in enumerate(sources)})
    return grouped, parts


def _log_types(gguf: GGUFFile, native: Collection[str]) -> None:
    """One INFO line per ggml type of the file: how many tensors, and how each is loaded."""
    by_type = Counter(gguf.tensor_info(n)[0] for n in gguf.tensor_names)
    for qtype, count in sorted(by_type.items(), key=lambda item: -item[1]):
        if qtype in FLOAT_TYPES:
            logger.info("GGUF %s: %s as float", qtype.name, _tensors(count))
            continue
        own = [n for n in gguf.tensor_names if gguf.tensor_info(n)[0] == qtype and n in native]
        how = []
        if own:
            how.append(f"{_tensors(len(own))} native (grouped kernel, {CODE_BITS[qtype]}-bit codes)")
            if "token_embd.weight" in own:
                how.append("token_embd.weight also dequantized for the embedding lookup")
        if count > len(own):
            how.append(f"{_tensors(count - len(own))} dequantized to float")
        logger.info("GGUF %s: %s", qtype.name, ", ".join(how))


def _tensors(n: int) -> str:
    return f"{n} tensor" if n == 1 else f"{n} tensors"


def open_hf(path: Path) -> Checkpoint:
    """The checkpoint of an HF directory: config.json and every ``*.safetensors`` file, sorted by name."""
    from safetensors import safe_open

    try:
        raw_config = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelFormatError(f"cannot read {path / 'config.json'}: {exc}") from None
    config = hf_model_config(raw_config)
    family = config.architecture

    def transform(name: str, t: torch.Tensor) -> torch.Tensor:
        if family == "gemma3" and name.endswith("norm.weight"):
            return t.float() + 1.0  # Gemma stores w for a (1 + w) multiplier
        return t

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for file in sorted(path.glob("*.safetensors")):
            try:
                with safe_open(str(file), framework="pt") as f:
                    for name in f.keys():
                        yield name, f.get_tensor(name)
            except Exception as exc:  # safetensors raises its own error types for corrupt files
                raise ModelFormatError(f"cannot read {file}: {exc}") from None

    named = map_tensors(split_stacked_experts(tensors()), lambda n: hf_name(n, family), transform)
    if config.tie_word_embeddings:
        named = (item for item in named if item[0] != "lm_head.weight")
    return Checkpoint(config, named)
