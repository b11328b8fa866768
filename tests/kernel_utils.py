"""The compiled CPU kernels for tests, built through the builder itself.

``dispatch.cpu_ops()`` swallows a build error (the engine falls back to PyTorch), so a test that
skipped on ``cpu_ops() is None`` turned a kernel that no longer compiles into a green run. Here a
build error is raised, with the compiler's output, and fails the tests that need the kernels:

    require_kernels()    the module; skips (a whole module too, at import) only when
                         TOKENMILL_CPU_KERNELS=0 (or false, no) is set explicitly
    kernels_or_none()    the module, or None when that variable turns them off (for modules
                         whose other tests run without the kernels)

Both build at most once per process. Hardware features (``int4_linear_fast()``,
``bf16_linear_fast()``: AVX-512 BF16) are separate, explicit skip conditions in the modules
that need them, with their own reason.
"""

from __future__ import annotations

import os
from types import ModuleType

import pytest

from tokenmill.kernels import cpu_ops as builder
from tokenmill.kernels import dispatch

_built: ModuleType | None = None


def off_reason() -> str | None:
    """Why the kernels are off (the variable, as set), or None when they are wanted."""
    if dispatch.enabled():
        return None
    return f"CPU kernels turned off ({dispatch.ENV_VAR}={os.environ[dispatch.ENV_VAR]})"


def kernels_or_none() -> ModuleType | None:
    """The compiled kernels, or None when turned off; a build error propagates."""
    global _built
    if off_reason() is not None:
        return None
    if _built is None:
        _built = builder.build()
    return _built


def require_kernels() -> ModuleType:
    """The compiled kernels; skip (module-level allowed) only when turned off; a build error propagates."""
    ops = kernels_or_none()
    if ops is None:
        pytest.skip(off_reason(), allow_module_level=True)
    return ops


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux lists them (/proc/cpuinfo), for tests of which kernel paths
    this host runs (the kernels are built with -march=native)."""
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()
