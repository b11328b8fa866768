"""``python -m tokenmill.kernels``: build (or load) this checkout's CPU kernels ahead of time.

``make install`` runs it after the pip install, so that ``make run``, ``make test`` and CI build
the kernels at install time and no request (and no ``tokenmill quantize``) waits for the compiler.

    exit 0   built or already built: prints the directory and how long it took
    exit 0   TOKENMILL_CPU_KERNELS=0 (or false, no): prints that they are off; builds nothing
    exit 1   the build failed: prints the compiler's error on stderr

It calls the builder directly (not :mod:`~tokenmill.kernels.dispatch`, which falls back to the
PyTorch path when a build fails): here a failed build is an error.
"""

from __future__ import annotations

import os
import sys
import time

from tokenmill.kernels import cpu_ops as builder
from tokenmill.kernels import dispatch


def main() -> int:
    if not dispatch.enabled():
        print(f"CPU kernels: off ({dispatch.ENV_VAR}={os.environ[dispatch.ENV_VAR]}); nothing built")
        return 0
    directory = builder.build_dir()
    was_built = builder.is_built(directory)
    if not was_built:
        print(f"CPU kernels: compiling into {directory} (about two minutes)...", flush=True)
    start = time.perf_counter()
    try:
        module = builder.build()
    except Exception as exc:
        print(f"CPU kernels: build failed after {time.perf_counter() - start:.1f} s in {directory}:\n"
              f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    seconds = time.perf_counter() - start
    what = "already built, loaded" if was_built else "built"
    fast = {name: getattr(module, f"{name}_linear_fast", lambda: False)() for name in ("int4", "bf16", "sparse")}
    print(f"CPU kernels: {what} in {directory} ({seconds:.1f} s); AVX-512 BF16 fast paths "
          "(sparse: + VBMI2): "
          + ", ".join(f"{name} {'yes' if on else 'no'}" for name, on in fast.items())
          + f"; AMX tiles for bfloat16 products: {'yes' if getattr(module, 'amx_tiles', lambda: False)() else 'no'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
