"""The MoE layer's routing: capacity-factor drops against a reference computed here, the
counters the engine reports, sigmoid scoring, and refusals."""

from __future__ import annotations

import math

import pytest
import torch

from tokenmill.config import MoESpec
from tokenmill.errors import InvalidParameterError
from tokenmill.loading.checkpoint import open_hf
from tokenmill.models.builder import build_model
from tokenmill.models.moe import SparseMoE, route
from tokenmill.models.moe_stats import ExpertStats
from tests.model_utils import prompt_logits
from tests.models.moe_helpers import tiny_moe_model

HIDDEN = 32


def random_moe(spec: MoESpec, seed: int = 0) -> SparseMoE:
    torch.manual_seed(seed)
    moe = SparseMoE(HIDDEN, spec, "silu", 0)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return moe


def reference_drops(ids: torch.Tensor, num_experts: int, capacity_factor: float) -> list[list[bool]]:
    """Switch/GShard capacity by hand: cap = ceil(c * T * k / E); first choices of all tokens
    in token order, then second choices ...; an assignment past its expert's cap is dropped."""
    tokens, k = ids.shape
    cap = math.ceil(capacity_factor * tokens * k / num_experts)
    used = [0] * num_experts
    kept = [[False] * k for _ in range(tokens)]
    for rank in range(k):
        for t in range(tokens):
            e = int(ids[t, rank])
            if used[e] < cap:
                used[e] += 1
                kept[t][rank] = True
    return kept


def by_hand(moe: SparseMoE, x: torch.Tensor, kept: list[list[bool]] | None) -> torch.Tensor:
    """Each token alone: the sum over its kept experts of weight * expert(token)."""
    weights, ids, _ = route(moe.router(x), moe.spec)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for r in range(ids.shape[1]):
            if kept is None or kept[t][r]:
                out[t] += weights[t, r] * moe.experts[int(ids[t, r])](x[t:t + 1])[0]
    return out


@pytest.mark.parametrize("capacity_factor", [0.5, 1.0, 1.25])
def test_capacity_factor_drops_what_the_reference_drops(capacity_factor):
    spec = MoESpec(num_experts=4, top_k=2, expert_intermediate_size=24)
    moe = random_moe(spec)
    x = torch.randn(37, HIDDEN, generator=torch.Generator().manual_seed(1))
    x[:20] += 2 * torch.randn(HIDDEN, generator=torch.Generator().manual_seed(2))  # skewed: some experts overflow
    _, ids, _ = route(moe.router(x), spec)
    kept = reference_drops(ids, 4, capacity_factor)
    expected_dropped = sum(not k for row in kept for k in row)
    moe.stats = ExpertStats(1, 4)
    moe.capacity_factor = capacity_factor
    with torch.no_grad():
        got = moe(x)
    step = moe.stats.drain()
    assert step.dropped == expected_dropped
    if capacity_factor <= 1.0:
        assert expected_dropped > 0  # the skew overflows some expert
    per_expert = [sum(1 for t in range(37) for r in range(2) if not kept[t][r] and ids[t, r] == e) for e in range(4)]
    assert step.dropped_per_expert[0] == per_expert
    torch.testing.assert_close(got, by_hand(moe, x, kept), rtol=1e-5, atol=1e-5)


