"""PromptLimits: what one prompt may be, checked in one place.

``LLMEngine.add_request`` checks every prompt with it, and the server checks a request's
prompts with the same object before admitting it (so a bad prompt gets its 400 before it
queues). It reads only numbers fixed when the engine was built, so any thread may call it.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.errors import ContextLengthError, InvalidParameterError


@dataclass(frozen=True)
class PromptLimits:
    vocab_size: int
    """Token ids must be in [0, vocab_size)."""
    max_model_len: int
    """The context window: prompt plus output tokens of one sequence."""
    kv_capacity_tokens: int
    """Tokens the whole KV pool holds; one sequence can never grow past it."""

    @property
    def max_seq_tokens(self) -> int:
        """Most tokens (prompt plus output) one sequence can hold."""
        return min(self.max_model_len, self.kv_capacity_tokens)

    def check(self, ids: list[int], max_tokens: int | None = None, param: str = "prompt") -> int:
        """Raise when the prompt cannot run; return the max_tokens it may use (all the room left when None).

        Errors name ``param`` (the prompt's field) or ``max_tokens``."""
        if not ids:
            raise InvalidParameterError("the prompt is empty", param=param, code="empty_prompt")
        bad = next((t for t in ids if isinstance(t, bool) or not isinstance(t, int)
                    or not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidParameterError(f"prompt token id {bad!r} is outside the vocabulary [0, {self.vocab_size})",
                                        param=param, code="invalid_token_id")
        if len(ids) >= self.max_model_len:
            raise ContextLengthError(
                f"the prompt has {len(ids)} tokens but the context window is {self.max_model_len} tokens; "
                f"shorten the prompt by at least {len(ids) - self.max_model_len + 1} tokens", param=param)
        if len(ids) >= self.kv_capacity_tokens:
            raise ContextLengthError(
                f"the prompt has {len(ids)} tokens but the KV cache holds {self.kv_capacity_tokens}; "
                f"raise kv_cache_memory", param=param)
        room = self.max_seq_tokens - len(ids)
        if max_tokens is None:
            return room
        if max_tokens > room:
            raise ContextLengthError(
                f"this model's maximum context length is {self.max_seq_tokens} tokens; you asked for "
                f"{len(ids) + max_tokens} ({len(ids)} in the prompt, {max_tokens} to generate)", param="max_tokens")
        return max_tokens
