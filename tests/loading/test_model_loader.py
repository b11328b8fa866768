"""Loading models the engine cannot run: each refusal is a TokenmillError naming what is wrong.

(The GGUF Llama q/k row un-permutation is checked by tests/models/test_parity_real.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFWriter
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers

from tokenmill import LLM, SamplingParams
from tokenmill.errors import ModelFormatError, UnsupportedModelError

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 16, 2, 1, 8, 32, 12
LLAMA_CONFIG = {
    "model_type": "llama", "vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": FFN,
    "num_hidden_layers": 1, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
    "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
}


def llama_tensors() -> dict[str, torch.Tensor]:
    """Every tensor of a one-layer Llama in HF naming, random."""
    g = torch.Generator().manual_seed(0)
    shapes = {
        "model.embed_tokens.weight": (VOCAB, HIDDEN),
        "model.layers.0.input_layernorm.weight": (HIDDEN,),
        "model.layers.0.self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
        "model.layers.0.self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
        "model.layers.0.self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
        "model.layers.0.self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
        "model.layers.0.post_attention_layernorm.weight": (HIDDEN,),
        "model.layers.0.mlp.gate_proj.weight": (FFN, HIDDEN),
        "model.layers.0.mlp.up_proj.weight": (FFN, HIDDEN),
        "model.layers.0.mlp.down_proj.weight": (HIDDEN, FFN),
        "model.norm.weight": (HIDDEN,),
    }
    return {name: torch.randn(shape, generator=g) for name, shape in shapes.items()}


def write_hf_dir(path: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    """config.json, model.safetensors and a word-level tokenizer.json over VOCAB words."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "model.safetensors"))
    words = ["<unk>", "<eos>"] + [chr(ord("a") + i) for i in range(VOCAB - 2)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    return path


def test_complete_tiny_hf_llama_loads_and_generates(tmp_path: Path) -> None:
    """The control for the tests below: the same directory with every tensor in place works."""
    llm = LLM(write_hf_dir(tmp_path / "tiny", LLAMA_CONFIG, llama_tensors()), dtype="float32", device="cpu")
    out = llm.generate("a b c", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 3 and all(0 <= t < VOCAB for t in out.token_ids)


@pytest.mark.parametrize("dropped, needle", [
    ("model.layers.0.self_attn.o_proj.weight", "layers.0.attn.o.weight"),
    ("model.norm.weight", "'norm.weight'"),
    ("model.layers.0.self_attn.k_proj.weight", "layers.0.attn.qkv.weight"),  # one of the fused q/k/v parts
    ("model.layers.0.mlp.up_proj.weight", "layers.0.mlp.gate_up.weight"),
])
def test_hf_checkpoint_missing_a_tensor_names_it(tmp_path: Path, dropped: str, needle: str) -> None:
    tensors = llama_tensors()
    del tensors[dropped]
    with pytest.raises(ModelFormatError, match="missing|incomplete") as info:
        LLM(write_hf_dir(tmp_path / "tiny", LLAMA_CONFIG, tensors), dtype="float32", device="cpu")
    assert needle in str(info.value)


def test_hf_checkpoint_with_a_wrongly_shaped_tensor(tmp_path: Path) -> None:
    tensors = llama_tensors()
    tensors["model.layers.0.mlp.down_proj.weight"] = torch.zeros(HIDDEN, FFN + 1)
    with pytest.raises(ModelFormatError, match="layers.0.mlp.down.weight"):
        LLM(write_hf_dir(tmp_path / "tiny", LLAMA_CONFIG, tensors), dtype="float32", device="cpu")


def test_hf_unsupported_model_type(tmp_path: Path) -> None:
    config = {"model_type": "gpt2", "vocab_size": VOCAB, "n_embd": HIDDEN, "n_layer": 1, "n_head": HEADS}
    path = write_hf_dir(tmp_path / "gpt2", config, {"wte.weight": torch.zeros(VOCAB, HIDDEN)})
    with pytest.raises(UnsupportedModelError, match="unsupported model_type 'gpt2'") as info:
        LLM(path, dtype="float32", device="cpu")
    assert "llama" in str(info.value)  # and says what is supported


def test_hf_config_missing_a_field(tmp_path: Path) -> None:
    config = {k: v for k, v in LLAMA_CONFIG.items() if k != "intermediate_size"}
    with pytest.raises(ModelFormatError, match="'intermediate_size'"):
        LLM(write_hf_dir(tmp_path / "tiny", config, llama_tensors()), dtype="float32", device="cpu")


def test_gguf_unsupported_architecture(tmp_path: Path) -> None:
    # no tokenizer metadata either: the architecture is the problem to report
    path = tmp_path / "falcon-tiny.gguf"
    writer = GGUFWriter(str(path), "falcon")
    writer.add_block_count(1)
    writer.add_embedding_length(HIDDEN)
    writer.add_head_count(HEADS)
    writer.add_tensor("token_embd.weight", np.zeros((VOCAB, HIDDEN), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="unsupported model architecture 'falcon'"):
        LLM(path, dtype="float32", device="cpu")
