"""Tenants: API keys (stored as sha256 hashes), per-key limits and usage counters.

The keys file is JSON::

    {"tenants": [
      {"name": "alice", "key_sha256": "<hex sha256 of the key>",
       "requests_per_minute": 60, "tokens_per_minute": 100000, "max_concurrent_requests": 4},
      {"name": "ops", "key_sha256": "<hex>", "admin": true}
    ]}

Limits are optional (0 or absent: unlimited). Tokens per minute count prompt tokens when a
request starts and completion tokens when it ends, over a sliding 60-second window. Without
a keys file every request belongs to the tenant ``default`` and nothing is enforced.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from tokenmill.config import reject_unknown_keys
from tokenmill.errors import InvalidParameterError
from tokenmill.server.admission import Rejected
from tokenmill.server.errors import APIError

WINDOW = 60.0
DEFAULT_TENANT = "default"


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class TenantConfig:
    name: str
    """Label in metrics and the admin endpoint."""
    key_sha256: str = ""
    """Hex sha256 of the API key (the key itself is never stored)."""
    requests_per_minute: int = 0
    """0: unlimited."""
    tokens_per_minute: int = 0
    """Prompt plus completion tokens; 0: unlimited."""
    max_concurrent_requests: int = 0
    """0: unlimited."""
    admin: bool = False
    """May read /admin/usage."""

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise InvalidParameterError("every tenant needs a non-empty string 'name'")
        for name in ("requests_per_minute", "tokens_per_minute", "max_concurrent_requests"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidParameterError(f"tenant {self.name!r}: {name} must be an integer >= 0, got {value!r}")


@dataclass
class Usage:
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class _Window:
    requests: deque[float] = field(default_factory=deque)
    tokens: deque[tuple[float, int]] = field(default_factory=deque)
    token_sum: int = 0
    concurrent: int = 0

    def purge(self, now: float) -> None:
        while self.requests and self.requests[0] <= now - WINDOW:
            self.requests.popleft()
        while self.tokens and self.tokens[0][0] <= now - WINDOW:
            self.token_sum -= self.tokens.popleft()[1]

    def add_tokens(self, now: float, n: int) -> None:
        if n:
            self.tokens.append((now, n))
            self.token_sum += n


class Tenancy:
    def __init__(self, tenants: list[TenantConfig] | None = None) -> None:
        self.enabled = tenants is not None
        self._by_hash = {t.key_sha256.lower(): t for t in tenants or []}
        self._anonymous = TenantConfig(DEFAULT_TENANT, admin=True)
        self._windows: dict[str, _Window] = {}
        self.usage: dict[str, Usage] = {}

    @classmethod
    def load(cls, path: str | Path | None) -> Tenancy:
        if path is None:
            return cls(None)
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise InvalidParameterError(f"cannot read the API keys file {path}: {exc}") from exc
        if not isinstance(data, dict) or not isinstance(data.get("tenants"), list) or set(data) != {"tenants"}:
            raise InvalidParameterError(f"{path}: expected {{\"tenants\": [...]}}")
        tenants = []
        for entry in data["tenants"]:
            if not isinstance(entry, dict):
                raise InvalidParameterError(f"{path}: every tenant must be an object, got {entry!r}")
            reject_unknown_keys(TenantConfig, entry)
            tenant = TenantConfig(**entry)
            if len(tenant.key_sha256) != 64 or any(c not in "0123456789abcdefABCDEF" for c in tenant.key_sha256):
                raise InvalidParameterError(f"{path}: tenant {tenant.name!r} needs key_sha256, 64 hex digits")
            tenants.append(tenant)
        if len({t.key_sha256.lower() for t in tenants}) != len(tenants):
            raise InvalidParameterError(f"{path}: two tenants share a key")
        return cls(tenants)

    def authenticate(self, authorization: str | None) -> TenantConfig:
        """The tenant of ``Authorization: Bearer KEY``; APIError 401 without a valid key."""
        if not self.enabled:
            return self._anonymous
        scheme, _, key = (authorization or "").partition(" ")
        tenant = self._by_hash.get(hash_key(key.strip())) if scheme.lower() == "bearer" and key.strip() else None
        if tenant is None:
            raise APIError(401, "a valid API key is required (Authorization: Bearer KEY)", code="invalid_api_key")
        return tenant

    def start(self, tenant: TenantConfig, prompt_tokens: int) -> None:
        """Count a request against the tenant's limits, or raise Rejected (429). Pair with finish()."""
        now = time.monotonic()
        window = self._windows.setdefault(tenant.name, _Window())
        window.purge(now)
        if tenant.max_concurrent_requests and window.concurrent >= tenant.max_concurrent_requests:
            raise Rejected(429, "tenant_concurrency", f"tenant {tenant.name!r} already has "
                           f"{window.concurrent} requests in flight (limit {tenant.max_concurrent_requests})", 1)
        if tenant.requests_per_minute and len(window.requests) >= tenant.requests_per_minute:
            raise Rejected(429, "tenant_requests", f"tenant {tenant.name!r} is over its limit of "
                           f"{tenant.requests_per_minute} requests per minute",
                           window.requests[0] + WINDOW - now)
        if (tenant.tokens_per_minute and window.token_sum
                and window.token_sum + prompt_tokens > tenant.tokens_per_minute):
            raise Rejected(429, "tenant_tokens", f"tenant {tenant.name!r} is over its limit of "
                           f"{tenant.tokens_per_minute} tokens per minute", window.tokens[0][0] + WINDOW - now)
        window.concurrent += 1
        window.requests.append(now)
        window.add_tokens(now, prompt_tokens)

    def finish(self, tenant: TenantConfig, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> None:
        window = self._windows[tenant.name]
        window.concurrent -= 1
        window.add_tokens(time.monotonic(), completion_tokens)
        usage = self.usage.setdefault(tenant.name, Usage())
        usage.requests += 1
        usage.prompt_tokens += prompt_tokens
        usage.cached_tokens += cached_tokens
        usage.completion_tokens += completion_tokens
