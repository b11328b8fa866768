"""tokenmill: serve and optimize language models on CPU and CUDA."""

import importlib

from tokenmill.sampling_params import SamplingParams

# LLM pulls in torch and the model code; each name loads on first use so `import tokenmill` stays light.
_EXPORTS = {
    "LLM": ("tokenmill.llm", "LLM"),
    "quantize": ("tokenmill.quantization.api", "quantize"),  # quantize(model, Int4WeightOnlyConfig | ...)
    "prune": ("tokenmill.pruning.api", "prune"),  # prune(model, MagnitudeConfig | ... | StructuredConfig)
    "distill": ("tokenmill.distillation.distill", "distill_models"),  # distill(teacher, student, config, out)
}
__all__ = ["SamplingParams", *_EXPORTS]


def __getattr__(name: str):
    if name in _EXPORTS:
        module, attr = _EXPORTS[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(name)