def test_no_drop_mode_runs_every_assignment_and_counts_it():
    spec = MoESpec(num_experts=5, top_k=2, expert_intermediate_size=24, norm_topk_prob=False)
    moe = random_moe(spec, seed=3)
    moe.stats = ExpertStats(1, 5)
    x = torch.randn(23, HIDDEN, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        got = moe(x)
        _, ids, _ = route(moe.router(x), spec)
    torch.testing.assert_close(got, by_hand(moe, x, None), rtol=1e-5, atol=1e-5)
    step = moe.stats.drain()
    assert step.tokens_per_expert[0] == torch.bincount(ids.reshape(-1), minlength=5).tolist()
    assert sum(step.tokens_per_expert[0]) == 23 * 2 and step.dropped == 0
    assert 0 < step.mean_entropy <= math.log(5)
    assert moe.stats.drain() is None  # drained


def test_sigmoid_scoring_picks_and_weighs_by_sigmoid():
    spec = MoESpec(num_experts=4, top_k=2, expert_intermediate_size=8, scoring="sigmoid", norm_topk_prob=True)
    logits = torch.tensor([[0.0, 2.0, -1.0, 1.0]])
    weights, ids, scores = route(logits, spec)
    assert ids.tolist() == [[1, 3]]
    s = torch.sigmoid(torch.tensor([2.0, 1.0]))
    torch.testing.assert_close(weights[0], s / s.sum())
    torch.testing.assert_close(scores, torch.sigmoid(logits))


def test_spec_is_checked():
    with pytest.raises(InvalidParameterError, match="top_k"):
        MoESpec(num_experts=4, top_k=5, expert_intermediate_size=8)
    with pytest.raises(InvalidParameterError, match="scoring"):
        MoESpec(num_experts=4, top_k=2, expert_intermediate_size=8, scoring="relu")


def test_model_stats_count_every_moe_layer(tmp_path):
    """Qwen2-MoE with a dense layer (mlp_only_layers=[1]): layers 0 and 2 route every token to
    top_k experts, layer 1 routes nothing."""
    tiny_moe_model("qwen2_moe", tmp_path)
    model = build_model(open_hf(tmp_path), torch.float32, "cpu")
    assert model.config.moe.layers == (0, 2)
    prompt_logits(model, list(range(30)))
    step = model.expert_stats.drain()
    assert [sum(row) for row in step.tokens_per_expert] == [30 * 2, 0, 30 * 2]
    assert step.routed_tokens == 2 * 30


def test_engine_reports_routing_per_step_and_applies_the_capacity_factor(tmp_path):
    from tokenmill import LLM, SamplingParams

    tiny_moe_model("mixtral", tmp_path)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    exact = LLM(str(tmp_path), dtype="float32", kv_cache_memory=2**22)
    exact.generate([list(range(20)), list(range(50, 61))], params)
    steps = [s.moe for s in exact.engine.stats]
    assert all(s is not None for s in steps)
    assert sum(s.routed_tokens for s in steps) == 3 * (20 + 11 + 2 * 3)  # 3 layers; prompts, then 3 decode steps
    assert sum(s.dropped for s in steps) == 0
    capped = LLM(str(tmp_path), dtype="float32", kv_cache_memory=2**22, moe_capacity_factor=0.5)
    capped.generate([list(range(20)), list(range(50, 61))], params)
    assert sum(s.moe.dropped for s in capped.engine.stats) > 0


def test_capacity_factor_is_refused_for_a_dense_model_and_checked(tmp_path):
    from tokenmill import LLM
    from tests.lora.helpers import tiny_hf_model

    tiny_hf_model("llama", tmp_path)
    with pytest.raises(InvalidParameterError, match="no experts"):
        LLM(str(tmp_path), dtype="float32", kv_cache_memory=2**22, moe_capacity_factor=1.0)
    with pytest.raises(InvalidParameterError, match="moe_capacity_factor"):
        LLM(str(tmp_path), dtype="float32", kv_cache_memory=2**22, moe_capacity_factor=0)


def test_lora_on_an_moe_model_serves_attention_and_refuses_expert_mlps(tmp_path):
    import json

    from safetensors.torch import save_file

    from tokenmill.lora.adapter import load_adapter

    tiny_moe_model("mixtral", tmp_path / "base")
    cfg = open_hf(tmp_path / "base").config

    def write(module: str, out: int, inp: int, path):
        path.mkdir()
        prefix = f"base_model.model.model.layers.0.{module}"
        save_file({f"{prefix}.lora_A.weight": torch.randn(4, inp), f"{prefix}.lora_B.weight": torch.randn(out, 4)},
                  str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8}))

    write("self_attn.q_proj", 64, 64, tmp_path / "attn")
    assert load_adapter("attn", tmp_path / "attn", cfg).weights
    write("mlp.gate_proj", 96, 64, tmp_path / "mlp")
    with pytest.raises(InvalidParameterError, match="MoE layer"):
        load_adapter("mlp", tmp_path / "mlp", cfg)
