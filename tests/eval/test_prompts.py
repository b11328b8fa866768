"""Chat prompts: seeded, rendered by the chat template, and the held-out split's topics apart from training's."""

from __future__ import annotations

import pytest

from tests.model_utils import save_byte_tokenizer
from tokenmill.errors import InvalidParameterError
from tokenmill.eval.prompts import EVAL_TOPICS, TOPICS, chat_prompts
from tokenmill.loading.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    path = tmp_path_factory.mktemp("tok")
    save_byte_tokenizer(path)
    return Tokenizer.from_hf_dir(path)


def test_prompts_are_seeded_chat_turns(tokenizer):
    a, b = chat_prompts(tokenizer, 6, seed=3), chat_prompts(tokenizer, 6, seed=3)
    assert a == b and a != chat_prompts(tokenizer, 6, seed=4)
    texts = [tokenizer.decode(p, skip_special_tokens=False) for p in a]
    assert all(t.startswith("<|im_start|>user\n") and t.endswith("<|im_start|>assistant\n") for t in texts)
    assert sum(any(topic in t for topic in TOPICS) for t in texts) >= 3  # half are generic requests


def test_held_out_prompts_never_name_a_training_topic(tokenizer):
    assert not set(TOPICS) & set(EVAL_TOPICS)
    texts = [tokenizer.decode(p, skip_special_tokens=False) for p in chat_prompts(tokenizer, 40, 0, split="eval")]
    assert all(any(topic in t for topic in EVAL_TOPICS) and not any(topic in t for topic in TOPICS) for t in texts)
    with pytest.raises(InvalidParameterError, match="split must be one of"):
        chat_prompts(tokenizer, 1, 0, split="test")
