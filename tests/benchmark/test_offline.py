"""The offline benchmark on a tiny random Llama: exact token counts, per-request latencies and
step-level MBU / MFU that follow from the model's cost and the given ceilings."""

from __future__ import annotations

import pytest

from tokenmill import LLM
from tokenmill.benchmark.hardware import HardwareCeilings, ModelCost
from tokenmill.benchmark.offline import (
    OfflineConfig,
    format_offline,
    plot_offline_roofline,
    run_offline,
)

CEILINGS = HardwareCeilings("cpu:test", 1e10, 1e10, 5e9, {"float32": 5e10, "bfloat16": 2e10}, "now")


@pytest.fixture(scope="module")
def result(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", max_num_seqs=4, kv_cache_memory=4 << 20)
    return run_offline(llm, OfflineConfig(num_requests=6, input_len="20:60", output_len="5:9", seed=3), CEILINGS,
                       progress=False), ModelCost.of(llm.engine.runner.model)


def test_every_request_generates_exactly_its_output_length(result) -> None:
    data, _ = result
    s = data["summary"]
    assert s["requests"] == 6
    assert 6 * 5 <= s["total_output_tokens"] <= 6 * 9 and 6 * 20 <= s["total_input_tokens"] <= 6 * 60
    assert s["output_tok_s"] == pytest.approx(s["total_output_tokens"] / s["duration_s"])
    assert s["ttft"]["count"] == 6 and s["tpot"]["count"] == 6 and s["e2el"]["count"] == 6
    assert s["ttft"]["median"] < s["e2el"]["median"]


def test_step_utilization_follows_the_cost_model(result) -> None:
    data, cost = result
    s = data["summary"]
    assert s["num_decode_steps"] > 0 and s["num_steps"] > s["num_decode_steps"]
    assert 1 <= s["mean_decode_batch"] <= 4  # max_num_seqs
    assert s["mbu"] > 0 and s["mfu"] > 0 and s["mfu_prefill"] > 0
    (_, decode_ai, decode_flops), (_, prefill_ai, _) = data["roofline"]
    # a decode step reads all weights for a handful of tokens; a prefill step computes many tokens
    assert decode_ai < prefill_ai
    assert decode_ai < 2 * cost.matmul_params * 4 / cost.weight_bytes
    assert decode_flops / decode_ai / CEILINGS.memory_bandwidth == pytest.approx(s["mbu"])
    assert data["model"]["weight_bytes"] == cost.weight_bytes


def test_table_and_roofline(result, tmp_path) -> None:
    data, _ = result
    text = format_offline(data)
    assert "MBU (decode steps)" in text and "Output token throughput" in text
    png = plot_offline_roofline(data, tmp_path / "roof.png")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_moe_model_routing_bytes_and_expert_load(tmp_path) -> None:
    """A tiny Mixtral: the result carries its routing (every prompt and decode token routed to
    top_k experts in each layer), a decode step's bytes count only the experts its routers
    picked, and the expert-load plot is drawn."""
    from tokenmill.models.moe_stats import plot_expert_load
    from tests.models.moe_helpers import tiny_moe_model

    tiny_moe_model("mixtral", tmp_path / "m")
    llm = LLM(str(tmp_path / "m"), dtype="float32", device="cpu", max_num_seqs=4, kv_cache_memory=4 << 20)
    data = run_offline(llm, OfflineConfig(num_requests=5, input_len="10:30", output_len="4:6", seed=1), CEILINGS,
                       progress=False)
    cost = ModelCost.of(llm.engine.runner.model)
    moe, s = data["moe"], data["summary"]
    assert cost.routed_experts == 3 * 6 and cost.expert_bytes > 0
    assert cost.bytes_read(0, active_experts=0) == cost.weight_bytes - 18 * cost.expert_bytes
    ran = s["total_input_tokens"] + s["total_output_tokens"] - s["requests"]  # the last token of each is not run
    assert moe["assignments"] == 3 * 2 * ran  # warm-up drained before the run
    assert len(moe["load"]) == 3 and all(abs(sum(row) - 1) < 1e-9 for row in moe["load"])
    assert moe["max_load_vs_even"] >= 1 and moe["dropped"] == 0
    assert "MoE: most loaded expert" in format_offline(data)
    png = plot_expert_load(moe["load"], tmp_path / "load.png", "load")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_arrivals_at_a_rate_under_a_concurrency_cap(tiny_llama_dir) -> None:
    """Requests arrive at their seeded offsets and at most max_concurrency run at once; each is timed
    from when it was sent, so the run lasts at least until the last arrival."""
    from tokenmill.benchmark.arrivals import ArrivalProcess

    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", max_num_seqs=4, kv_cache_memory=4 << 20)
    config = OfflineConfig(num_requests=6, input_len="8", output_len="5", seed=2, request_rate=40, max_concurrency=2)
    s = run_offline(llm, config, CEILINGS, progress=False)["summary"]
    assert (s["requests"], s["total_output_tokens"]) == (6, 30)
    assert s["duration_s"] >= ArrivalProcess(40, seed=2).offsets(6)[-1]
    assert max(step.num_scheduled for step in llm.engine.stats) <= 2  # the cap, not max_num_seqs
    assert s["ttft"]["count"] == 6 and s["ttft"]["median"] < s["e2el"]["median"]
