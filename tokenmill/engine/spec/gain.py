"""Whether drafting pays at the current batch size, measured rather than predicted.

The draft-length model (drafter.py, cost.py) prices draft tokens from a cost curve; a price can be
wrong (a size never measured looks as cheap as the largest one measured, steps are noisy, the
proposer's own time is outside the curve), and under load a wrong price makes speculation slower
than plain decoding. :class:`RealisedGain` is the check on it, by batch size:

- **plain steps** run without the proposer (nothing drafted, nothing looked up) and measure what
  a decode step over ``n`` decoding sequences costs: :class:`PlainCost`, the median of the recent
  plain steps within 1/8 of ``n``;
- **drafting steps** (the proposer ran; some sequences may have got no draft) each give a realised
  gain: the tokens they produced per decoding sequence, times the plain step's cost at the same
  ``n`` over the drafting step's own time (proposer, forward pass, verification). A gain of 1 is
  what plain decoding would have done in the same time;
- per batch bucket (1, 2-3, 4-7, ...), the gain of the recent drafting steps together (sums,
  with exponential forgetting, of what they produced, in plain-step seconds, and of what they took:
  a ratio of sums, since a step that keeps its whole draft pays for several that keep nothing)
  decides the mode: drafting while it is at least 1, plain steps otherwise. A step over ``n``
  sequences is ``n`` samples of what a draft brings: the sums forget ``1/MEMORY`` of themselves per
  sequence (at most ``_EMA`` a step), so at batch 1 one draft refused outright does not outweigh
  the dozen kept before it, and at 64 streams four steps turn the verdict;
- a verdict against drafting is confirmed before it holds: the plain cost near ``n`` is measured
  afresh (``PLAIN_MEDIAN_OF`` plain steps, forgetting the older ones, which may come from a faster
  or slower moment of a noisy host), then a probe of ``PROBE_STEPS`` drafting steps, whose samples
  alone are the new verdict. While drafting loses, a probe comes after ``PROBE_EVERY`` plain steps,
  so that a change (another workload, a smaller batch) is seen again; each probe that finds
  drafting losing by more than ``1 - DOUBLE_BELOW`` doubles the wait, up to ``PROBE_EVERY_MAX``
  (near 1 a probe costs little). In a probe every drafting sequence drafts at least one token,
  whatever the draft-length model says: its acceptance estimates do not move while nothing is
  drafted, and a probe that verifies nothing leaves the verdict as it was. (Both happened together:
  Gemma's shortlist draft at batch 1 keeps 96% of its tokens, but one draft refused outright pulled
  a four-step average under 1, the draft-length model, its estimate lowered by the same refusal,
  drafted nothing in the probes, and the run went plain for most of a round.)
- a step's time counts at most ``CLIP`` times what its rows would cost at the plain step's price
  per row: a first step at a new shape can pay one-off costs.

A drafting bucket still runs a plain step every ``REFRESH_EVERY`` of its steps, and whenever no
plain step has been measured near the current ``n``, so the gain is always against a recent plain
cost (the batch shrinks as sequences finish). The price of measuring: at most one step in
``REFRESH_EVERY`` undrafted where drafting wins; where it loses, ``PROBE_STEPS`` drafted in
``PROBE_EVERY`` at first, in ``PROBE_EVERY_MAX`` once it has lost by a margin for a while.
"""

from __future__ import annotations

import statistics

REFRESH_EVERY = 32
"""Steps of a drafting bucket between two plain steps."""
PROBE_EVERY = 24
"""Plain steps of a losing bucket before its next probe..."""
PROBE_STEPS = 4
"""... of this many drafting steps; each probe that ends losing by more than ``1 - DOUBLE_BELOW``
doubles the wait, up to..."""
DOUBLE_BELOW = 0.9
PROBE_EVERY_MAX = 384
"""... this many steps (back to PROBE_EVERY once the bucket wins)."""
CLIP = 1.5
"""A drafting step's time counts as at most this times (n + verified) / n plain steps."""
PLAIN_MEDIAN_OF = 3
"""A plain cost is the median of this many recent plain steps near the size..."""
PLAIN_MIN_SAMPLES = 2
"""... once there are this many (a first step at a new size can pay one-off costs)."""
MEMORY = 16
"""A bucket's sums forget 1/MEMORY of themselves per decoding sequence of a new drafting step..."""
_EMA = 0.25
"""... and at most this much a step."""


def batch_bucket(n: int) -> int:
    return n.bit_length()  # 1, 2-3, 4-7, 8-15, ...


