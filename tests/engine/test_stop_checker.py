"""check_stop and stream_safe_length on hand-built sequences: each token arrives with the text it adds."""

from __future__ import annotations

import pytest

from tokenmill.engine.request import Sequence, SequenceStatus
from tokenmill.engine.sampler import SamplingState
from tokenmill.engine.stop_checker import check_stop, stream_safe_length
from tokenmill.sampling_params import SamplingParams

EOS = 0
EOS_IDS = frozenset({EOS})
PROMPT = [5, 6, 7]


def sequence(**params) -> Sequence:
    params.setdefault("max_tokens", None)
    state = SamplingState.create(SamplingParams(**params), PROMPT, eos_token_ids=EOS_IDS)
    return Sequence("r", 0, list(PROMPT), state, detokenizer=None)


def feed(seq: Sequence, pieces: list[tuple[int, str]], max_model_len: int = 1000) -> int:
    """Append (token id, text it adds) pairs until the sequence finishes; return how many were taken."""
    for count, (token, text) in enumerate(pieces, 1):
        seq.append_token(token)
        check_stop(seq, text, EOS_IDS, max_model_len)
        if seq.status.finished:
            return count
    return len(pieces)


def tokens(*texts: str) -> list[tuple[int, str]]:
    return [(100 + i, t) for i, t in enumerate(texts)]


def test_running_sequence_accumulates_text() -> None:
    seq = sequence(stop=["zzz"])
    feed(seq, tokens("Hello", " wor", "ld"))
    assert seq.text == "Hello world"
    assert seq.status == SequenceStatus.WAITING  # not finished: check_stop leaves the status alone
    assert seq.stop_reason is None


def test_stop_string_spanning_two_tokens() -> None:
    seq = sequence(stop=["o w"])
    taken = feed(seq, tokens("Hello", " wor", "ld"))
    assert taken == 2
    assert seq.status == SequenceStatus.FINISHED_STOPPED
    assert seq.text == "Hell"
    assert seq.stop_reason == "o w"


def test_stop_string_inside_one_token_keeps_text_before_it() -> None:
    seq = sequence(stop=["STOP"])
    feed(seq, tokens("a", "bSTOPc", "d"))
    assert (seq.text, seq.stop_reason) == ("ab", "STOP")


def test_include_stop_str_in_output_keeps_the_stop_string() -> None:
    seq = sequence(stop=["o w"], include_stop_str_in_output=True)
    feed(seq, tokens("Hello", " wor", "ld"))
    assert (seq.text, seq.stop_reason) == ("Hello w", "o w")


def test_earliest_of_several_stop_strings_wins() -> None:
    # both complete in the same token; "lo w" starts first although "world" is listed first
    seq = sequence(stop=["world", "lo w"])
    feed(seq, tokens("hel", "lo world"))
    assert (seq.text, seq.stop_reason) == ("hel", "lo w")
    # the one completed by an earlier token wins even if another would start before it later
    seq = sequence(stop=["cd", "bcdx"])
    feed(seq, tokens("ab", "cd", "x"))
    assert (seq.text, seq.stop_reason) == ("ab", "cd")


def test_eos_stops_without_stop_reason() -> None:
    seq = sequence()
    taken = feed(seq, [*tokens("a", "b"), (EOS, ""), *tokens("c")])
    assert taken == 3
    assert seq.status.finish_reason == "stop"
    assert seq.stop_reason is None
    assert seq.text == "ab"


def test_ignore_eos_keeps_going() -> None:
    seq = sequence(ignore_eos=True, max_tokens=4)
    assert feed(seq, [(EOS, ""), (EOS, ""), *tokens("a", "b", "c")]) == 4
    assert seq.status.finish_reason == "length"


def test_stop_token_id_is_the_stop_reason() -> None:
    seq = sequence(stop_token_ids=[42])
    assert feed(seq, [*tokens("a"), (42, "!"), *tokens("b")]) == 2
    assert (seq.status.finish_reason, seq.stop_reason) == ("stop", 42)


def test_min_tokens_blocks_eos_stop_ids_and_stop_strings() -> None:
    seq = sequence(min_tokens=4, stop_token_ids=[42], stop=["x"])
    assert feed(seq, [(EOS, ""), (42, ""), (101, "x")]) == 3
    assert not seq.status.finished
    assert feed(seq, [(EOS, "")]) == 1
    assert seq.status.finish_reason == "stop"


def test_max_tokens_gives_length() -> None:
    seq = sequence(max_tokens=3)
    assert feed(seq, tokens("a", "b", "c", "d")) == 3
    assert (seq.status.finish_reason, seq.stop_reason) == ("length", None)


def test_eos_on_the_last_allowed_token_is_a_stop() -> None:
    seq = sequence(max_tokens=2)
    feed(seq, [*tokens("a"), (EOS, "")])
    assert seq.status.finish_reason == "stop"


def test_context_window_gives_length() -> None:
    seq = sequence()  # no max_tokens: only the context window ends it
    assert feed(seq, tokens(*"abcdefgh"), max_model_len=len(PROMPT) + 5) == 5
    assert seq.status.finish_reason == "length"
    assert seq.num_tokens == len(PROMPT) + 5


@pytest.mark.parametrize("stop, text, safe", [
    ([], "Hello world", 11),
    (["abc"], "Hello world", 9),  # the last 2 characters could start "abc"
    (["abc", "x"], "Hello world", 9),  # the longest stop string decides
    (["abcdef"], "Hi", 0),
])
def test_stream_safe_length_holds_back_possible_stop_prefixes(stop: list[str], text: str, safe: int) -> None:
    seq = sequence(stop=stop)
    seq.text = text
    assert stream_safe_length(seq) == safe
    seq.status = SequenceStatus.FINISHED_LENGTH
    assert stream_safe_length(seq) == len(text)


def test_streamed_text_never_shows_what_a_stop_string_later_cuts() -> None:
    pieces = tokens("The", " ans", "wer", " is", ": ", "4", "2", ".")
    for stop in (["answer"], [" is:"], ["2."], ["s: 4"], ["nope"]):
        seq = sequence(stop=stop, max_tokens=len(pieces))
        shown = ""
        for token, text in pieces:
            feed(seq, [(token, text)])
            visible = seq.text[:stream_safe_length(seq)]
            assert visible.startswith(shown), (stop, visible, shown)
            shown = visible
            if seq.status.finished:
                break
        assert shown == seq.text
        assert stop[0] not in shown
