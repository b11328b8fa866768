"""tokenmill: serve and optimize language models on CPU and CUDA."""

from tokenmill.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "distill", "prune", "quantize"]


def __getattr__(name: str):
    # LLM pulls in torch and the model code; import it on first use so `import tokenmill` stays light.
    if name == "LLM":
        from tokenmill.llm import LLM

        return LLM
    if name == "quantize":
        from tokenmill.quantization.api import quantize

        return quantize
    if name == "prune":  # prune(model, MagnitudeConfig | WandaConfig | SparseGPTConfig | StructuredConfig)
        from tokenmill.pruning.api import prune

        return prune
    if name == "distill":  # distill(teacher, student, DistillConfig, out_dir)
        from tokenmill.distillation.distill import distill_models

        return distill_models
    raise AttributeError(name)
