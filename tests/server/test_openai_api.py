"""The server through the official OpenAI SDK: completions, chat, streaming with usage, logprobs,
n > 1, stop sequences, seeds, echo, token-id prompts, cached tokens; greedy outputs equal the
offline engine's for the same request."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server.conftest import MODEL
from tokenmill import LLM, SamplingParams

PROMPT = "The quick brown fox jumps over"


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(tiny_dir) -> LLM:
    """A second copy of the same checkpoint: the reference the server must match."""
    return LLM(str(tiny_dir), dtype="float32", device="cpu")


def test_completion_greedy_equals_offline_engine(client, offline) -> None:
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    ref = offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    assert out.choices[0].text == ref.text
    assert out.choices[0].finish_reason == ref.finish_reason
    assert out.usage.prompt_tokens == len(offline.tokenizer.encode(PROMPT))
    assert out.usage.completion_tokens == len(ref.token_ids)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    assert out.model == MODEL and out.object == "text_completion"


def test_chat_greedy_equals_offline_engine(client, offline) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10, temperature=0)
    ref = offline.chat(messages, SamplingParams(temperature=0, max_tokens=10))[0].outputs[0]
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == ref.text
    assert out.usage.prompt_tokens == len(offline.render_chat(messages))
    assert out.usage.completion_tokens == len(ref.token_ids)


def test_streaming_completion_with_usage(client, offline) -> None:
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    text_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert text_chunks[0].choices[0].text != "", "the first chunk must carry the first token"
    assert all(c.usage is None for c in text_chunks)
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 10
    assert text_chunks[-1].choices[0].finish_reason == "length"
    ref = offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=10))[0].outputs[0]
    assert "".join(c.choices[0].text for c in text_chunks) == ref.text


def test_streaming_chat_first_chunk_has_role_and_content(client) -> None:
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}],
                                            max_tokens=8, temperature=0, stream=True)
    chunks = list(stream)
    first = chunks[0].choices[0].delta
    assert first.role == "assistant" and first.content
    assert chunks[-1].choices[0].finish_reason == "length"
    full = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}],
                                          max_tokens=8, temperature=0)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content


def test_raw_sse_framing(server) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as response:
        raw = response.read().decode()
    assert response.headers["content-type"].startswith("text/event-stream")
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-2])
    assert '"choices":[]' in events[-3] and '"usage":{"prompt_tokens"' in events[-3]


def test_logprobs_completion_and_chat(client, offline) -> None:
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    ref = offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=5, logprobs=3))[0].outputs[0]
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert lp.token_logprobs == pytest.approx([e.logprob for e in ref.logprobs], abs=1e-4)
    assert all(3 <= len(top) <= 4 for top in lp.top_logprobs)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)
    assert "".join(c.token for c in content) == chat.choices[0].message.content


def test_echo_with_logprobs_returns_prompt_tokens(client) -> None:
    out = client.completions.create(model=MODEL, prompt="abc", max_tokens=2, temperature=0, echo=True, logprobs=1)
    choice = out.choices[0]
    assert choice.text.startswith("abc")
    assert choice.logprobs.token_logprobs[0] is None and len(choice.logprobs.tokens) == 3 + 2
    assert all(v is not None for v in choice.logprobs.token_logprobs[1:])


def test_n_samples_and_seed_reproducibility(client) -> None:
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=20.0, n=3, seed=1234,  # flat: samples differ
                  extra_body={"ignore_eos": True})
    first = client.completions.create(**kwargs)
    again = client.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert len({c.text for c in first.choices}) > 1, "n samples of one seed should differ from each other"
    assert first.usage.completion_tokens == 36
    other = client.completions.create(**{**kwargs, "seed": 99})
    assert [c.text for c in other.choices] != [c.text for c in first.choices]


def test_stop_sequence_cuts_the_text(client) -> None:
    sampled = dict(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=20.0, seed=7,
                   extra_body={"ignore_eos": True})  # seeded and flat: varied, reproducible text
    full = client.completions.create(**sampled).choices[0].text
    stop = full[6:8]
    cut = full.index(stop)
    assert len(stop) == 2 and cut > 0
    out = client.completions.create(**sampled, stop=[stop])
    assert out.choices[0].text == full[:cut]
    assert out.choices[0].finish_reason == "stop"
    streamed = client.completions.create(**sampled, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == full[:cut]


def test_token_id_and_batched_prompts(client, offline) -> None:
    ids = offline.tokenizer.encode(PROMPT)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    by_text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    batch = client.completions.create(model=MODEL, prompt=[PROMPT, "hello"], max_tokens=6, temperature=0, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == by_text.choices[0].text


def test_cached_tokens_reported_for_a_repeated_prefix(client) -> None:
    prompt = "A long shared prefix that spans several KV blocks of sixteen tokens each. " * 2
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached >= 16 and cached % 16 == 0 and cached < again.usage.prompt_tokens


def test_models_tokenize_detokenize(server, client, offline) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    tok = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}).json()
    assert tok["tokens"] == offline.tokenizer.encode(PROMPT) and tok["count"] == len(tok["tokens"])
    assert tok["max_model_len"] == 256
    chat = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["tokens"] == offline.render_chat([{"role": "user", "content": "Hi"}])
    back = httpx.post(server.url + "/detokenize", json={"tokens": tok["tokens"]}).json()
    assert back == {"prompt": PROMPT}


def test_health_ready_and_metrics(server, client) -> None:
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/ready").json() == {"status": "ready"}
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
    server.wait_idle()
    m = server.metrics()
    label = f'{{model_name="{MODEL}"}}'
    for name in ("time_to_first_token_seconds_count", "time_per_output_token_seconds_count",
                 "inter_token_latency_seconds_count", "e2e_request_latency_seconds_count",
                 "request_queue_time_seconds_count", "prompt_tokens_total", "generation_tokens_total",
                 "prefix_cache_queries_total"):
        assert m[f"tokenmill:{name}{label}"] > 0, name
    assert f"tokenmill:kv_cache_usage_perc{label}" in m and f"tokenmill:num_preemptions_total{label}" in m
    assert m['tokenmill:tenant_requests_total{tenant="default"}'] > 0
