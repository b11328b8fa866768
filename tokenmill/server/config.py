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
    spare_kv_cache_memory: int = option(
        0, "bytes of the KV cache budget (--kv-cache-memory) kept unallocated at start, for models loaded "
           "at runtime (POST /admin/models)")
    routes: str | None = option(
        None, "JSON file of routed model names (e.g. \"auto\": rule, cascade or learned over served models; see "
              "tokenmill/server/routing.py)", metavar="FILE")
    route_log: str | None = option(
        None, "append each cascade decision (prompt token ids, confidence, escalated) to this JSON-lines file: "
              "training data for `tokenmill route train`", metavar="FILE")
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
        return parse_pairs(self.lora_modules, "lora_modules")


def parse_pairs(text: str | None, what: str) -> list[tuple[str, str]]:
    """``NAME=VALUE,NAME=VALUE`` as pairs (``what`` names the option in errors)."""
    pairs = []
    for item in (text or "").split(","):
        if not item.strip():
            continue
        name, sep, value = item.strip().partition("=")
        if not sep or not name or not value:
            raise InvalidParameterError(f"{what}: expected NAME=VALUE, got {item.strip()!r}")
        pairs.append((name, value))
    return pairs


@dataclass(frozen=True)
class CostConfig(Config):
    """Cost accounting (server/cost.py), budgets (budgets.py) and service-level objectives."""

    title: ClassVar[str] = "cost"

    price_per_hour: float = option(
        0.0, "price of the machine per hour (any currency: costs, budgets and exports are in its unit); 0: costs "
             "are all 0, and tenants' budgets cannot be enforced")
    model_prices: str | None = option(
        None, "per-model price per hour, NAME=PRICE,...: that model's steps are priced at it (e.g. a model "
              "pinned to a dearer device)", metavar="NAME=PRICE,...")
    reserve_prompt_per_1k: float | None = option(
        None, "price per 1k prompt tokens a request's budget hold assumes (default: the model's measured rate, "
              "or its warm-up's, times reserve_margin)")
    reserve_completion_per_1k: float | None = option(
        None, "price per 1k completion tokens (max_tokens of every sample) a budget hold assumes (default: "
              "measured, times reserve_margin)")
    reserve_margin: float = option(2.0, "factor on measured rates for budget holds when no rate is configured")
    cost_log: str | None = option(
        None, "append every request's cost record to this JSON-lines file; read back at start, where budgets count "
              "it as spent", metavar="FILE")
    slo_ttft: float | None = option(None, "time-to-first-token objective in seconds (SLO compliance per tenant)")
    slo_tpot: float | None = option(None, "time-per-output-token objective in seconds (SLO compliance per tenant)")

    def __post_init__(self) -> None:
        if not 0 <= self.price_per_hour < float("inf"):
            raise InvalidParameterError(f"price_per_hour must be >= 0, got {self.price_per_hour}")
        for name, price in self.model_price_map().items():
            if not 0 <= price < float("inf"):
                raise InvalidParameterError(f"model_prices: {name}'s price must be >= 0, got {price}")
        for name in ("reserve_prompt_per_1k", "reserve_completion_per_1k", "slo_ttft", "slo_tpot"):
            value = getattr(self, name)
            if value is not None and not 0 < value < float("inf"):
                raise InvalidParameterError(f"{name} must be > 0, got {value}")
        if not self.reserve_margin >= 1:
            raise InvalidParameterError(f"reserve_margin must be >= 1, got {self.reserve_margin}")

    def model_price_map(self) -> dict[str, float]:
        prices = {}
        for name, value in parse_pairs(self.model_prices, "model_prices"):
            try:
                prices[name] = float(value)
            except ValueError:
                raise InvalidParameterError(f"model_prices: {name}={value!r} is not a number") from None
        return prices
