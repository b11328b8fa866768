"""tokenmill: serve and optimize language models on CPU and CUDA."""

from tokenmill.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "quantize"]


def __getattr__(name: str):
    # LLM pulls in torch and the model code; import it on first use so `import tokenmill` stays light.
    if name == "LLM":
        from tokenmill.llm import LLM

        return LLM
    if name == "quantize":
        from tokenmill.quantization.api import quantize

        return quantize
    raise AttributeError(name)
