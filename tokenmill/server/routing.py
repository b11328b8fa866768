"""Model routing: a routed model name (``"auto"``) answered by one of the served models, by policy.

Routes come from a JSON file (``--routes FILE``)::

    {"routes": [
      {"name": "auto", "policy": "cascade", "models": ["small", "large"],
       "signal": "mean_logprob", "threshold": -0.6},
      {"name": "by-rule", "policy": "rule", "default": "large", "rules": [
         {"max_prompt_tokens": 200, "model": "small"},
         {"tenants": ["vip"], "model": "large"},
         {"tags": {"tier": "batch"}, "model": "small"}]},
      {"name": "learned", "policy": "learned", "models": ["small", "large"],
       "router": "router.json", "threshold": 0.5}
    ]}

::

    rule      the first rule whose every condition holds picks the model (prompt length in
              tokens, the tenant, request tags: OpenAI ``metadata`` / X-Tokenmill-Tags), else
              ``default``
    cascade   answer with the cheaper model (``models[0]``); when its confidence is below
              ``threshold``, run the request again on ``models[1]`` and answer with that.
              Signals over the answer's tokens: ``mean_logprob`` (mean of the chosen tokens'
              logprobs), ``min_logprob``, ``entropy`` (negated mean entropy of the top-20
              distribution, so that higher is more confident everywhere). A streamed request
              is streamed once judged. The budget hold covers both attempts, and the answer's
              cost (usage.cost) includes the first one; the escalation rate is in /metrics.
    learned   a classifier trained from logged outcomes (``tokenmill route train``,
              tokenmill/routing/learned.py) gives the probability the cheap model suffices;
              at or above ``threshold`` it answers, else the other

Every routed response names the model that answered (``model`` in the body, the header
X-Tokenmill-Model) and the route (X-Tokenmill-Route). With ``--route-log FILE`` each cascade
decision is appended as JSON (the prompt's token ids under the cheap model's tokenizer, the
signal, whether it escalated): the training data of a learned route.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from fastapi.responses import Response

from tokenmill.config import reject_unknown_keys
from tokenmill.errors import InvalidParameterError
from tokenmill.routing.learned import LearnedRouter
from tokenmill.server.admission import Rejected
from tokenmill.server.errors import APIError
from tokenmill.server.generation import ClientDisconnected, Generation, rejected_error
from tokenmill.server.state import ServerState, Target
from tokenmill.server.tenancy import TenantConfig

logger = logging.getLogger("tokenmill.server")

Prepare = Callable[..., Awaitable[Generation]]
"""``prepare(target, route_logprobs=None)``: the handler's Generation for a target, not started (its
logprobs at least ``route_logprobs`` when given: what a cascade judges the answer by)."""
Respond = Callable[[Generation], Awaitable[Response]]
"""``respond(gen)``: the handler's response from a started generation (streamed or whole)."""

SIGNALS = ("mean_logprob", "min_logprob", "entropy")
TOP_FOR_ENTROPY = 20


@dataclass(frozen=True)
class Rule:
    model: str
    min_prompt_tokens: int | None = None
    max_prompt_tokens: int | None = None
    tenants: tuple[str, ...] | None = None
    tags: tuple[tuple[str, str], ...] = ()

    def holds(self, prompt_tokens: int, tenant: str, tags: dict[str, str]) -> bool:
        return ((self.min_prompt_tokens is None or prompt_tokens >= self.min_prompt_tokens)
                and (self.max_prompt_tokens is None or prompt_tokens <= self.max_prompt_tokens)
                and (self.tenants is None or tenant in self.tenants)
                and all(tags.get(k) == v for k, v in self.tags))


@dataclass
class Route:
    name: str
    policy: str
    models: list[str]
    """The served models (or model:adapter names) it may answer with; the first is the cheaper."""
    rules: list[Rule] = field(default_factory=list)
    default: str | None = None
    signal: str = "mean_logprob"
    threshold: float = 0.0
    router: LearnedRouter | None = None

    def targets(self, state: ServerState, tenant: TenantConfig) -> dict[str, Target]:
        return {name: replace(state.resolve_model(name, _ANYONE), route=self.name) for name in self.models}


_ANYONE = TenantConfig("route")
"""A route's models are resolved as no tenant in particular: the tenant's right is to the route's name."""


