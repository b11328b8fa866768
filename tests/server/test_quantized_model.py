"""A quantized checkpoint served through the OpenAI API answers as the quantized model does."""

from __future__ import annotations

import openai
import pytest

from tests.model_utils import prompt_logits
from tests.server.conftest import MODEL, live_server
from tokenmill import LLM, SamplingParams
from tokenmill.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig, quantize, save_quantized

PROMPT = "The quick brown fox"
CONFIGS = {"int8": Int8WeightOnlyConfig(), "int4-g32": Int4WeightOnlyConfig(group_size=32)}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_quantized_checkpoint_served_answers_like_the_quantized_model(name, tiny_dir, tmp_path) -> None:
    loaded = quantize(str(tiny_dir), CONFIGS[name], dtype="float32", progress=False)
    out_dir = save_quantized(loaded, tmp_path / name)
    ids = loaded.tokenizer.encode(PROMPT)
    expected: list[int] = []
    for _ in range(10):  # greedy by hand through the in-memory quantized model: no engine, no server
        expected.append(int(prompt_logits(loaded.model, ids + expected)[-1].argmax()))
    llm = LLM(str(out_dir), dtype="float32", device="cpu", max_num_seqs=4, kv_cache_memory=2**22)
    offline = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0].outputs[0]
    assert offline.token_ids == expected
    messages = [{"role": "user", "content": PROMPT}]
    # before the server starts: while it runs, its engine thread alone may step the engine
    reference = llm.chat(messages, SamplingParams(temperature=0, max_tokens=6))[0].outputs[0]
    with live_server(llm) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert out.choices[0].text == offline.text and out.usage.completion_tokens == 10
        chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
        assert chat.choices[0].message.content == reference.text
        assert chat.usage.completion_tokens == len(reference.token_ids)
        server.wait_idle()
