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


ACTIVATION_MODES = ("dynamic", "static")
OBSERVER_NAMES = ("minmax", "percentile", "mse")


@dataclass(frozen=True)
class W8A8Config(QuantConfig):
    """INT8 weights (symmetric, one scale per output channel) and INT8 activations, multiplied by
    an int8 x int8 -> int32 GEMM and rescaled to the model dtype.

    ``dynamic``: each token (row of the input) gets its own scale from its own range at run time.
    ``static``: one (scale, zero point) per layer input, fixed by running calibration text through
    the float model and feeding each linear layer's inputs to ``observer``. Calibration sequences
    come from the end of the evaluation corpus, as for ``int4-gptq``.

    Example: ``quantize("smollm2-135m-instruct", W8A8Config(activation="static", observer="mse"))``.
    """

    method: ClassVar[str] = "w8a8"

    activation: str = "dynamic"
    """``dynamic`` (per token, at run time) or ``static`` (per tensor, from calibration)."""
    symmetric: bool = True
    """Activations on -127..127 around zero; False: -128..127 with a zero point."""
    observer: str = "minmax"
    """static: ``minmax``, ``percentile`` or ``mse``, how the calibration inputs give the range."""
    percentile: float = 99.99
    """static with the ``percentile`` observer: the percentile clipped at (of |x| when symmetric)."""
    calibration_samples: int = 16
    """static: calibration sequences."""
    seq_len: int = 512
    """static: tokens per calibration sequence."""

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATION_MODES:
            raise InvalidParameterError(f"W8A8Config.activation must be one of {ACTIVATION_MODES}, "
                                        f"got {self.activation!r}")
        if self.observer not in OBSERVER_NAMES:
            raise InvalidParameterError(f"W8A8Config.observer must be one of {OBSERVER_NAMES}, got {self.observer!r}")
        if self.activation == "dynamic" and self.observer != "minmax":
            raise InvalidParameterError("W8A8Config.observer applies to static activations only; "
                                        "dynamic ones use each token's own range")
        if not 50 < self.percentile <= 100:
            raise InvalidParameterError(f"W8A8Config.percentile must be in (50, 100], got {self.percentile}")
        for name in ("calibration_samples", "seq_len"):
            if getattr(self, name) <= 0:
                raise InvalidParameterError(f"W8A8Config.{name} must be positive, got {getattr(self, name)}")


CONFIG_CLASSES: dict[str, type[QuantConfig]] = {
    cls.method: cls for cls in (Int8WeightOnlyConfig, Int4WeightOnlyConfig, Int4GPTQConfig, W8A8Config)}


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
