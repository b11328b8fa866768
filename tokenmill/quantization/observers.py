"""Calibration observers: watch a stream of tensors, then give INT8 quantization parameters.

Every observer maps the values it saw to ``(scale, zero_point)`` for the grid
``q = clamp(round(x / scale) + zero_point)``, ``x ~ (q - zero_point) * scale``:

    symmetric   q in -127..127, zero_point = 0, scale = range / 127
    asymmetric  q in -128..127, scale = (hi - lo) / 255, zero_point = round(-128 - lo / scale);
                [lo, hi] is widened to hold 0, so that zero is exactly representable

``axis=None`` gives one pair for the whole tensor (shape ``[]``); ``axis=d`` one pair per index
of dimension ``d`` (shape ``[size of d]``): per output channel for a weight ``[N, K]`` with
``axis=0``, per input channel for activations ``[..., K]`` with ``axis=-1``.

    MinMaxObserver      the range seen: no clipping, outliers stretch the grid
    PercentileObserver  the ``percentile``-th percentile of the values (of |x| when symmetric)
    MSEObserver         the clipping of the min-max range, among ``num_ratios`` ratios down to
                        ``min_ratio``, that minimizes the mean squared quantization error

Percentile and MSE need the values themselves: they keep a uniform random sample of at most
``max_samples`` of them (rows, when per channel), each update contributing in proportion to
its size.
"""

from __future__ import annotations

import torch

QMIN_SYMMETRIC, QMAX = -127, 127
QMIN_ASYMMETRIC = -128


