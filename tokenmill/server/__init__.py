"""The OpenAI-compatible HTTP server: ``tokenmill serve`` or ``serve(LLM(...), ServerConfig(...))``.

Modules, one concept each: config (ServerConfig), protocol (request/response schemas),
async_engine (the engine's thread and its streams), admission (queue, priorities, shedding,
deadlines), tenancy (keys, limits, usage), metrics (Prometheus), errors (OpenAI error JSON),
generation (one request's life), completions / chat / models / ops (the endpoints), app
(build_app), serve (uvicorn with draining).
"""

from tokenmill.server.config import ServerConfig

__all__ = ["ServerConfig"]
