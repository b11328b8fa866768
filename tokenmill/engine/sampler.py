"""The batched sampler: one token per row of logits, each row with its own SamplingParams.

Per row, in vLLM's order::

    raw logits ──► logprobs (log_softmax of the raw logits, when asked)
        │
        ▼
    repetition penalty ─► frequency / presence penalties ─► min_tokens mask on stop ids
        │
        ├── greedy row: argmax (lowest id on ties)
        └── random row: temperature ─► top-k ─► top-p ─► min-p ─► draw (one uniform per row)

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
from tokenmill.sampling_params import SamplingParams


_PROMPT_LOGPROB_CHUNK = 1 << 24
"""compute_prompt_logprobs works on at most this many logits elements at a time (64 MiB float32)."""


@dataclass
class SamplingState:
    """One sequence being sampled; the engine keeps it on the request and appends each sampled token.

    ``generator`` is the row's own RNG when the request has a seed. A random row draws exactly
    one uniform per step from it (greedy rows draw nothing), so its tokens depend only on
    (seed, logits), not on the batch it shares or on other requests.
    """

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    stop_ids: frozenset[int] = frozenset()
    """EOS and stop token ids: masked while fewer than ``params.min_tokens`` tokens are generated."""

    @classmethod
    def create(cls, params: SamplingParams, prompt_token_ids: Iterable[int], device: torch.device | str = "cpu",
               eos_token_ids: Iterable[int] = ()) -> SamplingState:
        """A fresh state; stop_ids are params.stop_token_ids plus the EOS ids unless params.ignore_eos."""
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=device)
            generator.manual_seed(params.seed)
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        return cls(params, list(prompt_token_ids), [], generator, frozenset(stop_ids))

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
        if logits.dim() != 2 or logits.shape[0] != len(states) or logits.shape[1] < self.vocab_size:
            raise ValueError(f"logits of shape {tuple(logits.shape)} do not match {len(states)} rows "
                             f"of vocab_size {self.vocab_size}")
        raw = logits[:, :self.vocab_size].float()
        token_ids = self._choose(self._penalized(raw, states), states)
        return _results(raw, token_ids, states)

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
            return scores.argmax(-1).tolist()
        random = [i for i, s in enumerate(states) if not s.greedy]
        sampled = self._sample(_take_rows(scores, random), [states[i] for i in random])
        if not greedy:
            return sampled.tolist()
        token_ids = torch.empty(len(states), dtype=torch.long, device=scores.device)
        token_ids[greedy] = _take_rows(scores, greedy).argmax(-1)
        token_ids[random] = sampled
        return token_ids.tolist()

    def _sample(self, scores: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p, draw; ``scores`` is not modified."""
        device, vocab_size = scores.device, scores.shape[1]
        params = [s.params for s in states]
        scores = scores / torch.tensor([p.temperature for p in params], device=device).unsqueeze(1)
        top_k = [min(p.top_k or vocab_size, vocab_size) for p in params]
        top_p = [p.top_p for p in params]
        filtered = [i for i in range(len(params)) if top_k[i] < vocab_size or top_p[i] < 1]
        if filtered:
            kept = apply_top_k_top_p(_take_rows(scores, filtered),
                                     torch.tensor([top_k[i] for i in filtered], device=device),
                                     torch.tensor([top_p[i] for i in filtered], device=device))
            scores = _put_rows(scores, filtered, kept)
        if any(p.min_p > 0 for p in params):
            apply_min_p(scores, torch.tensor([p.min_p for p in params], device=device))
        return sample(scores, self._uniforms(states, device))

    def _uniforms(self, states: list[SamplingState], device: torch.device) -> torch.Tensor:
        """One uniform per row: from the row's generator when seeded, else from the shared one."""
        unseeded = sum(s.generator is None for s in states)
        shared = iter(torch.rand(unseeded, generator=self.generator).tolist())
        values = [next(shared) if s.generator is None else
                  torch.rand(1, generator=s.generator, device=s.generator.device).item() for s in states]
        return torch.tensor(values, device=device)


def _take_rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Rows of ``x`` (ascending, distinct): ``x`` itself when they are all of them, else a copy."""
    if len(rows) == x.shape[0]:
        return x
    return x.index_select(0, torch.tensor(rows, device=x.device))


def _put_rows(x: torch.Tensor, rows: list[int], values: torch.Tensor) -> torch.Tensor:
    """Write ``values`` into the given rows of ``x`` (in place) and return it; ``values`` when they are all rows."""
    if len(rows) == x.shape[0]:
        return values
    return x.index_copy_(0, torch.tensor(rows, device=x.device), values)


def _penalize_rows(scores: torch.Tensor, rows: list[int], states: Sequence[SamplingState]) -> None:
    picked = [states[i] for i in rows]

    def per_row(name: str) -> torch.Tensor:
        return torch.tensor([getattr(s.params, name) for s in picked], device=scores.device)

    sub = _take_rows(scores, rows)
    apply_penalties(sub, [s.prompt_token_ids for s in picked], [s.output_token_ids for s in picked],
                    per_row("repetition_penalty"), per_row("frequency_penalty"), per_row("presence_penalty"))
    _put_rows(scores, rows, sub)


def _results(raw: torch.Tensor, token_ids: list[int], states: Sequence[SamplingState]) -> list[SampleResult]:
    """SampleResults with logprobs of the raw distribution for the rows that asked for them."""
    results = [SampleResult(t) for t in token_ids]
    asking = [i for i, s in enumerate(states) if s.params.logprobs is not None]
    if not asking:
        return results
    top_n = max(states[i].params.logprobs or 0 for i in asking)
    logprobs = _take_rows(raw, asking).log_softmax(-1)
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
