"""ServerConfig: what the HTTP layer needs beyond the engine (address, queue bounds, keys, deadlines)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from tokenmill.config import Config
from tokenmill.errors import InvalidParameterError
from tokenmill.options import option


@dataclass(frozen=True)
class ServerConfig(Config):
    """The HTTP server: address, authentication, queue bounds, deadlines, draining."""

    title: ClassVar[str] = "server"

    host: str = option("127.0.0.1", "address to listen on")
    port: int = option(8000, "TCP port to listen on (0 picks a free one)")
    served_model_name: str | None = option(None, "name clients pass as 'model' (default: the loaded model's name)")
    api_keys: str | None = option(
        None, "JSON file of tenants with sha256-hashed keys and limits (see tenancy.py); enables authentication",
        metavar="FILE")
    max_queued_requests: int = option(256, "requests waiting for an engine slot before new ones get 429")
    max_queued_tokens: int = option(262_144, "prompt tokens waiting for an engine slot before new requests get 429")
    request_timeout: float = option(
        600.0, "seconds a request may live (queue and generation) before it is aborted; the header "
        "X-Request-Timeout may ask for less")
    retry_after: int = option(1, "seconds suggested in Retry-After when the queue is full, shedding or draining")
    drain_timeout: float = option(30.0, "seconds SIGTERM waits for in-flight requests before the server stops anyway")
    max_request_bytes: int = option(8 * 2**20, "largest request body accepted; larger ones get 413")
    header_timeout: float = option(
        10.0, "seconds a connection may take to send a request's headers (from connecting, or from a "
        "keep-alive request's first byte) before it is closed")
    max_connections_per_client: int = option(
        64, "open connections one client address may hold; more get 503 and are closed (0: unlimited)")
    lora_modules: str | None = option(
        None, "LoRA adapters to load at start, NAME=PATH (a PEFT directory or GGUF LoRA file), several separated by "
              "commas; needs --enable-lora", metavar="NAME=PATH,...")

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise InvalidParameterError(f"ServerConfig.port must be in [0, 65535], got {self.port}")
        for name in ("max_queued_requests", "max_queued_tokens", "max_request_bytes", "max_connections_per_client"):
            if getattr(self, name) < 0:
                raise InvalidParameterError(f"ServerConfig.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("request_timeout", "drain_timeout", "header_timeout"):
            if not getattr(self, name) > 0:
                raise InvalidParameterError(f"ServerConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.retry_after < 1:
            raise InvalidParameterError(f"ServerConfig.retry_after must be >= 1, got {self.retry_after}")
        self.lora_module_paths()

    def lora_module_paths(self) -> list[tuple[str, str]]:
        """``lora_modules`` as (name, path) pairs."""
        pairs = []
        for item in (self.lora_modules or "").split(","):
            if not item.strip():
                continue
            name, sep, path = item.strip().partition("=")
            if not sep or not name or not path:
                raise InvalidParameterError(f"lora_modules: expected NAME=PATH, got {item.strip()!r}")
            pairs.append((name, path))
        return pairs
