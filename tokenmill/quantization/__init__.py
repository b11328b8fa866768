"""Quantization: ``quantize(model, config)``, one config per method, quantized layers that multiply
in low precision, and checkpoints that ``LLM(dir)`` loads directly.

Names load on first use, so that the CLI's parser stays free of torch."""

import importlib

_EXPORTS = {
    "HANDLERS": "handlers", "quantize": "api", "quantize_model": "api",
    "load_quantized": "checkpoint", "save_quantized": "checkpoint",
    "CONFIG_CLASSES": "config", "Int4GPTQConfig": "config", "Int4WeightOnlyConfig": "config",
    "Int8WeightOnlyConfig": "config", "QuantConfig": "config", "W8A8Config": "config",
    "config_from_dict": "config",
    "GroupedLinear": "grouped", "load_gguf_native": "gguf_native",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"tokenmill.quantization.{_EXPORTS[name]}"), name)
    raise AttributeError(name)
