"""EAGLE heads: trained by tokenmill on the target's own text (a tiny target here), saved, resumed,
loaded by the engine, and drafting with output identical to speculation off."""

from __future__ import annotations

import json

import pytest

from tests.server.conftest import build_tiny_checkpoint
from tokenmill import LLM, SamplingParams
from tokenmill.engine.spec.eagle import CONFIG_FILE, WEIGHTS_FILE, EagleHead
from tokenmill.errors import InvalidParameterError, ModelFormatError
from tokenmill.spec_heads import DATA_FILE, HeadTrainingConfig, train_eagle_head
from tokenmill.training.trainer import CHECKPOINT

SMALL = dict(prompts=10, max_tokens=24, passage_chars=80, draft_vocab=96, batch_size=2, seq_len=64,
             checkpoint_every=10, lr=2e-3, warmup_steps=2)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-eagle-target")
    build_tiny_checkpoint(path)
    return path


@pytest.fixture(scope="module")
def head_dir(tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("eagle-head")
    report = train_eagle_head(str(tiny_dir), out, HeadTrainingConfig(steps=30, **SMALL), progress=False,
                              device="cpu")
    return out, report


def test_training_writes_the_head_its_report_data_and_a_checkpoint(head_dir):
    out, report = head_dir
    for name in (CONFIG_FILE, WEIGHTS_FILE, DATA_FILE, CHECKPOINT):
        assert (out / name).is_file(), name
    meta = json.loads((out / CONFIG_FILE).read_text())
    assert meta["kind"] == "eagle" and meta["draft_vocab"] == 96 and meta["train_sequences"] == 9
    assert 0 <= meta["held_out_top1"] <= 1 and meta["training"]["steps"] == 30 and meta["resumed_at"] == 0


def test_more_steps_resume_from_the_checkpoint(head_dir, tiny_dir):
    out, _ = head_dir
    report = train_eagle_head(str(tiny_dir), out, HeadTrainingConfig(steps=40, **SMALL), progress=False,
                              device="cpu")
    assert report["resumed_at"] == 30 and report["training"]["steps"] == 40


def test_the_engine_drafts_with_the_head_and_keeps_the_output(head_dir, tiny_dir):
    out, _ = head_dir
    prompts = [[(5 * i + j) % 250 for j in range(6 + 7 * i)] for i in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=7, max_tokens=30, ignore_eos=True)] * 3
    plain = LLM(str(tiny_dir), dtype="float32", device="cpu")
    spec = LLM(str(tiny_dir), dtype="float32", device="cpu",
               speculative={"method": "eagle", "draft_model": str(out), "num_speculative_tokens": 3,
                            "adaptive": False})
    for e, g in zip(plain.generate(prompts, params), spec.generate(prompts, params)):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids
    c = spec.engine.drafter.counters
    assert c.num_drafts > 0 and c.num_accepted_tokens > 0
    assert spec.engine.num_used_blocks == 0


def test_a_head_for_another_model_or_no_head_is_refused(head_dir, tmp_path):
    from tests.benchmark.test_hardware import tiny_model

    out, _ = head_dir
    with pytest.raises(ModelFormatError, match="not an EAGLE head directory"):
        EagleHead.load(tmp_path, tiny_model(True))
    other = tiny_model(True)
    other.config = other.config.__class__(**{**other.config.__dict__, "hidden_size": 32, "head_dim": 8})
    with pytest.raises(InvalidParameterError, match="trained for a model of hidden size 64"):
        EagleHead.load(out, other)


def test_a_head_trains_on_a_distill_runs_teacher_text_instead_of_generating(tiny_dir, tmp_path):
    seqs = [[(3 * i + j) % 250 for j in range(20 + i)] for i in range(12)]
    text = tmp_path / "teacher_text.json"
    text.write_text(json.dumps({"settings": {}, "tokens": sum(map(len, seqs)), "sequences": seqs}))
    out = tmp_path / "head"
    report = train_eagle_head(str(tiny_dir), out, HeadTrainingConfig(steps=4, texts=(str(text),), **SMALL),
                              progress=False, device="cpu")
    assert report["train_sequences"] == 11 and report["train_tokens"] == sum(map(len, seqs[:11]))
    import torch

    data = torch.load(out / DATA_FILE, weights_only=False)
    assert [d["ids"].tolist() for d in data] == seqs  # the file's text, in order, not the model's answers


def test_teacher_text_from_another_vocabulary_or_not_one_is_refused(tiny_dir, tmp_path):
    text = tmp_path / "teacher_text.json"
    text.write_text(json.dumps({"sequences": [[1, 2, 300_000]]}))
    with pytest.raises(InvalidParameterError, match="outside this model's vocabulary"):
        train_eagle_head(str(tiny_dir), tmp_path / "a", HeadTrainingConfig(steps=1, texts=(str(text),), **SMALL),
                         progress=False, device="cpu")
    text.write_text("[1, 2, 3]")
    with pytest.raises(InvalidParameterError, match="is not a teacher_text.json"):
        train_eagle_head(str(tiny_dir), tmp_path / "b", HeadTrainingConfig(steps=1, texts=(str(text),), **SMALL),
                         progress=False, device="cpu")
