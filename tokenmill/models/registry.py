"""Model family name -> model class."""

from __future__ import annotations

from tokenmill.models.base import CausalLM
from tokenmill.models.gemma3 import Gemma3ForCausalLM
from tokenmill.models.llama import LlamaForCausalLM

MODEL_CLASSES: dict[str, type[CausalLM]] = {
    "llama": LlamaForCausalLM,
    "gemma3": Gemma3ForCausalLM,
}
