"""Bad input gets a 4xx with OpenAI's error JSON, never a 500 or a hang: hand-written cases, then
schemathesis fuzzing of every operation in /openapi.json (valid and invalid inputs)."""

from __future__ import annotations

import httpx
import hypothesis
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase

from tests.server.conftest import MODEL

CASES = [
    # (path, body or raw bytes, expected status, expected param)
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10**12}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "n": 1000}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "n": 64}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": "word " * 400}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 100000]}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "bogus": 1}, 400, "bogus"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "suffix"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400,
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
     400, "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi " * 300}]}, 400, "messages"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/tokenize", {"nothing": True}, 400, None),
]


def assert_openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


@pytest.mark.parametrize("path,body,status,param", CASES)
def test_bad_input_gets_openai_error_json(server, path, body, status, param) -> None:
    kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body}
    error = assert_openai_error(httpx.post(server.url + path, timeout=30, **kwargs), status)
    if param is not None:
        assert error["param"] == param, error


def test_unknown_route_method_and_oversized_body(server) -> None:
    assert_openai_error(httpx.get(server.url + "/v1/nothing"), 404)
    assert_openai_error(httpx.get(server.url + "/v1/completions"), 405)
    huge = b'{"prompt": "' + b"a" * (9 * 2**20) + b'"}'
    assert_openai_error(httpx.post(server.url + "/v1/completions", content=huge,
                                   headers={"content-type": "application/json"}), 413)
    bad_timeout = httpx.post(server.url + "/v1/completions", json={"prompt": "x"},
                             headers={"x-request-timeout": "soon"})
    assert assert_openai_error(bad_timeout, 400)["param"] == "X-Request-Timeout"


def test_deadline_aborts_and_frees_blocks(server) -> None:
    response = httpx.post(server.url + "/v1/completions", headers={"x-request-timeout": "0.05"},
                          json={"prompt": "slow", "max_tokens": 240, "ignore_eos": True}, timeout=30)
    error = assert_openai_error(response, 503)
    assert error["code"] == "deadline_exceeded" and int(response.headers["retry-after"]) >= 1
    server.wait_idle()


@pytest.mark.parametrize("mode", list(schemathesis.GenerationMode))
def test_fuzz_openapi_no_server_errors(server, mode) -> None:
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    failures, called = [], set()
    for result in schema.get_all_operations():
        operation = result.ok()

        @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
        @hypothesis.settings(max_examples=15, deadline=None, database=None, phases=[Phase.generate],
                             suppress_health_check=list(HealthCheck))
        def check(case) -> None:
            response = case.call(base_url=server.url, timeout=30)
            called.add(case.path)
            if response.status_code >= 500:
                failures.append((case.method, case.path, case.body, response.status_code, response.text[:300]))
            elif response.status_code >= 400 and response.headers.get("content-type") == "application/json":
                assert set(response.json()["error"]) == {"message", "type", "param", "code"}

        try:
            check()
        except hypothesis.errors.Unsatisfiable:  # nothing to break in an operation without inputs
            assert mode == schemathesis.GenerationMode.NEGATIVE
    assert not failures, failures[:5]
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"} <= called
    server.wait_idle()
    assert httpx.get(server.url + "/v1/models").json()["data"][0]["id"] == MODEL


@pytest.mark.parametrize("prompt, code", [([1, 2, 100000], "invalid_token_id"), ([[1, 2], [3, 10**6]], "invalid_token_id")])
def test_prompt_errors_carry_a_code(server, prompt, code) -> None:
    error = assert_openai_error(httpx.post(server.url + "/v1/completions", json={"prompt": prompt}, timeout=30), 400)
    assert error["code"] == code and error["param"] == "prompt", error
