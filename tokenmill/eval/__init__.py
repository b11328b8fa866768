"""Quality measurement: sliding-window perplexity on a public-domain corpus.

The function itself is ``tokenmill.eval.perplexity.perplexity`` (the module shares its name).
Names load on first use, so that the CLI's parser stays free of torch."""

import importlib

_EXPORTS = {"fetch_corpus": "corpus", "PerplexityResult": "perplexity"}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"tokenmill.eval.{_EXPORTS[name]}"), name)
    raise AttributeError(name)
