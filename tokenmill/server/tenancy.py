"""Tenants: API keys (stored as sha256 hashes), per-key limits, usage counters, prefix-cache groups.

The keys file is JSON::

    {"tenants": [
      {"name": "alice", "key_sha256": "<hex sha256 of the key>",
       "requests_per_minute": 60, "tokens_per_minute": 100000, "max_concurrent_requests": 4},
      {"name": "bob", "key_sha256": "<hex>", "cache_group": "shared-assistant"},
      {"name": "carol", "key_sha256": "<hex>", "cache_group": "shared-assistant"},
      {"name": "dave", "key_sha256": "<hex>", "models": ["sql-lora", "support-lora"]},
      {"name": "erin", "key_sha256": "<hex>", "budget": 25.0, "budget_soft_limit": 20.0},
      {"name": "prometheus", "key_sha256": "<hex>", "metrics": true},
      {"name": "ops", "key_sha256": "<hex>", "admin": true}
    ]}

Names (and cache groups) are 1 to 64 characters of ``A-Z a-z 0-9 . _ -``. Limits are optional
(0 or absent: unlimited). ``models`` limits a tenant to the named models (the served model, LoRA
adapters, routes; absent: all); others answer 403 and are not listed by /v1/models for it.
``budget`` is currency (the unit of ``--price-per-hour``) the tenant's requests may be charged in
all, enforced at admission (budgets.py); ``budget_soft_limit`` (default: the budget) logs a warning
and counts an alert when spending passes it. Without a
keys file every request belongs to the tenant ``default``, which may do everything, and nothing
is enforced.

Tokens per minute are reserved, not counted after the fact::

    start()    refuse (400) a reservation larger than the limit: it can never fit, whatever the wait
               refuse (429) when what the window holds + this reservation > the limit
               else hold the reservation at admission time: its prompts plus max_tokens for every
               sample (the caller fills max_tokens in: the rest of the context when omitted)
    finish()   settle: the reservation shrinks to the prompt plus the completion tokens really made
    cancel()   never reached the engine (queue full, shed, deadline, client gone): give it all back

An entry leaves the sliding window ``window`` seconds after it was admitted, whether or not it
has settled, so the window holds only admissions of the last ``window`` seconds, and a refusal's
Retry-After is the time until enough of them leave for the reservation to fit (settling early
only makes the real wait shorter). The 400 is chosen over a 429 for a reservation above the limit
because no wait makes it fit: clients (the OpenAI SDK among them) retry a 429 by themselves, and a
Retry-After would promise something false; the error names ``max_tokens``, the thing to lower.

Prefix-cache isolation: with keys, every request's prefix-cache salt is a sha256 of its tenant's
``cache_group`` (default: the tenant's own name) and its ``cache_salt``, so tenants of different
groups never share cached blocks (a name cannot be forged into another pair: see cache_salt).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from tokenmill.config import reject_unknown_keys
from tokenmill.errors import InvalidParameterError
from tokenmill.server.admission import Rejected
from tokenmill.server.errors import APIError

WINDOW = 60.0
"""Seconds of the sliding window that requests_per_minute and tokens_per_minute count over."""
DEFAULT_TENANT = "default"
NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
"""What tenant names and cache groups may be (no ':' or other separators, no spaces)."""


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _check_name(what: str, value: object, tenant: object) -> None:
    if not isinstance(value, str) or not NAME.fullmatch(value):
        where = "" if tenant is None else f"tenant {tenant!r}: "
        raise InvalidParameterError(f"{where}{what} {value!r} is not allowed: use 1 to 64 characters of "
                                    "A-Z a-z 0-9 . _ -")


def prefix_cache_salt(group: str | None, cache_salt: str | None) -> str | None:
    """A sha256 of the JSON list ``[group, cache_salt]``: distinct pairs give distinct salts (JSON
    quotes each part, so ("team", "prod") and ("team:prod", None) do not meet, as they did when the
    salt was the two joined with ':'). None when there is neither (the plain shared cache)."""
    if group is None and cache_salt is None:
        return None
    return hashlib.sha256(json.dumps([group, cache_salt]).encode()).hexdigest()


@dataclass(frozen=True)
class TenantConfig:
    name: str
    """Label in metrics and the admin endpoint."""
    key_sha256: str = ""
    """Hex sha256 of the API key (the key itself is never stored)."""
    requests_per_minute: int = 0
    """0: unlimited."""
    tokens_per_minute: int = 0
    """Prompt plus completion tokens, reserved at admission (prompt + max_tokens per sample); 0: unlimited."""
    max_concurrent_requests: int = 0
    """0: unlimited."""
    admin: bool = False
    """May read /admin/usage and /metrics."""
    metrics: bool = False
    """May read /metrics (every tenant's name and usage), nothing else beyond a tenant's own requests."""
    cache_group: str = ""
    """Tenants with the same group share prefix-cache blocks; others never do. Default: the name."""
    models: tuple[str, ...] | None = None
    """The models it may use by name (served models, LoRA adapters, routes); None: all of them."""
    budget: float = 0.0
    """Currency its requests may be charged in all (budgets.py); 0: no budget."""
    budget_soft_limit: float = 0.0
    """Spending that logs a warning and counts an alert; 0: the budget itself."""

    def may_use(self, model: str) -> bool:
        return self.models is None or model in self.models

    def __post_init__(self) -> None:
        _check_name("the name", self.name, None)
        if self.cache_group:
            _check_name("cache_group", self.cache_group, self.name)
        else:
            object.__setattr__(self, "cache_group", self.name)
        for name in ("requests_per_minute", "tokens_per_minute", "max_concurrent_requests"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidParameterError(f"tenant {self.name!r}: {name} must be an integer >= 0, got {value!r}")
        for name in ("budget", "budget_soft_limit"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise InvalidParameterError(f"tenant {self.name!r}: {name} must be a number >= 0, got {value!r}")
        if self.budget_soft_limit > self.budget:
            raise InvalidParameterError(f"tenant {self.name!r}: budget_soft_limit {self.budget_soft_limit} is above "
                                        f"its budget {self.budget}")
        if self.models is not None:
            if not isinstance(self.models, (list, tuple)) or not all(isinstance(m, str) for m in self.models):
                raise InvalidParameterError(f"tenant {self.name!r}: models must be a list of model names, "
                                            f"got {self.models!r}")
            object.__setattr__(self, "models", tuple(self.models))
        for name in ("admin", "metrics"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidParameterError(f"tenant {self.name!r}: {name} must be true or false, "
                                            f"got {getattr(self, name)!r}")


@dataclass
class Usage:
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class Reservation:
    """One request's hold on its tenant's limits, from start() to finish() or cancel()."""

    tenant: str
    time: float
    """When it was admitted (the clock of Tenancy); it leaves the window ``window`` seconds later."""
    tokens: int
    """Reserved while in flight; the real count once settled (0 when cancelled)."""
    in_window: bool = True
    done: bool = False


@dataclass
class _Window:
    requests: deque[float] = field(default_factory=deque)
    tokens: deque[Reservation] = field(default_factory=deque)
    token_sum: int = 0
    concurrent: int = 0

    def purge(self, now: float, length: float) -> None:
        while self.requests and self.requests[0] <= now - length:
            self.requests.popleft()
        while self.tokens and self.tokens[0].time <= now - length:
            entry = self.tokens.popleft()
            entry.in_window = False
            self.token_sum -= entry.tokens

    def resize(self, entry: Reservation, tokens: int) -> None:
        if entry.in_window:
            self.token_sum += tokens - entry.tokens
        entry.tokens = tokens

    def wait_for(self, tokens: int, limit: int, now: float, length: float) -> int:
        """Whole seconds until entries leave the window enough for ``tokens`` more to fit (tokens <= limit)."""
        excess, freed = self.token_sum + tokens - limit, 0
        for entry in self.tokens:
            freed += entry.tokens
            if freed >= excess:
                return max(1, math.ceil(entry.time + length - now))
        return max(1, math.ceil(length))


class Tenancy:
    def __init__(self, tenants: list[TenantConfig] | None = None, window: float = WINDOW) -> None:
        if not window > 0:
            raise InvalidParameterError(f"the tenancy window must be > 0 seconds, got {window}")
        self.enabled = tenants is not None
        self.window = window
        self.tenants = list(tenants or [])
        self._by_hash = {t.key_sha256.lower(): t for t in self.tenants}
        self._anonymous = TenantConfig(DEFAULT_TENANT, admin=True)
        self._windows: dict[str, _Window] = {}
        self.usage: dict[str, Usage] = {}
        self.adapter_usage: dict[str, Usage] = {}
        """The same counters per LoRA adapter (every tenant's requests that named it)."""

    @classmethod
    def load(cls, path: str | Path | None, window: float = WINDOW) -> Tenancy:
        if path is None:
            return cls(None, window)
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
            try:
                tenant = TenantConfig(**entry)
            except InvalidParameterError as exc:
                raise InvalidParameterError(f"{path}: {exc}") from None
            except TypeError as exc:  # "name" missing
                raise InvalidParameterError(f"{path}: every tenant needs a 'name': {exc}") from None
            if len(tenant.key_sha256) != 64 or any(c not in "0123456789abcdefABCDEF" for c in tenant.key_sha256):
                raise InvalidParameterError(f"{path}: tenant {tenant.name!r} needs key_sha256, 64 hex digits")
            tenants.append(tenant)
        if len({t.key_sha256.lower() for t in tenants}) != len(tenants):
            raise InvalidParameterError(f"{path}: two tenants share a key")
        names = [t.name for t in tenants]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise InvalidParameterError(f"{path}: tenant name(s) {', '.join(map(repr, repeated))} appear twice")
        return cls(tenants, window)

    def authenticate(self, authorization: str | None) -> TenantConfig:
        """The tenant of ``Authorization: Bearer KEY``; APIError 401 without a valid key."""
        if not self.enabled:
            return self._anonymous
        scheme, _, key = (authorization or "").partition(" ")
        tenant = self._by_hash.get(hash_key(key.strip())) if scheme.lower() == "bearer" and key.strip() else None
        if tenant is None:
            raise APIError(401, "a valid API key is required (Authorization: Bearer KEY)", code="invalid_api_key")
        return tenant

    def cache_salt(self, tenant: TenantConfig, cache_salt: str | None) -> str | None:
        """The engine's prefix-cache salt for a request of ``tenant``: by its cache_group with keys;
        without keys there is one tenant, and only the request's own cache_salt separates."""
        return prefix_cache_salt(tenant.cache_group if self.enabled else None, cache_salt)

    def start(self, tenant: TenantConfig, tokens: int) -> Reservation:
        """Reserve ``tokens`` (prompts + max_tokens of every sample) against the tenant's limits, or raise
        Rejected (429, Retry-After from the window) or APIError (400: more than the limit). Pair with
        finish() or cancel()."""
        now = time.monotonic()
        window = self._windows.setdefault(tenant.name, _Window())
        window.purge(now, self.window)
        limit = tenant.tokens_per_minute
        if limit and tokens > limit:
            raise APIError(400, f"this request reserves {tokens} tokens (its prompts plus max_tokens for every "
                           f"sample; max_tokens defaults to the rest of the context) but tenant {tenant.name!r} "
                           f"may use {limit} tokens per {self.window:g} s: lower max_tokens, n or the prompt",
                           param="max_tokens", code="tenant_tokens_exceeded")
        if tenant.max_concurrent_requests and window.concurrent >= tenant.max_concurrent_requests:
            raise Rejected(429, "tenant_concurrency", f"tenant {tenant.name!r} already has "
                           f"{window.concurrent} requests in flight (limit {tenant.max_concurrent_requests})", 1)
        if tenant.requests_per_minute and len(window.requests) >= tenant.requests_per_minute:
            wait = max(1, math.ceil(window.requests[0] + self.window - now))
            raise Rejected(429, "tenant_requests", f"tenant {tenant.name!r} is over its limit of "
                           f"{tenant.requests_per_minute} requests per {self.window:g} s; retry in {wait} s", wait)
        if limit and window.token_sum + tokens > limit:
            wait = window.wait_for(tokens, limit, now, self.window)
            raise Rejected(429, "tenant_tokens", f"tenant {tenant.name!r} has {window.token_sum} of its "
                           f"{limit} tokens per {self.window:g} s reserved or used; this request reserves "
                           f"{tokens}: retry in {wait} s", wait)
        window.concurrent += 1
        window.requests.append(now)
        reservation = Reservation(tenant.name, now, tokens)
        window.tokens.append(reservation)
        window.token_sum += tokens
        return reservation

    def finish(self, reservation: Reservation, prompt_tokens: int, cached_tokens: int,
               completion_tokens: int, adapter: str | None = None) -> None:
        """Settle a request that reached the engine (finished, failed or aborted): the reservation
        becomes what it really used, and the usage counters grow (its tenant's, and its LoRA
        ``adapter``'s if it named one). Idempotent."""
        if reservation.done:
            return
        reservation.done = True
        window = self._windows[reservation.tenant]
        window.concurrent -= 1
        window.resize(reservation, prompt_tokens + completion_tokens)
        counters = [self.usage.setdefault(reservation.tenant, Usage())]
        if adapter is not None:
            counters.append(self.adapter_usage.setdefault(adapter, Usage()))
        for usage in counters:
            usage.requests += 1
            usage.prompt_tokens += prompt_tokens
            usage.cached_tokens += cached_tokens
            usage.completion_tokens += completion_tokens

    def cancel(self, reservation: Reservation) -> None:
        """Give back everything of a request that never reached the engine (its request and its
        tokens no longer count). Idempotent."""
        if reservation.done:
            return
        reservation.done = True
        window = self._windows[reservation.tenant]
        window.concurrent -= 1
        window.resize(reservation, 0)
        if reservation.in_window and reservation.time in window.requests:
            window.requests.remove(reservation.time)

    def tokens_in_window(self, name: str) -> int:
        """Tokens the tenant has reserved or used in the current window."""
        window = self._windows.get(name)
        if window is None:
            return 0
        window.purge(time.monotonic(), self.window)
        return window.token_sum