class PlainCost:
    """Seconds of a plain decode-only step by its number of decoding sequences."""

    def __init__(self) -> None:
        self._recent: dict[int, list[float]] = {}

    def observe(self, n: int, seconds: float) -> None:
        if n > 0 and seconds > 0:
            recent = self._recent.setdefault(n, [])
            recent.append(seconds)
            del recent[:-PLAIN_MEDIAN_OF]

    def forget(self, n: int) -> None:
        """Drop the plain steps measured near ``n``: the next ones are measured afresh."""
        for m in [m for m in self._recent if abs(m - n) <= max(1, n // 8)]:
            del self._recent[m]

    def __call__(self, n: int) -> float | None:
        """The recent plain steps at the measured size nearest ``n`` (within n / 8, at least 1), or
        None where there are fewer than PLAIN_MIN_SAMPLES."""
        near = [m for m in self._recent if abs(m - n) <= max(1, n // 8)]
        if not near:
            return None
        nearest = min(near, key=lambda m: (abs(m - n), -m))
        recent = self._recent[nearest]
        if len(recent) < PLAIN_MIN_SAMPLES:
            return None
        # scaled down in proportion (a step's cost grows at most so), never up: both err on plain's side
        return statistics.median(recent) * min(n, nearest) / nearest


class RealisedGain:
    """Per decoding-batch bucket: the realised gain of drafting, and whether the next step drafts."""

    def __init__(self) -> None:
        self.plain = PlainCost()
        self._worth: dict[int, list[float]] = {}
        """Bucket -> sums, with forgetting, of its drafting steps' [produced tokens per sequence times the
        plain step's seconds, seconds taken]."""
        self._fresh: set[int] = set()
        """Buckets whose next sample replaces their sums (a probe under way: its samples alone decide)."""
        self._since: dict[int, int] = {}
        """Bucket -> steps since its last plain step (winning) or its last probe (losing)."""
        self._probe: dict[int, int] = {}
        """Bucket -> drafting steps left in the probe under way (losing)."""
        self._wait: dict[int, int] = {}
        """Bucket -> plain steps before its next probe (losing)."""
        self._lookups: dict[int, float] = {}
        """Bucket -> proposer seconds of its drafting steps that found nothing to verify, charged to the
        next one that did."""

    def drafts(self, n: int) -> bool:
        """Whether a step with ``n`` decoding sequences runs the proposer (else: a plain step)."""
        if n <= 0 or self.plain(n) is None:
            return False  # measure what drafting is compared with first
        b = batch_bucket(n)
        if self.gain(n) >= 1.0:
            return self._since.get(b, 0) < REFRESH_EVERY
        return self._probe.get(b, 0) > 0 or self._since.get(b, 0) >= self._wait.get(b, PROBE_EVERY)

    def probing(self, n: int) -> bool:
        """Whether a drafting step with ``n`` decoding sequences is a probe of a losing bucket (every
        sequence that can should draft: a probe that verifies nothing tells nothing)."""
        return n > 0 and self.gain(n) < 1.0

    def gain(self, n: int) -> float:
        """The bucket's realised gain so far (1.0 before any drafting step there: try it)."""
        worth, seconds = self._worth.get(batch_bucket(n), (1.0, 1.0))
        return worth / seconds

    def observe(self, n: int, drafted: bool, produced: int, seconds: float, verified: int = 0,
                proposer_seconds: float = 0.0) -> None:
        """A decode-only step over ``n`` sequences: whether the proposer ran, the tokens produced,
        its whole time (proposer included), how many drafted tokens it verified, and the proposer's
        part of its time. A drafting step with nothing to verify (the proposer found nothing) was a
        plain step plus its lookups: it is no sample of what drafting is worth (its time against the
        plain median is noise, and a run of them, as an answer's opening that matches nothing, would
        pull the recent average under 1 and turn drafting off), but its lookups' time is added to the
        next sample of the bucket (at 64 streams lookups cost), or, once it adds up to a plain step,
        is a sample of its own that produced nothing (a workload where lookups never find anything)."""
        if n <= 0 or not seconds > 0:
            return
        b = batch_bucket(n)
        losing = self.gain(n) < 1.0
        if not drafted:
            self.plain.observe(n, seconds)
            self._since[b] = self._since.get(b, 0) + 1 if losing else 0
            return
        if losing:
            if self._probe.get(b, 0) == 0:  # a probe starts: its samples alone decide
                self._probe[b] = PROBE_STEPS
                self._fresh.add(b)
            self._probe[b] -= 1
            self._since[b] = 0
        else:
            self._probe[b] = 0
            self._since[b] = self._since.get(b, 0) + 1
        plain = self.plain(n)
        sample = None
        if not verified:
            if not losing:
                self._lookups[b] = self._lookups.get(b, 0.0) + proposer_seconds
                if plain is not None and self._lookups[b] >= plain:  # a whole step's worth of lookups for nothing
                    sample = (0.0, self._lookups.pop(b))
        elif plain is not None and produced > 0:
            sample = (produced / n * plain,
                      min(seconds, CLIP * plain * (n + verified) / n) + self._lookups.pop(b, 0.0))
        if sample is not None:
            old = self._worth.get(b)
            if old is None or b in self._fresh:
                self._fresh.discard(b)
                self._worth[b] = list(sample)
            else:
                keep = max(1 - _EMA, (1 - 1 / MEMORY) ** n)
                self._worth[b] = [keep * o + x for o, x in zip(old, sample)]
        gain = self.gain(n)
        if gain >= 1.0:
            self._wait[b] = PROBE_EVERY
        elif not losing:  # drafting has just turned losing: confirm against fresh plain steps, then a probe
            self.plain.forget(n)
            self._since[b], self._wait[b] = 0, PLAIN_MEDIAN_OF
        elif self._probe[b] == 0:  # a probe ended, drafting still loses
            self._fresh.discard(b)
            wait = self._wait.get(b, PROBE_EVERY)
            self._wait[b] = min(2 * max(wait, PROBE_EVERY), PROBE_EVERY_MAX) if gain < DOUBLE_BELOW else PROBE_EVERY
