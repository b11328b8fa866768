"""LoRA training: records read and masked right, the loss falls, checkpoints resume, the output
loads in PEFT and in tokenmill with the same logits, and QLoRA trains over a quantized base."""

from __future__ import annotations

import copy
import json
import random

import pytest
import torch

from tokenmill.errors import InvalidParameterError
from tokenmill.finetune import LoRATrainConfig, train_lora
from tokenmill.finetune.data import IGNORE, collate, read_examples
from tokenmill.loading.sources import resolve_model
from tokenmill.lora.adapter import load_adapter
from tokenmill.lora.slots import LoRASlots
from tokenmill.models.builder import load_float_model
from tokenmill.training.trainer import TrainConfig
from tests.lora.helpers import hf_logits, lora_logits, tiny_hf_model

WORDS = ["red", "blue", "green", "stone", "river", "cloud", "apple", "tiger", "lamp", "sand", "moon", "fish"]


def write_task(path, n: int, seed: int = 0) -> None:
    """A lookup to learn: each word answers with a fixed other word ('red =' -> ' tiger')."""
    rng = random.Random(seed)
    answer = dict(zip(WORDS, WORDS[5:] + WORDS[:5]))
    with open(path, "w") as f:
        for _ in range(n):
            word = rng.choice(WORDS)
            f.write(json.dumps({"prompt": f"{word} =", "completion": f" {answer[word]}"}) + "\n")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("ft-base")
    hf = tiny_hf_model("llama", path)
    with torch.no_grad():  # a head able to express confident predictions: the final norm bounds the
        hf.lm_head.weight.mul_(25)  # hidden state, and LoRA does not adapt the head (std 0.02: logits within +-1.3)
    hf.save_pretrained(path)
    return path, hf


def small_config(steps: int = 30, **extra) -> LoRATrainConfig:
    return LoRATrainConfig(rank=8, alpha=16, batch_size=8, eval_every=10,
                           train=TrainConfig(steps=steps, lr=1e-2, warmup_steps=2, mixed_precision=False), **extra)


def test_records_and_loss_mask(base, tmp_path):
    path, _ = base
    loaded = load_float_model(resolve_model(str(path)))
    tok = loaded.tokenizer
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "ab", "completion": "cd"}, {"text": "xyz"},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}]) + "\n")
    examples = read_examples(data, tok, max_len=64)
    assert examples[0].prompt == tok.encode("ab") and examples[0].completion == tok.encode("cd") + [tok.eos_token_id]
    assert examples[1].prompt == [] and examples[1].completion == tok.encode("xyz")
    assert tok.decode(examples[2].completion).startswith("yo")
    ids, labels = collate(examples[:2], pad_id=0)
    assert ids.shape == (2, 5) and labels[0].tolist() == [IGNORE, tok.encode("c")[0], tok.encode("d")[0],
                                                          tok.eos_token_id, IGNORE]
    assert labels[1].tolist() == tok.encode("yz") + [IGNORE] * 3
    for bad, message in (("not json", "not JSON"), (json.dumps({"prompt": "a"}), "expected"),
                         (json.dumps({"messages": [{"role": "user", "content": "x"}]}), "assistant")):
        data.write_text(bad + "\n")
        with pytest.raises(InvalidParameterError, match=f"line 1: .*{message}"):
            read_examples(data, tok, max_len=64)


def test_training_lowers_the_loss_and_the_adapter_loads_in_peft_and_tokenmill(base, tmp_path):
    path, hf = base
    write_task(tmp_path / "task.jsonl", 200)
    loaded = load_float_model(resolve_model(str(path)))
    result = train_lora(loaded, tmp_path / "task.jsonl", tmp_path / "out", small_config(), progress=False)
    assert result.num_eval == 20 and result.num_train == 180
    assert result.eval_loss_after < 0.5 * result.eval_loss_before
    # PEFT loads it, and gives the logits tokenmill gives with it
    from peft import PeftModel

    ids = loaded.tokenizer.encode("moon =")
    base_logits = hf_logits(hf, ids)
    peft_model = PeftModel.from_pretrained(copy.deepcopy(hf), str(tmp_path / "out")).eval()
    expected = hf_logits(peft_model, ids)
    adapter = load_adapter("trained", tmp_path / "out", loaded.config)
    slots = LoRASlots(loaded.config, 1, 8, torch.float32, "cpu")
    slots.assign(0, adapter)
    got = lora_logits(loaded.model, slots, [ids], [0])[0]
    assert (got - expected).abs().max().item() <= 1e-3
    assert (got - base_logits).abs().max().item() > 0.1


