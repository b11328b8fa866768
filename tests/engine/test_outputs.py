"""The engine's output contract: one RequestDelta per changed request per step, holding only what
is new; deltas concatenate to the cumulative output, multi-byte characters are never split, stop
strings that span steps are never shown, and detokenizing costs only the new tokens.

The model is the tiny random Llama with a byte-level tokenizer (every UTF-8 byte is a token), and a
scripted sampler chooses the tokens, so the text and its byte boundaries are known exactly.
"""

from __future__ import annotations

import pytest

from tests.server.conftest import build_tiny_checkpoint
from tokenmill import LLM, SamplingParams
from tokenmill.engine import OutputAccumulator, RequestDelta
from tokenmill.engine.sampler import SampleResult
from tokenmill.loading.detokenizer import PROMPT_CONTEXT_TOKENS

TEXT = "héllo 世界 🙂 naïve ok"


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    path = tmp_path_factory.mktemp("tiny-outputs")
    build_tiny_checkpoint(path)
    return LLM(str(path), dtype="float32", device="cpu", max_num_seqs=4)


class ScriptedSampler:
    """Returns each sequence's next token from its script (the first sequence seen gets script 0)."""

    def __init__(self, scripts: list[list[int]]) -> None:
        self.scripts, self.position, self.order = scripts, {}, {}

    def __call__(self, logits, states):
        out = []
        for state in states:
            key = id(state)
            script = self.scripts[self.order.setdefault(key, len(self.order))]
            i = self.position.get(key, 0)
            self.position[key] = i + 1
            token = script[i] if i < len(script) else script[-1]
            asked = state.params.logprobs is not None
            out.append(SampleResult(token, -0.5 if asked else None, [(token, -0.5)] if asked else None))
        return out


def _run(llm: LLM, prompt: str, params: SamplingParams, scripts: list[list[int]], monkeypatch) -> list[RequestDelta]:
    monkeypatch.setattr(llm.engine, "sampler", ScriptedSampler(scripts))
    llm.engine.add_request(prompt, params)
    deltas = []
    while llm.engine.has_unfinished_requests():
        deltas += llm.engine.step()
    assert llm.engine.num_used_blocks == 0
    return deltas


def _ids(llm: LLM, text: str) -> list[int]:
    return llm.tokenizer.encode(text, add_special_tokens=False)


def test_deltas_concatenate_and_never_split_a_character(llm: LLM, monkeypatch) -> None:
    script = _ids(llm, TEXT)
    assert len(script) > len(TEXT)  # multi-byte characters span several tokens
    params = SamplingParams(max_tokens=len(script), ignore_eos=True, logprobs=1)
    deltas = _run(llm, "say:", params, [script], monkeypatch)
    assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
    samples = [s for d in deltas for s in d.samples]
    assert [len(s.token_ids) for s in samples] == [1] * len(script)  # one step, one new token
    assert all("\ufffd" not in s.text for s in samples)
    assert "".join(s.text for s in samples) == TEXT
    assert sum((s.token_ids for s in samples), []) == script
    assert all(len(s.logprobs) == len(s.token_ids) for s in samples)
    # some steps add a token but no text yet (inside a character), and the text catches up later
    assert any(s.token_ids and not s.text for s in samples)
    assert [s.finish_reason for s in samples] == [None] * (len(samples) - 1) + ["length"]


def test_a_stop_string_that_spans_steps_is_never_streamed(llm: LLM, monkeypatch) -> None:
    script = _ids(llm, "abc STOP more text")
    params = SamplingParams(max_tokens=40, ignore_eos=True, stop=["STOP"])
    deltas = _run(llm, "go:", params, [script], monkeypatch)
    streamed = [s.text for d in deltas for s in d.samples]
    assert "".join(streamed) == "abc "
    assert not any(c in "".join(streamed) for c in "STOP")
    last = deltas[-1].samples[-1]
    assert last.finish_reason == "stop" and last.stop_reason == "STOP"


def test_kept_stop_string_and_held_back_text_arrive_whole(llm: LLM, monkeypatch) -> None:
    script = _ids(llm, "xy STO! then END")
    params = SamplingParams(max_tokens=40, ignore_eos=True, stop=["STOP", "END"], include_stop_str_in_output=True)
    deltas = _run(llm, "go:", params, [script], monkeypatch)
    # "STO" was held back as a possible stop string, then shown once "!" ruled it out
    assert "".join(s.text for d in deltas for s in d.samples) == "xy STO! then END"


def test_detokenizing_costs_only_the_new_tokens(llm: LLM, monkeypatch) -> None:
    script = _ids(llm, TEXT * 8)
    decoded = []
    real = llm.tokenizer.decode

    def counting(ids, *args, **kwargs):
        decoded.append(len(ids))
        return real(ids, *args, **kwargs)

    monkeypatch.setattr(llm.tokenizer, "decode", counting)
    deltas = _run(llm, "long:", SamplingParams(max_tokens=len(script), ignore_eos=True), [script], monkeypatch)
    assert sum(len(s.token_ids) for d in deltas for s in d.samples) == len(script) > 150
    assert max(decoded) <= PROMPT_CONTEXT_TOKENS + 8  # a short trailing window, never the whole output
    assert len(decoded) <= 3 * len(script)


def test_n_samples_each_report_their_own_news_once(llm: LLM, monkeypatch) -> None:
    a, b = _ids(llm, "first sample"), _ids(llm, "second")
    params = SamplingParams(n=2, max_tokens=12, ignore_eos=True, stop=["ond"])
    deltas = _run(llm, "two:", params, [a, b], monkeypatch)
    acc = OutputAccumulator(deltas[0].request_id)
    finishes = {0: 0, 1: 0}
    for d in deltas:
        acc.add(d)
        assert len({s.index for s in d.samples}) == len(d.samples)
        for s in d.samples:
            finishes[s.index] += s.finished
    assert finishes == {0: 1, 1: 1}
    texts = {o.index: o.text for o in acc.output.outputs}
    assert texts[0] == "first sample" and texts[1] == "sec"
    assert acc.output.outputs[1].stop_reason == "ond" and acc.output.outputs[0].finish_reason == "length"


def test_generate_returns_the_cumulative_view_of_the_same_deltas(llm: LLM, monkeypatch) -> None:
    script = _ids(llm, TEXT)
    monkeypatch.setattr(llm.engine, "sampler", ScriptedSampler([script]))
    out = llm.generate("say:", SamplingParams(max_tokens=len(script), ignore_eos=True, logprobs=0))[0]
    assert out.outputs[0].text == TEXT and out.outputs[0].token_ids == script
    assert len(out.outputs[0].logprobs) == len(script) and out.finished
    monkeypatch.setattr(llm.engine, "sampler", ScriptedSampler([script]))
    assert "".join(llm.stream("say:", SamplingParams(max_tokens=len(script), ignore_eos=True))) == TEXT
