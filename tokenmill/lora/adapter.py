"""A LoRA adapter read from disk: its low-rank weights per projection, scaling folded in.

Two formats, both for the Llama family and Gemma 3, on any of the seven projections (q, k, v, o,
gate, up, down)::

    PEFT directory   adapter_config.json + adapter_model.safetensors (or .bin is refused: pickles)
                     keys  base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight   [r, in]
                                                                       ....lora_B.weight   [out, r]
                     scaling  lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora, per module
                              through rank_pattern / alpha_pattern as PEFT matches them
    GGUF file        general.type = adapter, adapter.type = lora, adapter.lora.alpha
                     tensors  blk.3.attn_q.weight.lora_a [r, in], .lora_b [out, r]
                     scaling  alpha / r (llama.cpp's rule; 1 when the file has no alpha); Llama
                              q/k B rows un-permuted the way the base weights are

The result, :class:`LoRAAdapter`, holds per canonical projection (``layers.3.attn.q``) the pair
(A [r, in], B [out, r] * scaling) in float32 on CPU: what the serving slots copy from
(``tokenmill.lora.slots``), whatever the base model's dtype or quantization. ``content_hash``
identifies the weights: prefix-cache keys include it, so a name loaded again with other weights
never reuses the old adapter's cached KV.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenmill.config import ModelConfig
from tokenmill.errors import InvalidParameterError, ModelFormatError, UnsupportedModelError
from tokenmill.loading.weights import GGUF_NAMES, hf_name, unpermute_rope_rows

PROJECTIONS = ("attn.q", "attn.k", "attn.v", "attn.o", "mlp.gate", "mlp.up", "mlp.down")
"""The canonical projections an adapter may target (tokenmill.loading.weights' names)."""
MAX_RANK = 64
"""The highest rank the serving kernels take."""


@dataclass(frozen=True, eq=False)
class LoRAAdapter:
    """One adapter's weights, ready to be copied into a serving slot. Compared by identity: a
    reload of the same path is another adapter (its ``content_hash`` tells whether it differs)."""

    name: str
    path: str
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    """Canonical projection (``layers.3.attn.q``) -> (A [r, in], B [out, r] with the scaling folded in), float32."""
    content_hash: str
    """sha256 of what defines the weights (the files' bytes)."""

    @property
    def rank(self) -> int:
        """The largest rank over its projections."""
        return max(a.shape[0] for a, _ in self.weights.values())

    @property
    def nbytes(self) -> int:
        """Bytes its weights take here (float32)."""
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())

    @property
    def targets(self) -> frozenset[str]:
        """The projection kinds it adapts (``attn.q`` ...)."""
        return frozenset(name.split(".", 2)[2] for name in self.weights)


