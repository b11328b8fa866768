"""The builder of tokenmill's CPU kernels written in C++ (``tokenmill/kernels/cpu/*.cpp``): compiled
with the host's C++ compiler (``-O3 -march=native``) into ``~/.cache/tokenmill/kernels``, one
directory per (source path, source content, flags, torch, machine), so a checkout compiles each
version once (about two minutes) and later processes only load it.

The directory is keyed by the absolute path of the kernel sources as well as their content:
torch's ninja build records absolute source paths, so two checkouts sharing one directory would
rebuild it in turn, each invalidating the other's build. With the path in the key each checkout
has its own directory and keeps reusing it.

A build killed mid-way leaves torch's lock file in its directory, which would make every later
build wait forever: :func:`wait_for_build_lock` removes one older than STALE_LOCK_SECONDS.

Build ahead of time with ``python -m tokenmill.kernels`` (``make install`` runs it), so that no
request ever waits for the compiler.

:func:`build` compiles (when needed) and loads the module, raising on any failure. Whether to
build at all, and what runs when it fails, is :mod:`tokenmill.kernels.dispatch`'s decision: call
``dispatch.cpu_ops()``, not this module.
"""

from __future__ import annotations

import hashlib
import logging
import platform
import time
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger("tokenmill.kernels")

MODULE_NAME = "tokenmill_cpu_kernels"
SOURCE_DIR = Path(__file__).resolve().parent / "cpu"
"""This checkout's kernel sources (an absolute path: part of the build directory's key)."""
SOURCE_NAMES = ("paged_attention.cpp", "prefill_attention.cpp", "int8_linear.cpp", "int4_linear.cpp",
                "group_linear.cpp", "int8_copy_linear.cpp", "bf16_linear.cpp", "sparse_linear.cpp", "kv_write.cpp",
                "lora.cpp", "decoder.cpp", "argmax.cpp", "int4_search.cpp", "gptq.cpp", "bindings.cpp")
HEADER_NAMES = ("kernels.h", "simd.h", "amx.h")
SOURCES = [SOURCE_DIR / name for name in SOURCE_NAMES]
HEADERS = [SOURCE_DIR / name for name in HEADER_NAMES]
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-fopenmp"]
STALE_LOCK_SECONDS = 1200.0
"""A build directory's lock older than this is left by a build that died (a full build takes about two
minutes, seven on a loaded host): torch's builder would wait on it forever."""


def build_dir(source_dir: Path = SOURCE_DIR) -> Path:
    """One directory per (sources' absolute path, their content, flags, torch, machine): a change
    to any rebuilds, and two checkouts never share one."""
    source_dir = Path(source_dir).resolve()
    digest = hashlib.sha256()
    digest.update(str(source_dir).encode() + b"\0")
    for name in SOURCE_NAMES + HEADER_NAMES:
        digest.update((source_dir / name).read_bytes())
    digest.update(" ".join(FLAGS + [torch.__version__, platform.machine(), platform.processor()]).encode())
    from tokenmill.paths import default_cache_dir

    return default_cache_dir() / "kernels" / digest.hexdigest()[:16]


def is_built(directory: Path | None = None) -> bool:
    """Whether ``directory`` (this checkout's :func:`build_dir` by default) holds a compiled module."""
    directory = build_dir() if directory is None else directory
    return (directory / f"{MODULE_NAME}.so").exists()


def wait_for_build_lock(directory: Path, stale_after: float = STALE_LOCK_SECONDS, poll: float = 0.5) -> None:
    """Return once ``directory`` has no build lock: another process's build finished (it removes
    its lock), or the lock is older than ``stale_after`` seconds, left by a build that was killed
    (removed here, with a warning). torch's ``cpp_extension`` takes the lock itself afterwards."""
    lock = directory / "lock"
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        if age > stale_after:
            logger.warning("removing the stale kernel build lock %s (%.0f s old: its build died)", lock, age)
            lock.unlink(missing_ok=True)
            return
        time.sleep(poll)


def build() -> ModuleType:
    """The compiled module, compiling it first when this checkout has no build of these sources.

    Raises whatever stops it (no compiler, no ninja, a compile error: torch's RuntimeError then
    carries the compiler's output). Not thread-safe and not cached: dispatch calls it once per
    process, under its lock."""
    from torch.utils.cpp_extension import load as cpp_load

    directory = build_dir()
    directory.mkdir(parents=True, exist_ok=True)
    wait_for_build_lock(directory)
    if not is_built(directory):
        logger.info("compiling CPU kernels into %s (first use of these sources in this checkout)", directory)
    return cpp_load(name=MODULE_NAME, sources=[str(s) for s in SOURCES], extra_cflags=FLAGS,
                    extra_ldflags=["-fopenmp"], build_directory=str(directory), verbose=False)
