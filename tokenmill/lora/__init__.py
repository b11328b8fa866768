"""LoRA adapters served on one base model: reading them (adapter), the step's slots and the
low-rank update the layers apply (slots), the registry and caches (manager), the options (config)."""

from tokenmill.lora.adapter import LoRAAdapter, load_adapter
from tokenmill.lora.config import LoRAConfig
from tokenmill.lora.manager import LoRAManager, UnknownAdapterError
from tokenmill.lora.slots import LayerLoRA, LoRABatch, LoRASlots

__all__ = ["LoRAAdapter", "LoRABatch", "LoRAConfig", "LoRAManager", "LoRASlots", "LayerLoRA", "UnknownAdapterError",
           "load_adapter"]
