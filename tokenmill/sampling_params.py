"""SamplingParams: how one request turns logits into tokens, and when it stops."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from tokenmill.config import reject_unknown_keys
from tokenmill.errors import InvalidParameterError

GREEDY_BELOW = 1e-5
"""Temperatures below this sample greedily (as vLLM), so logits / temperature never overflow."""


@dataclass
class SamplingParams:
    """Per-request sampling and stopping parameters (names follow vLLM / OpenAI).

    ``temperature == 0`` means greedy. Filters apply in the order
    penalties -> temperature -> top-k -> top-p -> min-p.
    """

    n: int = 1
    """Number of samples to return for the prompt."""
    temperature: float = 1.0
    """Softmax temperature; 0 (or anything below GREEDY_BELOW) selects greedy decoding."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 or -1 disables."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability reaches top_p; 1 disables."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the top token's; 0 disables."""
    repetition_penalty: float = 1.0
    """CTRL-style: divide positive / multiply negative logits of tokens seen in prompt or output; 1 disables."""
    presence_penalty: float = 0.0
    """Subtract this from logits of tokens already generated (OpenAI semantics); 0 disables."""
    frequency_penalty: float = 0.0
    """Subtract this times the count of each token already generated; 0 disables."""
    seed: int | None = None
    """Per-request RNG seed: the same seed gives the same output."""
    max_tokens: int | None = 16
    """Maximum tokens to generate; None means up to the context window."""
    min_tokens: int = 0
    """Do not stop (EOS or stop ids) before this many tokens."""
    stop: list[str] = field(default_factory=list)
    """Stop strings; generation stops when one appears; it is not included in the text."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end generation (in addition to EOS unless ignore_eos)."""
    include_stop_str_in_output: bool = False
    """Keep the matched stop string in the returned text."""
    ignore_eos: bool = False
    """Keep generating past the EOS token."""
    logprobs: int | None = None
    """Return the sampled token's logprob plus this many top alternatives per position; None for none."""
    prompt_logprobs: int | None = None
    """Return logprobs of prompt tokens plus this many top alternatives; None for none."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the returned text."""
    speculative: bool = True
    """Let the engine draft tokens for this request when it runs speculative decoding (the output is
    distributed the same either way); False opts out."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, why: str) -> InvalidParameterError:
            return InvalidParameterError(f"invalid sampling parameter {name}={getattr(self, name)!r}: {why}")

        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise bad(name, "must be a finite number")
        for name in ("n", "top_k", "min_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise bad(name, "must be an integer")
        if self.n < 1:
            raise bad("n", "must be at least 1")
        if self.temperature < 0:
            raise bad("temperature", "must be >= 0 (0 means greedy)")
        if self.top_k < 0:
            raise bad("top_k", "must be >= 0 (0 or -1 disables it)")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be > 0 (1 disables it)")
        if not -2 <= self.presence_penalty <= 2:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if self.max_tokens is not None and (
                isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", "must be a positive integer or None")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise bad("min_tokens", "must be >= 0 and <= max_tokens")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise bad("seed", "must be an integer")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 20):
                raise bad(name, "must be an integer in [0, 20] or None")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SamplingParams":
        reject_unknown_keys(cls, data)
        return cls(**data)

    def clone(self, **changes: Any) -> "SamplingParams":
        return dataclasses.replace(self, **changes)
