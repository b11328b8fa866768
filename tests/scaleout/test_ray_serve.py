"""``tokenmill serve --replicas``: a local Ray cluster (2 CPUs), 2 replicas of 1 thread each of the tiny
model, the front serving HTTP. One cluster for the module (starting one takes ~10 s); the kill test
runs last.

What a user relies on: the openai SDK works through the endpoint and answers as one process would;
a shared-prefix workload lands on the replica holding the prefix, and once that replica evicted
it, routing follows the reported block hashes to the replica that still holds it; a replica killed
under load loses no request that had sent no bytes; a tenant's quota holds across replicas.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
import ray

from tests.scaleout.conftest import MODEL, OPTIONS, served_front
from tests.server.conftest import build_tiny_checkpoint
from tokenmill import LLM, SamplingParams
from tokenmill.scaleout.config import ScaleOutConfig
from tokenmill.scaleout.deploy import APP_NAME, DEPLOYMENT
from tokenmill.scaleout.replica import ReplicaRequest
from tokenmill.server.config import CostConfig, ServerConfig
from tokenmill.server.tenancy import hash_key

PREFIX_P = "Shared system prompt P: long enough to fill several KV blocks of sixteen bytes each. " * 2
PREFIX_Q = "Another system prompt Q, which only the second replica has seen in its cache so far. " * 2
USER = {"authorization": "Bearer user-key"}


@pytest.fixture(scope="module")
def front(tiny_dir, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    keys.write_text(json.dumps({"tenants": [
        {"name": "user", "key_sha256": hash_key("user-key")},
        {"name": "alice", "key_sha256": hash_key("alice-key"), "requests_per_minute": 3},
        {"name": "ops", "key_sha256": hash_key("ops-key"), "admin": True}]}))
    config = ServerConfig(served_model_name=MODEL, api_keys=str(keys))
    scale = ScaleOutConfig(replicas=2, replica_threads=1, routing_stats_period=0.2, optimistic_ttl=1.0)
    with served_front(str(tiny_dir), config, CostConfig(price_per_hour=1.0), scale) as server:
        yield server


def complete(front, prompt: str, key: str = "user-key", **body) -> httpx.Response:
    return httpx.post(front.url + "/v1/completions", headers={"authorization": f"Bearer {key}"}, timeout=60,
                      json={"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, **body})


def routed(front) -> dict[str, int]:
    """Requests each replica took so far (the front's count)."""
    return {rid: n for (rid, event), n in front.state.engine.events.items() if event == "routed"}


def direct(front, prompt: str, exclude: tuple[str, ...], key: str = "user-key") -> str:
    """Run a prompt as ``key``'s tenant (its cache salt) on a replica, through the deployment's handle,
    keeping it off ``exclude`` -> the replica that ran it."""
    state = front.state
    salt = state.tenancy.cache_salt(state.tenancy.authenticate(f"Bearer {key}"), None)
    ids = state.default_model.tokenizer.encode(prompt)
    request = ReplicaRequest(f"direct-{time.monotonic_ns()}", ids, SamplingParams(max_tokens=1), 30.0, None,
                             cache_salt=salt, block_hashes=state.engine.block_hashes(ids, SamplingParams(), salt, None),
                             exclude=exclude)
    replica = None
    handle = next(iter(state.engine.versions.values())).handle
    for item in handle.options(stream=True).generate.remote(request):
        replica = item.replica_id
        if item.update is not None and request.prefilled_at is None:
            request.prefilled_at = time.time()
    request.finished_at = time.time()  # marked as the front marks its requests, for the router
    return replica


def test_openai_sdk_through_the_endpoint_answers_as_one_process(front, tiny_dir) -> None:
    client = openai.OpenAI(base_url=front.url + "/v1", api_key="user-key", max_retries=0)
    assert [m.id for m in client.models.list().data] == [MODEL]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}],
                                          max_tokens=6, temperature=0)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=6, temperature=0, stream=True)
        if chunk.choices)
    assert chat.choices[0].message.content == streamed and chat.usage.completion_tokens == 6
    completion = client.completions.create(model=MODEL, prompt="abcdef", max_tokens=5, temperature=0)
    local = LLM(str(tiny_dir), **OPTIONS).generate(["abcdef"], SamplingParams(max_tokens=5, temperature=0))
    assert completion.choices[0].text == local[0].outputs[0].text
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=front.url + "/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=5, temperature=-1)


