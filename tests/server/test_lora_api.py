"""LoRA adapters through the OpenAI API: a request names its adapter in ``model`` (or
``base:adapter``), /v1/models lists them, vLLM's load/unload endpoints work at runtime (admin only
with keys), tenants can be limited to named adapters, usage and metrics per adapter, and
unloading under load loses or corrupts no request."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from tests.lora.helpers import random_adapter
from tests.server.conftest import MODEL, build_tiny_checkpoint, live_server
from tokenmill import LLM, SamplingParams
from tokenmill.server.tenancy import hash_key

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory):
    import transformers

    path = tmp_path_factory.mktemp("lora-server")
    build_tiny_checkpoint(path / "base")
    base = transformers.AutoModelForCausalLM.from_pretrained(path / "base")
    for i in range(3):
        random_adapter(base, path / f"a{i}", seed=40 + i, r=8, alpha=64)
    return path


def make_llm(lora_dir) -> LLM:
    return LLM(str(lora_dir / "base"), dtype="float32", device="cpu", max_num_seqs=8, enable_lora=True,
               max_loras=2, kv_cache_memory=4 << 20)


@pytest.fixture(scope="module")
def expected(lora_dir) -> dict[str | None, str]:
    """Each adapter's (and the base's) greedy text, from the offline API."""
    llm = make_llm(lora_dir)
    for i in range(3):
        llm.load_lora(f"a{i}", str(lora_dir / f"a{i}"))
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    names = [None, "a0", "a1", "a2"]
    outputs = llm.generate([PROMPT] * 4, params, lora=names)
    return {name: out.outputs[0].text for name, out in zip(names, outputs)}


def complete(server, model: str, key: str | None = None, **extra) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    body = {"model": model, "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True, **extra}
    return httpx.post(server.url + "/v1/completions", json=body, headers=headers, timeout=60)


def test_requests_name_their_adapter(lora_dir, expected):
    assert len(set(expected.values())) == 4  # each adapter changes the text
    llm = make_llm(lora_dir)
    with live_server(llm, lora_modules=f"a0={lora_dir / 'a0'},a1={lora_dir / 'a1'}") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
        for name in (None, "a0", "a1"):
            model = name or MODEL
            out = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0,
                                            extra_body={"ignore_eos": True})
            assert out.choices[0].text == expected[name] and out.model == model
        assert complete(server, f"{MODEL}:a1").json()["choices"][0]["text"] == expected["a1"]
        chat = client.chat.completions.create(model="a0", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert chat.model == "a0"
        models = {m.id: m for m in client.models.list().data}
        assert set(models) == {MODEL, "a0", "a1"}
        assert models["a0"].parent == MODEL and models["a0"].root == str(lora_dir / "a0")
        missing = complete(server, "a2")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        assert "'a0'" in missing.json()["error"]["message"]
        # load at runtime, use it, replace it in place, unload it
        load = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path":
                                                                       str(lora_dir / "a2")}, timeout=30)
        assert load.status_code == 200, load.text
        assert complete(server, "a2").json()["choices"][0]["text"] == expected["a2"]
        again = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path":
                                                                        str(lora_dir / "a0")}, timeout=30)
        assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]
        inplace = httpx.post(server.url + "/v1/load_lora_adapter", json={
            "lora_name": "a2", "lora_path": str(lora_dir / "a0"), "load_inplace": True}, timeout=30)
        assert inplace.status_code == 200
        assert complete(server, "a2").json()["choices"][0]["text"] == expected["a0"]
        bad = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nope"},
                         timeout=30)
        assert bad.status_code == 400 and "/nope" in bad.json()["error"]["message"]
        unload = httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "a2"}, timeout=30)
        assert unload.status_code == 200 and unload.json()["status"] == "unloaded"
        assert complete(server, "a2").status_code == 404
        gone = httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "a2"}, timeout=30)
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "lora_not_found"
        # per adapter: usage and metrics
        usage = httpx.get(server.url + "/admin/usage", timeout=10).json()["adapters"]
        assert usage["a0"]["requests"] >= 2 and usage["a0"]["completion_tokens"] >= 16
        samples = server.metrics()
        assert samples[f'tokenmill:lora_requests_total{{lora_name="a1",model_name="{MODEL}"}}'] == 2
        assert samples[f'tokenmill:lora_loaded_adapters{{model_name="{MODEL}"}}'] == 2
        server.wait_idle()


def test_unloading_under_load_loses_no_request(lora_dir, expected):
    """Streams on every adapter in flight while their adapters are unloaded and replaced: each
    finishes with exactly the text its adapter gives."""
    llm = make_llm(lora_dir)
    with live_server(llm, lora_modules=",".join(f"a{i}={lora_dir / f'a{i}'}" for i in range(3))) as server:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused")

        started = {"a0": asyncio.Event(), "a1": asyncio.Event()}

        async def stream(model: str) -> str:
            chunks = await client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0,
                                                     stream=True, extra_body={"ignore_eos": True})
            text = []
            async for chunk in chunks:
                text.extend(c.text for c in chunk.choices)
                if model in started and text:
                    started[model].set()
            return "".join(text)

        async def churn() -> None:
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
                for event in started.values():  # both adapters' requests are generating
                    await event.wait()
                assert (await http.post("/v1/unload_lora_adapter", json={"lora_name": "a0"})).status_code == 200
                load = await http.post("/v1/load_lora_adapter", json={
                    "lora_name": "a1", "lora_path": str(lora_dir / "a2"), "load_inplace": True})
                assert load.status_code == 200

        async def run():
            models = [MODEL, "a0", "a1", "a2"] * 2  # all admitted at once (max_num_seqs 8); max_loras 2
            results = await asyncio.gather(*(stream(m) for m in models), churn())
            return models, results[:-1]

        models, texts = asyncio.run(run())
        assert texts == [expected[None if m == MODEL else m] for m in models]
        server.wait_idle()
        assert all(info.in_use == 0 for info in llm.engine.lora.list())


def test_keys_gate_loading_and_limit_tenants_to_their_adapters(lora_dir, expected, tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"tenants": [
        {"name": "ops", "key_sha256": hash_key("ops-key"), "admin": True},
        {"name": "dave", "key_sha256": hash_key("dave-key"), "models": ["a1"]},
    ]}))
    llm = make_llm(lora_dir)
    with live_server(llm, api_keys=str(keys), lora_modules=f"a0={lora_dir / 'a0'},a1={lora_dir / 'a1'}") as server:
        body = {"lora_name": "a2", "lora_path": str(lora_dir / "a2")}
        denied = httpx.post(server.url + "/v1/load_lora_adapter", json=body, timeout=30,
                            headers={"authorization": "Bearer dave-key"})
        assert denied.status_code == 403 and denied.json()["error"]["code"] == "not_admin"
        assert httpx.post(server.url + "/v1/load_lora_adapter", json=body, timeout=30).status_code == 401
        assert httpx.post(server.url + "/v1/load_lora_adapter", json=body, timeout=30,
                          headers={"authorization": "Bearer ops-key"}).status_code == 200
        assert complete(server, "a1", "dave-key").json()["choices"][0]["text"] == expected["a1"]
        for model in ("a0", MODEL):
            refused = complete(server, model, "dave-key")
            assert refused.status_code == 403 and refused.json()["error"]["code"] == "model_not_allowed"
        listed = httpx.get(server.url + "/v1/models", headers={"authorization": "Bearer dave-key"}, timeout=10)
        assert [m["id"] for m in listed.json()["data"]] == ["a1"]
        assert complete(server, "a2", "ops-key").json()["choices"][0]["text"] == expected["a2"]


def test_server_without_lora_refuses_adapter_endpoints(tiny_llm):
    with live_server(tiny_llm) as server:
        response = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/x"},
                              timeout=10)
        assert response.status_code == 400 and response.json()["error"]["code"] == "lora_disabled"
        assert complete(server, "x").status_code == 404
