"""The engine through the offline API on the real SmolLM2-135M: batching, seeds, stops, logprobs,
abort, errors and streaming; plus a Gemma 3 smoke test. Every test leaves no KV cache slot behind."""

from __future__ import annotations

import gc

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.engine import EngineConfig, OutputAccumulator
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.request import SequenceStatus
from tokenmill.errors import ContextLengthError, InvalidParameterError
from tokenmill.models.builder import LoadedModel
from tests.model_utils import prompt_logits

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time,",
    "Q: What is 17 * 23?\nA:",
    "The three primary colors are",
    "import numpy as np\n",
    "Photosynthesis is the process by which",
    "1, 1, 2, 3, 5, 8,",
]
FRANCE = PROMPTS[0]
CHAT_FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = SamplingParams(temperature=0, max_tokens=8)


@pytest.fixture(scope="module")
def llm() -> LLM:
    model = LLM("smollm2-135m-instruct", dtype="float32", device="cpu")
    yield model
    del model
    gc.collect()


@pytest.fixture(autouse=True)
def no_leftovers(request: pytest.FixtureRequest):
    """After each test on the shared model: nothing queued or running, every KV cache slot freed."""
    yield
    if "llm" in request.fixturenames:
        engine = request.getfixturevalue("llm").engine
        assert not engine.has_unfinished_requests()
        assert engine.requests == {}
        assert engine.num_used_blocks == 0


def greedy(llm: LLM, prompt, **params):
    return llm.generate(prompt, SamplingParams(**{"temperature": 0, "max_tokens": 8, **params}))[0].outputs[0]


@pytest.fixture(scope="module")
def france(llm: LLM):
    """16 greedy tokens after FRANCE: ' Paris.\\n\\nThe answer is: 2018-01' (no EOS among them)."""
    out = greedy(llm, FRANCE, max_tokens=16)
    assert "answer" in out.text and out.text.startswith(" Paris.")
    return out


@pytest.fixture(scope="module")
def chat_france(llm: LLM):
    """The greedy chat answer, which ends with EOS within a few tokens."""
    out = llm.chat(CHAT_FRANCE, SamplingParams(temperature=0, max_tokens=32))[0].outputs[0]
    assert out.finish_reason == "stop" and len(out.token_ids) < 16
    return out


# ---- batching and seeds --------------------------------------------------------------------------

@pytest.mark.real_model
def test_batch_composition_does_not_change_greedy_outputs(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=5)
    together = [o.outputs[0] for o in llm.generate(PROMPTS, params)]
    identical = 0
    for prompt, batched in zip(PROMPTS, together):
        alone = llm.generate(prompt, params)[0].outputs[0]
        assert batched.finish_reason == alone.finish_reason == "length"
        for pos, (a, b) in enumerate(zip(alone.logprobs, batched.logprobs)):
            if a.token_id != b.token_id:  # allowed only as a numerical near-tie
                alone_top = dict(a.top)
                assert b.token_id in alone_top, (prompt, pos, a, b)
                assert alone_top[a.token_id] - alone_top[b.token_id] < 1e-2, (prompt, pos, a, b)
                break
            assert a.logprob == pytest.approx(b.logprob, abs=1e-3), (prompt, pos)
        else:
            identical += 1
            assert batched.text == alone.text
    assert identical >= len(PROMPTS) - 1


@pytest.mark.real_model
def test_n_seeded_samples_are_distinct_and_reproducible(llm: LLM) -> None:
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=8)
    first = llm.generate(FRANCE, params)[0]
    samples = [tuple(o.token_ids) for o in first.outputs]
    assert [o.index for o in first.outputs] == [0, 1, 2, 3]
    assert len(set(samples)) == 4
    again = llm.generate(FRANCE, params)[0]
    assert [tuple(o.token_ids) for o in again.outputs] == samples
    assert [o.text for o in again.outputs] == [o.text for o in first.outputs]


@pytest.mark.real_model
def test_seeded_request_is_independent_of_its_batch(llm: LLM) -> None:
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=8)
    alone = llm.generate(FRANCE, seeded)[0].outputs[0]
    assert llm.generate(FRANCE, seeded)[0].outputs[0].token_ids == alone.token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=8), seeded, SamplingParams(temperature=0, max_tokens=3),
              SamplingParams(temperature=1.2, seed=99, max_tokens=8)]
    batch = llm.generate([PROMPTS[2], FRANCE, PROMPTS[4], FRANCE], others)
    assert batch[1].outputs[0].token_ids == alone.token_ids
    assert batch[3].outputs[0].token_ids != alone.token_ids  # another seed draws differently


