"""tokenmill.kernels.dispatch: the kernel decision is taken once per process and logged once;
TOKENMILL_CPU_KERNELS=0 builds nothing; each entry point keeps its callers' conditions."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import types
from pathlib import Path

import pytest
import torch

from tokenmill.kernels import cpu_ops as builder
from tokenmill.kernels import dispatch

ROOT = Path(__file__).resolve().parents[2]

OFF_SCRIPT = r"""
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s %(levelname)s %(message)s")
import torch
from tokenmill.kernels import cpu_ops, dispatch

def no_build():
    raise AssertionError("built with TOKENMILL_CPU_KERNELS=0")

cpu_ops.build = no_build
from tokenmill.attention.kv_cache import PagedKVCache
from tokenmill.attention.metadata import PagedAttentionMetadata
from tokenmill.attention.paged import PagedAttentionBackend

x = torch.zeros(2, 16)
assert dispatch.cpu_ops() is None and dispatch.cpu_ops() is None
assert dispatch.for_tensors(x) is None and dispatch.for_inference(x) is None
assert dispatch.for_attention(torch.zeros(1, 2, 16)) is None and dispatch.for_int4("cpu") is None
cache = PagedKVCache(4, 4, [0], 2, 16, torch.float32)
meta = PagedAttentionMetadata.build([1], [3], [[[1]]], 4)
q, k, v = torch.randn(1, 2, 16), torch.randn(1, 2, 16), torch.randn(1, 2, 16)
out = PagedAttentionBackend().forward(q, k, v, cache.layer(0), meta, 0.25, None)  # the PyTorch path
assert out.shape == (1, 2, 16) and torch.isfinite(out).all()
try:
    PagedAttentionBackend(use_cpu_kernel=True).forward(q, k, v, cache.layer(0), meta, 0.25, None)
except RuntimeError as exc:
    assert "use_cpu_kernel=True" in str(exc)
else:
    raise AssertionError("use_cpu_kernel=True ran without kernels")
print("OK")
"""


def test_off_builds_nothing_and_logs_the_decision_once(tmp_path):
    env = dict(os.environ, TOKENMILL_CPU_KERNELS="0", XDG_CACHE_HOME=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", OFF_SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[-1] == "OK"
    decisions = [line for line in lines if line.startswith("tokenmill.kernels")]
    assert decisions == ["tokenmill.kernels INFO CPU kernels: off (TOKENMILL_CPU_KERNELS=0), PyTorch path"]
    assert not (tmp_path / "tokenmill" / "kernels").exists()


@pytest.fixture
def undecided(monkeypatch):
    """dispatch as in a fresh process (restored afterwards), with the variable unset."""
    monkeypatch.setattr(dispatch, "_decided", False)
    monkeypatch.setattr(dispatch, "_ops", None)
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    return monkeypatch


def test_the_decision_is_taken_once_and_logged_once(undecided, caplog):
    module = types.SimpleNamespace()
    calls = []
    undecided.setattr(builder, "build", lambda: calls.append(1) or module)
    caplog.set_level(logging.INFO, logger="tokenmill.kernels")
    got = []
    threads = [threading.Thread(target=lambda: got.append(dispatch.cpu_ops())) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(got) == 8 and all(m is module for m in got)
    undecided.setenv(dispatch.ENV_VAR, "0")  # too late: the process has decided
    assert dispatch.cpu_ops() is module and len(calls) == 1
    messages = [r.getMessage() for r in caplog.records if r.name == "tokenmill.kernels"]
    assert messages == [f"CPU kernels: tokenmill C++ (built in {builder.build_dir()})"]


def test_a_failed_build_is_logged_and_falls_back(undecided, caplog):
    def fail():
        raise OSError("no C++ compiler")

    undecided.setattr(builder, "build", fail)
    caplog.set_level(logging.INFO, logger="tokenmill.kernels")
    assert dispatch.cpu_ops() is None and dispatch.cpu_ops() is None
    records = [r for r in caplog.records if r.name == "tokenmill.kernels"]
    assert [(r.levelname, r.getMessage()) for r in records] == [
        ("WARNING", "CPU kernels: unavailable: no C++ compiler; PyTorch path")]
    q = torch.zeros(1, 2, 16)
    assert dispatch.for_attention(q) is None
    with pytest.raises(RuntimeError, match="use_cpu_kernel=True"):
        dispatch.for_attention(q, use_cpu_kernel=True)


@pytest.fixture
def fake_ops(monkeypatch):
    """A decided process whose kernels take head_dim 16 only and have the fast int4 path."""
    ops = types.SimpleNamespace(supports_head_dim=lambda d: d == 16, int4_linear_fast=lambda: True)
    monkeypatch.setattr(dispatch, "_decided", True)
    monkeypatch.setattr(dispatch, "_ops", ops)
    return ops


def test_for_tensors_takes_float32_and_bfloat16_cpu_tensors(fake_ops):
    x = torch.zeros(2, 4)
    assert dispatch.for_tensors(x) is fake_ops and dispatch.for_tensors(x.bfloat16(), x) is fake_ops
    assert dispatch.for_tensors(x.half()) is None and dispatch.for_tensors(x, x.double()) is None
    assert dispatch.for_tensors(torch.zeros(2, 4, device="meta")) is None


def test_for_inference_keeps_autograd_on_the_pytorch_path(fake_ops):
    x, w = torch.zeros(2, 4), torch.nn.Parameter(torch.ones(4))
    assert dispatch.for_inference(x) is fake_ops
    assert dispatch.for_inference(x, w) is None  # a weight being trained
    assert dispatch.for_inference(x.requires_grad_()) is None
    with torch.no_grad():
        assert dispatch.for_inference(x, w) is fake_ops
    assert dispatch.for_inference(torch.zeros(2, 4, dtype=torch.float16)) is None


def test_for_attention_and_for_int4(fake_ops):
    assert dispatch.for_attention(torch.zeros(3, 2, 16)) is fake_ops
    assert dispatch.for_attention(torch.zeros(3, 2, 16), use_cpu_kernel=True) is fake_ops
    assert dispatch.for_attention(torch.zeros(3, 2, 16), use_cpu_kernel=False) is None
    assert dispatch.for_attention(torch.zeros(3, 2, 24)) is None  # a head_dim the kernels do not take
    assert dispatch.for_attention(torch.zeros(3, 2, 16, dtype=torch.float16), use_cpu_kernel=True) is None
    assert dispatch.for_int4("cpu") is fake_ops and dispatch.for_int4(torch.device("meta")) is None
    fake_ops.int4_linear_fast = lambda: False
    assert dispatch.for_int4("cpu") is None
