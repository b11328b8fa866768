"""The batched sampler: one token per row of logits, each row with its own SamplingParams.

Per row, in vLLM's order::

    raw logits ──► logprobs (log_softmax of the raw logits, when asked)
        │
        ▼
    repetition penalty ─► frequency / presence penalties ─► min_tokens mask on stop ids
        │
        ├── greedy row: argmax (lowest id on ties)
        └── random row: temperature ─► top-k ─► top-p ─► min-p ─► draw (one uniform per row)

A seeded row's uniform is a hash of (seed, output position, stream): the token at position i
depends on the seed and that position's logits only, not on the batch, the steps before or how
many rows a step verified (speculative decoding samples several positions of a sequence at once
and throws some away). :meth:`Sampler.scores` gives the processed rows themselves (the
distributions a draw samples), for the speculative verifier (spec/verify.py).

Work nobody in the batch needs is skipped: no copy or penalty pass without penalties,
no top-k/top-p pass without those filters, no logprobs without a request for them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TypedDict

import torch

from tokenmill.engine.logits_processors import apply_min_p, apply_penalties, apply_top_k_top_p, sample
from tokenmill.kernels import dispatch
from tokenmill.sampling_params import SamplingParams


_PROMPT_LOGPROB_CHUNK = 1 << 24
"""compute_prompt_logprobs works on at most this many logits elements at a time (64 MiB float32)."""


@dataclass
class SamplingState:
    """One sequence being sampled; the engine keeps it on the request and appends each sampled token.

    With ``params.seed`` a random row's uniform is :func:`seeded_uniform` of (seed, the position it
    samples), so its tokens depend only on (seed, logits), not on the batch it shares, on other
    requests or on speculative decoding. Greedy rows draw nothing.
    """

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    stop_ids: frozenset[int] = frozenset()
    """EOS and stop token ids: masked while fewer than ``params.min_tokens`` tokens are generated."""

    @classmethod
    def create(cls, params: SamplingParams, prompt_token_ids: Iterable[int],
               eos_token_ids: Iterable[int] = ()) -> SamplingState:
        """A fresh state; stop_ids are params.stop_token_ids plus the EOS ids unless params.ignore_eos."""
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        return cls(params, list(prompt_token_ids), [], frozenset(stop_ids))

    def after(self, draft: list[int]) -> SamplingState:
        """This state as it will be once ``draft`` is appended: what the row sampling the token after
        ``draft`` sees (penalty counts, min_tokens, the seeded position). ``draft`` empty: self."""
        if not draft:
            return self
        return SamplingState(self.params, self.prompt_token_ids, self.output_token_ids + draft, self.stop_ids)

    @property
    def greedy(self) -> bool:
        return self.params.greedy

    @property
    def has_penalties(self) -> bool:
        p = self.params
        return p.repetition_penalty != 1 or p.frequency_penalty != 0 or p.presence_penalty != 0

    @property
    def blocks_stop(self) -> bool:
        """Whether stop ids must be masked this step (min_tokens not reached yet)."""
        return bool(self.stop_ids) and len(self.output_token_ids) < self.params.min_tokens


@dataclass(slots=True)
class SampleResult:
    """The sampled token of one row, with logprobs of the raw model distribution when asked."""

    token_id: int
    logprob: float | None = None
    """Logprob of token_id; None unless params.logprobs is set."""
    top_logprobs: list[tuple[int, float]] | None = None
    """The params.logprobs best (id, logprob) pairs, best first; None unless params.logprobs is set."""


class Sampler:
    """Samples a batch of rows in one call; unseeded rows share this sampler's generator."""

    def __init__(self, vocab_size: int, seed: int | None = None) -> None:
        self.vocab_size = vocab_size
        self.generator = torch.Generator()
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, states: Sequence[SamplingState]) -> list[SampleResult]:
        """``logits``: ``[B, >= vocab_size]`` of any float dtype and device; columns past vocab_size are padding."""
        raw = self._raw(logits, states)
        token_ids = self._choose(self._penalized(raw, states), states)
        return _results(raw, token_ids, states)

    def _raw(self, logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
        if logits.dim() != 2 or logits.shape[0] != len(states) or logits.shape[1] < self.vocab_size:
            raise ValueError(f"logits of shape {tuple(logits.shape)} do not match {len(states)} rows "
                             f"of vocab_size {self.vocab_size}")
        return logits[:, :self.vocab_size].float()

    def scores(self, logits: torch.Tensor, states: Sequence[SamplingState]) -> tuple[torch.Tensor, torch.Tensor]:
        """(raw float32 logits, processed scores): per row what the sampler draws from. A greedy row's
        scores are its penalized logits (argmax picks the token); a random row's the logits after
        temperature, top-k, top-p and min-p, whose softmax is the distribution it samples."""
        raw = self._raw(logits, states)
        scores = self._penalized(raw, states)
        random = [i for i, s in enumerate(states) if not s.greedy]
        if random:
            filtered = self._filtered(take_rows(scores, random), [states[i] for i in random])
            scores = filtered if len(random) == len(states) else \
                _put_rows(scores.clone() if scores is raw else scores, random, filtered)
        return raw, scores

    def results(self, raw: torch.Tensor, token_ids: list[int], states: Sequence[SamplingState],
                rows: list[int] | None = None) -> list[SampleResult]:
        """SampleResults of chosen tokens, with the logprobs the rows asked for (of ``raw``; result i of
        ``raw``'s row ``rows[i]``, without a copy of those rows: a verification's logits are many)."""
        return _results(raw, token_ids, states, rows)

    def uniforms(self, states: Sequence[SamplingState], stream: int = 0) -> list[float]:
        """One uniform in [0, 1) per row: seeded rows from (seed, position, ``stream``), the others
        from this sampler's generator."""
        unseeded = sum(s.params.seed is None for s in states)
        shared = iter(torch.rand(unseeded, generator=self.generator, dtype=torch.float64).tolist())
        return [next(shared) if s.params.seed is None else
                seeded_uniform(s.params.seed, len(s.output_token_ids), stream) for s in states]

    def _penalized(self, raw: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
        """Raw logits after penalties and the min_tokens mask; ``raw`` itself when no row needs them."""
        penalized = [i for i, s in enumerate(states) if s.has_penalties]
        blocking = [i for i, s in enumerate(states) if s.blocks_stop]
        if not penalized and not blocking:
            return raw
        scores = raw.clone()
        if penalized:
            _penalize_rows(scores, penalized, states)
        for i in blocking:
            ids = [t for t in states[i].stop_ids if t < self.vocab_size]
            scores[i, ids] = -math.inf
        return scores

    def _choose(self, scores: torch.Tensor, states: Sequence[SamplingState]) -> list[int]:
        greedy = [i for i, s in enumerate(states) if s.greedy]
        if len(greedy) == len(states):
            return argmax_rows(scores).tolist()
        random = [i for i, s in enumerate(states) if not s.greedy]
        sampled = self._sample(take_rows(scores, random), [states[i] for i in random])
        if not greedy:
            return sampled.tolist()
        token_ids = torch.empty(len(states), dtype=torch.long, device=scores.device)
        token_ids[greedy] = argmax_rows(take_rows(scores, greedy))
        token_ids[random] = sampled
        return token_ids.tolist()

    def _sample(self, scores: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p, draw; ``scores`` is not modified."""
        return sample(self._filtered(scores, states),
                      torch.tensor(self.uniforms(states), dtype=torch.float32, device=scores.device))

    def _filtered(self, scores: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p: a new tensor; ``scores`` is not modified."""
        device, vocab_size = scores.device, scores.shape[1]
        params = [s.params for s in states]
        scores = scores / torch.tensor([p.temperature for p in params], device=device).unsqueeze(1)
        top_k = [min(p.top_k or vocab_size, vocab_size) for p in params]
        top_p = [p.top_p for p in params]
        filtered = [i for i in range(len(params)) if top_k[i] < vocab_size or top_p[i] < 1]
        if filtered:
            kept = apply_top_k_top_p(take_rows(scores, filtered),
                                     torch.tensor([top_k[i] for i in filtered], device=device),
                                     torch.tensor([top_p[i] for i in filtered], device=device))
            scores = _put_rows(scores, filtered, kept)
        if any(p.min_p > 0 for p in params):
            apply_min_p(scores, torch.tensor([p.min_p for p in params], device=device))
        return scores


_MASK64 = (1 << 64) - 1


def seeded_uniform(seed: int, position: int, stream: int = 0) -> float:
    """A uniform in [0, 1) fixed by (seed, position, stream): splitmix64 of their mix, 53 bits.

    Counter-based, so any position's draw is known without drawing the ones before it (what lets a
    seeded sample be the same with and without speculative decoding)."""
    x = (seed * 0x9E3779B97F4A7C15 + position * 0xD1B54A32D192ED03 + stream * 0x8CB92BA72F3D8DD7) & _MASK64
    for _ in range(2):
        x = (x + 0x9E3779B97F4A7C15) & _MASK64
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
        x ^= x >> 31
    return (x >> 11) * (1.0 / (1 << 53))


def argmax_rows(scores: torch.Tensor) -> torch.Tensor:
    """``scores.argmax(-1)``: for float32 CPU logits by the C++ kernel (torch.argmax took 0.3-0.5 ms
    a row of 49k logits on our 2-core hosts), else by PyTorch. The same index either way."""
    ops = dispatch.for_tensors(scores) if scores.dtype == torch.float32 and scores.dim() == 2 else None
    return ops.argmax_rows(scores) if ops is not None else scores.argmax(-1)


def take_rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Rows of ``x`` (ascending, distinct): a view where they are a run (``x`` itself when they are all
    of them), else one copy (Gemma 3's logits rows are 1 MB each: a 64-stream verification's are 300 MB)."""
    if not rows or rows == list(range(rows[0], rows[0] + len(rows))):
        return x[rows[0]:rows[0] + len(rows)] if rows else x[:0]
    return x.index_select(0, torch.tensor(rows, device=x.device))


def _put_rows(x: torch.Tensor, rows: list[int], values: torch.Tensor) -> torch.Tensor:
    """Write ``values`` into the given rows of ``x`` (in place) and return it; ``values`` when they are all rows.
    Values that are those rows already (:func:`take_rows`' view of a run, changed in place) stay."""
    if len(rows) == x.shape[0]:
        return values
    if values.data_ptr() == x[rows[0]].data_ptr():
        return x
    return x.index_copy_(0, torch.tensor(rows, device=x.device), values)


def _penalize_rows(scores: torch.Tensor, rows: list[int], states: Sequence[SamplingState]) -> None:
    picked = [states[i] for i in rows]

    def per_row(name: str) -> torch.Tensor:
        return torch.tensor([getattr(s.params, name) for s in picked], device=scores.device)

    sub = take_rows(scores, rows)
    apply_penalties(sub, [s.prompt_token_ids for s in picked], [s.output_token_ids for s in picked],
                    per_row("repetition_penalty"), per_row("frequency_penalty"), per_row("presence_penalty"))
    _put_rows(scores, rows, sub)


def _results(raw: torch.Tensor, token_ids: list[int], states: Sequence[SamplingState],
             rows: list[int] | None = None) -> list[SampleResult]:
    """SampleResults with logprobs of the raw distribution for the rows that asked for them (result i
    of ``raw``'s row ``rows[i]``, or row i)."""
    results = [SampleResult(t) for t in token_ids]
    asking = [i for i, s in enumerate(states) if s.params.logprobs is not None]
    if not asking:
        return results
    top_n = max(states[i].params.logprobs or 0 for i in asking)
    logprobs = take_rows(raw, asking if rows is None else [rows[i] for i in asking]).log_softmax(-1)
    chosen = logprobs.gather(1, torch.tensor([token_ids[i] for i in asking], device=raw.device).unsqueeze(1))
    top_values, top_ids = logprobs.topk(top_n, dim=-1)
    for i, lp, values, ids in zip(asking, chosen.squeeze(1).tolist(), top_values.tolist(), top_ids.tolist()):
        n = states[i].params.logprobs or 0
        results[i].logprob = lp
        results[i].top_logprobs = list(zip(ids[:n], values[:n]))
    return results


class PromptLogprob(TypedDict):
    """One scored prompt token."""

    logprob: float
    """Logprob of the prompt token given the tokens before it."""
    top: list[tuple[int, float]]
    """The top_n best (id, logprob) pairs at that position, best first."""


def compute_prompt_logprobs(logits: torch.Tensor, prompt_ids: Sequence[int],
                            top_n: int) -> list[PromptLogprob | None]:
    """Logprobs of the prompt tokens: entry i scores ``log p(prompt_ids[i] | prompt_ids[:i])``.

    ``logits``: ``[P, V]`` (or ``[P - 1, V]``), row j being the model's output at position j,
    i.e. the distribution of token j + 1. Entry 0 is None (the first token has no context).
    Logprobs are of the raw distribution (no penalties or temperature), like SampleResult's.
    """
    count = len(prompt_ids) - 1
    if count > logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} rows of logits cannot score {len(prompt_ids)} prompt tokens")
    entries: list[PromptLogprob | None] = [None] if prompt_ids else []
    targets = torch.tensor(list(prompt_ids[1:]), dtype=torch.long, device=logits.device)
    chunk = max(1, _PROMPT_LOGPROB_CHUNK // max(1, logits.shape[1]))
    for start in range(0, max(count, 0), chunk):
        stop = min(count, start + chunk)
        logprobs = logits[start:stop].float().log_softmax(-1)
        chosen = logprobs.gather(1, targets[start:stop].unsqueeze(1)).squeeze(1).tolist()
        top_values, top_ids = logprobs.topk(top_n, dim=-1)
        for lp, values, ids in zip(chosen, top_values.tolist(), top_ids.tolist()):
            entries.append(PromptLogprob(logprob=lp, top=list(zip(ids, values))))
    return entries
