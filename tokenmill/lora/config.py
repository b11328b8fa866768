"""Multi-LoRA serving options: how many adapters a step mixes, how many stay in memory."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from tokenmill.config import Config
from tokenmill.errors import InvalidParameterError
from tokenmill.lora.adapter import MAX_RANK
from tokenmill.options import option


@dataclass(frozen=True)
class LoRAConfig(Config):
    """One base model, many LoRA adapters in the same batch (tokenmill.lora)."""

    title: ClassVar[str] = "LoRA"

    enable_lora: bool = option(False, "serve LoRA adapters on top of the model (requests name them in `model`)")
    max_loras: int = option(8, "most distinct adapters in one step (each has a slot of resident weights)")
    max_lora_rank: int = option(16, f"highest adapter rank the slots take (up to {MAX_RANK}; lower ranks are padded)")
    lora_dtype: str = option(
        "auto", "how the slots hold adapter weights: auto (the model's dtype) or int8 (a scale per row: half the "
                "bytes a decode step reads for them; lossy, see the README)", choices=("auto", "int8"))
    max_cpu_loras: int | None = option(
        None, "most adapters kept loaded in memory, least recently used dropped first and read again from disk "
              "when asked for (default: max_loras)")

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise InvalidParameterError(f"max_loras must be >= 1, got {self.max_loras}")
        if not 1 <= self.max_lora_rank <= MAX_RANK:
            raise InvalidParameterError(f"max_lora_rank must be in 1..{MAX_RANK}, got {self.max_lora_rank}")
        if self.lora_dtype not in ("auto", "int8"):
            raise InvalidParameterError(f"lora_dtype must be auto or int8, got {self.lora_dtype!r}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise InvalidParameterError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")

    @property
    def cpu_capacity(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras
