"""A tiny random Llama checkpoint with a byte-level tokenizer, shared by the offline and CLI tests."""

from __future__ import annotations

import pytest
import torch

from tests.model_utils import save_byte_tokenizer


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("tiny-llama-bench")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                      tie_word_embeddings=True, eos_token_id=256, bos_token_id=None)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    save_byte_tokenizer(path)
    return path
