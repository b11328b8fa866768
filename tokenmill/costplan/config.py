"""What ``tokenmill cost plan`` measures and what it asks of the result.

:class:`SearchSpace` lists each axis as comma-separated values (on the command line) or a tuple
(in Python); every combination is one :class:`Candidate`. :class:`Objectives` holds the SLO and the
machine's price. The workload is the offline benchmark's (``OfflineConfig``). All three reject
unknown keys and bad values on construction, naming them.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from tokenmill.benchmark.offline import OfflineConfig
from tokenmill.benchmark.workloads import LengthDist
from tokenmill.config import Config
from tokenmill.engine.config import SPECULATIVE_METHODS
from tokenmill.errors import InvalidParameterError
from tokenmill.loading.sources import DEFAULT_MODEL
from tokenmill.options import option
from tokenmill.quantization.config import CONFIG_CLASSES

FLOAT_WEIGHTS = ("float32", "bfloat16", "float16")
"""Weights loaded in this dtype (a GGUF file dequantized to it)."""
QUANTIZED_WEIGHTS = tuple(CONFIG_CLASSES)
"""Weights quantized in-process from a float32 load by that ``tokenmill quantize`` method, computing in bfloat16."""
WEIGHTS = ("native", *FLOAT_WEIGHTS, *QUANTIZED_WEIGHTS)
SPECULATION = ("off", *SPECULATIVE_METHODS)


class PlanError(InvalidParameterError):
    """A cost plan asked for something it cannot measure or price."""


@dataclass(frozen=True)
class Candidate:
    """One configuration: which weights, loaded how, served with how many sequences and which speculation."""

    model: str
    weights: str
    max_num_seqs: int
    speculative: str
    """'off' or a speculative_method."""

    @property
    def label(self) -> str:
        """Short and unique within a plan: ``smollm2-135m-instruct int8 seqs=8 ngram``."""
        return f"{Path(self.model).name} {self.setting}"

    @property
    def setting(self) -> str:
        """The label without the model: ``int8 seqs=8 ngram``."""
        spec = "" if self.speculative == "off" else f" {self.speculative}"
        return f"{self.weights} seqs={self.max_num_seqs}{spec}"

    @property
    def speculative_method(self) -> str | None:
        return None if self.speculative == "off" else self.speculative


@dataclass(frozen=True)
class SearchSpace(Config):
    """The configurations to measure: every combination of the values of each axis."""

    title: ClassVar[str] = "configurations (comma-separated values; every combination is measured)"

    models: str | tuple[str, ...] = option(
        DEFAULT_MODEL, "models: names, GGUF files, HF or tokenmill-quantized directories, hub repo ids", short="-m")
    weights: str | tuple[str, ...] = option(
        "native", f"weights of each model: native (as stored: a GGUF file's quantized weights run natively), "
                  f"{', '.join(FLOAT_WEIGHTS)} (loaded in that dtype), {', '.join(QUANTIZED_WEIGHTS)} (quantized "
                  f"here from float32 by that `tokenmill quantize` method, bfloat16 activations)")
    max_num_seqs: str | tuple[int, ...] = option("1,8", "most sequences the engine runs at once")
    speculative: str | tuple[str, ...] = option(
        "off,ngram", f"speculative decoding: off or a method ({', '.join(SPECULATIVE_METHODS)}; the speculative "
                     f"options below apply)")
    quality_tokens: int = option(
        0, "also measure each weights setting's perplexity on the first N held-out tokens of the eval corpus "
           "(what a lossy setting costs in quality); 0 skips it")

    def __post_init__(self) -> None:
        self._set("models", _values("models", self.models, str))
        self._set("weights", _choices("weights", self.weights, WEIGHTS))
        self._set("max_num_seqs", _values("max_num_seqs", self.max_num_seqs, int))
        self._set("speculative", _choices("speculative", self.speculative, SPECULATION))
        if any(n < 1 for n in self.max_num_seqs):
            raise PlanError(f"max_num_seqs values must be >= 1, got {', '.join(map(str, self.max_num_seqs))}")
        if self.quality_tokens < 0 or self.quality_tokens == 1:
            raise PlanError(f"quality_tokens must be 0 (off) or at least 2, got {self.quality_tokens}")

    def _set(self, name: str, value: tuple) -> None:
        object.__setattr__(self, name, value)  # frozen: the parsed tuple replaces the text

    def candidates(self) -> list[Candidate]:
        """Every combination, grouped by (model, weights) so each weights setting is loaded once."""
        return [Candidate(*combo) for combo in
                itertools.product(self.models, self.weights, self.max_num_seqs, self.speculative)]


@dataclass(frozen=True)
class Objectives(Config):
    """The service-level objective a configuration must meet, and what the machine costs."""

    title: ClassVar[str] = "SLO and price"

    slo_ttft: float | None = option(None, "objective for the p90 time to first token, seconds (required)")
    slo_tpot: float | None = option(None, "objective for the p90 time per output token after the first, seconds "
                                          "(required)")
    price_per_hour: float | None = option(None, "what the machine costs per hour, in --currency (required)")
    currency: str = option("$", "the price's currency, as printed")

    def __post_init__(self) -> None:
        for name in ("slo_ttft", "slo_tpot", "price_per_hour"):
            value = getattr(self, name)
            if value is None:
                raise PlanError(f"{name} is required (--{name.replace('_', '-')})")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise PlanError(f"{name} must be a positive number, got {value!r}")
        if not self.currency:
            raise PlanError("currency must not be empty")

    def meets(self, ttft_p90_s: float, tpot_p90_s: float) -> bool:
        """Whether both p90 latencies are within their objectives."""
        return ttft_p90_s <= self.slo_ttft and tpot_p90_s <= self.slo_tpot

    def cost(self, seconds: float, count: int, per: int) -> float:
        """What ``per`` units cost when ``count`` of them took ``seconds`` of the machine."""
        return self.price_per_hour * seconds / 3600 / count * per


def check_workload(workload: OfflineConfig) -> None:
    """TPOT is the time between output tokens: every request must generate at least two."""
    if LengthDist.parse(workload.output_len).low < 2:
        raise PlanError(f"output lengths must be at least 2 tokens for a TPOT, got {workload.output_len!r}")


def _values(name: str, value, kind: type) -> tuple:
    """``"a,b"`` or a sequence -> a tuple of ``kind``; empty, malformed or repeated values refused."""
    items = [v.strip() for v in value.split(",")] if isinstance(value, str) else list(value)
    if not items or any(item == "" for item in items):
        raise PlanError(f"{name}: give one or more comma-separated values, got {value!r}")
    try:
        parsed = tuple(kind(item) for item in items)
    except (TypeError, ValueError):
        raise PlanError(f"{name}: {value!r} is not a list of {kind.__name__} values") from None
    repeated = sorted({str(v) for v in parsed if parsed.count(v) > 1})
    if repeated:
        raise PlanError(f"{name}: {', '.join(repeated)} given more than once")
    return parsed


def _choices(name: str, value, known: tuple[str, ...]) -> tuple[str, ...]:
    parsed = _values(name, value, str)
    unknown = [v for v in parsed if v not in known]
    if unknown:
        raise PlanError(f"{name}: unknown value(s) {', '.join(map(repr, unknown))}; use {', '.join(known)}")
    return parsed
