"""Other ways to deploy: disaggregated prefill/decode (prototype: a prefill replica computes the prompt and
hands its KV blocks through Ray's object store to a decode replica, which answers exactly as one process
would), and a front attached to replicas a Ray Serve config file deployed."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import yaml
from ray import serve

from tests.scaleout.conftest import MODEL, OPTIONS, served_front
from tests.server.conftest import LiveServer
from tokenmill import LLM, SamplingParams
from tokenmill.scaleout.config import ScaleOutConfig
from tokenmill.errors import InvalidParameterError
from tokenmill.scaleout.deploy import build_engine_app, launch
from tokenmill.server.config import CostConfig, ServerConfig



@pytest.fixture(scope="module")
def front(tiny_dir):
    config = ServerConfig(served_model_name=MODEL)
    scale = ScaleOutConfig(replicas=1, prefill_replicas=1, replica_threads=1, routing_stats_period=0.2)
    with served_front(str(tiny_dir), config, CostConfig(), scale) as server:
        yield server


def test_decode_replica_serves_the_prompt_from_handed_over_blocks(front, tiny_dir) -> None:
    prompt = "a prompt long enough for a few blocks of sixteen bytes, handed over " * 2
    r = httpx.post(front.url + "/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    local = LLM(str(tiny_dir), **OPTIONS).generate([prompt], SamplingParams(max_tokens=12, temperature=0))
    assert r.json()["choices"][0]["text"] == local[0].outputs[0].text
    full_blocks = len(local[0].prompt_token_ids) // 16
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == full_blocks * 16
    transfers = front.state.engine.transfers
    assert transfers["requests"] == 1 and transfers["blocks"] == full_blocks and transfers["bytes"] > 0
    streamed = []
    with httpx.stream("POST", front.url + "/v1/completions", timeout=60,
                      json={"model": MODEL, "prompt": prompt + "!", "max_tokens": 5, "stream": True}) as s:
        streamed = [line for line in s.iter_lines() if line.startswith("data: ")]
    assert streamed[-1] == "data: [DONE]" and len(streamed) >= 3
    text = httpx.get(front.url + "/metrics").text
    assert "tokenmill:kv_transfer_bytes_total" in text and 'tokenmill:kv_transfer_seconds_total{phase="import"}' in text


def test_a_front_attaches_to_replicas_a_config_file_deployed(front, tiny_dir) -> None:
    config = yaml.safe_load((Path(__file__).parents[2] / "docs" / "scale-out-serve.yaml").read_text())
    args = config["applications"][0]["args"]
    args = {**args, "model": str(tiny_dir), "options": {**OPTIONS, "prefix_hash_key": "from-the-file"},
            "replicas": 1, "min_replicas": None, "max_replicas": None, "replica_threads": 1}
    with pytest.raises(InvalidParameterError, match="prefix_hash_key"):
        build_engine_app({**args, "options": OPTIONS})
    serve.run(build_engine_app(args), name="from-config", route_prefix=None)
    try:
        with pytest.raises(InvalidParameterError, match="prefix-hash-key"):
            launch(str(tiny_dir), {}, ServerConfig(), CostConfig(), ScaleOutConfig(attach="from-config"))
        attached = launch(str(tiny_dir), {"prefix_hash_key": "from-the-file"}, ServerConfig(served_model_name=MODEL),
                          CostConfig(), ScaleOutConfig(attach="from-config", routing_stats_period=0.2))
        with LiveServer(None, attached.state.config, state=attached.state, app=attached.app()) as server:
            prompt = "the same long prompt, twice, lands where its blocks are cached " * 2
            for _ in range(2):
                r = httpx.post(server.url + "/v1/completions", timeout=60,
                               json={"model": MODEL, "prompt": prompt, "max_tokens": 3})
                assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 96
        attached.stop()  # owns nothing: the application stays
        assert "from-config" in serve.status().applications
    finally:
        serve.delete("from-config")
