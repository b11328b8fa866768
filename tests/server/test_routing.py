"""Routed model names: rule, cascade and learned policies over two served models."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server.conftest import build_tiny_checkpoint, live_server
from tokenmill import LLM, SamplingParams
from tokenmill.cli import main
from tokenmill.errors import InvalidParameterError
from tokenmill.server.config import CostConfig
from tokenmill.server.routing import load_routes
from tokenmill.server.tenancy import hash_key

OPTIONS = {"dtype": "float32", "device": "cpu", "max_num_seqs": 4, "kv_cache_memory": 64 * 16 * 2 * 2 * 2 * 32 * 4}


@pytest.fixture(scope="module")
def models(tiny_llm, tmp_path_factory):
    """``small``: the tiny model (it repeats the prompt's last byte, confidently); ``large``: another."""
    path = tmp_path_factory.mktemp("tiny-llama-large")
    build_tiny_checkpoint(path, seed=1, tied=False)
    return {"small": tiny_llm, "large": LLM(str(path), **OPTIONS)}


def _greedy(llm: LLM, prompt: str) -> str:
    return llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].outputs[0].text


def _routes(tmp_path, *routes) -> str:
    path = tmp_path / "routes.json"
    path.write_text(json.dumps({"routes": list(routes)}))
    return str(path)


def _ask(server, model: str, prompt: str, **extra) -> httpx.Response:
    r = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, **extra})
    assert r.status_code == 200, r.text
    return r


def test_rule_route_by_prompt_length_and_tags(models, tmp_path):
    routes = _routes(tmp_path, {"name": "auto", "policy": "rule", "default": "large", "rules": [
        {"tags": {"tier": "batch"}, "model": "small"}, {"max_prompt_tokens": 8, "model": "small"}]})
    want = {name: _greedy(llm, p) for name, llm in models.items() for p in ("short",)}
    with live_server(models, routes=routes) as server:
        short = _ask(server, "auto", "short")
        assert short.json()["model"] == "small" and short.json()["choices"][0]["text"] == want["small"]
        assert short.headers["X-Tokenmill-Model"] == "small" and short.headers["X-Tokenmill-Route"] == "auto"
        long = _ask(server, "auto", "a much longer prompt than eight bytes")
        assert long.json()["model"] == "large"
        tagged = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
            "model": "auto", "messages": [{"role": "user", "content": "a long question " * 3}], "max_tokens": 3,
            "metadata": {"tier": "batch"}})
        assert tagged.json()["model"] == "small"
        listed = {c["id"]: c for c in httpx.get(server.url + "/v1/models", timeout=10).json()["data"]}
        assert listed["auto"]["route"] == ["large", "small"]
        m = server.metrics()
        assert m['tokenmill:route_requests_total{model_name="small",route="auto"}'] == 2
        assert m['tokenmill:route_requests_total{model_name="large",route="auto"}'] == 1


@pytest.mark.parametrize("stream", [False, True])
def test_cascade_answers_with_the_cheap_model_or_escalates(models, tmp_path, stream):
    routes = _routes(tmp_path, {"name": "trusting", "policy": "cascade", "models": ["small", "large"],
                                "threshold": -1e9},
                     {"name": "doubting", "policy": "cascade", "models": ["small", "large"], "signal": "entropy",
                      "threshold": 1.0})
    log = tmp_path / "route.jsonl"
    want = {name: _greedy(llm, "hello") for name, llm in models.items()}
    cost = CostConfig(price_per_hour=3600.0, slo_ttft=60.0, slo_tpot=60.0)
    with live_server(models, routes=routes, route_log=str(log), cost=cost) as server:
        for route, answer in (("trusting", "small"), ("doubting", "large")):
            if stream:
                body = {"model": route, "prompt": "hello", "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                        "stream": True, "stream_options": {"include_usage": True}}
                with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
                    assert r.headers["X-Tokenmill-Model"] == answer
                    chunks = [json.loads(line[6:]) for line in r.iter_lines()
                              if line.startswith("data: ") and line != "data: [DONE]"]
                text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
                assert {c["model"] for c in chunks} == {answer}
                usage = chunks[-1]["usage"]
            else:
                r = _ask(server, route, "hello")
                text, usage = r.json()["choices"][0]["text"], r.json()["usage"]
                assert r.json()["model"] == answer and r.json()["choices"][0]["logprobs"] is None
            assert text == want[answer]
            assert usage["cost"] > 0
        costs = httpx.get(server.url + "/admin/costs", params={"group_by": "route,model"}, timeout=10).json()
        by = {(row["route"], row["model"]): row for row in costs["groups"]}
        # the escalated request paid for both attempts; the trusted one for one
        assert set(by) == {("trusting", "small"), ("doubting", "small"), ("doubting", "large")}
        m = server.metrics()
        assert m['tokenmill:route_escalations_total{route="doubting"}'] == 1
        assert 'tokenmill:route_escalations_total{route="trusting"}' not in m
        assert m['tokenmill:slo_requests_total{met="true",tenant="default"}'] == 2  # once per request answered
        server.wait_idle()
    logged = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(e["route"], e["escalated"]) for e in logged] == [("trusting", False), ("doubting", True)]
    assert logged[0]["prompt_token_ids"] == models["small"].tokenizer.encode("hello")


