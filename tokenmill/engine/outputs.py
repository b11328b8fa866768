"""What generation hands back to callers (offline API, CLI, later the server)."""

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
class CompletionOutput:
    """One sample of a request."""

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
    """A request's prompt and its samples, as of the latest step."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    """Per prompt position (None for the first token), when asked for."""

    @property
    def finished(self) -> bool:
        return all(o.finished for o in self.outputs)