def projection_shape(cfg: ModelConfig, projection: str) -> tuple[int, int]:
    """(out, in) of one canonical projection kind of ``cfg`` (``attn.q`` ...)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"attn.q": (q, cfg.hidden_size), "attn.k": (kv, cfg.hidden_size), "attn.v": (kv, cfg.hidden_size),
            "attn.o": (cfg.hidden_size, q), "mlp.gate": (cfg.intermediate_size, cfg.hidden_size),
            "mlp.up": (cfg.intermediate_size, cfg.hidden_size),
            "mlp.down": (cfg.hidden_size, cfg.intermediate_size)}[projection]


def load_adapter(name: str, path: str | Path, cfg: ModelConfig) -> LoRAAdapter:
    """The adapter at ``path`` (a PEFT directory or a GGUF LoRA file) for a model of ``cfg``.
    Raises InvalidParameterError naming the problem: no such path, not an adapter, a module or
    feature tokenmill does not serve (DoRA, bias, modules_to_save, embeddings), a shape that does
    not fit the model, a rank above MAX_RANK."""
    path = Path(path)
    if path.is_dir():
        weights, digest = _read_peft(path, cfg)
    elif path.is_file():
        weights, digest = _read_gguf(path, cfg)
    else:
        raise InvalidParameterError(f"LoRA adapter {name!r}: no file or directory at {path}", param="lora_path")
    if not weights:
        raise InvalidParameterError(f"LoRA adapter {name!r} at {path} has no LoRA weights", param="lora_path")
    for key, (a, b) in weights.items():
        _check_shapes(name, key, a, b, cfg)
    return LoRAAdapter(name, str(path), weights, digest)


def _check_shapes(name: str, key: str, a: torch.Tensor, b: torch.Tensor, cfg: ModelConfig) -> None:
    layer, projection = int(key.split(".")[1]), key.split(".", 2)[2]
    if projection.startswith("mlp.") and cfg.is_moe_layer(layer):
        raise InvalidParameterError(
            f"LoRA adapter {name!r}: {key} targets the MLP of an MoE layer; tokenmill serves adapters on the "
            "attention projections of MoE models (and on every projection of dense ones)", param="lora_path")
    out, inp = projection_shape(cfg, projection)
    r = a.shape[0]
    if layer >= cfg.num_layers:
        raise InvalidParameterError(f"LoRA adapter {name!r}: {key} is beyond the model's {cfg.num_layers} layers",
                                    param="lora_path")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != inp or b.shape != (out, r):
        raise InvalidParameterError(
            f"LoRA adapter {name!r} does not fit the model: {key} has A {tuple(a.shape)}, B {tuple(b.shape)}; "
            f"the model's projection is [{out}, {inp}] (A [r, {inp}], B [{out}, r])", param="lora_path")
    if not 1 <= r <= MAX_RANK:
        raise InvalidParameterError(f"LoRA adapter {name!r}: {key} has rank {r}; tokenmill serves ranks 1..{MAX_RANK}",
                                    param="lora_path")


def _hash_files(*files: Path) -> str:
    digest = hashlib.sha256()
    for file in files:
        with open(file, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


# ---- PEFT ----------------------------------------------------------------------------------------

_PEFT_KEY = re.compile(r"^(?:base_model\.model\.)?(.+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")
_HF_PROJECTIONS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def _read_peft(path: Path, cfg: ModelConfig) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], str]:
    config_file, weights_file = path / "adapter_config.json", path / "adapter_model.safetensors"
    if not config_file.is_file():
        raise InvalidParameterError(f"{path} is not a PEFT adapter: no adapter_config.json", param="lora_path")
    if not weights_file.is_file():
        found = "adapter_model.bin (a pickle: save with safe_serialization)" if (path / "adapter_model.bin").exists() \
            else "no weights"
        raise InvalidParameterError(f"{path}: tokenmill reads adapter_model.safetensors; found {found}",
                                    param="lora_path")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise InvalidParameterError(f"cannot read {config_file}: {exc}", param="lora_path") from None
    _check_peft_config(path, config)
    from safetensors import safe_open

    pairs: dict[str, dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(weights_file), framework="pt") as f:
            for key in f.keys():
                m = _PEFT_KEY.match(key)
                if m is None:
                    raise UnsupportedModelError(f"{weights_file}: tensor {key!r} is not a LoRA A/B weight of a "
                                                "linear projection (embeddings, biases and DoRA are not served)")
                module, which = m.groups()
                pairs.setdefault(module, {})[which] = f.get_tensor(key).float()
    except (UnsupportedModelError, InvalidParameterError) as exc:
        raise InvalidParameterError(str(exc), param="lora_path") from None
    except Exception as exc:  # safetensors' own error types for a corrupt file
        raise InvalidParameterError(f"cannot read {weights_file}: {exc}", param="lora_path") from None
    weights = {}
    for module, pair in pairs.items():
        key = _canonical_hf_module(path, module, cfg.architecture)
        if set(pair) != {"A", "B"}:
            raise InvalidParameterError(f"{weights_file}: {module} has lora_{''.join(pair)} without its pair",
                                        param="lora_path")
        r = pair["A"].shape[0]
        rank = _pattern_value(config.get("rank_pattern") or {}, module, config.get("r", r))
        alpha = _pattern_value(config.get("alpha_pattern") or {}, module, config.get("lora_alpha", rank))
        if rank != r:
            raise InvalidParameterError(f"{path}: {module} has rank {r} but adapter_config.json says {rank}",
                                        param="lora_path")
        scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        weights[key] = (pair["A"].contiguous(), (pair["B"] * scaling).contiguous())
    return weights, _hash_files(config_file, weights_file)


def _check_peft_config(path: Path, config: dict) -> None:
    def refuse(what: str) -> None:
        raise InvalidParameterError(f"LoRA adapter at {path}: {what} is not supported", param="lora_path")

    if config.get("peft_type", "LORA") != "LORA":
        refuse(f"peft_type {config.get('peft_type')!r} (only LORA)")
    if config.get("use_dora"):
        refuse("DoRA (use_dora)")
    if config.get("bias", "none") != "none":
        refuse(f"bias {config.get('bias')!r}")
    if config.get("modules_to_save"):
        refuse(f"modules_to_save {config['modules_to_save']}")
    if config.get("fan_in_fan_out"):
        refuse("fan_in_fan_out (Conv1D layers)")


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern: the value of the first key that matches the end of the
    module's name at a dot boundary (``q_proj``, ``layers.3.self_attn.q_proj``, a regex)."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return default


def _canonical_hf_module(path: Path, module: str, family: str) -> str:
    canonical = hf_name(f"{module}.weight", family)
    projection = None if canonical is None else canonical.removesuffix(".weight").split(".", 2)[-1]
    if canonical is None or projection not in PROJECTIONS:
        raise InvalidParameterError(
            f"LoRA adapter at {path} adapts {module}; tokenmill serves LoRA on "
            f"{', '.join(sorted(_HF_PROJECTIONS))} of the decoder layers", param="lora_path")
    return canonical.removesuffix(".weight")


# ---- GGUF ----------------------------------------------------------------------------------------

_GGUF_KEY = re.compile(r"^blk\.(\d+)\.(\w+)\.weight\.lora_([ab])$")


def _read_gguf(path: Path, cfg: ModelConfig) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], str]:
    from tokenmill.loading.gguf_config import permutes_rope_rows
    from tokenmill.loading.gguf_file import GGUFFile

    try:
        gguf = GGUFFile(path)
    except (ModelFormatError, UnsupportedModelError) as exc:
        raise InvalidParameterError(f"LoRA adapter at {path}: {exc}", param="lora_path") from None
    with gguf:
        meta = gguf.metadata
        if meta.get("general.type") != "adapter" or meta.get("adapter.type") != "lora":
            raise InvalidParameterError(
                f"{path} is not a GGUF LoRA adapter (general.type {meta.get('general.type')!r}, adapter.type "
                f"{meta.get('adapter.type')!r}; expected 'adapter' and 'lora')", param="lora_path")
        alpha = meta.get("adapter.lora.alpha")
        permute = permutes_rope_rows(meta)
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for name in gguf.tensor_names:
            m = _GGUF_KEY.match(name)
            part = GGUF_NAMES.get(m.group(2)) if m else None
            if part not in PROJECTIONS:
                raise InvalidParameterError(f"{path}: tensor {name!r} is not a LoRA weight of a projection tokenmill "
                                            "serves (q, k, v, o, gate, up, down)", param="lora_path")
            pairs.setdefault(f"layers.{m.group(1)}.{part}", {})[m.group(3)] = gguf.load_tensor(name)
    weights = {}
    for key, pair in pairs.items():
        if set(pair) != {"a", "b"}:
            raise InvalidParameterError(f"{path}: {key} has lora_{''.join(pair)} without its pair", param="lora_path")
        a, b = pair["a"], pair["b"]
        if permute and key.endswith(("attn.q", "attn.k")):
            heads = cfg.num_heads if key.endswith("attn.q") else cfg.num_kv_heads
            b = unpermute_rope_rows(b, heads)
        scaling = float(alpha) / a.shape[0] if alpha else 1.0
        weights[key] = (a.contiguous(), (b * scaling).contiguous())
    return weights, _hash_files(path)
