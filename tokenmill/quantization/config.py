"""One validated config dataclass per quantization method.

``config_from_dict({"method": "int4", "group_size": 32})`` picks the class by ``method`` and
rejects unknown keys; ``config.to_dict()`` is what a quantized checkpoint stores in its
``config.json`` under ``quantization_config``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from tokenmill.config import config_by_method
from tokenmill.errors import InvalidParameterError
from tokenmill.loading.hf_config import quantization_config_of  # noqa: F401  (defined with the HF config reader)

GROUP_SIZES = (32, 64, 128, 256)


@dataclass(frozen=True)
class QuantConfig:
    """Base of every method's config. ``method`` is the name used by the CLI and in saved configs."""

    method: ClassVar[str] = ""

    quantize_lm_head: bool = True
    """Quantize the LM head too (for tied embeddings: a quantized copy of the embedding matrix;
    the embedding lookup itself stays in the model dtype)."""
    keep_layers: tuple[str, ...] = ()
    """Module paths (``layers.3.mlp.down``, ``lm_head``) kept in higher precision: INT8 weight-only
    for the int4 methods, the model dtype (a plain nn.Linear) for int8 and w8a8. A list is
    accepted and stored as a tuple; the names are checked against the model when quantizing."""

    def __post_init__(self) -> None:
        layers = tuple(self.keep_layers) if isinstance(self.keep_layers, (list, tuple)) else None
        if layers is None or not all(isinstance(name, str) and name for name in layers):
            raise InvalidParameterError(f"{type(self).__name__}.keep_layers must be a list of module paths, "
                                        f"got {self.keep_layers!r}")
        repeated = sorted({name for name in layers if layers.count(name) > 1})
        if repeated:
            raise InvalidParameterError(f"{type(self).__name__}.keep_layers names {', '.join(repeated)} more than once")
        object.__setattr__(self, "keep_layers", layers)  # frozen: normalise a JSON list to a tuple

    def resolved(self, has_calibration: bool) -> QuantConfig:
        """This config with its automatic choices made, for a quantization that has calibration
        text (a tokenizer or calibration ids) or not: what the quantized model records."""
        return self

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: ``keep_layers`` as a list (``config_from_dict`` reads it back as a tuple)."""
        return {"method": self.method, **dataclasses.asdict(self), "keep_layers": list(self.keep_layers)}


@dataclass(frozen=True)
class Int8WeightOnlyConfig(QuantConfig):
    """INT8 weights, one symmetric scale per output channel; activations stay in the model dtype.

    Example: ``quantize("smollm2-135m-instruct", Int8WeightOnlyConfig())``.
    """

    method: ClassVar[str] = "int8"

    scale_search: bool = True
    """Each channel's scale minimises its squared rounding error over clipping ratios 0.70-1.0 of
    its largest magnitude instead of plain absmax (an MSE observer on the weights)."""


@dataclass(frozen=True)
class Int4WeightOnlyConfig(QuantConfig):
    """INT4 weights, asymmetric, one (scale, zero) pair per ``group_size`` input columns of each
    output channel, by round-to-nearest; activations stay in the model dtype.

    Example: ``quantize(model, Int4WeightOnlyConfig(group_size=32))``.
    """

    method: ClassVar[str] = "int4"

    group_size: int = 32
    """Input columns sharing one scale and zero: 32, 64, 128 or 256. 32 by default: the block of
    every llama.cpp 4- and 5-bit type, so a GGUF source's own 4-bit grid (Q4_0, Q4_1, Q4_K
    sub-blocks) is found again by the range search and kept, and the one size that met the +8%
    perplexity budget by plain rounding (SmolLM2 from its Q4_1 file: +0.04% at g32, +27% at g64)."""
    lm_head_int8: bool = True
    """Quantize the LM head to INT8 per channel instead: the logits are the outputs most sensitive
    to rounding (llama.cpp's 4-bit files keep theirs at 6 bits or more for the same reason)."""
    range_search: bool = True
    """Each group's (scale, zero) minimise its squared rounding error over ranges trimmed at either
    end and least-squares refits (llama.cpp's make_qkx, AWQ's clip search) instead of plain min-max."""
    activation_weighted: bool | None = None
    """With ``range_search``: weight each column's error by its input's mean square on calibration
    text (llama.cpp's imatrix), so that columns fed by large activations are clipped least.
    None (the default): weighted whenever calibration text is at hand, which is the case for a
    model given by name, file or directory, a ``LoadedModel`` or ``tokenmill quantize``; a bare
    ``CausalLM`` without calibration ids is not weighted. It is what meets the +8% perplexity
    budget on Gemma 3 270M (whose source is 5-bit): +3.85% weighted, +13.3% not, where SmolLM2
    is at +0.2% either way (``tokenmill quantize MODEL --method int4``, the quality line)."""
    num_samples: int = 32
    """Calibration sequences (``activation_weighted``, and ``int4-gptq``)."""
    seq_len: int = 512
    """Tokens per calibration sequence."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.range_search, bool):
            raise InvalidParameterError(f"{type(self).__name__}.range_search must be true or false, "
                                        f"got {self.range_search!r}")
        if self.activation_weighted is not None and not isinstance(self.activation_weighted, bool):
            raise InvalidParameterError(f"{type(self).__name__}.activation_weighted must be true or false (or null: "
                                        f"when calibration text is at hand), got {self.activation_weighted!r}")
        if self.method == "int4" and self.activation_weighted and not self.range_search:  # calibrating for nothing
            raise InvalidParameterError("Int4WeightOnlyConfig.activation_weighted weights the range search: "
                                        "it needs range_search=True")
        if self.group_size not in GROUP_SIZES:
            raise InvalidParameterError(f"{type(self).__name__}.group_size must be one of {GROUP_SIZES}, "
                                        f"got {self.group_size}")
        for name in ("num_samples", "seq_len"):
            if getattr(self, name) <= 0:
                raise InvalidParameterError(f"{type(self).__name__}.{name} must be positive, got {getattr(self, name)}")

    def resolved(self, has_calibration: bool) -> Int4WeightOnlyConfig:
        if self.activation_weighted is not None:
            return self
        return dataclasses.replace(self, activation_weighted=self.range_search and has_calibration)


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

    activation_weighted: bool = True
    """With ``range_search``: weight each column's error by the Hessian's diagonal (its input's
    mean square), which GPTQ has already: no extra calibration pass. Ignored without it."""
    damping: float = 0.01
    """Added to the Hessian's diagonal, as a fraction of its mean diagonal."""
    block_size: int = 128
    """Columns quantized together before their error is pushed to the later columns (rounded up
    to a multiple of group_size)."""
    act_order: bool = True
    """Quantize columns in order of decreasing Hessian diagonal (most active inputs first, while
    the most columns remain to absorb their error), with static groups: every group's (scale,
    zero) come from the original weights, so the stored layout is unchanged."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.act_order, bool):
            raise InvalidParameterError(f"Int4GPTQConfig.act_order must be true or false, got {self.act_order!r}")
        if self.block_size <= 0:
            raise InvalidParameterError(f"Int4GPTQConfig.block_size must be positive, got {self.block_size}")
        if not 0 < self.damping < 1:
            raise InvalidParameterError(f"Int4GPTQConfig.damping must be in (0, 1), got {self.damping}")


ACTIVATION_MODES = ("dynamic", "static")
OBSERVER_NAMES = ("minmax", "percentile", "mse")
SMOOTHABLE_LAYERS = ("qkv", "gate_up", "down", "o", "lm_head")
AUTO_SMOOTHING_ALPHA = {"dynamic": 0.5, "static": 0.85}
"""``smoothing_alpha="auto"``: measured best on SmolLM2 per activation mode (see W8A8Config)."""


@dataclass(frozen=True)
class W8A8Config(QuantConfig):
    """INT8 weights (symmetric, one scale per output channel) and INT8 activations, multiplied by
    an int8 x int8 -> int32 GEMM and rescaled to the model dtype.

    ``dynamic``: each token (row of the input) gets its own scale from its own range at run time.
    ``static``: one (scale, zero point) per layer input, fixed by running calibration text through
    the float model and feeding each linear layer's inputs to ``observer``. Calibration sequences
    come from the end of the evaluation corpus, as for ``int4-gptq``.

    Before either, SmoothQuant (``smoothing_alpha``) divides the outlier input channels of each
    layer down, scaling its weight columns up, folded exactly into the layers before (see
    :mod:`tokenmill.quantization.smoothing`); it calibrates on the same text.

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
    """static activations and smoothing: calibration sequences."""
    seq_len: int = 512
    """static activations and smoothing: tokens per calibration sequence."""
    smoothing_alpha: float | str | None = "auto"
    """SmoothQuant's migration strength in [0, 1]: each input channel of a layer is divided by
    ``max|X|^alpha / max|W|^(1 - alpha)`` (from calibration text, like static activations) and its
    weight column multiplied by it, folded into the norm or linear layer before; None: no smoothing.
    ``auto``: 0.5 for ``dynamic``, 0.85 for ``static``. Per-tensor static grids need more migration
    than per-token ones: on SmolLM2 0.5 suits ``dynamic`` (perplexity +1.4% vs bf16), about 0.85
    ``static`` (+3.1%; +31% at 0.5, +4.8% at 0.9), whose mlp.down inputs carry outliers of over a hundred."""
    smoothing_layers: tuple[str, ...] = SMOOTHABLE_LAYERS
    """Which layers to smooth, among ``qkv``, ``gate_up``, ``down``, ``o`` and ``lm_head``."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.smoothing_layers, str):
            raise InvalidParameterError("W8A8Config.smoothing_layers must be a list of layer kinds, "
                                        f"got the string {self.smoothing_layers!r}")
        object.__setattr__(self, "smoothing_layers", tuple(self.smoothing_layers))  # a list, from config.json
        if self.smoothing_alpha == "auto":
            object.__setattr__(self, "smoothing_alpha", AUTO_SMOOTHING_ALPHA.get(self.activation, 0.5))
        if self.smoothing_alpha is not None and (isinstance(self.smoothing_alpha, str)
                                                 or not 0.0 <= self.smoothing_alpha <= 1.0):
            raise InvalidParameterError(f"W8A8Config.smoothing_alpha must be in [0, 1], 'auto' or None, "
                                        f"got {self.smoothing_alpha!r}")
        unknown = sorted(set(self.smoothing_layers) - set(SMOOTHABLE_LAYERS))
        if unknown:
            raise InvalidParameterError(f"W8A8Config.smoothing_layers: unknown {unknown}; "
                                        f"known: {', '.join(SMOOTHABLE_LAYERS)}")
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

    def to_dict(self) -> dict[str, Any]:
        """As saved in config.json: ``smoothing_layers`` as a list, the form JSON reads back."""
        return {**super().to_dict(), "smoothing_layers": list(self.smoothing_layers)}


CONFIG_CLASSES: dict[str, type[QuantConfig]] = {
    cls.method: cls for cls in (Int8WeightOnlyConfig, Int4WeightOnlyConfig, Int4GPTQConfig, W8A8Config)}


def config_from_dict(data: dict[str, Any]) -> QuantConfig:
    """The config named by ``data["method"]``, built from the other keys (unknown ones rejected)."""
    return config_by_method(CONFIG_CLASSES, data, "quantization")