def test_a_second_run_resumes(base, tmp_path):
    path, _ = base
    write_task(tmp_path / "task.jsonl", 100)
    loaded = load_float_model(resolve_model(str(path)))
    first = train_lora(loaded, tmp_path / "task.jsonl", tmp_path / "out", small_config(steps=6), progress=False)
    assert first.log.resumed_at == 0 and len(first.log.values["loss"]) == 6
    again = train_lora(loaded, tmp_path / "task.jsonl", tmp_path / "out", small_config(steps=10), progress=False)
    assert again.log.resumed_at == 6 and len(again.log.values["loss"]) == 10
    assert again.log.values["loss"][:6] == first.log.values["loss"]


def test_qlora_trains_over_an_int4_base(base, tmp_path):
    from tokenmill.quantization.api import quantize_model
    from tokenmill.quantization.config import Int4WeightOnlyConfig

    path, _ = base
    write_task(tmp_path / "task.jsonl", 200)
    loaded = load_float_model(resolve_model(str(path)))
    quantize_model(loaded.model, Int4WeightOnlyConfig(group_size=32, range_search=False), torch.float32,
                   progress=False)
    result = train_lora(loaded, tmp_path / "task.jsonl", tmp_path / "out", small_config(), progress=False)
    assert result.eval_loss_after < 0.5 * result.eval_loss_before
    adapter = load_adapter("q", tmp_path / "out", loaded.config)
    first_layer_a = adapter.weights["layers.0.attn.q"][1]
    assert first_layer_a.abs().max() > 0  # gradients reached the first layer through the quantized ones


TASK_WORDS = """apple river stone cloud tiger lamp sand moon fish table chair window garden bread horse paper glass
sugar candle mirror pencil rocket forest bridge violin castle pillow ocean desert camera jacket ladder basket button
carpet dragon engine feather guitar hammer island kettle lemon marble needle orange parrot rabbit saddle tunnel
wallet yogurt zebra anchor bottle cactus""".split()


def word_code_records(n: int, seed: int) -> list[dict]:
    """A made-up rule the base model cannot guess: three words -> 'last-first'."""
    rng = random.Random(seed)
    records = []
    for _ in range(n):
        w = rng.sample(TASK_WORDS, 3)
        records.append({"prompt": f"Words: {' '.join(w)}\nCode:", "completion": f" {w[2]}-{w[0]}"})
    return records


@pytest.mark.real_model
def test_trained_adapter_beats_the_base_on_held_out_exact_match(tmp_path):
    """SmolLM2: an adapter trained for 15 steps of 8 records (of 320) of the task answers at least 20 points more of
    60 held-out prompts exactly than the base model does."""
    from tokenmill import LLM, SamplingParams
    from tokenmill.loader import load_model

    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in word_code_records(320, seed=0)))
    held = word_code_records(60, seed=1)
    loaded = load_model("smollm2-135m-instruct", "float32", "cpu")
    config = LoRATrainConfig(rank=8, alpha=16, batch_size=8, eval_fraction=0.1, eval_every=0,
                             train=TrainConfig(steps=15, lr=1e-3, warmup_steps=3))
    train_lora(loaded, tmp_path / "train.jsonl", tmp_path / "adapter", config, progress=False)
    del loaded
    llm = LLM("smollm2-135m-instruct", enable_lora=True, max_lora_rank=8, max_num_seqs=16)
    llm.load_lora("code", str(tmp_path / "adapter"))
    params = SamplingParams(temperature=0, max_tokens=8, stop=["\n"])
    prompts = [r["prompt"] for r in held]

    def exact(lora) -> float:
        outputs = llm.generate(prompts, params, lora=lora)
        return 100 * sum(o.outputs[0].text.strip() == r["completion"].strip() for o, r in zip(outputs, held)) / len(held)

    base, adapted = exact(None), exact("code")
    print(f"\nheld-out exact match: base {base:.0f}%, adapted {adapted:.0f}%")
    assert adapted >= base + 20, (base, adapted)
