"""When requests arrive: a seeded gamma process at a request rate, or as fast as allowed.

Inter-arrival gaps are gamma distributed with shape ``burstiness`` and mean ``1 / rate``:
burstiness 1 is a Poisson process (exponential gaps), below 1 burstier (coefficient of variation
``1 / sqrt(burstiness)``), above 1 steadier. An infinite rate sends everything at once; a fixed
concurrency is a cap on requests in flight that the runner applies on top of either.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from tokenmill.errors import InvalidParameterError


@dataclass(frozen=True)
class ArrivalProcess:
    rate: float = math.inf
    """Requests per second on average; inf sends all requests at once."""
    burstiness: float = 1.0
    """Gamma shape: 1 = Poisson."""
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise InvalidParameterError(f"request rate must be positive (or inf), got {self.rate}")
        if not self.burstiness > 0:
            raise InvalidParameterError(f"burstiness must be positive, got {self.burstiness}")

    def gaps(self) -> Iterator[float]:
        """Seconds between successive arrivals, forever."""
        if math.isinf(self.rate):
            while True:
                yield 0.0
        rng = np.random.default_rng(self.seed)
        scale = 1.0 / (self.rate * self.burstiness)
        while True:
            yield from rng.gamma(self.burstiness, scale, size=256).tolist()

    def offsets(self, n: int) -> np.ndarray:
        """Arrival times of the first ``n`` requests, seconds after the first (which is at 0)."""
        gaps = self.gaps()
        return np.cumsum([0.0] + [next(gaps) for _ in range(n - 1)])[:n]
