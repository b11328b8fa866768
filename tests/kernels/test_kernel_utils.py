"""tests/kernel_utils.py: a kernel build error fails the tests that need the kernels (it is raised,
not turned into a skip); only TOKENMILL_CPU_KERNELS=0, set explicitly, skips them."""

from __future__ import annotations

import types

import pytest

from tests import kernel_utils
from tokenmill.kernels import cpu_ops as builder
from tokenmill.kernels import dispatch


@pytest.fixture
def unbuilt(monkeypatch):
    """kernel_utils as in a fresh process (nothing built yet), with the variable unset."""
    monkeypatch.setattr(kernel_utils, "_built", None)
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    return monkeypatch


def test_a_build_error_is_raised_not_skipped(unbuilt):
    def fail():
        raise RuntimeError("Error building extension 'tokenmill_cpu_kernels': bindings.cpp:7:1: error: boom")

    unbuilt.setattr(builder, "build", fail)
    with pytest.raises(RuntimeError, match="bindings.cpp:7:1: error: boom"):
        kernel_utils.require_kernels()
    with pytest.raises(RuntimeError, match="error: boom"):
        kernel_utils.kernels_or_none()


@pytest.mark.parametrize("value", ["0", "false", "no"])
def test_only_the_variable_turns_them_into_skips(unbuilt, value):
    def no_build():
        raise AssertionError("built with the kernels turned off")

    unbuilt.setattr(builder, "build", no_build)
    unbuilt.setenv(dispatch.ENV_VAR, value)
    with pytest.raises(pytest.skip.Exception, match=f"TOKENMILL_CPU_KERNELS={value}"):
        kernel_utils.require_kernels()
    assert kernel_utils.kernels_or_none() is None


def test_the_module_is_built_once(unbuilt):
    module, calls = types.SimpleNamespace(), []
    unbuilt.setattr(builder, "build", lambda: calls.append(1) or module)
    assert kernel_utils.require_kernels() is module and kernel_utils.kernels_or_none() is module
    assert calls == [1]
