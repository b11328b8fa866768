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
