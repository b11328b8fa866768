"""Loading the models a server serves: ``--model NAME=SOURCE`` (several), one KV budget split among them.

::

    ModelLoader(options)      the load and engine options every model shares (tokenmill serve's
                              flags), and the KV cache budget (--kv-cache-memory: bytes, or a
                              fraction of free memory, turned into bytes once, here)
    loader.share(n)           each of n startup models gets (total - spare) / n bytes of KV pool
    loader.load(name, source, kv_bytes)
                              an LLM with that pool -> (llm, seconds it took)
    loader.available(pools)   what is left of the total beside the pools of the models served:
                              the default budget of a model loaded at runtime (POST /admin/models)

A model's pool is also capped by what its max_num_seqs full-length sequences can use (the
engine sizes it), so a share may leave memory unused; ``available`` counts the pools' real sizes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from tokenmill.engine import CacheConfig, free_memory
from tokenmill.errors import InvalidParameterError
from tokenmill.llm import LLM


@dataclass(frozen=True)
class ModelSpec:
    """One ``--model`` value: ``NAME=SOURCE``, or a bare ``SOURCE`` (named after the model it loads)."""

    name: str | None
    source: str

    @classmethod
    def parse(cls, text: str) -> ModelSpec:
        name, sep, source = text.partition("=")
        if not sep:
            return cls(None, text)
        if not name or not source or ":" in name or "/" in name:
            raise InvalidParameterError(f"--model {text!r}: expected NAME=SOURCE with a NAME of no ':' or '/'")
        return cls(name, source)


class ModelLoader:
    def __init__(self, options: dict[str, Any], spare: int = 0) -> None:
        """``options``: LLM keyword options shared by every model (no ``model``); their
        ``kv_cache_memory`` is the total budget. ``spare``: bytes kept out of the startup shares."""
        self.options = {k: v for k, v in options.items() if k not in ("model", "kv_cache_memory")}
        total = options.get("kv_cache_memory") or CacheConfig().kv_cache_memory
        if total < 1:
            device = self.options.get("device") or "cpu"
            total = int(total * free_memory(torch.device("cuda" if device == "auto" and torch.cuda.is_available()
                                                         else "cpu" if device == "auto" else device)))
        self.total = int(total)
        if not 0 <= spare < self.total:
            raise InvalidParameterError(f"spare_kv_cache_memory must be in [0, {self.total}) (the KV budget), "
                                        f"got {spare}")
        self.spare = spare

    def share(self, n: int) -> int:
        """Each of ``n`` startup models' KV budget."""
        return (self.total - self.spare) // max(n, 1)

    def available(self, pools: list[int]) -> int:
        """Bytes of the total not held by the pools of the models served."""
        return max(self.total - sum(pools), 0)

    def load(self, source: str, kv_bytes: int, **overrides: Any) -> tuple[LLM, float]:
        """An LLM of ``source`` with a KV pool of at most ``kv_bytes`` -> (llm, seconds it took).
        ``overrides``: options for this model only (an unknown one is an error naming it)."""
        start = time.perf_counter()
        llm = LLM(source, **{**self.options, **overrides, "kv_cache_memory": kv_bytes})
        return llm, time.perf_counter() - start
