"""Several models behind one endpoint: listing, answering by name, loading and unloading at runtime."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.server.conftest import build_tiny_checkpoint, live_server
from tokenmill import LLM, SamplingParams
from tokenmill.server.config import CostConfig
from tokenmill.server.model_pool import ModelLoader, ModelSpec

POOL = 64 * 16 * 2 * 2 * 2 * 32 * 4  # the tiny model's 64-block pool, in bytes
OPTIONS = {"dtype": "float32", "device": "cpu", "max_num_seqs": 4}


@pytest.fixture(scope="module")
def other_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-b")
    build_tiny_checkpoint(path, seed=1, tied=False)
    return path


@pytest.fixture(scope="module")
def pair(tiny_dir, other_dir):
    """Two different tiny models, loaded by the server's loader from one KV budget."""
    loader = ModelLoader({**OPTIONS, "kv_cache_memory": 3 * POOL}, spare=POOL)
    models = {name: loader.load(str(path), loader.share(2))[0] for name, path in (("a", tiny_dir), ("b", other_dir))}
    return loader, models


def _greedy(llm: LLM, prompt: str, n: int = 8) -> str:
    return llm.generate(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0].outputs[0].text


def test_two_models_answer_by_name_and_split_one_budget(pair):
    loader, models = pair
    want = {name: _greedy(llm, "hello there") for name, llm in models.items()}
    assert want["a"] != want["b"]  # different weights, different answers: the test can tell them apart
    with live_server(models, loader=loader, cost=CostConfig(price_per_hour=1.0)) as server:
        listed = httpx.get(server.url + "/v1/models", timeout=10).json()["data"]
        assert [card["id"] for card in listed] == ["a", "b"]

        async def ask_all():
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                return await asyncio.gather(*[client.post("/v1/completions", json={
                    "model": name, "prompt": "hello there", "max_tokens": 8, "temperature": 0, "ignore_eos": True})
                    for name in ("a", "b", "a", "b")])
        for r, name in zip(asyncio.run(ask_all()), "abab"):
            assert r.status_code == 200, r.text
            assert r.json()["model"] == name and r.json()["choices"][0]["text"] == want[name]
        default = httpx.post(server.url + "/v1/completions", timeout=30,
                             json={"prompt": "hello there", "max_tokens": 8, "temperature": 0, "ignore_eos": True})
        assert default.json()["choices"][0]["text"] == want["a"]  # no model: the first served
        missing = httpx.post(server.url + "/v1/completions", timeout=10, json={"model": "c", "prompt": "x"})
        assert missing.status_code == 404 and "'a', 'b'" in missing.json()["error"]["message"]

        served = httpx.get(server.url + "/admin/models", timeout=10).json()
        pools = [m["kv_cache_memory"] for m in served["data"]]
        assert served["kv_cache_budget"] == 3 * POOL and sum(pools) <= 2 * POOL
        assert served["kv_cache_available"] == 3 * POOL - sum(pools)
        m = server.metrics()
        for name in "ab":
            assert m[f'tokenmill:generation_tokens_total{{model_name="{name}"}}'] == 16 + (8 if name == "a" else 0)
            assert m[f'tokenmill:request_cost_total{{model_name="{name}",tenant="default"}}'] > 0
        server.wait_idle()


def test_load_and_unload_a_model_at_runtime(pair, other_dir):
    loader, models = pair
    with live_server({"a": models["a"]}, loader=loader) as server:
        body = {"name": "c", "source": str(other_dir), "kv_cache_memory": POOL}
        loaded = httpx.post(server.url + "/admin/models", json=body, timeout=120)
        assert loaded.status_code == 200, loaded.text
        info = loaded.json()
        assert info["name"] == "c" and info["cold_start_seconds"] > 0 and not info["warming"]
        assert server.metrics()['tokenmill:model_cold_start_seconds{model_name="c"}'] == info["cold_start_seconds"]
        answer = httpx.post(server.url + "/v1/completions", timeout=30, json={
            "model": "c", "prompt": "hello there", "max_tokens": 8, "temperature": 0, "ignore_eos": True})
        assert answer.json()["choices"][0]["text"] == _greedy(models["b"], "hello there")
        assert httpx.post(server.url + "/admin/models", json=body, timeout=10).json()["error"]["code"] == "name_taken"
        too_big = httpx.post(server.url + "/admin/models", timeout=10,
                             json={**body, "name": "d", "kv_cache_memory": 100 * POOL})
        assert too_big.status_code == 409 and too_big.json()["error"]["code"] == "kv_budget_exhausted"
        bad = httpx.post(server.url + "/admin/models", timeout=60, json={**body, "name": "d", "source": "/nowhere"})
        assert bad.status_code == 400 and "nowhere" in bad.json()["error"]["message"]
        bad = httpx.post(server.url + "/admin/models", timeout=60, json={**body, "name": "d", "options": {"colour": 1}})
        assert bad.status_code == 400 and "colour" in bad.json()["error"]["message"]

        async def unload_while_running():
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                running = asyncio.create_task(client.post("/v1/completions", json={
                    "model": "c", "prompt": "x", "max_tokens": 200, "ignore_eos": True}))
                while not server.state.engine.snapshots.get("c") or not server.state.engine.snapshots["c"].num_running:
                    await asyncio.sleep(0.005)
                gone = await client.delete("/admin/models/c")
                return gone, await running
        gone, ended = asyncio.run(unload_while_running())
        assert gone.status_code == 200 and gone.json()["ended_requests"] == 1
        assert ended.status_code == 503 and ended.json()["error"]["code"] == "model_unloaded"
        assert httpx.post(server.url + "/v1/completions", timeout=10,
                          json={"model": "c", "prompt": "x"}).status_code == 404
        assert [m["id"] for m in httpx.get(server.url + "/v1/models", timeout=10).json()["data"]] == ["a"]
        last = httpx.delete(server.url + "/admin/models/a", timeout=10)
        assert last.status_code == 409 and last.json()["error"]["code"] == "last_model"
        costs = httpx.get(server.url + "/admin/costs", timeout=10).json()["since_start"]
        assert costs["lines"].get("load:c", 0) >= 0 and "load:c" in costs["lines"]
        server.wait_idle()


def test_model_specs_parse():
    assert ModelSpec.parse("small=smollm2-135m-instruct") == ModelSpec("small", "smollm2-135m-instruct")
    assert ModelSpec.parse("/models/x.gguf") == ModelSpec(None, "/models/x.gguf")
    with pytest.raises(Exception, match="NAME=SOURCE"):
        ModelSpec.parse("a:b=c")
