"""Device and dtype selection: one place that knows what runs where."""

from __future__ import annotations

import torch

from tokenmill.errors import InvalidParameterError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as exc:
        raise InvalidParameterError(f"invalid device {device!r}: {exc}") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise InvalidParameterError(f"device {device!r} requested but CUDA is not available")
    if resolved.type not in ("cpu", "cuda"):
        raise InvalidParameterError(f"unsupported device type {resolved.type!r}; use cpu or cuda")
    return resolved


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """'auto' is float32 on CPU and bfloat16 on CUDA; float16 runs on CUDA only.

    (One exception, decided by ``tokenmill.loader.load_model``, which knows the model and the
    kernels: a GGUF file with 'auto' on CPU runs its quantized weights natively, in bfloat16.)"""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise InvalidParameterError(f"unsupported dtype {dtype!r}; use one of auto, {', '.join(DTYPES)}")
        dtype = DTYPES[dtype]
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise InvalidParameterError(f"unsupported dtype {dtype}")
    if dtype == torch.float16 and device.type == "cpu":
        raise InvalidParameterError("float16 is not supported on CPU; use float32 or bfloat16")
    return dtype
