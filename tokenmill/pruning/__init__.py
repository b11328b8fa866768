"""Pruning: smaller or sparser models from the ones tokenmill serves. ``prune(model, config)``,
one config per method (magnitude, Wanda, SparseGPT, structured), and ``save_pruned`` for a
directory that ``LLM``, ``serve``, ``quantize`` and HF transformers load.

Names load on first use, so that the CLI's parser stays free of torch."""

import importlib

_EXPORTS = {
    "HANDLERS": "api", "PruneReport": "api", "prune": "api", "prune_model": "api", "save_pruned": "api",
    "MagnitudeConfig": "config", "PruneConfig": "config", "SparseGPTConfig": "config",
    "StructuredConfig": "config", "WandaConfig": "config", "config_from_dict": "config",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"tokenmill.pruning.{_EXPORTS[name]}"), name)
    raise AttributeError(name)
