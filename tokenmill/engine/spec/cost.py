"""What a step costs and what a draft token is worth, measured while the engine runs.

:class:`CostCurve` learns seconds as a function of a size (a step's batched tokens; a draft model's
batch) from the engine's own steps: the median of the recent measurements per size bucket (exact
up to 16, then 2^(1/4) apart; a bucket counts from its second measurement), linear between
measured buckets, flat outside them. Flat above the largest measured size is optimistic on
purpose: a size never tried looks as cheap as the largest tried, so it is tried and measured
(the first steps at 64 streams with drafts tell the truth).

:class:`Acceptance` estimates the probability that a drafted token is kept, per sequence, from its
verifications: kept tokens are successes, the first refused one a failure (positions after it were
never tested), counts decayed so the estimate follows the text. A sequence without history starts
from the proposer's pooled estimate.
"""

from __future__ import annotations

import bisect
import math
import statistics

_DECAY = 0.8
"""Acceptance: weight of the history against the newest verification."""
MEDIAN_OF = 5
"""A size's cost is the median of its last this many measurements..."""
MIN_SAMPLES = 2
"""... once it has this many (a first step at a new size can pay one-off costs: a kernel's first
call at a new shape took 1.2 s where the next took 7 ms)."""


def _bucket(size: int) -> int:
    return size if size <= 16 else 16 + round(4 * math.log2(size / 16))


class CostCurve:
    def __init__(self) -> None:
        self._recent: dict[int, list[float]] = {}
        """Bucket -> its last MEDIAN_OF measurements (seconds)."""
        self._sizes: dict[int, int] = {}
        """Bucket -> the last size measured in it (where its value sits on the size axis)."""
        self._points: tuple[list[int], list[float]] | None = None
        """The curve's (sizes, seconds), sorted by size, until the next measurement: a drafting step
        asks for hundreds of values (one per candidate draft token) between two measurements."""

    def observe(self, size: int, seconds: float) -> None:
        if size <= 0 or not seconds > 0:
            return
        b = _bucket(size)
        recent = self._recent.setdefault(b, [])
        recent.append(seconds)
        del recent[:-MEDIAN_OF]
        self._sizes[b] = size
        self._points = None

    @property
    def known(self) -> bool:
        return any(len(v) >= MIN_SAMPLES for v in self._recent.values())

    def __call__(self, size: int) -> float:
        """Estimated seconds at ``size`` (0 before any measurement)."""
        if self._points is None:
            points = sorted((self._sizes[b], statistics.median(v)) for b, v in self._recent.items()
                            if len(v) >= MIN_SAMPLES)
            self._points = [x for x, _ in points], [y for _, y in points]
        xs, ys = self._points
        if not xs:
            return 0.0
        i = bisect.bisect_left(xs, size)
        if i < len(xs) and xs[i] == size:
            return ys[i]
        if i == 0:
            return ys[0]
        if i == len(xs):
            return ys[-1]
        x0, y0, x1, y1 = xs[i - 1], ys[i - 1], xs[i], ys[i]
        return y0 + (y1 - y0) * (size - x0) / (x1 - x0)


class Acceptance:
    def __init__(self, prior: float = 0.6) -> None:
        self._pooled = [2 * prior, 2 * (1 - prior)]  # (kept, refused): a prior worth two verifications
        self._per_seq: dict[str, list[float]] = {}

    def rate(self, seq_id: str) -> float:
        kept, refused = self._per_seq.get(seq_id, self._pooled)
        return kept / (kept + refused) if kept + refused > 0 else 0.0

    def observe(self, seq_id: str, num_drafted: int, num_kept: int) -> None:
        refused = 1.0 if num_kept < num_drafted else 0.0
        for counts in (self._per_seq.setdefault(seq_id, list(self._pooled)), self._pooled):
            counts[0] = _DECAY * counts[0] + num_kept
            counts[1] = _DECAY * counts[1] + refused

    def relax(self, seq_id: str) -> None:
        """A step without a draft for the sequence: its estimate moves a little toward the pooled one
        (about halfway in 7 steps), so one bad stretch does not keep it from drafting for good."""
        counts, total = self._per_seq.get(seq_id), sum(self._pooled)
        if counts is not None and total > 0:
            scale = sum(counts) / total  # the pooled proportions at this sequence's weight of evidence
            counts[:] = [0.9 * mine + 0.1 * pooled * scale for mine, pooled in zip(counts, self._pooled)]

    def forget(self, seq_id: str) -> None:
        self._per_seq.pop(seq_id, None)