def load_routes(path: str | Path, served: list[str]) -> dict[str, Route]:
    """The routes of a JSON file (module docstring), checked against the served model names."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise InvalidParameterError(f"cannot read the routes file {path}: {exc}") from exc
    if not isinstance(data, dict) or set(data) != {"routes"} or not isinstance(data["routes"], list):
        raise InvalidParameterError(f"{path}: expected {{\"routes\": [...]}}")
    routes: dict[str, Route] = {}
    for entry in data["routes"]:
        route = _route(entry, path)
        if route.name in routes or route.name in served:
            raise InvalidParameterError(f"{path}: the route name {route.name!r} is taken (a model or another route)")
        unknown = [m for m in route.models if m.partition(":")[0] not in served]
        if unknown:
            raise InvalidParameterError(f"{path}: route {route.name!r} names {', '.join(map(repr, unknown))}, "
                                        f"not served (served: {', '.join(served)})")
        routes[route.name] = route
    return routes


def _route(entry: object, path: str | Path) -> Route:
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not entry["name"]:
        raise InvalidParameterError(f"{path}: every route needs a \"name\": {entry!r}")
    name, policy = entry["name"], entry.get("policy")
    where = f"{path}: route {name!r}"
    keys = {"rule": {"name", "policy", "rules", "default"},
            "cascade": {"name", "policy", "models", "signal", "threshold"},
            "learned": {"name", "policy", "models", "router", "threshold"}}
    if policy not in keys:
        raise InvalidParameterError(f"{where}: policy must be one of {', '.join(keys)}, got {policy!r}")
    unknown = sorted(set(entry) - keys[policy])
    if unknown:
        raise InvalidParameterError(f"{where}: unknown key(s) {', '.join(unknown)} for policy {policy!r} "
                                    f"(known: {', '.join(sorted(keys[policy]))})")
    if policy == "rule":
        rules = [_rule(r, where) for r in entry.get("rules", [])]
        default = entry.get("default")
        if not isinstance(default, str):
            raise InvalidParameterError(f"{where}: a rule route needs a \"default\" model")
        models = list(dict.fromkeys([default, *(r.model for r in rules)]))
        return Route(name, policy, models, rules=rules, default=default)
    models = entry.get("models")
    if not isinstance(models, list) or len(models) != 2 or not all(isinstance(m, str) for m in models):
        raise InvalidParameterError(f"{where}: \"models\" must be [cheaper, stronger]")
    threshold = entry.get("threshold", -0.5 if policy == "cascade" else 0.5)
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not math.isfinite(threshold):
        raise InvalidParameterError(f"{where}: threshold must be a number, got {threshold!r}")
    if policy == "cascade":
        signal = entry.get("signal", "mean_logprob")
        if signal not in SIGNALS:
            raise InvalidParameterError(f"{where}: signal must be one of {', '.join(SIGNALS)}, got {signal!r}")
        return Route(name, policy, models, signal=signal, threshold=float(threshold))
    if not isinstance(entry.get("router"), str):
        raise InvalidParameterError(f"{where}: a learned route needs \"router\": a file from `tokenmill route train`")
    router_path = Path(entry["router"])
    if not router_path.is_absolute():
        router_path = Path(path).parent / router_path
    return Route(name, policy, models, threshold=float(threshold), router=LearnedRouter.load(router_path))


def _rule(entry: object, where: str) -> Rule:
    if not isinstance(entry, dict):
        raise InvalidParameterError(f"{where}: every rule must be an object, got {entry!r}")
    reject_unknown_keys(Rule, entry)
    if not isinstance(entry.get("model"), str):
        raise InvalidParameterError(f"{where}: every rule needs a \"model\": {entry!r}")
    tags = entry.get("tags") or {}
    if not isinstance(tags, dict):
        raise InvalidParameterError(f"{where}: a rule's tags must be an object of strings")
    tenants = entry.get("tenants")
    return Rule(entry["model"], entry.get("min_prompt_tokens"), entry.get("max_prompt_tokens"),
                tuple(tenants) if tenants is not None else None, tuple(sorted(tags.items())))


async def run_request(state: ServerState, model: str | None, tenant: TenantConfig, prepare: Prepare,
                      respond: Respond) -> Response:
    """Run one generation request: on the target ``model`` names, or through its route."""
    route = state.routes.get(model) if model is not None else None
    if route is None:
        gen = await prepare(state.resolve_model(model, tenant))
        await gen.start()
        return await respond(gen)
    if not tenant.may_use(route.name):
        raise APIError(403, f"tenant {tenant.name!r} may not use the model {model!r}", param="model",
                       code="model_not_allowed")
    targets = route.targets(state, tenant)
    if route.policy == "cascade":
        return await _cascade(state, route, targets, tenant, prepare, respond)
    first = await prepare(targets[route.models[0]])
    if route.policy == "rule":
        chosen = next((r.model for r in route.rules if r.holds(first.prompt_tokens, tenant.name,
                                                                  dict(first.labels.tags))), route.default)
    else:
        ok = min(route.router.predict(ids) for ids in first.prompts)
        chosen = route.models[0] if ok >= route.threshold else route.models[1]
    gen = first if chosen == route.models[0] else await prepare(targets[chosen])
    state.metrics.route_requests.labels(route.name, chosen).inc()
    await gen.start()
    return await respond(gen)


def confidence(gen: Generation, signal: str) -> float:
    """The least confident sample's ``signal`` over its answer tokens (higher: more confident)."""
    values = []
    for request_id in gen.request_ids:
        for out in gen.output(request_id).outputs:
            entries = out.logprobs or []
            if not entries:
                values.append(-math.inf)
                continue
            if signal == "mean_logprob":
                values.append(sum(e.logprob for e in entries) / len(entries))
            elif signal == "min_logprob":
                values.append(min(e.logprob for e in entries))
            else:
                values.append(-sum(_entropy(e.top) for e in entries) / len(entries))
    return min(values) if values else -math.inf


