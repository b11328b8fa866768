"""CPU kernels written in C++ (``tokenmill/kernels/cpu/*.cpp``), compiled once per machine on first
use with the host's C++ compiler (``-O3 -march=native``) into ``~/.cache/tokenmill/kernels``.

``load()`` returns the compiled module, or None when it cannot be built (no compiler, no ninja,
``TOKENMILL_CPU_KERNELS=0``): the engine then uses its PyTorch path, slower but the same results
within float rounding. Build failures are logged once.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger("tokenmill.kernels")

SOURCES = [Path(__file__).parent / "cpu" / name
           for name in ("paged_attention.cpp", "prefill_attention.cpp", "int8_linear.cpp", "int4_linear.cpp",
                        "bf16_linear.cpp", "kv_write.cpp", "decoder.cpp", "bindings.cpp")]
HEADERS = [Path(__file__).parent / "cpu" / "simd.h"]
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-fopenmp"]

_lock = threading.Lock()
_module: ModuleType | None = None
_tried = False


def enabled() -> bool:
    return os.environ.get("TOKENMILL_CPU_KERNELS", "1") not in ("0", "false", "no")


def build_dir() -> Path:
    """One directory per (sources, flags, torch, machine): a change to any rebuilds."""
    digest = hashlib.sha256()
    for src in SOURCES + HEADERS:
        digest.update(src.read_bytes())
    digest.update(" ".join(FLAGS + [torch.__version__, platform.machine(), platform.processor()]).encode())
    from tokenmill.paths import default_cache_dir

    return default_cache_dir() / "kernels" / digest.hexdigest()[:16]


def load() -> ModuleType | None:
    """The compiled CPU kernels, building them on first call; None when unavailable."""
    global _module, _tried
    if _tried:
        return _module
    with _lock:
        if _tried:
            return _module
        if enabled():
            try:
                from torch.utils.cpp_extension import load as cpp_load

                directory = build_dir()
                directory.mkdir(parents=True, exist_ok=True)
                logger.info("loading CPU kernels from %s (compiled on first use)", directory)
                _module = cpp_load(name="tokenmill_cpu_kernels", sources=[str(s) for s in SOURCES],
                                   extra_cflags=FLAGS, extra_ldflags=["-fopenmp"], build_directory=str(directory),
                                   verbose=False)
            except Exception as exc:  # no compiler, no ninja, build error: the PyTorch path still works
                logger.warning("CPU kernels unavailable, using the PyTorch attention path: %s", exc)
                _module = None
        _tried = True
    return _module
