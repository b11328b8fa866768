"""One validated config dataclass per pruning method.

Unstructured and semi-structured (the model keeps its shapes; weights become zeros):

    MagnitudeConfig(sparsity=0.5)              smallest |w| per layer, or model-wide (scope="global")
    WandaConfig(sparsity="2:4")                smallest |w| x ||x|| per output row (Sun et al. 2023)
    SparseGPTConfig(sparsity=0.5)              mask and error compensation from the inputs' Hessian
                                               (Frantar & Alistarh 2023), block by block

``sparsity`` is a fraction of every layer's weights (0.5) or an N:M pattern ("2:4": at most 2
nonzeros in every 4 consecutive inputs of a row). ``schedule_steps`` > 1 reaches it in steps
(cubic, as Zhu & Gupta's gradual pruning), scoring again on the pruned model between steps.

Structured (the model gets smaller shapes: a new config.json that HF transformers loads):

    StructuredConfig(target_params=0.5)        plan widths and depth for a parameter budget,
                                               choosing among candidates by calibration loss
    StructuredConfig(intermediate_size=768)    or give the shapes directly (FFN channels,
    StructuredConfig(num_kv_heads=2)           whole KV groups of attention heads, q heads per
    StructuredConfig(num_layers=20)            group, layers by block influence)

``config_from_dict({"method": "wanda", "sparsity": "2:4"})`` picks the class by ``method`` and
rejects unknown keys; ``config.to_dict()`` is what a pruned checkpoint records in config.json.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar

from tokenmill.config import config_by_method
from tokenmill.errors import InvalidParameterError

STRUCTURED_DIMS = ("heads", "channels", "layers")


@dataclass(frozen=True)
class PruneConfig:
    """Base of every method's config: calibration text (from the end of the corpus, which
    perplexity, measured on its start, never reaches)."""

    method: ClassVar[str] = ""

    num_samples: int = 32
    """Calibration sequences."""
    seq_len: int = 512
    """Tokens per calibration sequence."""

    def __post_init__(self) -> None:
        for name in ("num_samples", "seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise InvalidParameterError(f"{type(self).__name__}.{name} must be a positive integer, got {value!r}")

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, **dataclasses.asdict(self)}


def parse_sparsity(value: float | str) -> tuple[float, tuple[int, int] | None]:
    """0.5 / "0.5" / "50%" -> (0.5, None); "2:4" -> (0.5, (2, 4)): (fraction pruned, N:M or None)."""
    if isinstance(value, str) and ":" in value:
        n_text, _, m_text = value.partition(":")
        try:
            n, m = int(n_text), int(m_text)
        except ValueError:
            raise InvalidParameterError(f"sparsity pattern must be N:M with integers, got {value!r}") from None
        if not 0 < n < m <= 64:
            raise InvalidParameterError(f"sparsity pattern N:M needs 0 < N < M <= 64, got {value!r}")
        return 1 - n / m, (n, m)
    try:
        fraction = float(value[:-1]) / 100 if isinstance(value, str) and value.endswith("%") else float(value)
    except (TypeError, ValueError):
        raise InvalidParameterError(f"sparsity must be a fraction such as 0.5 or a pattern such as 2:4, "
                                    f"got {value!r}") from None
    if not 0 < fraction < 1 or not math.isfinite(fraction):
        raise InvalidParameterError(f"sparsity must be a fraction in (0, 1), got {value!r}")
    return fraction, None


@dataclass(frozen=True)
class SparsityConfig(PruneConfig):
    """Base of the methods that zero weights inside the model's shapes."""

    sparsity: float | str = 0.5
    """Fraction of each layer's weights set to zero (exactly ``floor(sparsity * inputs)`` per row,
    or per layer with a global or per-layer magnitude scope), or an N:M pattern such as ``"2:4"``."""
    schedule_steps: int = 1
    """1: one shot. k > 1: k rounds reaching ``sparsity`` on a cubic schedule, each scoring the
    model as the earlier rounds left it (weights pruned stay pruned)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        parse_sparsity(self.sparsity)
        if not isinstance(self.schedule_steps, int) or self.schedule_steps <= 0:
            raise InvalidParameterError(f"{type(self).__name__}.schedule_steps must be a positive integer, "
                                        f"got {self.schedule_steps!r}")
        if self.pattern is not None and self.schedule_steps != 1:
            raise InvalidParameterError(f"{type(self).__name__}: an N:M pattern is pruned in one shot "
                                        "(schedule_steps=1)")

    @property
    def fraction(self) -> float:
        return parse_sparsity(self.sparsity)[0]

    @property
    def pattern(self) -> tuple[int, int] | None:
        return parse_sparsity(self.sparsity)[1]

    def fraction_at(self, step: int) -> float:
        """Sparsity after round ``step`` (1-based) of ``schedule_steps``: s (1 - (1 - t)^3), t = step / steps."""
        t = step / self.schedule_steps
        return self.fraction * (1 - (1 - t) ** 3)


@dataclass(frozen=True)
class MagnitudeConfig(SparsityConfig):
    """Zero the smallest weights by magnitude. No calibration text.

    Example: ``prune(model, MagnitudeConfig(sparsity=0.5, scope="global"))``."""

    method: ClassVar[str] = "magnitude"

    scope: str = "layer"
    """``layer``: each linear layer (q, k, v, o, gate, up, down apart) loses the same fraction;
    ``global``: one threshold over all of them, so layers with larger weights keep more. With an
    N:M pattern the scope is the group of M."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.scope not in ("layer", "global"):
            raise InvalidParameterError(f"MagnitudeConfig.scope must be 'layer' or 'global', got {self.scope!r}")