# ---- stopping ------------------------------------------------------------------------------------

@pytest.mark.real_model
def test_max_tokens_gives_length(llm: LLM, france) -> None:
    out = greedy(llm, FRANCE, max_tokens=5)
    assert out.finish_reason == "length" and out.stop_reason is None
    assert out.token_ids == france.token_ids[:5]


@pytest.mark.real_model
def test_eos_gives_stop_without_reason(llm: LLM, chat_france) -> None:
    assert chat_france.token_ids[-1] in llm.tokenizer.stop_token_ids
    assert chat_france.stop_reason is None
    assert "Paris" in chat_france.text and "<|im_end|>" not in chat_france.text


@pytest.mark.real_model
def test_ignore_eos_generates_past_eos(llm: LLM, chat_france) -> None:
    n = len(chat_france.token_ids)
    out = llm.chat(CHAT_FRANCE, SamplingParams(temperature=0, max_tokens=n + 3, ignore_eos=True))[0].outputs[0]
    assert out.finish_reason == "length"
    assert out.token_ids[:n] == chat_france.token_ids
    assert len(out.token_ids) == n + 3


@pytest.mark.real_model
def test_min_tokens_holds_off_eos(llm: LLM, chat_france) -> None:
    n = len(chat_france.token_ids)
    out = llm.chat(CHAT_FRANCE, SamplingParams(temperature=0, min_tokens=n + 2, max_tokens=n + 4))[0].outputs[0]
    assert len(out.token_ids) >= n + 2
    assert not set(out.token_ids[:n + 1]) & llm.tokenizer.stop_token_ids
    assert out.token_ids[:n - 1] == chat_france.token_ids[:n - 1]


@pytest.mark.real_model
def test_stop_token_id_is_reported(llm: LLM, france) -> None:
    stop_id = france.token_ids[2]
    first = france.token_ids.index(stop_id)
    out = greedy(llm, FRANCE, max_tokens=16, stop_token_ids=[stop_id])
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)
    assert out.token_ids == france.token_ids[:first + 1]


@pytest.mark.real_model
def test_stop_strings(llm: LLM, france) -> None:
    cut = france.text.index("answer")
    out = greedy(llm, FRANCE, max_tokens=16, stop=["answer"])
    assert (out.text, out.finish_reason, out.stop_reason) == (france.text[:cut], "stop", "answer")
    kept = greedy(llm, FRANCE, max_tokens=16, stop=["answer"], include_stop_str_in_output=True)
    assert kept.text == france.text[:cut + len("answer")]
    # "is." spans the tokens " Paris" and "."; of several stop strings the earliest match wins
    out = greedy(llm, FRANCE, max_tokens=16, stop=["answer", "is."])
    assert (out.text, out.stop_reason) == (" Par", "is.")
    assert out.token_ids == france.token_ids[:2]


@pytest.mark.real_model
def test_context_window_gives_length(llm: LLM) -> None:
    engine = _small_engine(llm, max_model_len=64)
    prompt = llm.tokenizer.encode("word " * 80)[:60]
    request = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=None))
    outputs = _run(engine)
    assert outputs[request.request_id].outputs[0].finish_reason == "length"
    assert len(outputs[request.request_id].outputs[0].token_ids) == 4
    assert engine.num_used_blocks == 0


# ---- logprobs ------------------------------------------------------------------------------------

