"""The real SmolLM2-135M-Instruct behind the server: greedy outputs through the OpenAI SDK equal the
offline engine's for the same requests (completions, chat, streaming)."""

from __future__ import annotations

import openai
import pytest

from tests.server.conftest import live_server
from tokenmill import LLM, SamplingParams

pytestmark = pytest.mark.real_model

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Q: What is 17 * 23?\nA:"]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def test_greedy_equals_offline_engine() -> None:
    offline = LLM("smollm2-135m-instruct", dtype="float32", device="cpu")
    params = SamplingParams(temperature=0, max_tokens=16)
    expected = [o.outputs[0].text for o in offline.generate(PROMPTS, params)]
    expected_chat = offline.chat(CHAT, SamplingParams(temperature=0, max_tokens=32))[0].outputs[0].text
    served = LLM("smollm2-135m-instruct", dtype="float32", device="cpu", policy="priority")
    with live_server(served, served_model_name="smollm2-135m-instruct") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        for prompt, want in zip(PROMPTS, expected):
            got = client.completions.create(model="smollm2-135m-instruct", prompt=prompt, max_tokens=16,
                                            temperature=0)
            assert got.choices[0].text == want
        batch = client.completions.create(model="smollm2-135m-instruct", prompt=PROMPTS, max_tokens=16,
                                          temperature=0)
        assert [c.text for c in batch.choices] == expected
        chat = client.chat.completions.create(model="smollm2-135m-instruct", messages=CHAT, max_tokens=32,
                                              temperature=0)
        assert chat.choices[0].message.content == expected_chat and "Paris" in expected_chat
        stream = client.chat.completions.create(model="smollm2-135m-instruct", messages=CHAT, max_tokens=32,
                                                temperature=0, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream) == expected_chat
        server.wait_idle()