@dataclass(frozen=True)
class WandaConfig(SparsityConfig):
    """Zero the weights with the smallest |w_ij| x ||x_j||_2 in each output row (inputs x from
    calibration text, block by block through the already pruned blocks). No weight update.

    Example: ``prune(model, WandaConfig(sparsity="2:4"))``."""

    method: ClassVar[str] = "wanda"


@dataclass(frozen=True)
class SparseGPTConfig(SparsityConfig):
    """Choose each block of columns' mask by w^2 / [H^-1]_jj^2 and push every pruned weight's error
    onto the columns not yet pruned through the inverse Hessian H = X^T X of the layer's inputs,
    so that X W^T changes least (Frantar & Alistarh 2023). Blocks are calibrated in order.

    Example: ``prune(model, SparseGPTConfig(sparsity=0.5))``."""

    method: ClassVar[str] = "sparsegpt"

    damping: float = 0.01
    """Added to the Hessian's diagonal, as a fraction of its mean diagonal."""
    block_size: int = 128
    """Columns whose mask is chosen together (a multiple of M for an N:M pattern)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.damping < 1:
            raise InvalidParameterError(f"SparseGPTConfig.damping must be in (0, 1), got {self.damping}")
        if self.block_size <= 0 or (self.pattern and self.block_size % self.pattern[1]):
            raise InvalidParameterError(f"SparseGPTConfig.block_size must be positive (and a multiple of M for "
                                        f"N:M), got {self.block_size}")


@dataclass(frozen=True)
class StructuredConfig(PruneConfig):
    """A smaller dense model: FFN channels, whole KV groups of attention heads (and q heads within
    each group), whole layers, with the same widths in every layer (HF configs have one
    ``intermediate_size``, one head count). What each layer keeps is chosen by importance measured
    on calibration text: a channel's contribution ``mean |a_c| x ||W_down[:, c]||``, a head's
    ``mean ||o-projection of its output||``, a layer's block influence ``1 - cos(h_in, h_out)``
    (ShortGPT). With ``refit`` (the default) the o and down projections then keep not their old
    columns but the least-squares fit, on the calibration inputs, of everything the layer wrote.

    Either ``target_params`` (a fraction of the non-embedding parameters, or a count), for which a
    plan picks the shapes among candidates by calibration loss over the dimensions in ``dims``, or
    the shapes themselves (``intermediate_size``, ``num_kv_heads``, ``heads_per_group``,
    ``num_layers``; unset ones stay as they are).

    Example: ``prune(model, StructuredConfig(target_params=0.5))``."""

    method: ClassVar[str] = "structured"

    num_samples: int = 128
    """Calibration sequences. The refit's least-squares fits want many: on SmolLM2's half-size
    shape, 128 instead of 32 took held-out perplexity from 107.8 to 92.3 (4x the calibration time)."""
    target_params: float | None = None
    """Non-embedding parameters to keep: a fraction (0 < f < 1) or a count (> 1)."""
    dims: tuple[str, ...] = STRUCTURED_DIMS
    """With ``target_params``: which dimensions the plan may shrink (``heads``, ``channels``, ``layers``)."""
    intermediate_size: int | None = None
    num_kv_heads: int | None = None
    heads_per_group: int | None = None
    """q heads per KV head (GQA group) kept."""
    num_layers: int | None = None
    channel_multiple: int = 32
    """The plan's FFN widths are multiples of this (what the kernels tile well)."""
    plan_samples: int = 4
    """Calibration sequences each candidate of the plan is scored on."""
    refit: bool = True
    """Refit the o and down projections' kept columns by least squares on the calibration inputs
    (what the removed heads and channels wrote, moved onto the kept ones); False: kept as they are."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.dims, str):
            object.__setattr__(self, "dims", tuple(d.strip() for d in self.dims.split(",") if d.strip()))
        object.__setattr__(self, "dims", tuple(self.dims))
        unknown = sorted(set(self.dims) - set(STRUCTURED_DIMS))
        if unknown or not self.dims:
            raise InvalidParameterError(f"StructuredConfig.dims must name some of {', '.join(STRUCTURED_DIMS)}, "
                                        f"got {list(self.dims)}")
        shapes = (self.intermediate_size, self.num_kv_heads, self.heads_per_group, self.num_layers)
        for name, value in zip(("intermediate_size", "num_kv_heads", "heads_per_group", "num_layers"), shapes):
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise InvalidParameterError(f"StructuredConfig.{name} must be a positive integer, got {value!r}")
        given = any(v is not None for v in shapes)
        if (self.target_params is None) == (not given):
            raise InvalidParameterError("StructuredConfig takes either target_params or shapes (intermediate_size, "
                                        "num_kv_heads, heads_per_group, num_layers), "
                                        + ("not both" if given else "got neither"))
        t = self.target_params
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0
                              or not math.isfinite(t) or t == 1):
            raise InvalidParameterError(f"StructuredConfig.target_params must be a fraction in (0, 1) or a "
                                        f"parameter count > 1, got {t!r}")
        if self.channel_multiple <= 0 or self.plan_samples <= 0:
            raise InvalidParameterError("StructuredConfig.channel_multiple and plan_samples must be positive")

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "dims": list(self.dims)}


CONFIG_CLASSES: dict[str, type[PruneConfig]] = {
    cls.method: cls for cls in (MagnitudeConfig, WandaConfig, SparseGPTConfig, StructuredConfig)}


def config_from_dict(data: dict[str, Any]) -> PruneConfig:
    """The config named by ``data["method"]``, built from the other keys (unknown ones rejected)."""
    return config_by_method(CONFIG_CLASSES, data, "pruning")