def qparams_from_range(lo: torch.Tensor, hi: torch.Tensor, symmetric: bool,
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipping range [lo, hi] (float, any shape) -> (float32 scale, int32 zero_point), same shape."""
    lo, hi = lo.float().clamp(max=0.0), hi.float().clamp(min=0.0)
    if symmetric:
        scale = (torch.maximum(-lo, hi) / QMAX).clamp(min=1e-10)
        return scale, torch.zeros_like(scale, dtype=torch.int32)
    scale = ((hi - lo) / (QMAX - QMIN_ASYMMETRIC)).clamp(min=1e-10)
    zero = torch.round(QMIN_ASYMMETRIC - lo / scale).clamp(QMIN_ASYMMETRIC, QMAX).to(torch.int32)
    return scale, zero


def quantize_int8(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor,
                  symmetric: bool) -> torch.Tensor:
    """x (float) -> int8 on the grid of (scale, zero_point), which broadcast against x."""
    qmin = QMIN_SYMMETRIC if symmetric else QMIN_ASYMMETRIC
    q = torch.round(x.float() / scale) + zero_point
    return q.clamp_(qmin, QMAX).to(torch.int8)


def fake_quantize(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, symmetric: bool) -> torch.Tensor:
    """x rounded to the grid and back, in float32: for calibration and error analysis only."""
    return (quantize_int8(x, scale, zero_point, symmetric).float() - zero_point) * scale


class Observer:
    """Base: ``update(x)`` any number of times, then ``qparams()``."""

    def __init__(self, symmetric: bool = True, axis: int | None = None) -> None:
        self.symmetric, self.axis = symmetric, axis
        self.lo: torch.Tensor | None = None
        self.hi: torch.Tensor | None = None

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """x as float32 [rows, channels]; one channel when per tensor."""
        if self.axis is None:
            return x.detach().reshape(-1, 1).float()
        return x.detach().movedim(self.axis, -1).reshape(-1, x.shape[self.axis]).float()

    @torch.no_grad()
    def update(self, x: torch.Tensor) -> None:
        r = self.rows(x)
        lo, hi = r.amin(dim=0), r.amax(dim=0)
        self.lo = lo if self.lo is None else torch.minimum(self.lo, lo)
        self.hi = hi if self.hi is None else torch.maximum(self.hi, hi)

    def clip_range(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[lo, hi] per channel, [C] each."""
        return self.lo, self.hi

    def qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.lo is None:
            raise RuntimeError(f"{type(self).__name__}.qparams() before any update()")
        scale, zero = qparams_from_range(*self.clip_range(), self.symmetric)
        return (scale[0], zero[0]) if self.axis is None else (scale, zero)


class MinMaxObserver(Observer):
    """The whole range seen."""


class SampleObserver(Observer):
    """An observer that also keeps a uniform random sample of rows (at most ``max_samples`` values)."""

    def __init__(self, symmetric: bool = True, axis: int | None = None, max_samples: int = 1 << 20,
                 seed: int = 0) -> None:
        super().__init__(symmetric, axis)
        self.max_samples = max_samples
        self.sample: torch.Tensor | None = None
        self.seen = 0
        self.generator = torch.Generator().manual_seed(seed)

    def _pick(self, r: torch.Tensor, n: int) -> torch.Tensor:
        if n >= r.shape[0]:
            return r
        index = torch.randperm(r.shape[0], generator=self.generator)[:n].to(r.device)
        return r[index]

    @torch.no_grad()
    def update(self, x: torch.Tensor) -> None:
        super().update(x)
        r = self.rows(x)
        cap = max(1, self.max_samples // r.shape[1])
        total = self.seen + r.shape[0]
        if self.sample is None:
            self.sample = self._pick(r, cap)
        else:  # keep each part in proportion to the rows it stands for
            keep_old = min(self.sample.shape[0], round(cap * self.seen / total))
            self.sample = torch.cat([self._pick(self.sample, keep_old), self._pick(r, cap - keep_old)])
        self.seen = total


class PercentileObserver(SampleObserver):
    """Clip at the ``percentile``-th percentile (and the ``100 - percentile``-th below, when asymmetric)."""

    def __init__(self, percentile: float = 99.99, symmetric: bool = True, axis: int | None = None,
                 max_samples: int = 1 << 20, seed: int = 0) -> None:
        super().__init__(symmetric, axis, max_samples, seed)
        if not 50.0 < percentile <= 100.0:
            raise ValueError(f"percentile must be in (50, 100], got {percentile}")
        self.percentile = percentile

    def _quantile(self, values: torch.Tensor, fraction: float) -> torch.Tensor:
        k = min(values.shape[0], max(1, round(fraction * values.shape[0])))
        return values.kthvalue(k, dim=0).values

    def clip_range(self) -> tuple[torch.Tensor, torch.Tensor]:
        p = self.percentile / 100.0
        if self.symmetric:
            bound = self._quantile(self.sample.abs(), p)
            return -bound, bound
        return self._quantile(self.sample, 1.0 - p), self._quantile(self.sample, p)


class MSEObserver(SampleObserver):
    """The min-max range shrunk by the ratio in [``min_ratio``, 1] minimizing the MSE of fake
    quantization on the sample, per channel."""

    def __init__(self, symmetric: bool = True, axis: int | None = None, num_ratios: int = 50,
                 min_ratio: float = 0.2, max_samples: int = 1 << 20, seed: int = 0) -> None:
        super().__init__(symmetric, axis, max_samples, seed)
        self.ratios = torch.linspace(min_ratio, 1.0, num_ratios).tolist()

    def clip_range(self) -> tuple[torch.Tensor, torch.Tensor]:
        best_err = best_lo = best_hi = None
        for ratio in self.ratios:
            lo, hi = self.lo * ratio, self.hi * ratio
            scale, zero = qparams_from_range(lo, hi, self.symmetric)
            err = (fake_quantize(self.sample, scale, zero, self.symmetric) - self.sample).pow(2).mean(dim=0)
            if best_err is None:
                best_err, best_lo, best_hi = err, lo, hi
            else:
                better = err < best_err
                best_err = torch.where(better, err, best_err)
                best_lo, best_hi = torch.where(better, lo, best_lo), torch.where(better, hi, best_hi)
        return best_lo, best_hi


OBSERVERS = {"minmax": MinMaxObserver, "percentile": PercentileObserver, "mse": MSEObserver}


def make_observer(name: str, symmetric: bool, axis: int | None = None, percentile: float = 99.99) -> Observer:
    """The observer called ``name`` in configs and on the command line."""
    if name == "percentile":
        return PercentileObserver(percentile, symmetric, axis)
    return OBSERVERS[name](symmetric=symmetric, axis=axis)
