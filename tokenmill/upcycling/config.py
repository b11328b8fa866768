"""What ``tokenmill upcycle`` builds and how it trains it: :class:`UpcycleConfig`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from tokenmill.config import reject_unknown_keys
from tokenmill.distillation.config import DistillConfig
from tokenmill.errors import InvalidParameterError

INITS = ("copy", "partition")


@dataclass(frozen=True)
class UpcycleConfig:
    """A dense model -> an MoE model of ``experts`` experts, ``top_k`` per token.

    ``init="copy"`` (Komatsuzaki et al. 2023): every expert a copy of the dense MLP plus Gaussian
    noise of ``noise`` times each weight's own standard deviation; with renormalised top-k weights
    the upcycled model starts as the dense model (exactly, at noise 0). ``init="partition"``
    (MoEfication): the MLP's inner channels split into ``experts`` equal parts, one per expert: the
    model holds the dense parameters once, and a token runs top_k / experts of them.

    The router is new (small random weights). Training distils the dense model into the upcycled
    one (``distill``: the distillation package's config: steps, lr, data, loss weights) plus
    ``balance_weight`` times the Switch Transformer load-balancing loss (1.0 when every expert
    gets an equal share), so that routing spreads out instead of eight copies doing one job.
    """

    experts: int = 8
    top_k: int = 2
    init: str = "copy"
    noise: float = 0.01
    """copy: noise standard deviation, relative to each weight matrix's own."""
    balance_weight: float = 0.01
    """Weight of the load-balancing loss (Switch Transformer's alpha; Mixtral trains with 0.02)."""
    router_std: float = 0.02
    """Standard deviation of the new routers' weights."""
    baseline: bool = True
    """Also train a copy of the dense model on the same tokens with the same loss (no experts), to
    judge the upcycled model against."""
    distill: DistillConfig = field(default_factory=lambda: DistillConfig(ce_weight=0.5))
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.distill, dict):
            object.__setattr__(self, "distill", DistillConfig.from_dict(self.distill))
        if not 1 <= self.top_k <= self.experts or self.experts < 2:
            raise InvalidParameterError(f"upcycle: need experts >= 2 and 1 <= top_k <= experts; got experts "
                                        f"{self.experts}, top_k {self.top_k}")
        if self.init not in INITS:
            raise InvalidParameterError(f"upcycle: init must be one of {', '.join(INITS)}, got {self.init!r}")
        if self.noise < 0 or self.balance_weight < 0 or not self.router_std > 0:
            raise InvalidParameterError("upcycle: noise and balance_weight must be >= 0, router_std > 0")
        if self.distill.qat is not None:
            raise InvalidParameterError("upcycle: quantization-aware training is not supported; quantize the "
                                        "upcycled model afterwards (tokenmill quantize)")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> UpcycleConfig:
        reject_unknown_keys(cls, data)
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "distill"}
        return {**out, "distill": self.distill.to_dict()}
