"""API keys from a file (stored hashed), 401 without a valid key, per-key limits answered with 429,
per-tenant usage in /metrics and /admin/usage (admin keys), and per-tenant prefix-cache isolation
(by default with keys). More attacks on these in test_hardening_tenancy.py."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.server.conftest import MODEL, live_server
from tokenmill.errors import InvalidParameterError
from tokenmill.server.admission import Rejected
from tokenmill.server.tenancy import Tenancy, hash_key

PREFIX = "Shared system prompt that is long enough to fill more than two KV blocks of sixteen. " * 2


@pytest.fixture
def keys_file(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"tenants": [
        {"name": "alice", "key_sha256": hash_key("alice-key"), "requests_per_minute": 3},
        {"name": "bob", "key_sha256": hash_key("bob-key"), "tokens_per_minute": 40},
        {"name": "carol", "key_sha256": hash_key("carol-key"), "max_concurrent_requests": 1},
        {"name": "ops", "key_sha256": hash_key("ops-key"), "admin": True},
    ]}))
    return path


def post(server, key: str | None, body: dict, path: str = "/v1/completions") -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.url + path, json={"model": MODEL, "max_tokens": 2, **body}, headers=headers, timeout=30)


def metrics(server, key: str) -> dict[str, float]:
    """/metrics samples as {'name{labels}': value}, read with ``key`` (it needs one when keys are set)."""
    response = httpx.get(server.url + "/metrics", headers={"authorization": f"Bearer {key}"}, timeout=10)
    assert response.status_code == 200, response.text
    return dict((name, float(value)) for name, value in
                (line.rsplit(" ", 1) for line in response.text.splitlines() if line and not line.startswith("#")))


def test_keys_file_stores_hashes_and_rejects_bad_files(keys_file, tmp_path) -> None:
    assert "alice-key" not in keys_file.read_text()
    tenancy = Tenancy.load(keys_file)
    assert tenancy.authenticate("Bearer alice-key").name == "alice"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"tenants": [{"name": "x", "key_sha256": "abc", "colour": "red"}]}))
    with pytest.raises(InvalidParameterError, match="colour"):
        Tenancy.load(bad)


def test_concurrency_limit(keys_file) -> None:
    tenancy = Tenancy.load(keys_file)
    carol = tenancy.authenticate("Bearer carol-key")
    held = tenancy.start(carol, 5)
    with pytest.raises(Rejected) as busy:
        tenancy.start(carol, 5)
    assert busy.value.status == 429 and busy.value.reason == "tenant_concurrency"
    tenancy.finish(held, 5, 0, 3)
    tenancy.start(carol, 5)
    assert tenancy.usage["carol"].completion_tokens == 3


def test_auth_limits_usage_and_admin(tiny_llm, keys_file) -> None:
    with live_server(tiny_llm, api_keys=str(keys_file)) as server:
        assert post(server, None, {"prompt": "hi"}).status_code == 401
        assert post(server, "wrong", {"prompt": "hi"}).json()["error"]["type"] == "authentication_error"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="alice-key", max_retries=0)
        assert client.models.list().data[0].id == MODEL

        codes = [post(server, "alice-key", {"prompt": "hi"}).status_code for _ in range(4)]
        assert codes == [200, 200, 200, 429]  # listing models is not a generation request
        limited = post(server, "alice-key", {"prompt": "hi"})
        assert limited.json()["error"]["code"] == "tenant_requests" and int(limited.headers["retry-after"]) >= 1

        assert post(server, "bob-key", {"prompt": "x" * 30}).status_code == 200  # 30 + 2 tokens
        assert post(server, "bob-key", {"prompt": "y" * 30}).json()["error"]["code"] == "tenant_tokens"

        assert httpx.get(server.url + "/admin/usage", headers={"authorization": "Bearer bob-key"}).status_code == 403
        usage = httpx.get(server.url + "/admin/usage", headers={"authorization": "Bearer ops-key"}).json()["tenants"]
        assert usage["alice"] == {"requests": 3, "prompt_tokens": 6, "cached_tokens": 0, "completion_tokens": 6}
        assert usage["bob"]["prompt_tokens"] == 30
        m = metrics(server, "ops-key")
        assert m['tokenmill:tenant_prompt_tokens_total{tenant="alice"}'] == 6
        assert m['tokenmill:tenant_completion_tokens_total{tenant="bob"}'] == 2
        assert m[f'tokenmill:request_rejected_total{{model_name="{MODEL}",reason="tenant_requests"}}'] == 2


def test_prefix_cache_isolation_between_tenants(tiny_llm, keys_file) -> None:
    with live_server(tiny_llm, api_keys=str(keys_file)) as server:
        def cached(key: str) -> int:
            response = post(server, key, {"prompt": PREFIX})
            assert response.status_code == 200, response.text
            return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        assert cached("ops-key") == 0
        assert cached("carol-key") == 0, "another tenant's cached prefix must not be shared"
        assert cached("ops-key") >= 32
        usage = httpx.get(server.url + "/admin/usage", headers={"authorization": "Bearer ops-key"}).json()
        assert usage["tenants"]["ops"]["cached_tokens"] >= 32
