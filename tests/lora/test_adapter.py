"""Reading LoRA adapters: PEFT directories and GGUF LoRA files, their scaling, and what is refused."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tokenmill.errors import InvalidParameterError
from tokenmill.loading.hf_config import hf_model_config
from tokenmill.lora.adapter import load_adapter
from tests.lora.helpers import random_adapter, tiny_hf_model


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("base")
    return tiny_hf_model("llama", path), hf_model_config(json.loads((path / "config.json").read_text()))


def _peft_pair(peft_model, layer: int, proj: str, group: str = "self_attn"):
    module = getattr(getattr(peft_model.base_model.model.model.layers[layer], group), proj)
    return module.lora_A["default"].weight.detach(), module.lora_B["default"].weight.detach()


def test_peft_weights_and_scaling(base, tmp_path):
    hf, cfg = base
    peft_model = random_adapter(hf, tmp_path / "a", seed=1, r=8, alpha=32, targets=["q_proj", "down_proj"])
    adapter = load_adapter("a", tmp_path / "a", cfg)
    assert set(adapter.weights) == {f"layers.{i}.{p}" for i in range(3) for p in ("attn.q", "mlp.down")}
    assert adapter.targets == {"attn.q", "mlp.down"} and adapter.rank == 8
    a, b = _peft_pair(peft_model, 1, "down_proj", "mlp")
    torch.testing.assert_close(adapter.weights["layers.1.mlp.down"][0], a)
    torch.testing.assert_close(adapter.weights["layers.1.mlp.down"][1], b * 32 / 8)
    assert len(adapter.content_hash) == 64


def test_rslora_and_patterns(base, tmp_path):
    hf, cfg = base
    peft_model = random_adapter(hf, tmp_path / "a", seed=2, r=8, alpha=16, use_rslora=True,
                                rank_pattern={"layers.2.self_attn.q_proj": 4}, alpha_pattern={"q_proj": 2})
    adapter = load_adapter("a", tmp_path / "a", cfg)
    a, b = _peft_pair(peft_model, 2, "q_proj")
    assert adapter.weights["layers.2.attn.q"][0].shape == (4, 64)
    torch.testing.assert_close(adapter.weights["layers.2.attn.q"][1], b * 2 / math.sqrt(4))
    _, b0 = _peft_pair(peft_model, 0, "v_proj")
    torch.testing.assert_close(adapter.weights["layers.0.attn.v"][1], b0 * 16 / math.sqrt(8))


def _permute_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter's interleaving of Llama q/k rows (rotate-half -> interleaved)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf_lora(adapter_dir, out, cfg, arch: str = "llama", alpha: float | None = 16.0) -> None:
    """The PEFT adapter at ``adapter_dir`` written the way llama.cpp's convert_lora_to_gguf.py writes it."""
    import gguf
    from safetensors.torch import load_file

    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
             "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_type("adapter")
    writer.add_string("adapter.type", "lora")
    if alpha is not None:
        writer.add_float32("adapter.lora.alpha", alpha)
    for key, t in load_file(str(adapter_dir / "adapter_model.safetensors")).items():
        parts = key.split(".")
        layer, proj, which = parts[4], parts[6], parts[7]
        if which == "lora_B" and proj in ("q_proj", "k_proj") and arch == "llama":
            t = _permute_rows(t, cfg.num_heads if proj == "q_proj" else cfg.num_kv_heads)
        writer.add_tensor(f"blk.{layer}.{names[proj]}.weight.lora_{which[-1].lower()}", t.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_gguf_lora_equals_peft(base, tmp_path, arch):
    hf, cfg = base
    random_adapter(hf, tmp_path / "a", seed=3, r=8, alpha=16)
    write_gguf_lora(tmp_path / "a", tmp_path / "a.gguf", cfg, arch=arch)
    peft_adapter, gguf_adapter = load_adapter("p", tmp_path / "a", cfg), load_adapter("g", tmp_path / "a.gguf", cfg)
    assert peft_adapter.weights.keys() == gguf_adapter.weights.keys()
    for key, (a, b) in peft_adapter.weights.items():
        torch.testing.assert_close(gguf_adapter.weights[key][0], a)
        torch.testing.assert_close(gguf_adapter.weights[key][1], b)


def test_gguf_without_alpha_has_scale_one(base, tmp_path):
    hf, cfg = base
    peft_model = random_adapter(hf, tmp_path / "a", seed=3, r=8, alpha=16, targets=["v_proj"])
    write_gguf_lora(tmp_path / "a", tmp_path / "a.gguf", cfg, alpha=None)
    adapter = load_adapter("g", tmp_path / "a.gguf", cfg)
    torch.testing.assert_close(adapter.weights["layers.0.attn.v"][1], _peft_pair(peft_model, 0, "v_proj")[1])


def _edit_config(path, **changes) -> None:
    config = json.loads((path / "adapter_config.json").read_text())
    config.update(changes)
    (path / "adapter_config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("change,message", [
    (dict(use_dora=True), "DoRA"),
    (dict(bias="lora_only"), "bias"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save"),
    (dict(peft_type="IA3"), "peft_type"),
])
def test_unsupported_peft_features_are_refused(base, tmp_path, change, message):
    hf, cfg = base
    random_adapter(hf, tmp_path / "a", seed=1)
    _edit_config(tmp_path / "a", **change)
    with pytest.raises(InvalidParameterError, match=message):
        load_adapter("a", tmp_path / "a", cfg)


def test_refusals_name_the_problem(base, tmp_path, smollm2_gguf):
    hf, cfg = base
    with pytest.raises(InvalidParameterError, match="no file or directory"):
        load_adapter("a", tmp_path / "missing", cfg)
    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidParameterError, match="adapter_config.json"):
        load_adapter("a", tmp_path / "empty", cfg)
    with pytest.raises(InvalidParameterError, match="not a GGUF LoRA adapter"):
        load_adapter("a", smollm2_gguf, cfg)
    # an adapter made for another model size
    from dataclasses import replace

    random_adapter(hf, tmp_path / "a", seed=1, targets=["o_proj"])
    with pytest.raises(InvalidParameterError, match="does not fit the model"):
        load_adapter("a", tmp_path / "a", replace(cfg, hidden_size=96))
    # adapters on the embedding are not served
    random_adapter(hf, tmp_path / "e", seed=1, targets=["embed_tokens"])
    with pytest.raises(InvalidParameterError, match="embed"):
        load_adapter("e", tmp_path / "e", cfg)
    # rank above the kernels' maximum
    random_adapter(hf, tmp_path / "big", seed=1, r=65, targets=["q_proj"])
    with pytest.raises(InvalidParameterError, match="rank 65"):
        load_adapter("big", tmp_path / "big", cfg)
    # a pickle is refused, not unpickled
    random_adapter(hf, tmp_path / "bin", seed=1, targets=["q_proj"])
    (tmp_path / "bin" / "adapter_model.safetensors").rename(tmp_path / "bin" / "adapter_model.bin")
    with pytest.raises(InvalidParameterError, match="pickle"):
        load_adapter("bin", tmp_path / "bin", cfg)


def test_content_hash_follows_the_weights(base, tmp_path):
    hf, cfg = base
    random_adapter(hf, tmp_path / "a", seed=1)
    first = load_adapter("a", tmp_path / "a", cfg).content_hash
    assert load_adapter("b", tmp_path / "a", cfg).content_hash == first
    random_adapter(hf, tmp_path / "a", seed=2)
    assert load_adapter("a", tmp_path / "a", cfg).content_hash != first
