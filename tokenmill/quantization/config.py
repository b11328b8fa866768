"""One validated config dataclass per quantization method.

``config_from_dict({"method": "int4", "group_size": 32})`` picks the class by ``method`` and
rejects unknown keys; ``config.to_dict()`` is what a quantized checkpoint stores in its
``config.json`` under ``quantization_config``.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from tokenmill.config import reject_unknown_keys
from tokenmill.errors import InvalidParameterError

GROUP_SIZES = (32, 64, 128, 256)


@dataclass(frozen=True)
class QuantConfig:
    """Base of every method's config. ``method`` is the name used by the CLI and in saved configs."""

    method: ClassVar[str] = ""

    quantize_lm_head: bool = True
    """Quantize the LM head too (for tied embeddings: a quantized copy of the embedding matrix;
    the embedding lookup itself stays in the model dtype)."""

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, **dataclasses.asdict(self)}


@dataclass(frozen=True)
class Int8WeightOnlyConfig(QuantConfig):
    """INT8 weights, one symmetric scale per output channel; activations stay in the model dtype.

    Example: ``quantize("smollm2-135m-instruct", Int8WeightOnlyConfig())``.
    """

    method: ClassVar[str] = "int8"


@dataclass(frozen=True)
class Int4WeightOnlyConfig(QuantConfig):
    """INT4 weights, asymmetric, one (scale, zero) pair per ``group_size`` input columns of each
    output channel, by round-to-nearest; activations stay in the model dtype.

    Example: ``quantize(model, Int4WeightOnlyConfig(group_size=32))``.
    """

    method: ClassVar[str] = "int4"

    group_size: int = 64
    """Input columns sharing one scale and zero: 32, 64, 128 or 256."""
    lm_head_int8: bool = True
    """Quantize the LM head to INT8 per channel instead: the logits are the outputs most sensitive
    to rounding (llama.cpp's 4-bit files keep theirs at 6 bits or more for the same reason)."""

    def __post_init__(self) -> None:
        if self.group_size not in GROUP_SIZES:
            raise InvalidParameterError(f"{type(self).__name__}.group_size must be one of {GROUP_SIZES}, "
                                        f"got {self.group_size}")


@dataclass(frozen=True)
class Int4GPTQConfig(Int4WeightOnlyConfig):
    """INT4 group-wise like ``int4`` (same stored form, same kernels), but each column's rounding
    error is compensated on the columns not yet quantized (GPTQ, Frantar et al. 2022), using the
    Hessian ``X^T X`` of each layer's inputs on calibration text. Blocks are quantized in order,
    each seeing the outputs of the already quantized blocks before it. Calibration sequences come
    from the end of the evaluation corpus, which perplexity (measured on its start) never reaches.

    Example: ``quantize("smollm2-135m-instruct", Int4GPTQConfig(group_size=64))``.
    """

    method: ClassVar[str] = "int4-gptq"

    num_samples: int = 32
    """Calibration sequences."""
    seq_len: int = 512
    """Tokens per calibration sequence."""
    damping: float = 0.01
    """Added to the Hessian's diagonal, as a fraction of its mean diagonal."""
    block_size: int = 128
    """Columns quantized together before their error is pushed to the later columns (rounded up
    to a multiple of group_size)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("num_samples", "seq_len", "block_size"):
            if getattr(self, name) <= 0:
                raise InvalidParameterError(f"Int4GPTQConfig.{name} must be positive, got {getattr(self, name)}")
        if not 0 < self.damping < 1:
            raise InvalidParameterError(f"Int4GPTQConfig.damping must be in (0, 1), got {self.damping}")


CONFIG_CLASSES: dict[str, type[QuantConfig]] = {
    cls.method: cls for cls in (Int8WeightOnlyConfig, Int4WeightOnlyConfig, Int4GPTQConfig)}


def config_from_dict(data: dict[str, Any]) -> QuantConfig:
    """The config named by ``data["method"]``, built from the other keys (unknown ones rejected)."""
    data = dict(data)
    method = data.pop("method", None)
    if method not in CONFIG_CLASSES:
        raise InvalidParameterError(
            f"unknown quantization method {method!r}; known methods are {', '.join(CONFIG_CLASSES)}")
    cls = CONFIG_CLASSES[method]
    reject_unknown_keys(cls, data)
    return cls(**data)


def quantization_config_of(path: str | Path) -> dict[str, Any] | None:
    """The ``quantization_config`` saved in a directory's config.json; None for an ordinary checkpoint."""
    try:
        raw = json.loads((Path(path) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return raw.get("quantization_config") if isinstance(raw, dict) else None
