"""The CPU allocator setting the engine applies: large freed blocks kept for the next step."""

from __future__ import annotations

import platform

import pytest

from tokenmill import allocator
from tokenmill.engine.config import EngineConfig


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt's thresholds are glibc's")
def test_glibc_keeps_large_blocks_once_per_process(monkeypatch):
    monkeypatch.setattr(allocator, "_applied", None)
    calls = []
    real = allocator._mallopt
    monkeypatch.setattr(allocator, "_mallopt", lambda p, v: calls.append((p, v)) or real(p, v))
    assert allocator.keep_large_buffers() is True
    assert allocator.keep_large_buffers() is True
    assert calls == [(allocator._M_MMAP_THRESHOLD, allocator.THRESHOLD), (allocator._M_TRIM_THRESHOLD, allocator.THRESHOLD)]


def test_without_mallopt_it_leaves_the_allocator_alone(monkeypatch):
    monkeypatch.setattr(allocator, "_applied", None)
    monkeypatch.setattr(allocator.ctypes, "CDLL", lambda name: object())  # a libc without mallopt
    assert allocator.keep_large_buffers() is False


def test_the_engine_option_is_on_by_default_and_can_be_turned_off():
    assert EngineConfig().keep_large_buffers is True
    assert EngineConfig.from_options(keep_large_buffers=False).keep_large_buffers is False
