"""An MoE model behind the server: OpenAI completions, and its routing in /metrics (tokens per
layer and expert, dropped assignments, router entropy)."""

from __future__ import annotations

import math

import httpx

from tokenmill import LLM
from tests.models.moe_helpers import tiny_moe_model
from tests.server.conftest import MODEL, live_server


def test_moe_model_serves_and_reports_routing(tmp_path):
    tiny_moe_model("qwen2_moe", tmp_path)  # layers 0 and 2 MoE (6 experts, top-2), layer 1 dense
    llm = LLM(str(tmp_path), dtype="float32", max_num_seqs=4, kv_cache_memory=2**22, moe_capacity_factor=0.5)
    with live_server(llm) as server:
        server.wait_idle()
        before = server.metrics()  # the warm-up's routing
        prompt_tokens = completion_tokens = 0
        for text in ("hello there", "the quick brown fox jumps"):
            r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": text, "max_tokens": 5,
                                                                  "temperature": 0}, timeout=60)
            assert r.status_code == 200, r.text
            prompt_tokens += r.json()["usage"]["prompt_tokens"]
            completion_tokens += r.json()["usage"]["completion_tokens"]
        server.wait_idle()
        m = server.metrics()
    routed = {k: v for k, v in m.items() if k.startswith("tokenmill:moe_expert_tokens_total")}
    layers = {k.split('layer="')[1].split('"')[0] for k in routed}
    assert layers == {"0", "2"}  # the dense layer routes nothing and is not listed
    assert len(routed) == 2 * 6
    # every token the model ran (prompts; each generated token but the last) went to 2 experts in each MoE layer
    tokens = prompt_tokens + completion_tokens - 2
    assert sum(v - before.get(k, 0) for k, v in routed.items()) == 2 * 2 * tokens
    label = f'{{model_name="{MODEL}"}}'
    assert m[f"tokenmill:moe_dropped_tokens_total{label}"] > 0  # capacity factor 0.5 drops
    assert 0 < m[f"tokenmill:moe_router_entropy{label}"] <= math.log(6)
