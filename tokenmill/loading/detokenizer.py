"""Streaming detokenization: the text each new token adds, decoding only a short trailing window.

Two offsets into the token list (as in vLLM)::

    ids:  ... p r o m p t | o u t p u t . . .
                   ^prefix_offset    ^read_offset      (end)
    prefix_text = decode(ids[prefix_offset:read_offset])   text already emitted
    new_text    = decode(ids[prefix_offset:])
    delta       = new_text[len(prefix_text):]

After a delta is emitted, ``prefix_offset`` moves to ``read_offset`` and ``read_offset`` to the end,
so each step decodes a few tokens, not the whole sequence.

Text is held back (delta "", offsets unchanged) while the window is unfinished:

* ``new_text`` ends in U+FFFD: the last token ends inside a multi-byte UTF-8 character;
* the last token is a byte-fallback token (``<0xE4>``): the decoder UTF-8-decodes a whole run of
  them at once, and one more byte can turn an already valid run invalid, which would change text
  already emitted.

``read_offset`` therefore only ever sits after a token that ends a complete character, so the text
decoded from there on never depends on what came before, and the deltas concatenate to
``decode(output ids)`` once :meth:`IncrementalDetokenizer.finish` flushes what is held back (for an
empty prompt, or a prompt that ends on a character boundary, i.e. any prompt encoded from text).
One exception, on purpose: decoders that strip the first space of a text (Llama's ``add_space_prefix``)
strip it from ``decode(output ids)`` but not from the first delta after a prompt, which is the
text to append to the prompt.

Only the window ``ids[prefix_offset:]`` is stored; ids before it are never decoded again.

With ``skip_special_tokens`` a special token adds no text and is left out of the window entirely:
the backend drops it before its decoder runs, so leaving it out decodes the same.
"""

from __future__ import annotations

from typing import Sequence

from tokenmill.loading.tokenizer import Tokenizer

PROMPT_CONTEXT_TOKENS = 5
"""Prompt tokens kept as decoding context, so the first output token gets its leading space right."""

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns a stream of output token ids into text deltas; ``text`` is everything emitted so far."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = [i for i in prompt_ids[-4 * PROMPT_CONTEXT_TOKENS:] if not self._skipped(i)]
        self._window: list[int] = context[-PROMPT_CONTEXT_TOKENS:]
        """ids[prefix_offset:]; its first ``_read`` ids decode to ``_prefix_text``, already emitted."""
        self._read = len(self._window)
        self._prefix_text = self._decode(self._window)
        self.text = ""

    def add(self, token_id: int) -> str:
        """Append one output token; return the text it completes (often "", never half a character)."""
        if self._skipped(token_id):
            return ""
        self._window.append(token_id)
        new_text = self._decode(self._window)
        if new_text.endswith(_REPLACEMENT) or token_id in self.tokenizer.byte_token_ids:
            return ""
        return self._emit(new_text)

    def finish(self) -> str:
        """Emit whatever is held back (e.g. a final incomplete character, as U+FFFD)."""
        if self._read == len(self._window):
            return ""
        return self._emit(self._decode(self._window))

    def _emit(self, new_text: str) -> str:
        """Emit ``new_text`` past the prefix; then prefix_offset = read_offset, read_offset = end."""
        delta = new_text[len(self._prefix_text):]
        del self._window[:self._read]
        self._read = len(self._window)
        self._prefix_text = self._decode(self._window)
        self.text += delta
        return delta

    def _skipped(self, token_id: int) -> bool:
        return self.skip_special_tokens and self.tokenizer.is_special(token_id)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
