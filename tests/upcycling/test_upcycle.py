"""Sparse upcycling: the grown model starts where the dense one is (copy init), partitioned
channels add back up to the MLP, the load-balancing loss measures balance, and a short end-to-end
run writes a Mixtral checkpoint transformers loads, with its report and expert-load plot."""

from __future__ import annotations

import json

import pytest
import torch

from tokenmill.errors import InvalidParameterError
from tokenmill.loader import load_model
from tokenmill.models.moe import SparseMoE
from tokenmill.upcycling.config import UpcycleConfig
from tokenmill.upcycling.upcycle import BalanceLoss, upcycle, upcycled_model
from tests.lora.helpers import tiny_hf_model
from tests.model_utils import prompt_logits

IDS = list(range(5, 60))


@pytest.fixture
def dense(tmp_path):
    tiny_hf_model("llama", tmp_path / "dense")
    return load_model(tmp_path / "dense", "float32", "cpu")


def test_copy_init_without_noise_is_the_dense_model(dense):
    moe = upcycled_model(dense, UpcycleConfig(experts=4, top_k=2, noise=0.0))
    assert all(isinstance(b.mlp, SparseMoE) for b in moe.model.layers)
    torch.testing.assert_close(prompt_logits(moe.model, IDS), prompt_logits(dense.model, IDS), rtol=0, atol=1e-4)
    noisy = upcycled_model(dense, UpcycleConfig(experts=4, top_k=2, noise=0.05))
    assert (prompt_logits(noisy.model, IDS) - prompt_logits(dense.model, IDS)).abs().max() > 1e-3


def test_partition_init_adds_back_up_to_the_mlp_when_every_expert_runs(dense):
    """Each expert holds 1/experts of the channels; with top_k = experts and an even router
    (weights 1/k, down scaled by k) their sum is the MLP exactly."""
    moe = upcycled_model(dense, UpcycleConfig(experts=4, top_k=4, init="partition"))
    for block in moe.model.layers:
        block.mlp.router.weight.data.zero_()
    assert moe.config.moe.expert_intermediate_size == dense.config.intermediate_size // 4
    torch.testing.assert_close(prompt_logits(moe.model, IDS), prompt_logits(dense.model, IDS), rtol=0, atol=1e-4)
    with pytest.raises(InvalidParameterError, match="divide"):
        upcycled_model(dense, UpcycleConfig(experts=5, top_k=2, init="partition"))


def test_balance_loss_is_one_when_even_and_experts_when_collapsed(dense):
    moe = upcycled_model(dense, UpcycleConfig(experts=4, top_k=1))
    balance = BalanceLoss(moe.model, weight=1.0)
    try:
        for block in moe.model.layers:
            block.mlp.router.weight.data.zero_()  # uniform probabilities
        prompt_logits_grad(moe.model)
        assert balance()[1]["balance"] == pytest.approx(1.0, abs=1e-5)
        for block in moe.model.layers:  # everything to expert 0
            block.mlp.router.weight.data.zero_()
            block.mlp.router.weight.data[0] = 50.0 * torch.sign(torch.randn(moe.config.hidden_size))
        x = prompt_logits_grad(moe.model)
        assert x is not None
        assert balance()[1]["balance"] > 1.5
    finally:
        balance.remove()


def prompt_logits_grad(model):
    """A training-style forward (autograd on): what BalanceLoss collects from."""
    from tokenmill.quantization.qat import training_logits

    model.requires_grad_(True)
    out = training_logits(model, torch.tensor([IDS]))
    model.requires_grad_(False)
    return out


def test_config_is_checked():
    with pytest.raises(InvalidParameterError, match="top_k"):
        UpcycleConfig(experts=4, top_k=5)
    with pytest.raises(InvalidParameterError, match="init"):
        UpcycleConfig(init="clone")


def test_upcycle_end_to_end_writes_a_mixtral_checkpoint_and_a_report(dense, tmp_path):
    import transformers

    config = UpcycleConfig(experts=4, top_k=2, noise=0.02, balance_weight=0.1, distill={
        "train": {"steps": 6, "lr": 1e-3, "warmup_steps": 1}, "batch_size": 2, "seq_len": 32, "eval_tokens": 256})
    result = upcycle(dense, config, tmp_path / "out", progress=False)
    report = json.loads((tmp_path / "out" / "upcycle.json").read_text())
    assert report == json.loads(json.dumps(result.report))
    ppl = report["perplexity"]
    assert all(ppl[k] > 0 for k in ("dense", "upcycled_before", "upcycled", "dense_trained"))
    load = report["routing"]["load"]
    assert len(load) == dense.config.num_layers and all(abs(sum(row) - 1) < 1e-6 for row in load)
    assert 0 < report["routing"]["entropy_fraction"] <= 1
    assert report["expert_similarity"]["mean_pairwise_cosine"] < 0.9999  # noise and training moved them apart
    assert report["parameters"]["upcycled_active"] < report["parameters"]["upcycled"]
    assert (tmp_path / "out" / "expert_load.png").stat().st_size > 0
    log = json.loads((tmp_path / "out" / "log.json").read_text())
    assert len(log["per_step"]["balance"]) == 6
    saved = json.loads((result.saved / "config.json").read_text())
    assert saved["model_type"] == "mixtral" and saved["num_local_experts"] == 4
    hf = transformers.AutoModelForCausalLM.from_pretrained(result.saved, dtype=torch.float32).eval()
    ours = load_model(result.saved, "float32", "cpu")
    with torch.no_grad():
        expected = hf(torch.tensor([IDS])).logits[0]
    assert (prompt_logits(ours.model, IDS) - expected).abs().max().item() <= 1e-3


def test_a_finished_upcycle_resumes_without_training_again(dense, tmp_path, monkeypatch):
    config = UpcycleConfig(experts=4, top_k=2, baseline=False, distill={
        "train": {"steps": 2, "warmup_steps": 1}, "batch_size": 1, "seq_len": 16, "eval_tokens": 128})
    first = upcycle(dense, config, tmp_path / "out", progress=False)
    import tokenmill.upcycling.upcycle as module

    monkeypatch.setattr(module, "distill", lambda *a, **k: pytest.fail("trained again"))
    again = upcycle(dense, config, tmp_path / "out", progress=False)
    assert again.report["perplexity"] == first.report["perplexity"]
    # the first report's routing ran on the bfloat16 student as saved, the second on it read back in float32
    flat = [x for row in again.report["routing"]["load"] for x in row]
    assert flat == pytest.approx([x for row in first.report["routing"]["load"] for x in row], abs=0.05)
