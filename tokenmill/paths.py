"""Where tokenmill keeps what it fetches and builds: one cache directory per user."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/tokenmill``, else ``~/.cache/tokenmill``: models, tokenizers, kernels, hardware figures."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tokenmill"
