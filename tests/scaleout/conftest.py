"""Scale-out tests: the tiny checkpoint (shared with the server tests), and a front served over live
replicas on a local Ray cluster."""

from __future__ import annotations

import contextlib

from tests.server.conftest import LiveServer, tiny_dir  # noqa: F401 - the tiny checkpoint fixture, shared
from tokenmill.server.config import CostConfig, ServerConfig

MODEL = "tiny-llama"
OPTIONS = {"dtype": "float32", "device": "cpu", "max_num_seqs": 4, "kv_cache_memory": 64 * 16 * 2 * 2 * 2 * 32 * 4}
"""4 sequences, 64 KV blocks of 16 tokens per replica (as the server tests' tiny_llm)."""


@contextlib.contextmanager
def served_front(source: str, config: ServerConfig, cost: CostConfig, scale):
    """``tokenmill serve --replicas``'s front over ``source`` on a local Ray cluster, live on a free port;
    the replicas, Ray Serve and Ray stop on exit."""
    import ray
    from ray import serve

    from tokenmill.scaleout.deploy import launch

    front = launch(source, OPTIONS, config, cost, scale)
    try:
        with LiveServer(None, config, state=front.state, app=front.app()) as server:
            yield server
    finally:
        front.stop()
        serve.shutdown()
        ray.shutdown()