@pytest.mark.real_model
def test_logprobs_match_the_model_distribution(llm: LLM) -> None:
    model = llm.engine.runner.model
    greedy_params = SamplingParams(temperature=0, max_tokens=6, logprobs=5, prompt_logprobs=3)
    sampled_params = SamplingParams(temperature=0.8, seed=3, max_tokens=6, logprobs=0)
    for params in (greedy_params, sampled_params):
        result = llm.generate(PROMPTS[6], params)[0]
        out = result.outputs[0]
        prompt = result.prompt_token_ids
        reference = prompt_logits(model, prompt + out.token_ids[:-1]).log_softmax(-1)
        assert len(out.logprobs) == len(out.token_ids) == 6
        for step, entry in enumerate(out.logprobs):
            row = reference[len(prompt) - 1 + step]
            assert entry.token_id == out.token_ids[step]
            assert entry.logprob == pytest.approx(row[entry.token_id].item(), abs=1e-3)
            assert len(entry.top) == params.logprobs
            if params.greedy:
                assert entry.top[0][0] == entry.token_id and entry.top[0][1] == pytest.approx(entry.logprob)
                values = torch.tensor([v for _, v in entry.top])
                assert torch.allclose(values, row.topk(5).values, atol=1e-3)
    # prompt logprobs: nothing for the first token, then each prompt token given the ones before it
    result = llm.generate(PROMPTS[6], greedy_params)[0]
    prompt = result.prompt_token_ids
    reference = prompt_logits(model, prompt).log_softmax(-1)
    assert len(result.prompt_logprobs) == len(prompt) and result.prompt_logprobs[0] is None
    for i, entry in enumerate(result.prompt_logprobs[1:], 1):
        assert entry.token_id == prompt[i]
        assert entry.logprob == pytest.approx(reference[i - 1, prompt[i]].item(), abs=1e-3)
        assert [t for t, _ in entry.top] == reference[i - 1].topk(3).indices.tolist()


@pytest.mark.real_model
def test_no_logprobs_unless_asked(llm: LLM) -> None:
    result = llm.generate(FRANCE, GREEDY)[0]
    assert result.outputs[0].logprobs is None and result.prompt_logprobs is None


# ---- abort and KV cache --------------------------------------------------------------------------

@pytest.mark.real_model
def test_abort_frees_the_request_and_its_cache_slot(llm: LLM) -> None:
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    requests = [engine.add_request(p, params) for p in PROMPTS[:3]]
    early = engine.step() + engine.step()
    held = engine.kv.block_table(requests[1].sequences[0].seq_id)[0]
    used = engine.num_used_blocks
    assert used >= 3 and len(held) >= 1
    victim = requests[1]
    engine.abort(victim.request_id)
    assert engine.num_used_blocks == used - len(held)
    assert victim.request_id not in engine.requests
    assert [s.status for s in victim.sequences] == [SequenceStatus.FINISHED_ABORTED]
    assert len(victim.sequences[0].output_token_ids) == 2
    outputs = _run(engine, early)
    assert victim.request_id not in outputs
    for request in (requests[0], requests[2]):
        assert len(outputs[request.request_id].outputs[0].token_ids) == 6
    engine.abort(victim.request_id)  # aborting again, or an unknown id, is a no-op
    engine.abort("no-such-request")


@pytest.mark.real_model
def test_abort_of_a_waiting_request_leaves_nothing_queued(llm: LLM) -> None:
    engine = llm.engine
    request = engine.add_request(FRANCE, GREEDY)
    engine.abort(request.request_id)
    assert not engine.has_unfinished_requests()
    assert engine.step() == []


@pytest.mark.real_model
def test_kv_blocks_follow_the_sequence_not_the_context_window(llm: LLM) -> None:
    engine = llm.engine
    request = engine.add_request(FRANCE, SamplingParams(temperature=0, max_tokens=None))
    engine.step()
    table = engine.kv.block_table(request.sequences[0].seq_id)[0]
    engine.abort(request.request_id)
    block = engine.config.cache.block_size
    assert len(table) == -(-len(request.prompt_token_ids) // block)  # no full-context reservation


# ---- errors --------------------------------------------------------------------------------------

@pytest.mark.real_model
def test_prompt_longer_than_context_window(llm: LLM) -> None:
    with pytest.raises(ContextLengthError, match=r"8192 tokens but the context window is 8192 tokens"):
        llm.generate([[42] * 8192])
    engine = _small_engine(llm, max_model_len=64)
    with pytest.raises(ContextLengthError, match=r"the prompt has 100 tokens .* context window is 64 tokens"):
        engine.add_request([42] * 100)
    assert not engine.has_unfinished_requests()


@pytest.mark.real_model
@pytest.mark.parametrize("prompt, needle", [
    ("", "empty"),
    ([], "empty"),
    ([1, 2, 49152], "49152"),
    ([1, -1], "-1"),
])
def test_bad_prompts(llm: LLM, prompt, needle: str) -> None:
    with pytest.raises(InvalidParameterError, match=needle):
        llm.engine.add_request(prompt, GREEDY)


@pytest.mark.real_model
def test_rejected_generate_leaves_nothing_queued(llm: LLM) -> None:
    with pytest.raises(InvalidParameterError, match="outside the vocabulary"):
        llm.generate([FRANCE, PROMPTS[1], [1, 10**6]], GREEDY)
    with pytest.raises(InvalidParameterError, match="2 SamplingParams for 3 prompts"):
        llm.generate(PROMPTS[:3], [GREEDY, GREEDY])
    assert not llm.engine.has_unfinished_requests() and llm.engine.requests == {}
    outputs = llm.generate([PROMPTS[2]], GREEDY)  # the engine still works, with only this call's request
    assert len(outputs) == 1 and outputs[0].prompt == PROMPTS[2]


@pytest.mark.real_model
def test_duplicate_request_id_is_rejected(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request(FRANCE, GREEDY, request_id="a")
    with pytest.raises(InvalidParameterError, match="'a'"):
        engine.add_request(FRANCE, GREEDY, request_id="a")
    engine.abort("a")


@pytest.mark.parametrize("params, name", [
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"logprobs": 50}, "logprobs"),
    ({"n": 0}, "n"),
    ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    ({"stop": [""]}, "stop"),
])
def test_invalid_sampling_params_name_the_parameter(params: dict, name: str) -> None:
    with pytest.raises(InvalidParameterError, match=rf"\b{name}\b"):
        SamplingParams(**params)
    with pytest.raises(InvalidParameterError, match=rf"\b{name}\b"):
        SamplingParams.from_dict(params)