def _entropy(top: list[tuple[int, float]]) -> float:
    """Entropy (nats) of the top-k distribution, renormalized."""
    probs = [math.exp(lp) for _, lp in top]
    total = sum(probs)
    return -sum(p / total * math.log(p / total) for p in probs if p > 0) if total > 0 else 0.0


async def _cascade(state: ServerState, route: Route, targets: dict[str, Target], tenant: TenantConfig,
                   prepare: Prepare, respond: Respond) -> Response:
    cheap_name, strong_name = route.models
    top = TOP_FOR_ENTROPY if route.signal == "entropy" else 0
    cheap, strong = await prepare(targets[cheap_name], top), await prepare(targets[strong_name])
    try:
        hold = state.budgets.hold(tenant, cheap.hold_amount() + strong.hold_amount())
    except Rejected as exc:
        state.metrics.reject(cheap.model.name, exc.reason)
        raise rejected_error(exc) from None
    cheap.use_hold(hold)
    strong.use_hold(hold)
    cheap.history = []
    try:
        await cheap.start()
        try:
            while not cheap.done:
                await cheap.next_update()
        except ClientDisconnected:
            return Response(status_code=499)
        finally:
            cheap.close()
        value = confidence(cheap, route.signal)
        escalate = value < route.threshold
        _log(state, route, cheap, value, escalate)
        answer = strong if escalate else cheap
        state.metrics.route_requests.labels(route.name, answer.target.name).inc()
        if not escalate:
            cheap.observe_slo(time.monotonic())
            cheap.replay()
            return await respond(cheap)
        state.metrics.route_escalations.labels(route.name).inc()
        strong.records.extend(cheap.records)  # the answer's cost includes the first attempt
        await strong.start()
        return await respond(strong)
    finally:
        if hold is not None:
            hold.seal()  # the parts start() opened settle it; none opened: nothing is charged


def _log(state: ServerState, route: Route, cheap: Generation, value: float, escalated: bool) -> None:
    path = state.config.route_log
    if path is None:
        return
    entry = {"time": time.time(), "route": route.name, "model": cheap.model.name, "tenant": cheap.tenant.name,
             "signal": route.signal, "value": value if math.isfinite(value) else None, "escalated": escalated,
             "prompt_token_ids": cheap.prompts[0]}
    try:
        with open(path, "a") as f:
            f.write(json.dumps(entry) + "\n")
    except OSError:
        logger.exception("cannot append to the route log %s", path)
