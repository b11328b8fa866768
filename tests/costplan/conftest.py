"""The tiny random Llama of the offline benchmark's tests serves the cost plan's end-to-end run too."""

from tests.benchmark.conftest import tiny_llama_dir  # noqa: F401