def test_unknown_sampling_key_is_named() -> None:
    with pytest.raises(InvalidParameterError, match="'temprature'"):
        SamplingParams.from_dict({"temprature": 0.5})


# ---- streaming -----------------------------------------------------------------------------------

@pytest.mark.real_model
@pytest.mark.parametrize("stop", [[], ["answer"], ["is."], [" 2018"]])
def test_stream_deltas_concatenate_to_generate_text(llm: LLM, stop: list[str]) -> None:
    params = SamplingParams(temperature=0, max_tokens=12, stop=stop)
    expected = llm.generate(FRANCE, params)[0].outputs[0].text
    deltas = list(llm.stream(FRANCE, params))
    assert all(deltas)
    # a delta is never taken back: text a stop string later cuts is never shown
    assert "".join(deltas) == expected
    assert not any(s in "".join(deltas) for s in stop)


@pytest.mark.real_model
def test_closing_a_stream_aborts_its_request(llm: LLM) -> None:
    stream = llm.stream(PROMPTS[2], SamplingParams(temperature=0, max_tokens=16))
    assert next(stream)
    assert llm.engine.num_used_blocks >= 1
    stream.close()


# ---- Gemma 3 -------------------------------------------------------------------------------------

@pytest.mark.real_model
def test_gemma3_smoke() -> None:
    # gemma-3-270m is the pretrained (not instruction-tuned) model: its chat answer echoes the
    # question instead of ending the turn (HF transformers does the same), so a completion checks the answer
    gemma = LLM("gemma3-270m", dtype="float32", device="cpu")
    end_of_turn = gemma.tokenizer.token_to_id("<end_of_turn>")
    assert end_of_turn in gemma.tokenizer.stop_token_ids
    chat = gemma.chat(CHAT_FRANCE, SamplingParams(temperature=0, max_tokens=8))[0].outputs[0]
    assert chat.text.strip()
    out = gemma.generate("Question: What is the capital of France?\nAnswer:",
                         SamplingParams(temperature=0, max_tokens=8, stop=["\n"]))[0].outputs[0]
    assert (out.text.strip(), out.finish_reason, out.stop_reason) == ("Paris", "stop", "\n")
    assert gemma.engine.num_used_blocks == 0


# ---- helpers -------------------------------------------------------------------------------------

def _small_engine(llm: LLM, max_model_len: int) -> LLMEngine:
    """A second engine over the already loaded model, with a shorter context window."""
    loaded = LoadedModel(llm.engine.runner.model, llm.model_config, llm.tokenizer, source=None)
    return LLMEngine(loaded, llm.device, EngineConfig(max_model_len=max_model_len))


def _run(engine: LLMEngine, earlier: list | tuple = ()) -> dict:
    """Step until idle; the cumulative output (``earlier`` deltas included) of each request that finished."""
    outputs, finished = {}, {}

    def fold(delta) -> None:
        out = outputs.setdefault(delta.request_id, OutputAccumulator(delta.request_id)).add(delta)
        if delta.finished:
            finished[delta.request_id] = out

    for delta in earlier:
        fold(delta)
    while engine.has_unfinished_requests():
        for delta in engine.step():
            fold(delta)
    return finished
