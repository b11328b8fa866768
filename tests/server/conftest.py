"""A live server on 127.0.0.1 around a tiny random Llama checkpoint (byte-level tokenizer).

``live_server(llm, **config)`` starts uvicorn in a thread on a free port and stops it on exit;
one LLM serves several servers in turn (never two at once: each owns the engine while it runs).
"""

from __future__ import annotations

import contextlib
import re
import socket
import threading
import time

import httpx
import pytest
import torch
import uvicorn

from tests.model_utils import save_byte_tokenizer
from tokenmill import LLM
from tokenmill.server.app import build_app, create_state
from tokenmill.server.config import CostConfig, ServerConfig
from tokenmill.server.serve import uvicorn_config

MODEL = "tiny-llama"


def build_tiny_checkpoint(path, seed: int = 0, tied: bool = True) -> None:
    """Embeddings scaled up so that greedy choices are no coin flips; ``tied``: the LM head is the
    embedding (such a model repeats its prompt's last byte), else a head of its own (another
    model, with other answers)."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      tie_word_embeddings=tied, eos_token_id=256, bos_token_id=None)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # peaked logits, so that greedy choices are not coin flips
        model.model.embed_tokens.weight.mul_(25)
        if not tied:
            model.lm_head.weight.mul_(25)
    model.save_pretrained(path)
    save_byte_tokenizer(path)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    build_tiny_checkpoint(path)
    return path


@pytest.fixture(scope="session")
def tiny_llm(tiny_dir) -> LLM:
    """4 sequences at once, a KV pool of 64 blocks of 16 tokens."""
    return LLM(str(tiny_dir), dtype="float32", device="cpu", max_num_seqs=4, policy="priority",
               kv_cache_memory=64 * 16 * 2 * 2 * 2 * 32 * 4)


class LiveServer:
    def __init__(self, llm: LLM | dict[str, LLM] | None, config: ServerConfig, cost: CostConfig | None = None,
                 loader=None, state=None, app=None) -> None:
        """``state``, ``app``: a ServerState and its app built elsewhere (a scale-out front), served
        instead of ``llm``'s."""
        self.state = state if state is not None else create_state(llm, config, cost, loader)
        self.app = app if app is not None else build_app(self.state)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn_config(self.app, config, log_level="warning", timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    wait_for_ready = True
    """Whether entering waits for /ready (the engine warmed up), not only for the socket."""

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.01)
        # the warm-up may compile the CPU kernels when nothing built them before (minutes)
        deadline = time.monotonic() + 600
        while self.wait_for_ready and httpx.get(self.url + "/ready", timeout=10).status_code != 200:
            assert time.monotonic() < deadline and self.thread.is_alive() and self.state.engine.alive, \
                "the server did not become ready"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        self.sock.close()

    def metrics(self, headers: dict | None = None) -> dict[str, float]:
        """Samples of /metrics, as {'name{labels}': value} (``headers``: an admin key, when keys are on)."""
        text = httpx.get(self.url + "/metrics", headers=headers, timeout=10).text
        out = {}
        for line in text.splitlines():
            match = re.match(r"^([a-zA-Z_:][\w:]*(?:\{[^}]*\})?) (\S+)$", line)
            if match:
                out[match.group(1)] = float(match.group(2))
        return out

    def wait_idle(self, timeout: float = 20.0, headers: dict | None = None) -> None:
        """Until nothing runs or waits and every KV block is free (as /metrics and the engine say)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics(headers)
            idle = True
            for name, served in self.state.models.items():
                label = f'{{model_name="{name}"}}'
                idle = idle and (m[f"tokenmill:num_requests_running{label}"] == 0
                                 and m[f"tokenmill:num_requests_waiting{label}"] == 0
                                 and m[f"tokenmill:kv_cache_used_blocks{label}"] == 0
                                 and served.admission.in_engine == 0 and served.admission.num_queued == 0)
            if idle:
                for served in self.state.models.values():
                    assert served.engine.num_used_blocks == 0 and not served.engine.has_unfinished_requests()
                return
            assert time.monotonic() < deadline, f"server not idle: {m}"
            time.sleep(0.05)


@contextlib.contextmanager
def live_server(llm: LLM | dict[str, LLM], cost: CostConfig | None = None, loader=None, **config):
    """``llm``: one model (served as ``tiny-llama``) or several by name; ``cost``: prices and
    objectives; ``loader``: a ModelLoader for POST /admin/models."""
    if isinstance(llm, LLM):
        config.setdefault("served_model_name", MODEL)
    with LiveServer(llm, ServerConfig(**config), cost, loader) as server:
        yield server


@pytest.fixture(scope="module")
def server(tiny_llm):
    with live_server(tiny_llm) as s:
        yield s
