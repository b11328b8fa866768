"""What the engine hands back: one delta per changed request per step, and the cumulative view.

::

    LLMEngine.step() ──► [RequestDelta]          what each changed request gained this step:
                           └─ [SampleDelta]      new token ids, new text, their logprobs, finish
    OutputAccumulator.add(delta) ──► RequestOutput   everything so far (the offline API's view)

A delta is built once per step from counters on the sequence (tokens and characters already
sent), so its cost is proportional to what is new. While a sample runs, text that could still
turn out to be the start of a stop string is held back; it comes in a later delta, or is
dropped when the stop string completes. The deltas of a sample concatenate to its final text,
token ids and logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprobs:
    """Logprob of one chosen token (generated or prompt) and its top alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    """Top-n (token id, logprob) of the model's distribution at this position, best first."""


@dataclass
class SampleDelta:
    """What one sample of a request gained in one step."""

    index: int
    token_ids: list[int]
    """Token ids generated since the previous delta."""
    text: str
    """Text added since the previous delta (held back where a stop string may still start)."""
    logprobs: list[TokenLogprobs] | None
    """One entry per new token when logprobs were asked for, else None."""
    finish_reason: str | None = None
    """'stop', 'length', 'abort' or 'error' once finished; None while running."""
    stop_reason: str | int | None = None
    """The stop string or stop token id that ended it; None for EOS, length or running."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestDelta:
    """One request's change in one step: ``LLMEngine.step()`` returns one per changed request."""

    request_id: str
    samples: list[SampleDelta]
    """The samples that changed this step (by ``index``)."""
    finished: bool
    """Every sample of the request has finished; no delta follows."""
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    """Prompt logprob entries new this step (the first is None: nothing predicts the first token)."""
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache."""
    arrival_time: float = 0.0
    scheduled_time: float | None = None
    """When the engine first scheduled it (the end of its wait in the engine's queue)."""
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def num_new_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.samples)


@dataclass
class CompletionOutput:
    """One sample of a request, everything so far."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    """'stop' (EOS, stop token or stop string), 'length' (max_tokens or context window), 'abort', or None while running."""
    stop_reason: str | int | None = None
    """The stop string or stop token id that ended it; None for EOS, length or running."""
    logprobs: list[TokenLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's prompt and its samples, everything so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    """Per prompt position (None for the first token), when asked for."""
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache."""

    @property
    def finished(self) -> bool:
        return all(o.finished for o in self.outputs)


class OutputAccumulator:
    """Folds a request's deltas into its cumulative :class:`RequestOutput` (updated in place).

    ``n``, ``logprobs`` and ``prompt_logprobs`` shape the empty output (samples and lists that are
    there even before, or without, a token); a delta for a further sample or with logprobs adds them."""

    def __init__(self, request_id: str, prompt: str | None = None, prompt_token_ids: list[int] | None = None,
                 n: int = 1, logprobs: bool = False, prompt_logprobs: bool = False) -> None:
        self.logprobs = logprobs
        samples = [self._empty(i) for i in range(n)]
        self.output = RequestOutput(request_id, prompt, list(prompt_token_ids or []), samples,
                                    [] if prompt_logprobs else None)

    def _empty(self, index: int) -> CompletionOutput:
        return CompletionOutput(index, "", [], None, logprobs=[] if self.logprobs else None)

    def add(self, delta: RequestDelta) -> RequestOutput:
        out = self.output
        for d in delta.samples:
            while d.index >= len(out.outputs):
                out.outputs.append(self._empty(len(out.outputs)))
            sample = out.outputs[d.index]
            sample.text += d.text
            sample.token_ids.extend(d.token_ids)
            if d.logprobs is not None:
                if sample.logprobs is None:
                    sample.logprobs = []
                sample.logprobs.extend(d.logprobs)
            sample.finish_reason, sample.stop_reason = d.finish_reason, d.stop_reason
        if delta.prompt_logprobs is not None:
            if out.prompt_logprobs is None:
                out.prompt_logprobs = []
            out.prompt_logprobs.extend(delta.prompt_logprobs)
        out.num_cached_tokens = delta.num_cached_tokens
        return out
