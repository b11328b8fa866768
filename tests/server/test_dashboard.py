"""The dashboard (server/dashboard.py): the percentile estimate, the JSON built from the registry
for any label values, and the page in a real headless Chromium: it shows what /metrics and
/admin/dashboard/data report with no console error, and asks for an admin key when keys are set."""

from __future__ import annotations

import bisect
import json
import math
import re
from types import SimpleNamespace

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from tests.browser import WatchedPage, chromium
from tests.server.conftest import MODEL, live_server
from tokenmill.server.dashboard import dashboard_data, histogram_quantile
from tokenmill.server.metrics import LATENCY_BUCKETS
from tokenmill.server.tenancy import hash_key

OTHER = "fake-model-b"
"""A second model that only the fake families below name (the server serves one)."""


def test_histogram_quantile_interpolates_inside_the_bucket() -> None:
    buckets = [(0.1, 2), (0.2, 6), (math.inf, 6)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.125)  # rank 3: 1 of the 4 in (0.1, 0.2]
    assert histogram_quantile(0.25, buckets) == pytest.approx(0.075)  # rank 1.5 of 2 in (0, 0.1]
    assert histogram_quantile(1.0, buckets) == pytest.approx(0.2)
    assert histogram_quantile(0.5, [(0.1, 0), (math.inf, 4)]) == 0.1  # beyond the last bound: the last bound
    assert histogram_quantile(0.5, [(0.1, 0), (math.inf, 0)]) is None
    assert histogram_quantile(0.5, []) is None


@given(st.lists(st.floats(0, 1000, allow_nan=False), min_size=1, max_size=200), st.sampled_from([0.5, 0.9, 0.99]))
def test_histogram_quantile_lies_in_the_bucket_of_the_true_quantile(values, q) -> None:
    bounds = [*LATENCY_BUCKETS, math.inf]
    ordered = sorted(values)
    buckets = [(b, bisect.bisect_right(ordered, b)) for b in bounds]
    estimate = histogram_quantile(q, buckets)
    true = ordered[max(math.ceil(q * len(values)), 1) - 1]  # the observation of rank q * n
    i = bisect.bisect_left(bounds, true)  # its bucket: (bounds[i - 1], bounds[i]]
    lower, upper = (bounds[i - 1] if i else 0.0), bounds[i]
    assert lower - 1e-12 <= estimate <= (upper if upper != math.inf else lower) + 1e-12  # interpolation rounds
    assert histogram_quantile(min(q + 0.005, 1.0), buckets) >= estimate


class FakeFamilies(Collector):
    """The cost, SLO, routing, budget, cold-start and speculation families, with a second model and
    tenants of their own: the dashboard renders whatever label values appear."""

    def collect(self):
        def family(kind, name, labels, *samples):
            f = kind(f"tokenmill:{name}", name, labels=labels)
            for *values, value in samples:
                f.add_metric(values, value)
            return f

        C, G = CounterMetricFamily, GaugeMetricFamily
        yield family(C, "request_cost", ["model_name", "tenant"], [MODEL, "fake-a", 0.5], [OTHER, "fake-a", 0.25],
                     [OTHER, "fake-b", 1.0])
        yield family(C, "idle_cost", [], [0.125])
        yield family(C, "metered_cost", [], [2.0])
        yield family(C, "other_cost", ["line"], ["fake-loading", 0.0625])
        yield family(G, "cost_per_1k_tokens", ["model_name", "kind"], [OTHER, "prompt", 0.001],
                     [OTHER, "cached", 0.0001], [OTHER, "completion", 0.002])
        yield family(C, "slo_requests", ["tenant", "met"], ["fake-a", "true", 3], ["fake-a", "false", 1])
        yield family(C, "route_requests", ["route", "model_name"], ["fake-route", MODEL, 6], ["fake-route", OTHER, 2])
        yield family(C, "route_escalations", ["route"], ["fake-route", 2])
        yield family(G, "budget_spent", ["tenant"], ["fake-a", 0.75])
        yield family(G, "budget_limit", ["tenant"], ["fake-a", 3.0])
        yield family(G, "budget_held", ["tenant"], ["fake-a", 0.5])
        yield family(C, "budget_soft_limit_alerts", ["tenant"], ["fake-a", 1])
        yield family(G, "model_cold_start_seconds", ["model_name"], [OTHER, 1.5])
        yield family(C, "spec_decode_num_drafts", ["model_name"], [OTHER, 10])
        yield family(C, "spec_decode_num_draft_tokens", ["model_name"], [OTHER, 30])
        yield family(C, "spec_decode_num_accepted_tokens", ["model_name"], [OTHER, 15])
        yield family(C, "spec_decode_num_accepted_tokens_per_pos", ["model_name", "position"], [OTHER, "0", 8],
                     [OTHER, "1", 5], [OTHER, "2", 2])


