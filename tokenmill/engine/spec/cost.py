"""What a step costs and what a draft token is worth, measured while the engine runs.

:class:`CostCurve` learns seconds as a function of a size (a step's batched tokens; a draft model's
batch) from the engine's own steps: the median of the recent measurements per size bucket (exact
up to 16, then 2^(1/4) apart; a bucket counts from its second measurement), linear between
measured buckets, flat outside them. Flat above the largest measured size is optimistic on
purpose: a size never tried looks as cheap as the largest tried, so it is tried and measured
(the first steps at 64 streams with drafts tell the truth). ``grows=True`` extrapolates in
proportion to the size instead, for costs that are known to grow so (a draft that is the model
itself: its passes cost what the model's layers cost at that batch), and the probes measure them.

:class:`Acceptance` estimates, per sequence, the probability that a draft position is kept, from
its verifications, in two rates: the first drafted token's, and the next ones' once the token
before was kept (positions after the first refused one were never tested). A draft's position j
(0-based) is then worth ``first * next**j`` expected tokens. One rate for every position undervalues long drafts
where outcomes come all or nothing: a prompt lookup is either in a copied run (every token kept) or
wrong from its first token, so SmolLM2's copy answers keep the first token 84% of the time and
each next one, given the last, 94-96%; at one rate (0.7 or so) a fourth token looked worth 0.24
where it was worth 0.7. Counts decay so the estimates follow the text; a sequence without history
starts from the proposer's pooled estimates.
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
    def __init__(self, grows: bool = False) -> None:
        self.grows = grows
        """Above the largest measured size: in proportion to the size (else flat)."""
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
            return ys[-1] * size / xs[-1] if self.grows else ys[-1]
        x0, y0, x1, y1 = xs[i - 1], ys[i - 1], xs[i], ys[i]
        return y0 + (y1 - y0) * (size - x0) / (x1 - x0)


class Acceptance:
    def __init__(self, prior: float = 0.6) -> None:
        # (kept, refused) of the first drafted token, then of the next ones given the one before:
        # each a prior worth two verifications
        self._pooled = [2 * prior, 2 * (1 - prior), 2 * prior, 2 * (1 - prior)]
        self._per_seq: dict[str, list[float]] = {}

    def rates(self, seq_id: str) -> tuple[float, float]:
        """(the first drafted token's rate, the next ones' rate given the token before was kept)."""
        c = self._per_seq.get(seq_id, self._pooled)
        return _rate(c[0], c[1]), _rate(c[2], c[3])

    def observe(self, seq_id: str, num_drafted: int, num_kept: int) -> None:
        if num_drafted <= 0:
            return
        first = (1.0, 0.0) if num_kept else (0.0, 1.0)
        # positions 1 .. num_kept tested after a kept one: all kept but the first refused, if any
        nxt = (float(max(num_kept - 1, 0)), 1.0 if 0 < num_kept < num_drafted else 0.0)
        for counts in (self._per_seq.setdefault(seq_id, list(self._pooled)), self._pooled):
            counts[0] = _DECAY * counts[0] + first[0]
            counts[1] = _DECAY * counts[1] + first[1]
            if nxt[0] or nxt[1]:
                counts[2] = _DECAY * counts[2] + nxt[0]
                counts[3] = _DECAY * counts[3] + nxt[1]

    def relax(self, seq_id: str) -> None:
        """A step without a draft for the sequence: its estimates move a little toward the pooled ones
        (about halfway in 7 steps), so one bad stretch does not keep it from drafting for good."""
        counts = self._per_seq.get(seq_id)
        if counts is None:
            return
        for at in (0, 2):
            mine, pooled = counts[at:at + 2], self._pooled[at:at + 2]
            total = sum(pooled)
            if total > 0:
                scale = sum(mine) / total  # the pooled proportions at this sequence's weight of evidence
                counts[at:at + 2] = [0.9 * m + 0.1 * p * scale for m, p in zip(mine, pooled)]

    def forget(self, seq_id: str) -> None:
        self._per_seq.pop(seq_id, None)


def _rate(kept: float, refused: float) -> float:
    return kept / (kept + refused) if kept + refused > 0 else 0.0
