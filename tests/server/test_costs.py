"""Cost per request that adds up: the meter's attribution, the chargeback export, budgets, SLOs."""

from __future__ import annotations

import asyncio
import csv
import io
import json
import time

import httpx
import pytest

from tests.server.conftest import MODEL, live_server
from tokenmill.server.config import CostConfig
from tokenmill.server.tenancy import hash_key

PRICE = 3600.0  # one currency unit per second of the engine thread


def _totals(server) -> tuple[dict, float, float]:
    """(/admin/costs since_start, the test's clock before the call, after it)."""
    before = time.monotonic()
    body = httpx.get(server.url + "/admin/costs", params={"group_by": "request_id", "include_open": "true"},
                     timeout=10).json()
    return body, before, time.monotonic()


async def _mixed_load(url: str, long_prompt: str) -> dict[str, dict]:
    """Streamed and whole, cached and not, finished and aborted requests at once -> responses by label."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        async def whole(label, prompt, max_tokens, **extra):
            r = await client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                                                           "ignore_eos": True, **extra})
            return label, r

        async def streamed(label, prompt, max_tokens, chunks=None):
            body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            events = []
            async with client.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        events.append(json.loads(line[6:]))
                        if chunks is not None and len(events) >= chunks:
                            break  # the client goes away: the request is aborted
            return label, events

        async def timed_out(label):
            r = await client.post("/v1/completions", headers={"X-Request-Timeout": "0.03"},
                                  json={"model": MODEL, "prompt": "slow " * 20, "max_tokens": 150, "ignore_eos": True})
            return label, r

        first = await whole("uncached", long_prompt, 8)  # fills the prefix cache
        results = await asyncio.gather(
            whole("cached", long_prompt, 8), whole("short", "hi", 4), whole("long-output", "hello", 40),
            streamed("stream", "tell me", 24), streamed("abandoned", "and then", 150, chunks=3))
        last = await timed_out("deadline")  # alone: it reaches the engine, then its deadline aborts it
        return dict([first, *results, last])


def test_per_request_costs_add_up_to_the_metered_total(tiny_llm):
    long_prompt = "the quick brown fox jumps over the lazy dog " * 4  # 180 bytes: 11 full blocks of 16
    with live_server(tiny_llm, cost=CostConfig(price_per_hour=PRICE)) as server:
        start, t0_before, t0_after = _totals(server)
        out = asyncio.run(_mixed_load(server.url, long_prompt))
        server.wait_idle()
        time.sleep(0.3)  # some idle time
        end, t1_before, t1_after = _totals(server)

        # the meter's own total follows the clock: one currency unit per second
        metered = end["since_start"]["metered"] - start["since_start"]["metered"]
        assert (t1_before - t0_after) * 0.99 <= metered <= (t1_after - t0_before) * 1.01, (metered, t0_before, t1_after)

        # every request's cost + idle and the other lines + the interval in progress = the metered total
        since = end["since_start"]
        per_request = sum(row["cost"] for row in end["groups"])
        assert per_request == pytest.approx(since["requests"], rel=1e-9)
        attributed = per_request + sum(since["lines"].values()) + since["in_progress"]
        assert attributed == pytest.approx(since["metered"], rel=0.01)
        assert since["lines"]["idle"] + since["in_progress"] > 0.25  # the sleep above (a wait still going on)

        # each kind of request paid, aborted ones included
        rows = {row["request_id"].split("-")[1]: row for row in end["groups"]}  # req-<uid>-<i>
        assert len(end["groups"]) == 7
        assert out["deadline"].status_code == 503, out["deadline"].text  # it ran, then its deadline aborted it
        bodies = {label: r.json() for label, r in out.items() if isinstance(r, httpx.Response) and r.status_code == 200}
        bodies["stream"] = out["stream"][-1]
        assert set(bodies) == {"uncached", "cached", "short", "long-output", "stream"}
        row = {label: rows[body["id"].split("-")[1]] for label, body in bodies.items()}  # cmpl-<uid>
        for label, body in bodies.items():  # the cost the response reports is the one exported, once final
            assert body["usage"]["cost"] == pytest.approx(row[label]["cost"], rel=1e-9), label
            assert body["usage"]["completion_tokens"] == row[label]["completion_tokens"], label
            assert row[label]["cost"] > 0
        abandoned = [r for uid, r in rows.items() if uid not in {body["id"].split("-")[1] for body in bodies.values()}]
        assert len(abandoned) == 2 and all(0 < r["completion_tokens"] < 150 for r in abandoned)

        # cached tokens are counted at their real cost: reads of their K/V, not a prompt recomputed
        assert bodies["cached"]["usage"]["prompt_tokens_details"]["cached_tokens"] >= 160
        assert row["cached"]["cached_cost"] > 0 and row["uncached"]["cached_cost"] == 0
        # within one request (so whatever else shared its steps): a cached token costs a fraction of a computed one
        twin = row["cached"]
        per_cached = twin["cached_cost"] / twin["cached_tokens"]
        per_computed = twin["prompt_cost"] / (twin["prompt_tokens"] - twin["cached_tokens"])
        assert per_cached < per_computed * 0.5, (per_cached, per_computed)

        metrics = server.metrics()
        assert metrics["tokenmill:metered_cost_total"] >= since["metered"] * 0.99
        rate_keys = [k for k in metrics if k.startswith("tokenmill:cost_per_1k_tokens")]
        assert {f'tokenmill:cost_per_1k_tokens{{kind="{k}",model_name="{MODEL}"}}' for k in
                ("prompt", "cached", "completion")} <= set(rate_keys)


def test_chargeback_export_groups_by_tenant_model_and_tags(tiny_llm, tmp_path):
    keys = {"alice": "key-alice", "bob": "key-bob", "ops": "key-ops"}
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"tenants": [{"name": name, "key_sha256": hash_key(key), "admin": name == "ops"}
                                            for name, key in keys.items()]}))
    log = tmp_path / "costs.jsonl"
    with live_server(tiny_llm, api_keys=str(path), cost=CostConfig(price_per_hour=10.0, cost_log=str(log))) as server:
        def ask(tenant, **extra):
            r = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                           headers={"Authorization": f"Bearer {keys[tenant]}", **extra.pop("headers", {})},
                           json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                                 **extra})
            assert r.status_code == 200, r.text
            return r
        ask("alice", metadata={"project": "search"}, user="u1")
        ask("alice", headers={"X-Tokenmill-Tags": "project=ads"})
        reply = ask("bob", metadata={"project": "search"})
        assert float(reply.headers["X-Request-Cost"]) == pytest.approx(reply.json()["usage"]["cost"], rel=1e-6)
        assert reply.headers["X-Tokenmill-Model"] == MODEL
        admin = {"Authorization": f"Bearer {keys['ops']}"}
        assert httpx.get(server.url + "/admin/costs", headers={"Authorization": f"Bearer {keys['bob']}"},
                         timeout=10).status_code == 403
        by_tenant = httpx.get(server.url + "/admin/costs", headers=admin, timeout=10).json()
        assert {row["tenant"]: row["requests"] for row in by_tenant["groups"]} == {"alice": 2, "bob": 1}
        by_tag = httpx.get(server.url + "/admin/costs", params={"group_by": "tag:project,model", "format": "csv"},
                           headers=admin, timeout=10)
        assert by_tag.headers["content-type"].startswith("text/csv")
        table = list(csv.DictReader(io.StringIO(by_tag.text)))
        assert {(r["tag:project"], r["model"], r["requests"]) for r in table} == {("search", MODEL, "2"),
                                                                                 ("ads", MODEL, "1")}
        total = sum(float(r["cost"]) for r in table)
        assert total == pytest.approx(sum(row["cost"] for row in by_tenant["groups"]), rel=1e-9)
        later = httpx.get(server.url + "/admin/costs", params={"from": time.time() + 60}, headers=admin,
                          timeout=10).json()
        assert later["groups"] == []
        bad = httpx.get(server.url + "/admin/costs", params={"group_by": "colour"}, headers=admin, timeout=10)
        assert bad.status_code == 400 and "group_by" in bad.json()["error"]["message"]
        for since in ("yesterday", "nan", "inf"):  # not-a-number seconds once broke the JSON reply (500)
            bad = httpx.get(server.url + "/admin/costs", params={"from": since}, headers=admin, timeout=10)
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "from", since
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert sorted(line["tenant"] for line in lines) == ["alice", "alice", "bob"]
    assert {line["user"] for line in lines} == {"u1", None}


def test_budgets_hold_under_concurrency(tiny_llm, tmp_path):
    """A tenant's concurrent requests never push its charges past its budget: each holds its stated
    upper bound at admission, the ones that do not fit get 429 budget_exceeded, all settle."""
    path = tmp_path / "keys.json"
    budget = 0.02
    path.write_text(json.dumps({"tenants": [
        {"name": "capped", "key_sha256": hash_key("k1"), "budget": budget, "budget_soft_limit": budget / 2},
        {"name": "ops", "key_sha256": hash_key("k2"), "admin": True}]}))
    # 1 currency unit per second; each request holds (20 + 4 x 16) tokens at these rates = 0.0084
    cost = CostConfig(price_per_hour=3600.0, reserve_prompt_per_1k=0.1, reserve_completion_per_1k=0.1)
    with live_server(tiny_llm, api_keys=str(path), cost=cost, max_queued_requests=64) as server:
        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=server.url, timeout=60,
                                         headers={"Authorization": "Bearer k1"}) as client:
                return await asyncio.gather(*[client.post("/v1/completions", json={
                    "model": MODEL, "prompt": "a" * 20, "max_tokens": 16, "ignore_eos": True, "n": 4})
                    for _ in range(12)])
        spent = 0.0
        refused = []
        for _ in range(4):
            responses = asyncio.run(burst())
            server.wait_idle(headers={"Authorization": "Bearer k2"})
            ok = [r for r in responses if r.status_code == 200]
            refused += [r for r in responses if r.status_code == 429]
            spent += sum(r.json()["usage"]["cost"] for r in ok)
            budgets = _budget_metrics(server)
            assert budgets["spent"] <= budget + 1e-12 and budgets["held"] == pytest.approx(0, abs=1e-12)
        assert refused and all(r.json()["error"]["code"] == "budget_exceeded" for r in refused)
        assert "lower max_tokens or raise the budget" in refused[0].json()["error"]["message"]
        budgets = _budget_metrics(server)
        assert budgets["soft_limit_alerts"] == 1
        # charged: the measured cost, capped by each request's own hold; never past the budget
        assert budgets["spent"] <= min(spent, budget) + 1e-9
        assert budgets["spent"] + budgets["overrun"] == pytest.approx(spent, rel=1e-6)


def test_a_restarted_server_counts_the_cost_log_as_spent(tiny_llm, tmp_path):
    path, log = tmp_path / "keys.json", tmp_path / "costs.jsonl"
    path.write_text(json.dumps({"tenants": [
        {"name": "capped", "key_sha256": hash_key("k1"), "budget": 0.05},
        {"name": "ops", "key_sha256": hash_key("k2"), "admin": True}]}))
    cost = CostConfig(price_per_hour=3600.0, reserve_prompt_per_1k=0.1, reserve_completion_per_1k=0.1,
                      cost_log=str(log))

    def ask(server):
        return httpx.post(server.url + "/v1/completions", headers={"Authorization": "Bearer k1"}, timeout=30,
                          json={"model": MODEL, "prompt": "hi", "max_tokens": 4})
    with live_server(tiny_llm, api_keys=str(path), cost=cost) as server:
        first = ask(server)
        assert first.status_code == 200
    spent = sum(json.loads(line)["cost"] for line in log.read_text().splitlines())
    assert spent == pytest.approx(first.json()["usage"]["cost"], rel=1e-9)
    log.write_text(log.read_text() + "not json\n" + json.dumps({"tenant": "capped", "cost": 0.05}) + "\n")
    with live_server(tiny_llm, api_keys=str(path), cost=cost) as server:
        assert _budget_metrics(server)["spent"] == pytest.approx(spent + 0.05, rel=1e-9)
        refused = ask(server)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "budget_exceeded"


def _budget_metrics(server) -> dict[str, float]:
    m = httpx.get(server.url + "/metrics", headers={"Authorization": "Bearer k2"}, timeout=10).text
    out = {}
    for name in ("spent", "held", "limit", "overrun", "soft_limit_alerts"):
        suffix = "_total" if name in ("overrun", "soft_limit_alerts") else ""
        prefix = f'tokenmill:budget_{name}{suffix}{{tenant="capped"}}'
        line = next(line for line in m.splitlines() if line.startswith(prefix))
        out[name] = float(line.split()[-1])
    return out


def test_slo_compliance_is_counted_per_tenant(tiny_llm):
    with live_server(tiny_llm, cost=CostConfig(slo_ttft=30.0, slo_tpot=30.0)) as server:
        for _ in range(3):
            assert httpx.post(server.url + "/v1/completions", timeout=30,
                              json={"model": MODEL, "prompt": "x", "max_tokens": 3}).status_code == 200
        m = server.metrics()
        assert m['tokenmill:slo_requests_total{met="true",tenant="default"}'] == 3
    with live_server(tiny_llm, cost=CostConfig(slo_ttft=1e-9)) as server:
        assert httpx.post(server.url + "/v1/completions", timeout=30,
                          json={"model": MODEL, "prompt": "x", "max_tokens": 3}).status_code == 200
        assert server.metrics()['tokenmill:slo_requests_total{met="false",tenant="default"}'] == 1