def test_dashboard_data_groups_by_whatever_labels_appear() -> None:
    registry = CollectorRegistry()
    success = Counter("tokenmill:request_success", "", ["model_name", "finished_reason"], registry=registry)
    success.labels(MODEL, "stop").inc(3)
    success.labels(OTHER, "length").inc(1)
    Gauge("tokenmill:num_requests_running", "", ["model_name"], registry=registry).labels(MODEL).set(2)
    ttft = Histogram("tokenmill:time_to_first_token_seconds", "", ["model_name"], buckets=(0.1, 0.2), registry=registry)
    for seconds in (0.05, 0.15, 0.15, 0.15, 0.15, 0.5):
        ttft.labels(OTHER).observe(seconds)
    Gauge("tokenmill:budget_limit", "", ["tenant"], registry=registry).labels("fake-c").set(math.inf)
    registry.register(FakeFamilies())
    data = dashboard_data(SimpleNamespace(metrics=SimpleNamespace(registry=registry)))
    json.dumps(data, allow_nan=False)  # as the endpoint sends it

    assert set(data["models"]) == {MODEL, OTHER}
    mine, other = data["models"][MODEL], data["models"][OTHER]
    assert (mine["requests"], mine["finished"], mine["running"]) == (3, {"stop": 3}, 2)
    assert (other["requests"], other["running"], other["generation_tokens"]) == (1, None, None)
    # cumulative counts 1, 5, 6; ranks 3, 5.4, 5.94: 0.1 + 0.1 * 2/4, then in (0.2, +Inf): the last finite bound
    assert other["latency"]["ttft"] == {"count": 6, "mean_ms": 191.67, "p50_ms": 150.0, "p90_ms": 200.0,
                                        "p99_ms": 200.0}
    assert mine["latency"]["ttft"]["count"] == 0 and mine["latency"]["ttft"]["p50_ms"] is None
    assert other["cold_start_seconds"] == 1.5 and mine["cold_start_seconds"] is None
    assert other["cost_per_1k_tokens"] == {"prompt": 0.001, "cached": 0.0001, "completion": 0.002}
    assert other["speculation"] == {"drafts": 10, "draft_tokens": 30, "accepted_tokens": 15, "acceptance_rate": 0.5,
                                    "mean_accepted_length": 2.5, "accepted_per_position": [8, 5, 2]}
    assert mine["speculation"] is None
    cost = data["cost"]
    assert (cost["request"], cost["idle"], cost["metered"], cost["other"]) == (1.75, 0.125, 2.0, 0.0625)
    assert cost["other_by"] == [{"labels": {"line": "fake-loading"}, "value": 0.0625}]
    assert cost["by_model"] == {MODEL: 0.5, OTHER: 1.25} and cost["by_tenant"] == {"fake-a": 0.75, "fake-b": 1.0}
    assert {(p["tenant"], p["model_name"]): p["cost"] for p in cost["by_tenant_model"]} == {
        ("fake-a", MODEL): 0.5, ("fake-a", OTHER): 0.25, ("fake-b", OTHER): 1.0}
    assert data["slo"] == {"fake-a": {"met": 3, "missed": 1, "compliance": 0.75}}
    assert data["routing"] == {"fake-route": {"requests": 8, "by_model": {MODEL: 6, OTHER: 2}, "escalations": 2,
                                              "escalation_rate": 0.25}}
    assert data["budgets"] == {  # no infinity in JSON
        "fake-a": {"spent": 0.75, "limit": 3.0, "held": 0.5, "overrun": None, "soft_limit_alerts": 1, "share": 0.25},
        "fake-c": {"spent": None, "limit": None, "held": None, "overrun": None, "soft_limit_alerts": None, "share": None}}

    empty = dashboard_data(SimpleNamespace(metrics=SimpleNamespace(registry=CollectorRegistry())))
    assert (empty["models"], empty["tenants"], empty["cost"], empty["slo"], empty["routing"], empty["budgets"]) == (
        {}, {}, None, {}, {}, {})