def test_shared_prefix_lands_on_the_replica_holding_it_and_follows_evictions(front) -> None:
    before = routed(front)
    first = complete(front, PREFIX_P + "question 0")
    assert first.status_code == 200, first.text
    holder = next(rid for rid, n in routed(front).items() if n > before.get(rid, 0))
    # no wait for the holder's next report (a loaded machine delays Ray's polling by seconds): the
    # front marks its requests' first token and end for the router, which so knows the holder idle
    # and holding P
    for i in range(1, 7):
        r = complete(front, PREFIX_P + f"question {i}")
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 160, r.text
    after = routed(front)
    assert after[holder] - before.get(holder, 0) == 7  # every one on the holder
    other = next(rid for rid in after if rid != holder) if len(after) > 1 else None
    if other is None:  # the other replica has not taken a request yet: find it
        other = direct(front, "warm the other replica", exclude=(holder,))
    assert other != holder

    # the other replica gets P too (a request kept off the holder), then the holder evicts P:
    # distinct prompts, kept on the holder, cycle its 64-block pool
    assert direct(front, PREFIX_P + "question on the other", exclude=(holder,)) == other
    for i in range(8):
        assert direct(front, f"{i} filler " * 25, exclude=(other,)) == holder
    time.sleep(2.5)  # the holder's report without P: the eviction is only known from reports
    r = complete(front, PREFIX_P + "question after eviction")
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 160, r.text
    decisions = front.state.engine.ledger.snapshot()[0]
    assert decisions.get((other, "prefix"), 0) >= 1
    text = httpx.get(front.url + "/metrics", headers={"authorization": "Bearer ops-key"}).text
    assert f'tokenmill:router_decisions_total{{model_name="{MODEL}",reason="prefix",replica="{holder}"}}' in text
    assert f'tokenmill:replica_prefix_cache_hit_rate{{model_name="{MODEL}",replica="{other}"}}' in text
    # the model-level engine figures, as one process reports them: the fleet's
    samples = front.metrics({"authorization": "Bearer ops-key"})
    assert samples[f'tokenmill:prefix_cache_hits_total{{model_name="{MODEL}"}}'] >= 7 * 10
    assert samples[f'tokenmill:num_requests_running{{model_name="{MODEL}"}}'] == 0


def test_a_tenants_quota_holds_across_replicas(front) -> None:
    holder_p = direct(front, PREFIX_P + "seed", exclude=(), key="alice-key")
    direct(front, PREFIX_Q + "seed", exclude=(holder_p,), key="alice-key")
    before = routed(front)
    codes = [complete(front, prefix + "alice asks", key="alice-key").status_code
             for prefix in (PREFIX_P, PREFIX_Q, PREFIX_P)]
    assert codes == [200, 200, 200]
    assert all(n > before.get(rid, 0) for rid, n in routed(front).items())  # both replicas served alice
    refused = complete(front, PREFIX_Q + "alice asks again", key="alice-key")
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "tenant_requests"


def test_a_replica_killed_under_load_loses_no_request_that_sent_no_bytes(front) -> None:
    """8 requests of 200 tokens, half streamed; the busier replica is killed while they run. Every
    non-streamed one and every stream that had sent no token yet completes (retried on the other
    replica); a stream that had sent tokens completes or ends with an error event, never silently short."""
    results: dict[int, tuple] = {}

    def run(i: int) -> None:
        body = {"model": MODEL, "prompt": f"{i} load " * 6, "max_tokens": 200, "ignore_eos": True,
                "temperature": 0}
        if i % 2:
            with httpx.stream("POST", front.url + "/v1/completions", headers=USER, timeout=120,
                              json={**body, "stream": True}) as r:
                tokens, first_at, error, done = 0, None, None, False
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        done = True
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        error = event["error"]
                    elif event["choices"][0]["text"]:
                        tokens += 1
                        first_at = first_at or time.monotonic()
                results[i] = ("stream", r.status_code, tokens, first_at, error, done)
        else:
            r = httpx.post(front.url + "/v1/completions", headers=USER, json=body, timeout=120)
            results[i] = ("json", r.status_code, r.json()["usage"]["completion_tokens"] if r.status_code == 200
                          else r.text, None, None, True)

    before = routed(front)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 20
    while sum(routed(front).values()) - sum(before.values()) < 8:
        assert time.monotonic() < deadline, "the requests did not reach the replicas"
        time.sleep(0.01)
    now = routed(front)
    victim = max(now, key=lambda rid: now[rid] - before.get(rid, 0))
    ray.kill(ray.get_actor(f"SERVE_REPLICA::{APP_NAME}#{DEPLOYMENT}#{victim}", namespace="serve"))
    for t in threads:
        t.join(120)
    assert len(results) == 8
    retried = sum(n for (rid, event), n in front.state.engine.events.items() if event == "retried")
    assert retried >= 1  # the victim held requests when it died
    for i, (kind, status, tokens, first_at, error, done) in results.items():
        assert status == 200, (i, results[i])
        if error is None:
            assert tokens == 200 and done, (i, results[i])
        else:  # only a stream that had sent tokens may end with an error event, and a clean one
            assert kind == "stream" and tokens >= 1 and error["code"] == "engine_error", (i, results[i])
    # Ray Serve replaces the replica; the endpoint serves on
    assert complete(front, "after the kill").status_code == 200


