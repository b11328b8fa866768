"""Decide, after each new token, whether a sequence is finished and where its text ends.

Order (as vLLM): below ``min_tokens`` nothing but length stops it; then EOS (unless
``ignore_eos``), a stop token id, a stop string in the text (the text is cut before it,
or after it with ``include_stop_str_in_output``), and last the length limits.
"""

from __future__ import annotations

from tokenmill.engine.request import Sequence, SequenceStatus


def check_stop(seq: Sequence, new_text: str, eos_token_ids: frozenset[int], max_model_len: int) -> None:
    """Update ``seq.text``, ``seq.status`` and ``seq.stop_reason`` after one appended token."""
    params = seq.sampling.params
    token = seq.output_token_ids[-1]
    previous_len = len(seq.text)
    seq.text += new_text
    num_output = len(seq.output_token_ids)
    if num_output >= params.min_tokens:
        if not params.ignore_eos and token in eos_token_ids:
            seq.status = SequenceStatus.FINISHED_STOPPED
            return
        if token in params.stop_token_ids:
            seq.status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, token
            return
        if params.stop and _cut_at_stop_string(seq, previous_len, len(new_text)):
            return
    if params.max_tokens is not None and num_output >= params.max_tokens:
        seq.status = SequenceStatus.FINISHED_LENGTH
    elif seq.num_tokens >= max_model_len:
        seq.status = SequenceStatus.FINISHED_LENGTH


def _cut_at_stop_string(seq: Sequence, previous_len: int, added: int) -> bool:
    """Find a stop string that ends in the newly added text; cut the text there."""
    params = seq.sampling.params
    best: tuple[int, str] | None = None
    for stop in params.stop:
        # a match must overlap the new text, so search only from where it could begin
        start = max(0, previous_len - len(stop) + 1)
        index = seq.text.find(stop, start)
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop)
    if best is None or not added:
        return False
    index, stop = best
    seq.text = seq.text[:index + len(stop)] if params.include_stop_str_in_output else seq.text[:index]
    seq.status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, stop
    return True


def stream_safe_length(seq: Sequence) -> int:
    """How much of ``seq.text`` can be shown while running: hold back what could still start a stop string."""
    if seq.status.finished or not seq.sampling.params.stop:
        return len(seq.text)
    hold = max(len(s) for s in seq.sampling.params.stop) - 1
    return max(0, len(seq.text) - hold)
