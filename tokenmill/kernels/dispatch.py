"""Which kernels run: decided once per process, logged once, asked by every caller.

The decision is whether tokenmill's compiled CPU kernels exist in this process:

    TOKENMILL_CPU_KERNELS=0 (or false, no)   off: nothing is built, the PyTorch path runs
    otherwise                                 built by :func:`tokenmill.kernels.cpu_ops.build`
                                              (loaded when ``python -m tokenmill.kernels`` built
                                              them at install, else compiled now), or, when that
                                              fails, unavailable: the PyTorch path runs

It is taken on the first call that needs it (never at import), under a lock, and logged on the
``tokenmill.kernels`` logger: INFO "CPU kernels: tokenmill C++ (built in DIR)" or "CPU kernels: off
(TOKENMILL_CPU_KERNELS=0), PyTorch path"; WARNING "CPU kernels: unavailable: <reason>". It is
never taken again: changing the variable later in the process has no effect. The server takes it
in its warm-up, before ``/ready`` turns 200, so no request waits for a compile. Tests do not ask
here (a failed build would only turn them into skips): they call the builder through
``tests/kernel_utils.py``, so that a build error fails them.

Callers do not check devices, dtypes or the variable themselves: they ask one of the functions
below, which add the conditions under which a kernel takes a given call and return the compiled
module or None (then the caller runs its PyTorch path). Both paths give the same results within
float rounding.
"""

from __future__ import annotations

import logging
import os
import threading
from types import ModuleType

import torch

from tokenmill.kernels import cpu_ops as builder

logger = logging.getLogger("tokenmill.kernels")

ENV_VAR = "TOKENMILL_CPU_KERNELS"
KERNEL_DTYPES = (torch.float32, torch.bfloat16)
"""The dtypes of the activations tokenmill's CPU kernels compute in."""

_lock = threading.Lock()
_decided = False
_ops: ModuleType | None = None


def enabled() -> bool:
    """Whether ``TOKENMILL_CPU_KERNELS`` allows the CPU kernels (unset: yes)."""
    return os.environ.get(ENV_VAR, "1") not in ("0", "false", "no")


def _decide() -> ModuleType | None:
    if not enabled():
        logger.info("CPU kernels: off (%s=%s), PyTorch path", ENV_VAR, os.environ[ENV_VAR])
        return None
    try:
        module = builder.build()
    except Exception as exc:  # no compiler, no ninja, build error: the PyTorch path still works
        logger.warning("CPU kernels: unavailable: %s; PyTorch path", exc)
        return None
    logger.info("CPU kernels: tokenmill C++ (built in %s)", builder.build_dir())
    return module


def cpu_ops() -> ModuleType | None:
    """The compiled CPU kernels, or None when off or unavailable (the process's one decision)."""
    global _decided, _ops
    if _decided:
        return _ops
    with _lock:
        if not _decided:
            _ops = _decide()
            _decided = True
    return _ops


def _takes(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype in KERNEL_DTYPES


def for_tensors(*tensors: torch.Tensor) -> ModuleType | None:
    """:func:`cpu_ops` when every tensor is a float32 or bfloat16 CPU tensor, else None (nothing built)."""
    if not all(_takes(t) for t in tensors):
        return None
    return cpu_ops()


def for_inference(x: torch.Tensor, *params: torch.Tensor) -> ModuleType | None:
    """:func:`for_tensors` of ``x``, but None when autograd records and ``x`` or one of ``params``
    requires a gradient (the kernels have no backward: training, QAT, goes through PyTorch).
    ``params`` are only checked for gradients, not for device or dtype."""
    if not _takes(x):
        return None
    if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params)):
        return None
    return cpu_ops()


def for_attention(q: torch.Tensor, use_cpu_kernel: bool | None = None) -> ModuleType | None:
    """The paged-attention kernels for queries ``q`` [T, H, D]: :func:`for_tensors` of ``q`` when the
    kernels take its head_dim.

    ``use_cpu_kernel`` (``PagedAttentionBackend``'s): False, None always; None, when they apply;
    True, likewise, but a float32 / bfloat16 CPU ``q`` with the kernels off or unavailable raises
    RuntimeError instead of falling back."""
    if use_cpu_kernel is False or not _takes(q):
        return None
    ops = cpu_ops()
    if use_cpu_kernel and ops is None:
        raise RuntimeError("use_cpu_kernel=True but the CPU kernels could not be built (see the log)")
    if ops is None or not ops.supports_head_dim(q.shape[-1]):
        return None
    return ops


def for_int4(device: torch.device | str) -> ModuleType | None:
    """:func:`cpu_ops` for an INT4 weight kept on ``device``: on CPU, when its kernel has its fast
    path in this build (AVX-512 BF16); else None (PyTorch's int4 kernels)."""
    if torch.device(device).type != "cpu":
        return None
    ops = cpu_ops()
    return ops if ops is not None and ops.int4_linear_fast() else None


def for_grouped(device: torch.device | str) -> ModuleType | None:
    """:func:`cpu_ops` for a weight on ``device`` that could take the grouped-codes kernel
    (``group_weight_linear``) instead of its own: on CPU, when that kernel has its fast path in this
    build (AVX-512 BF16); else None."""
    if torch.device(device).type != "cpu":
        return None
    ops = cpu_ops()
    return ops if ops is not None and ops.group_linear_fast() else None