def test_a_router_trained_from_a_log_routes_by_what_it_learned(models, tmp_path, capsys):
    tok = models["small"].tokenizer
    log = tmp_path / "outcomes.jsonl"
    # prompts about arithmetic were fine on the cheap model, prompts about poems were not
    lines = [{"prompt_token_ids": tok.encode(f"add {i} and {i + 3}"), "label": 1} for i in range(40)]
    lines += [{"prompt_token_ids": tok.encode(f"write a poem about {w}"), "escalated": True}
              for w in ("rain", "snow", "cats", "dogs", "sea", "trees", "night", "dawn") * 5]
    log.write_text("\n".join(json.dumps(line) for line in lines))
    router = tmp_path / "router.json"
    assert main(["route", "train", "--log", str(log), "--out", str(router)]) == 0
    printed = capsys.readouterr().out
    assert "80 examples (40 where the cheap model sufficed)" in printed and "held out 16: accuracy 1.000" in printed
    routes = _routes(tmp_path, {"name": "learned", "policy": "learned", "models": ["small", "large"],
                                "router": "router.json"})
    with live_server(models, routes=routes) as server:
        assert _ask(server, "learned", "add 100 and 103").json()["model"] == "small"
        assert _ask(server, "learned", "write a poem about wind").json()["model"] == "large"


def test_route_budget_and_permissions(models, tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"tenants": [
        {"name": "router-only", "key_sha256": hash_key("k1"), "models": ["auto"]},
        {"name": "broke", "key_sha256": hash_key("k2"), "budget": 1e-9}]}))
    routes = _routes(tmp_path, {"name": "auto", "policy": "cascade", "models": ["small", "large"]})
    with live_server(models, routes=routes, api_keys=str(keys),
                     cost=CostConfig(price_per_hour=3600.0, reserve_prompt_per_1k=1.0,
                                     reserve_completion_per_1k=1.0)) as server:
        def ask(key, model):
            return httpx.post(server.url + "/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                              json={"model": model, "prompt": "hi", "max_tokens": 2})
        assert ask("k1", "auto").status_code == 200
        assert ask("k1", "large").json()["error"]["code"] == "model_not_allowed"
        refused = ask("k2", "auto")
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "budget_exceeded"


def test_routes_file_errors_name_the_problem(tmp_path):
    served = ["small", "large"]
    cases = [({"name": "auto", "policy": "vote", "models": served}, "policy must be one of"),
             ({"name": "auto", "policy": "cascade", "models": ["small", "huge"]}, "'huge', not served"),
             ({"name": "small", "policy": "cascade", "models": served}, "is taken"),
             ({"name": "auto", "policy": "cascade", "models": served, "signal": "vibes"}, "signal must be one of"),
             ({"name": "auto", "policy": "cascade", "models": served, "colour": 1}, "unknown key(s) colour"),
             ({"name": "auto", "policy": "rule", "rules": [{"model": "small", "weekday": 1}], "default": "large"},
              "weekday"),
             ({"name": "auto", "policy": "learned", "models": served, "router": "missing.json"}, "cannot read")]
    for route, message in cases:
        with pytest.raises(InvalidParameterError, match=message.replace("(", r"\(").replace(")", r"\)")):
            load_routes(_routes(tmp_path, route), served)