def test_canary_then_blue_green_switch_then_retire(front, tmp_path) -> None:
    """A second version (another checkpoint: other answers) takes its weight of the traffic, all of it
    after the switch; retiring the first drains it and the endpoint serves on."""
    admin = {"authorization": "Bearer ops-key"}
    build_tiny_checkpoint(tmp_path, seed=1, tied=False)
    old_answer = complete(front, "abcdef", max_tokens=6).json()["choices"][0]["text"]
    assert httpx.post(front.url + "/admin/rollout", headers=USER, json={"source": str(tmp_path)}).status_code == 403
    bad = httpx.post(front.url + "/admin/rollout", headers=admin, timeout=120, json={"source": "/no/such/model"})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "deploy_failed"
    r = httpx.post(front.url + "/admin/rollout", headers=admin, timeout=120,
                   json={"source": str(tmp_path), "weight": 0.5, "replicas": 1, "name": "v2"})
    assert r.status_code == 200, r.text
    assert {v["name"]: v["weight"] for v in r.json()["versions"]} == {APP_NAME: 0.5, "v2": 0.5}
    answers = [complete(front, "abcdef", max_tokens=6).json()["choices"][0]["text"] for _ in range(24)]
    new_answer = next(a for a in answers if a != old_answer)
    assert set(answers) == {old_answer, new_answer} and 4 <= answers.count(new_answer) <= 20
    r = httpx.put(front.url + "/admin/rollout", headers=admin, json={"weights": {"v2": 1.0}})
    assert r.status_code == 200 and {v["name"]: v["weight"] for v in r.json()["versions"]}["v2"] == 1.0
    assert {complete(front, "abcdef", max_tokens=6).json()["choices"][0]["text"] for _ in range(6)} == {new_answer}
    assert httpx.put(front.url + "/admin/rollout", headers=admin, json={"weights": {"v9": 1}}).status_code == 400
    # retiring a version drains it: a long request it runs finishes
    httpx.put(front.url + "/admin/rollout", headers=admin, json={"weights": {APP_NAME: 1.0}})
    long: list[httpx.Response] = []
    runner = threading.Thread(target=lambda: long.append(complete(front, "x", max_tokens=200, ignore_eos=True)))
    runner.start()
    time.sleep(0.2)
    httpx.put(front.url + "/admin/rollout", headers=admin, json={"weights": {"v2": 1.0}})
    r = httpx.delete(front.url + f"/admin/rollout/{APP_NAME}", headers=admin, timeout=120)
    runner.join(60)
    assert r.status_code == 200 and [v["name"] for v in r.json()["versions"]] == ["v2"]
    assert long[0].status_code == 200 and long[0].json()["usage"]["completion_tokens"] == 200, long[0].text
    assert httpx.delete(front.url + "/admin/rollout/v2", headers=admin, timeout=60).status_code == 400
    assert complete(front, "abcdef", max_tokens=6).json()["choices"][0]["text"] == new_answer
    text = httpx.get(front.url + "/metrics", headers=admin).text
    assert f'tokenmill:version_weight{{model_name="{MODEL}",version="v2"}} 1.0' in text
