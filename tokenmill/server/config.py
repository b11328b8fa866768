"""ServerConfig: what the HTTP layer needs beyond the engine (address, queue bounds, keys, deadlines)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenmill.config import reject_unknown_keys
from tokenmill.errors import InvalidParameterError


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    """Address to listen on."""
    port: int = 8000
    """TCP port to listen on (0 picks a free one)."""
    served_model_name: str | None = None
    """Name clients pass as ``model``; None means the loaded model's name."""
    api_keys_file: str | None = None
    """JSON file of tenants and their hashed keys (see tenancy.py); None: no authentication."""
    max_queued_requests: int = 256
    """Requests waiting for an engine slot before new ones get 429."""
    max_queued_tokens: int = 262_144
    """Prompt tokens waiting for an engine slot before new requests get 429."""
    request_timeout: float = 600.0
    """Seconds a request may live (queue and generation) before it is aborted; the header
    ``X-Request-Timeout`` may ask for less."""
    retry_after: int = 1
    """Seconds suggested in ``Retry-After`` when the queue is full, shedding or draining."""
    isolate_tenant_prefix_cache: bool = False
    """Salt the prefix cache with the tenant name, so tenants never share cached blocks."""
    drain_timeout: float = 30.0
    """Seconds SIGTERM waits for in-flight requests before the server stops anyway."""
    max_request_bytes: int = 8 * 2**20
    """Largest request body accepted; larger ones get 413."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise InvalidParameterError(f"ServerConfig.port must be in [0, 65535], got {self.port}")
        for name in ("max_queued_requests", "max_queued_tokens", "max_request_bytes"):
            if getattr(self, name) < 0:
                raise InvalidParameterError(f"ServerConfig.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("request_timeout", "drain_timeout"):
            if not getattr(self, name) > 0:
                raise InvalidParameterError(f"ServerConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.retry_after < 1:
            raise InvalidParameterError(f"ServerConfig.retry_after must be >= 1, got {self.retry_after}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ServerConfig:
        reject_unknown_keys(cls, data)
        return cls(**data)