# ---- in the browser -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser():
    with chromium() as b:
        yield b


def metric(metrics: dict[str, float], name: str, **labels: str) -> float:
    """The sum of /metrics samples ``name`` whose labels include ``labels``."""
    total = 0.0
    for key, value in metrics.items():
        sample, _, rest = key.partition("{")
        found = dict(re.findall(r'(\w+)="([^"]*)"', rest))
        if sample == name and all(found.get(k) == v for k, v in labels.items()):
            total += value
    return total


def traffic(server, n: int) -> None:
    """n completions, every other one streamed."""
    for i in range(n):
        body = {"model": MODEL, "prompt": f"dashboard {i}", "max_tokens": 4 + i % 3, "ignore_eos": True}
        if i % 2:
            with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=30) as r:
                assert r.status_code == 200
                assert [line for line in r.iter_lines() if line][-1] == "data: [DONE]"
        else:
            assert httpx.post(server.url + "/v1/completions", json=body, timeout=30).status_code == 200
    server.wait_idle()


def field(page, section: str, key: str, name: str) -> str:
    return page.locator(f'[data-section="{section}"] [data-key="{key}"] [data-field="{name}"]').first.inner_text()


def wait_for_polls(page, n: int) -> None:
    # functions, not expressions: the page's Content-Security-Policy forbids eval
    page.wait_for_function("n => window.tokenmillDashboard && window.tokenmillDashboard.polls >= n", arg=n,
                           timeout=10_000)


def test_dashboard_shows_what_the_api_reports(tiny_llm, browser, tmp_path) -> None:
    with live_server(tiny_llm) as server, WatchedPage(browser) as watched:
        page = watched.page
        server.state.metrics.registry.register(FakeFamilies())
        served = httpx.get(server.url + "/dashboard", timeout=10)
        assert served.status_code == 200 and "default-src 'self'" in served.headers["content-security-policy"]
        assert httpx.get(server.url + "/dashboard/static/nope.js", timeout=10).status_code == 404
        traffic(server, 6)

        page.goto(server.url + "/dashboard?interval_ms=300")
        wait_for_polls(page, 2)
        metrics, data = server.metrics(), httpx.get(server.url + "/admin/dashboard/data", timeout=10).json()
        requests = metric(metrics, "tokenmill:request_success_total", model_name=MODEL)
        generated = metric(metrics, "tokenmill:generation_tokens_total", model_name=MODEL)
        assert requests >= 6 and generated >= 6 * 4
        assert field(page, "models", MODEL, "requests") == str(int(requests)) == str(int(data["models"][MODEL]["requests"]))
        assert field(page, "models", MODEL, "generation_tokens") == str(int(generated))
        assert field(page, "models", MODEL, "prompt_tokens") == str(int(metric(metrics, "tokenmill:prompt_tokens_total",
                                                                               model_name=MODEL)))
        assert field(page, "models", MODEL, "running") == "0" and field(page, "models", MODEL, "kv_cache_usage") == "0.0%"
        for kind in ("ttft", "tpot", "e2e"):
            figures = data["models"][MODEL]["latency"][kind]
            assert figures["count"] > 0 and figures["p50_ms"] <= figures["p90_ms"] <= figures["p99_ms"]
            for q in ("p50", "p90", "p99"):
                assert field(page, "latency", f"{MODEL}/{kind}", f"{q}_ms") == f"{figures[q + '_ms']:.2f}", (kind, q)
        usage = metric(metrics, "tokenmill:tenant_requests_total", tenant="default")
        assert field(page, "tenants", "default", "requests") == str(int(usage)) == str(int(requests))

        # the families only the fakes fill, for a second model and tenants of their own
        assert field(page, "cost", "fake-b", "cost") == "1.0000" and field(page, "cost", OTHER, "cost") == "1.2500"
        assert field(page, "cost", "fake-a/" + OTHER, "cost") == "0.2500"
        assert field(page, "prices", OTHER, "completion") == "0.002000"
        assert field(page, "slo", "fake-a", "compliance") == "75.0%"
        assert field(page, "routing", "fake-route", "escalation_rate") == "25.0%"
        assert field(page, "routing", "fake-route", f"model:{OTHER}") == "2"
        assert field(page, "budgets", "fake-a", "share") == "25.0%" and field(page, "budgets", "fake-a", "held") == "0.5000"
        assert field(page, "speculation", OTHER, "acceptance_rate") == "50.0%"
        assert field(page, "models", OTHER, "cold_start_seconds") == "1.50"
        assert field(page, "models", OTHER, "requests") == "–"

        # live throughput: tokens made while the page is open show as a rate
        traffic(server, 4)
        after = metric(server.metrics(), "tokenmill:request_success_total", model_name=MODEL)
        page.wait_for_function("([model, n]) => document.querySelector(`[data-section='models'] [data-key='${model}'] "
                               "[data-field='requests']`).textContent === n", arg=[MODEL, str(int(after))], timeout=10_000)
        peak = page.evaluate(f"Math.max(...window.tokenmillDashboard.charts.tokens.lines.get('{MODEL}'))")
        assert peak > 0
        for chart in ("tokens", "requests", "queue", "kv", "ttft", "tpot", "e2e"):
            assert page.locator(f"#chart-{chart} canvas").count() == 1, chart
        assert page.locator("#auth").is_hidden()
        page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
        assert watched.errors() == []
        assert all(url.startswith(server.url + "/") or url.startswith("data:") for url in watched.requests), \
            watched.requests


