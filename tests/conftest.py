"""Shared fixtures: the real shipped models, resolved (and fetched once) through tokenmill's resolver."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    from tokenmill.loading.sources import resolve_model

    return resolve_model("smollm2-135m-instruct").path


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    from tokenmill.loading.sources import resolve_model

    return resolve_model("gemma3-270m").path


@pytest.fixture(scope="session", autouse=True)
def _one_gguf_parse_per_file():
    """HF transformers, the oracle, parses a GGUF's metadata with ``gguf.GGUFReader`` on every load
    of a config, tokenizer or model from it: about 30 s each for Gemma 3's 262k-token vocabulary.
    The reader is read-only (mode "r"), so the session keeps one per file; what HF reads is unchanged."""
    import functools

    import gguf  # tokenmill's own dependency

    original = gguf.GGUFReader

    @functools.cache
    def cached(path: str, mode: str):
        return original(path, mode)

    def reader(path, mode="r"):
        if mode != "r":
            return original(path, mode)
        return cached(str(Path(path).resolve()), mode)

    gguf.GGUFReader = reader
    yield
    gguf.GGUFReader = original
