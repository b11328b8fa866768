"""The builder of tokenmill's CPU kernels written in C++ (``tokenmill/kernels/cpu/*.cpp``): compiled
with the host's C++ compiler (``-O3 -march=native``) into ``~/.cache/tokenmill/kernels``, one
directory per source hash, so a machine compiles each version once (about two minutes) and later
processes only load it.

:func:`build` compiles (when needed) and loads the module, raising on any failure. Whether to
build at all, and what runs when it fails, is :mod:`tokenmill.kernels.dispatch`'s decision: call
``dispatch.cpu_ops()``, not this module.
"""

from __future__ import annotations

import hashlib
import logging
import platform
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger("tokenmill.kernels")

MODULE_NAME = "tokenmill_cpu_kernels"
SOURCES = [Path(__file__).parent / "cpu" / name
           for name in ("paged_attention.cpp", "prefill_attention.cpp", "int8_linear.cpp", "int4_linear.cpp",
                        "bf16_linear.cpp", "kv_write.cpp", "decoder.cpp", "bindings.cpp")]
HEADERS = [Path(__file__).parent / "cpu" / name for name in ("kernels.h", "simd.h")]
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-fopenmp"]


def build_dir() -> Path:
    """One directory per (sources, flags, torch, machine): a change to any rebuilds."""
    digest = hashlib.sha256()
    for src in SOURCES + HEADERS:
        digest.update(src.read_bytes())
    digest.update(" ".join(FLAGS + [torch.__version__, platform.machine(), platform.processor()]).encode())
    from tokenmill.paths import default_cache_dir

    return default_cache_dir() / "kernels" / digest.hexdigest()[:16]


def build() -> ModuleType:
    """The compiled module, compiling it first when this machine has no build of these sources.

    Raises whatever stops it (no compiler, no ninja, a compile error). Not thread-safe and not
    cached: dispatch calls it once per process, under its lock."""
    from torch.utils.cpp_extension import load as cpp_load

    directory = build_dir()
    directory.mkdir(parents=True, exist_ok=True)
    if not (directory / f"{MODULE_NAME}.so").exists():
        logger.info("compiling CPU kernels into %s (first use of these sources on this machine)", directory)
    return cpp_load(name=MODULE_NAME, sources=[str(s) for s in SOURCES], extra_cflags=FLAGS,
                    extra_ldflags=["-fopenmp"], build_directory=str(directory), verbose=False)
