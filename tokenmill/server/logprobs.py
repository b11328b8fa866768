"""Logprobs in OpenAI's two shapes: completions (parallel lists) and chat (one object per token)."""

from __future__ import annotations

from tokenmill.engine import TokenLogprobs
from tokenmill.loading.tokenizer import Tokenizer
from tokenmill.server.protocol import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    TopLogprob,
)

Item = tuple[int, float | None, list[tuple[int, float]] | None]
"""(token id, its logprob or None, top alternatives or None)."""


class TokenText:
    """Token id -> its text (special tokens spelled out), cached for one response."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text


def items(entries: list[TokenLogprobs] | None) -> list[Item]:
    return [(e.token_id, e.logprob, e.top) for e in entries or []]


def echo_items(prompt_ids: list[int], prompt_logprobs: list[TokenLogprobs | None] | None) -> list[Item]:
    """The prompt's tokens for echo: the first has no logprob (nothing predicts it)."""
    rest = [(e.token_id, e.logprob, e.top) for e in (prompt_logprobs or [])[1:] if e is not None]
    return [(prompt_ids[0], None, None)] + rest


def completion_logprobs(tokens: TokenText, entries: list[Item], offset: int = 0) -> CompletionLogprobs:
    out = CompletionLogprobs()
    for token_id, logprob, top in entries:
        text = tokens.text(token_id)
        out.tokens.append(text)
        out.token_logprobs.append(logprob)
        if top is None:
            out.top_logprobs.append(None)
        else:
            alternatives = {tokens.text(t): lp for t, lp in top}
            alternatives.setdefault(text, logprob)
            out.top_logprobs.append(alternatives)
        out.text_offset.append(offset)
        offset += len(text)
    return out


def chat_logprobs(tokens: TokenText, entries: list[TokenLogprobs], num_top: int) -> ChatLogprobs:
    def top(token_id: int, logprob: float) -> TopLogprob:
        text = tokens.text(token_id)
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))

    content = []
    for e in entries:
        chosen = top(e.token_id, e.logprob)
        content.append(ChatTokenLogprob(token=chosen.token, logprob=chosen.logprob, bytes=chosen.bytes,
                                        top_logprobs=[top(t, lp) for t, lp in e.top[:num_top]]))
    return ChatLogprobs(content=content)