@pytest.fixture
def keys_file(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"tenants": [{"name": "alice", "key_sha256": hash_key("alice-key")},
                                            {"name": "ops", "key_sha256": hash_key("ops-key"), "admin": True}]}))
    return path


def test_dashboard_asks_for_an_admin_key(tiny_llm, browser, keys_file) -> None:
    with live_server(tiny_llm, api_keys=str(keys_file)) as server, WatchedPage(browser) as watched:
        page = watched.page
        url = server.url + "/admin/dashboard/data"
        assert httpx.get(url, timeout=10).status_code == 401
        assert httpx.get(url, headers={"authorization": "Bearer alice-key"}, timeout=10).json()["error"]["code"] == \
            "not_admin"
        completion = httpx.post(server.url + "/v1/completions", headers={"authorization": "Bearer alice-key"},
                                json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=30)
        assert completion.status_code == 200

        page.goto(server.url + "/dashboard?interval_ms=300")
        page.locator("#auth").wait_for(state="visible", timeout=10_000)
        assert "Admin key needed" in page.locator("#auth").inner_text() and page.locator("#content").is_hidden()

        page.fill("#auth-key", "alice-key")
        page.click("#auth button[type=submit]")
        page.wait_for_function("() => document.getElementById('auth').dataset.status === '403'", timeout=10_000)
        assert "not an admin key" in page.locator("#auth-message").inner_text()
        assert "'alice' is not an admin" in page.locator("#auth-message").inner_text()

        page.fill("#auth-key", "ops-key")
        page.click("#auth button[type=submit]")
        wait_for_polls(page, 1)
        assert page.locator("#auth").is_hidden() and page.locator("#content").is_visible()
        data = httpx.get(url, headers={"authorization": "Bearer ops-key"}, timeout=10).json()
        assert field(page, "models", MODEL, "requests") == str(int(data["models"][MODEL]["requests"])) == "1"
        assert page.evaluate("sessionStorage.getItem('tokenmill.dashboard.key')") == "ops-key"
        page.reload()
        wait_for_polls(page, 1)  # the key is kept for the tab
        assert page.locator("#auth").is_hidden()
        refused = ("the server responded with a status of 401", "the server responded with a status of 403")
        assert watched.errors(expected=refused) == []
