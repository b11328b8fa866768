"""Attacks on tenancy (issue 14, items 3 to 6), each replayed against the fix:

- tokens_per_minute: a first request far over the limit, concurrent requests that together are,
  a Retry-After shorter than the real wait, reservations never given back;
- prefix-cache salts forged through tenant names (``team`` + cache_salt ``prod`` against ``team:prod``);
- /metrics read without a key (every tenant's name and usage);
- a tenant timing another tenant's prompt out of the shared prefix cache (isolation off by default).
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.server.conftest import MODEL, live_server
from tokenmill.benchmark.client import ClientConfig
from tokenmill.benchmark.runner import LoadConfig, run_serve
from tokenmill.benchmark.workloads import Conversation, Turn
from tokenmill.errors import InvalidParameterError
from tokenmill.server.admission import Rejected
from tokenmill.server.errors import APIError
from tokenmill.server.tenancy import Tenancy, TenantConfig, hash_key, prefix_cache_salt

LONG_PROMPT = "A tenant's private system prompt, long enough to fill several KV blocks of sixteen tokens. " * 2


def write_keys(tmp_path, *tenants: dict):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"tenants": [{"key_sha256": hash_key(t["name"] + "-key"), **t} for t in tenants]}))
    return path


def post(server, key: str | None, body: dict, path: str = "/v1/completions") -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.url + path, json={"model": MODEL, **body}, headers=headers, timeout=60)


def wait_settled(server, timeout: float = 10.0) -> None:
    """Until no request holds an engine slot or a queue place (close() ran for every one)."""
    deadline = time.monotonic() + timeout
    admission = server.state.default_model.admission
    while admission.in_engine or admission.num_queued or server.state.in_flight:
        assert time.monotonic() < deadline, "requests still in flight"
        time.sleep(0.02)


# ---- item 3: tokens_per_minute -------------------------------------------------------------------------

def test_a_first_request_over_the_limit_is_refused_and_names_max_tokens() -> None:
    tenant = TenantConfig("t", tokens_per_minute=200)
    tenancy = Tenancy([tenant])
    with pytest.raises(APIError) as refused:
        tenancy.start(tenant, 1801)  # the probe: 1,801 tokens admitted against 200 while the window was empty
    assert refused.value.status == 400 and refused.value.param == "max_tokens"
    assert refused.value.code == "tenant_tokens_exceeded" and "max_tokens" in refused.value.message
    assert tenancy.tokens_in_window("t") == 0
    tenancy.start(tenant, 200)  # nothing was held by the refusal: the whole limit is still there


def test_retry_after_covers_the_real_wait() -> None:
    """Two reservations must leave the window before the third fits; Retry-After waits for the
    second (the old one only waited for the first)."""
    tenant = TenantConfig("t", tokens_per_minute=100)
    tenancy = Tenancy([tenant], window=2.0)
    tenancy.start(tenant, 40)
    time.sleep(1.0)
    second = tenancy.start(tenant, 40)
    with pytest.raises(Rejected) as refused:
        tenancy.start(tenant, 70)
    refused_at = time.monotonic()
    real_wait = second.time + tenancy.window - refused_at
    assert refused.value.status == 429 and refused.value.reason == "tenant_tokens"
    assert refused.value.retry_after == int(refused.value.retry_after) >= real_wait > 1.5
    time.sleep(1.2)  # still before the second reservation leaves the window
    with pytest.raises(Rejected):
        tenancy.start(tenant, 70)
    time.sleep(max(refused_at + refused.value.retry_after - time.monotonic(), 0))
    tenancy.start(tenant, 70)


def test_settling_gives_back_what_was_not_used_and_cancelling_gives_back_all() -> None:
    tenant = TenantConfig("t", tokens_per_minute=300, requests_per_minute=2)
    tenancy = Tenancy([tenant])
    ran = tenancy.start(tenant, 250)
    with pytest.raises(Rejected):
        tenancy.start(tenant, 100)
    tenancy.finish(ran, 10, 0, 5)  # stopped early: 15 of the 250 reserved were used
    assert tenancy.tokens_in_window("t") == 15
    queued = tenancy.start(tenant, 200)
    tenancy.cancel(queued)  # never reached the engine: its tokens and its request are given back
    tenancy.cancel(queued)
    assert tenancy.tokens_in_window("t") == 15
    tenancy.start(tenant, 285)  # fits beside the 15, and the request-per-minute slot is free again
    assert tenancy.usage["t"].requests == 1 and tenancy.usage["t"].completion_tokens == 5


def test_reservations_count_prompts_plus_max_tokens_of_every_sample(tiny_llm, tmp_path) -> None:
    keys = write_keys(tmp_path, {"name": "small", "tokens_per_minute": 200},
                      {"name": "ops", "admin": True})
    with live_server(tiny_llm, api_keys=str(keys)) as server:
        over = post(server, "small-key", {"prompt": "p" * 100, "max_tokens": 150})  # 250 reserved
        assert over.status_code == 400, over.text
        error = over.json()["error"]
        assert error["param"] == "max_tokens" and error["code"] == "tenant_tokens_exceeded"
        assert "250" in error["message"] and "max_tokens" in error["message"]
        # max_tokens null (completions; its default is 16) or omitted (chat): the rest of the context
        # is reserved, 2 + 254 tokens
        for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": None}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
            response = post(server, "small-key", body, path)
            assert response.status_code == 400 and response.json()["error"]["param"] == "max_tokens", response.text
        # two prompts of 10 tokens, n=2, max_tokens 30: 2 * 10 + 4 * 30 = 140 reserved, each sample's
        several = post(server, "small-key", {"prompt": ["q" * 10, "r" * 10], "n": 2, "max_tokens": 30})
        assert several.status_code == 200, several.text
        assert server.state.tenancy.tokens_in_window("small") == several.json()["usage"]["total_tokens"]
        used = several.json()["usage"]["total_tokens"]
        again = post(server, "small-key", {"prompt": ["q" * 10, "r" * 10], "n": 2, "max_tokens": 30})
        assert (again.status_code == 429) == (used + 140 > 200), again.text
        rejected = httpx.get(server.url + "/metrics", headers={"authorization": "Bearer ops-key"}).text
        assert f'request_rejected_total{{model_name="{MODEL}",reason="tenant_tokens_exceeded"}} 3.0' in rejected


def test_concurrent_requests_are_not_admitted_beyond_the_limit(tiny_llm, tmp_path) -> None:
    """The probe: 6 concurrent requests were admitted for 906 tokens against 200, since completion
    tokens counted only at the end. Each reserves 10 + 40 = 50 now: at most 4 fit."""
    keys = write_keys(tmp_path, {"name": "burst", "tokens_per_minute": 200})
    with live_server(tiny_llm, api_keys=str(keys)) as server:
        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=60, headers={"authorization": "Bearer burst-key"}) as client:
                body = {"model": MODEL, "prompt": "c" * 10, "max_tokens": 40, "ignore_eos": True,
                        "temperature": 0}
                return await asyncio.gather(*(client.post(server.url + "/v1/completions", json=body)
                                              for _ in range(6)))

        responses = asyncio.run(burst())
        ok = [r for r in responses if r.status_code == 200]
        refused = [r for r in responses if r.status_code != 200]
        assert len(ok) == 4, [r.text for r in responses]
        assert sum(r.json()["usage"]["total_tokens"] for r in ok) <= 200
        for r in refused:
            assert r.status_code == 429 and r.json()["error"]["code"] == "tenant_tokens", r.text
            assert int(r.headers["retry-after"]) >= 1
        wait_settled(server)
        assert server.state.tenancy.tokens_in_window("burst") == 200


def test_aborted_and_refused_requests_settle(tiny_llm, tmp_path) -> None:
    """A stream the client drops settles to what it used; a request the full queue refuses gives
    its whole reservation back."""
    keys = write_keys(tmp_path, {"name": "erin", "tokens_per_minute": 5000},
                      {"name": "dave", "tokens_per_minute": 5000, "requests_per_minute": 1})
    with live_server(tiny_llm, api_keys=str(keys), max_queued_requests=0) as server:
        tenancy = server.state.tenancy
        body = {"model": MODEL, "prompt": "e" * 20, "n": 4, "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60,
                          headers={"authorization": "Bearer erin-key"}) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            assert tenancy.tokens_in_window("erin") == 20 + 4 * 200  # held while it runs
            full = post(server, "dave-key", {"prompt": "d" * 20, "max_tokens": 10})  # 4 slots taken: no room
            assert full.status_code == 429 and full.json()["error"]["code"] == "queue_full", full.text
            assert tenancy.tokens_in_window("dave") == 0
        wait_settled(server)
        usage = tenancy.usage["erin"]
        assert tenancy.tokens_in_window("erin") == usage.prompt_tokens + usage.completion_tokens < 20 + 4 * 200
        assert post(server, "dave-key", {"prompt": "d" * 20, "max_tokens": 10}).status_code == 200


# ---- item 4: salts cannot be forged through names ------------------------------------------------------

def test_tenant_names_with_separators_are_refused(tmp_path) -> None:
    for bad in ("team:prod", "a b", "", "x" * 65, "caf\u00e9"):
        with pytest.raises(InvalidParameterError, match="not allowed") as refused:
            Tenancy.load(write_keys(tmp_path, {"name": bad}))
        assert repr(bad) in str(refused.value)
    with pytest.raises(InvalidParameterError, match="'shared:x'"):
        Tenancy.load(write_keys(tmp_path, {"name": "ok", "cache_group": "shared:x"}))
    with pytest.raises(InvalidParameterError, match="appear twice"):
        Tenancy.load(_two_with_one_name(tmp_path))
    with pytest.raises(InvalidParameterError, match="admin must be true or false"):
        Tenancy.load(write_keys(tmp_path, {"name": "ok", "admin": "no"}))
    assert Tenancy.load(write_keys(tmp_path, {"name": "Team-1.prod_x"})).enabled


def _two_with_one_name(tmp_path):
    path = tmp_path / "twice.json"
    path.write_text(json.dumps({"tenants": [{"name": "same", "key_sha256": hash_key("a")},
                                            {"name": "same", "key_sha256": hash_key("b")}]}))
    return path


def test_salts_of_distinct_pairs_never_collide() -> None:
    pairs = [("team", "prod"), ("team:prod", None), ("team", "prod:"), ("team", None), ("team", ""),
             (None, "team:prod"), (None, "team"), ("team:", "prod"), ('team", "prod', None)]
    salts = [prefix_cache_salt(group, salt) for group, salt in pairs]
    assert len(set(salts)) == len(pairs) and None not in salts
    assert prefix_cache_salt(None, None) is None
    team, other = TenantConfig("team"), TenantConfig("other", cache_group="team")
    tenancy = Tenancy([team, other])
    assert tenancy.cache_salt(team, "prod") == tenancy.cache_salt(other, "prod") != tenancy.cache_salt(team, None)


# ---- item 5: /metrics needs an admin or metrics key ----------------------------------------------------

def test_metrics_refuses_keyless_and_non_admin_callers(tiny_llm, tmp_path) -> None:
    keys = write_keys(tmp_path, {"name": "alice"}, {"name": "ops", "admin": True})
    with live_server(tiny_llm, api_keys=str(keys)) as server:
        assert post(server, "alice-key", {"prompt": "hi", "max_tokens": 2}).status_code == 200
        keyless = httpx.get(server.url + "/metrics")
        assert keyless.status_code == 401 and keyless.json()["error"]["code"] == "invalid_api_key"
        tenant = httpx.get(server.url + "/metrics", headers={"authorization": "Bearer alice-key"})
        assert tenant.status_code == 403 and "tenant_requests_total" not in tenant.text
        assert set(tenant.json()["error"]) == {"message", "type", "param", "code"}
        assert tenant.json()["error"]["type"] == "permission_error"
        admin = httpx.get(server.url + "/metrics", headers={"authorization": "Bearer ops-key"})
        assert admin.status_code == 200 and 'tenant_requests_total{tenant="alice"} 1.0' in admin.text


def test_metrics_keys_read_metrics_and_bench_scrapes_with_its_key(tiny_llm, tmp_path) -> None:
    keys = write_keys(tmp_path, {"name": "alice"}, {"name": "prom", "metrics": True})
    with live_server(tiny_llm, api_keys=str(keys)) as server:
        assert post(server, "alice-key", {"prompt": "hi", "max_tokens": 2}).status_code == 200
        allowed = httpx.get(server.url + "/metrics", headers={"authorization": "Bearer prom-key"})
        assert allowed.status_code == 200 and 'tenant_requests_total{tenant="alice"} 1.0' in allowed.text
        assert httpx.get(server.url + "/admin/usage", headers={"authorization": "Bearer prom-key"}).status_code == 403

        # tokenmill bench serve --scrape-metrics sends its --api-key
        convs = [Conversation((Turn("hello there", 2, 3),)) for _ in range(2)]
        scraped = run_serve(ClientConfig(server.url, MODEL, api_key="prom-key"), LoadConfig(max_concurrency=1),
                            convs, lambda text: len(text.split()), progress=False, scrape_metrics=True)
        assert scraped.summary.completed == 2 and scraped.server_metrics["ttft"]["count"] == 2
        refused = run_serve(ClientConfig(server.url, MODEL, api_key="alice-key"), LoadConfig(max_concurrency=1),
                            convs, lambda text: len(text.split()), progress=False, scrape_metrics=True)
        assert refused.summary.completed == 2 and "403" in refused.server_metrics["error"]


# ---- item 6: isolation by cache group, on by default with keys -----------------------------------------

def cached_tokens(server, key: str, prompt: str, cache_salt: str | None = None) -> int:
    """cached_tokens of one request (the engine, and its cache, outlive each test's server: each test
    sends its own prompt)."""
    body = {"prompt": prompt, "max_tokens": 2, **({"cache_salt": cache_salt} if cache_salt else {})}
    response = post(server, key, body)
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_with_keys_tenants_do_not_share_the_prefix_cache_by_default(tiny_llm, tmp_path) -> None:
    """The probe: tenant b guessing tenant a's long prompt was served it from the cache (TTFT and
    cached_tokens told it so), since isolation was off unless asked for."""
    keys = write_keys(tmp_path, {"name": "a"}, {"name": "b"})
    prompt = "isolation " + LONG_PROMPT
    with live_server(tiny_llm, api_keys=str(keys)) as server:
        assert cached_tokens(server, "a-key", prompt) == 0
        assert cached_tokens(server, "b-key", prompt) == 0, "tenant b was served tenant a's cached prompt"
        assert cached_tokens(server, "a-key", prompt) >= 32, "a tenant's own prompt is still cached"


def test_tenants_of_one_cache_group_share_the_prefix_cache(tiny_llm, tmp_path) -> None:
    keys = write_keys(tmp_path, {"name": "a"}, {"name": "c", "cache_group": "support"},
                      {"name": "d", "cache_group": "support"})
    prompt = "group " + LONG_PROMPT
    with live_server(tiny_llm, api_keys=str(keys)) as server:
        assert cached_tokens(server, "c-key", prompt) == 0
        assert cached_tokens(server, "d-key", prompt) >= 32, "tenants of one cache group share"
        assert cached_tokens(server, "a-key", prompt) == 0, "a tenant outside the group does not"
        assert cached_tokens(server, "d-key", prompt, cache_salt="x") == 0  # a cache_salt still separates in a group
