"""``tokenmill serve --replicas N``: a model's replicas on Ray Serve, one OpenAI endpoint in front.

::

    clients ─► front (this process: tokenmill's HTTP server, auth, quotas, budgets, /metrics)
                 │ RemoteEngine: each engine request -> handle.generate(ReplicaRequest), streamed
                 ▼
               Ray Serve deployment "tokenmill-engine" (num_replicas, or autoscaling min..max)
                 PrefixRequestRouter (in this process): the replica holding the longest cached
                 prefix of the request, by the block hashes each replica reports
                 replica 0: EngineReplica (LLM + AsyncEngine)   replica 1: ...   replica N-1: ...

Versions (rollout.py): each deployment of the model is a Ray Serve application of its own (the first
is ``tokenmill``); the front splits new requests between them by weight.

The front and the replicas share a secret ``prefix_hash_key`` (made here, per start), so their
block hashes agree; tenants' salts keep one tenant's blocks out of another's matches, as in one
process. Quotas and budgets are held in the front, so they hold across replicas.

Ray: the command starts a local cluster (``ray.init``) unless ``--ray-address`` names one; Ray
Serve runs without its HTTP proxy (the front serves HTTP). Draining on scale-down is Ray Serve's
(a replica stops taking requests, finishes its ongoing ones up to ``graceful_shutdown_timeout_s``:
the server's ``--drain-timeout``). ``build_engine_app`` is also an application builder for a Ray
Serve config file (``import_path: tokenmill.scaleout.deploy:build_engine_app``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import time
from dataclasses import dataclass
from typing import Any

from tokenmill.engine import BlockHasher
from tokenmill.errors import InvalidParameterError
from tokenmill.scaleout.config import ScaleOutConfig
from tokenmill.scaleout.remote import RemoteEngine, RemoteModel, Version
from tokenmill.scaleout.replica import EngineReplica, ReplicaInfo
from tokenmill.server.admission import AdmissionController
from tokenmill.server.config import CostConfig, ServerConfig
from tokenmill.server.state import ServedModel, ServerState

logger = logging.getLogger("tokenmill.scaleout")

RESOURCE_WAIT = 60.0
"""Seconds a deployment waits for the cluster's free CPUs to cover its replicas before it is refused."""
APP_NAME = "tokenmill"
DEPLOYMENT = "tokenmill-engine"


def engine_deployment(source: str, options: dict[str, Any], scale: ScaleOutConfig, config: ServerConfig,
                      cost: CostConfig):
    """The bound Ray Serve application of EngineReplica (``serve.run`` it)."""
    from ray import serve
    from ray.serve.config import AutoscalingConfig, AutoscalingPolicy, RequestRouterConfig

    low, high = scale.autoscaling_bounds
    max_seqs = options.get("max_num_seqs") or _default_max_num_seqs()
    router = RequestRouterConfig(
        request_router_class="tokenmill.scaleout.ray_router:PrefixRequestRouter",
        request_router_kwargs={"policy": scale.routing, "max_imbalance": scale.max_imbalance,
                               "optimistic_ttl": scale.optimistic_ttl},
        request_routing_stats_period_s=scale.routing_stats_period,
        request_routing_stats_timeout_s=max(scale.routing_stats_period * 4, 5.0))
    kwargs: dict[str, Any] = {
        "name": DEPLOYMENT, "request_router_config": router,
        # room for a full batch and its queue: admission (the front) bounds the total
        "max_ongoing_requests": max_seqs + config.max_queued_requests,
        "ray_actor_options": {"num_cpus": scale.replica_threads},
        "graceful_shutdown_timeout_s": config.drain_timeout, "graceful_shutdown_wait_loop_s": 0.5,
        "health_check_period_s": 2.0, "health_check_timeout_s": 30.0}
    if scale.autoscaling:
        policy = AutoscalingPolicy(policy_function="tokenmill.scaleout.autoscale:queue_and_ttft_policy",
                                   policy_kwargs={"target_queue": scale.target_queue or max_seqs,
                                                  "slo_ttft": cost.slo_ttft})
        kwargs["autoscaling_config"] = AutoscalingConfig(
            min_replicas=low, max_replicas=high, initial_replicas=scale.replicas or low,
            target_ongoing_requests=scale.target_queue or max_seqs, upscale_delay_s=scale.upscale_delay,
            downscale_delay_s=scale.downscale_delay, metrics_interval_s=1.0, look_back_period_s=5.0,
            policy=policy)
    else:
        kwargs["num_replicas"] = scale.replicas
    deployment = serve.deployment(EngineReplica, **kwargs)
    return deployment.bind(source, options, None, config.lora_module_paths(), cost.price_per_hour,
                           scale.replica_threads)


def build_engine_app(args: dict[str, Any]):
    """Ray Serve application builder (config files): ``args`` are ``model`` (a source), ``options``
    (LLM keywords, ``prefix_hash_key`` among them), and ScaleOutConfig's fields."""
    args = dict(args)
    source, options = args.pop("model"), dict(args.pop("options", {}))
    if not options.get("prefix_hash_key"):
        raise InvalidParameterError("options.prefix_hash_key: set a secret, and give the front the same "
                                    "(tokenmill serve --attach APP --prefix-hash-key KEY)")
    return engine_deployment(source, options, ScaleOutConfig.from_dict(args), ServerConfig(), CostConfig())


def _default_max_num_seqs() -> int:
    from tokenmill.engine import SchedulerConfig

    return SchedulerConfig().max_num_seqs


def start_ray(scale: ScaleOutConfig) -> None:
    """Join ``--ray-address``, or start a local cluster: its logical CPUs are the machine's, or
    enough for two full fleets (a rollout runs both versions for a while), whichever is more."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        if scale.ray_address:
            ray.init(address=scale.ray_address, logging_level=logging.WARNING)
        else:
            replicas = scale.autoscaling_bounds[1] + scale.prefill_replicas
            ray.init(num_cpus=max(os.cpu_count() or 1, 2 * replicas * scale.replica_threads), include_dashboard=False,
                     logging_level=logging.WARNING, configure_logging=False)
    serve.start(proxy_location="Disabled")


class Fleet:
    """The Ray Serve applications this front deployed (one per version of the model), and how it
    deploys more: the same engine options, scale-out settings and block-hash key for each."""

    def __init__(self, options: dict[str, Any], config: ServerConfig, cost: CostConfig, scale: ScaleOutConfig,
                 key: str) -> None:
        self.options = {**options, "prefix_hash_key": key}
        self.config, self.cost, self.scale, self.key = config, cost, scale, key
        self.apps: list[str] = []

    def deploy(self, name: str, source: str, replicas: int | None = None):
        """Deploy ``source`` as application ``name`` and wait until its replicas serve (blocking)
        -> (handle, what a replica describes)."""
        from ray import serve

        import ray

        scale = self.scale if replicas is None else dataclasses.replace(
            self.scale, replicas=replicas, min_replicas=None, max_replicas=None)
        need = (scale.replicas or scale.autoscaling_bounds[0]) * scale.replica_threads
        deadline = time.monotonic() + RESOURCE_WAIT
        while (free := ray.available_resources().get("CPU", 0.0)) < need:  # Ray Serve would wait forever
            if time.monotonic() > deadline:  # (a deleted version's or restarted replica's CPUs free in seconds)
                raise InvalidParameterError(f"{name}: {scale.replicas} replica(s) of {scale.replica_threads} "
                                            f"thread(s) need {need} CPUs; the Ray cluster has {free:g} free")
            time.sleep(0.5)
        app = engine_deployment(source, self.options, scale, self.config, self.cost)
        logger.info("starting %d replica(s) of %s on Ray Serve as %s", scale.replicas, source, name)
        handle = serve.run(app, name=name, route_prefix=None)
        self.apps.append(name)
        info: ReplicaInfo = handle.describe.remote().result()
        return handle, info

    def delete(self, name: str) -> None:
        """Delete application ``name`` (blocking): Ray Serve stops routing to its replicas and lets
        each finish its ongoing requests (up to the server's drain timeout)."""
        from ray import serve

        serve.delete(name)
        self.apps.remove(name)

    def stop(self) -> None:
        """Delete every application this front deployed, when Ray still runs."""
        import ray

        for name in list(self.apps):
            if not ray.is_initialized():
                return
            try:
                self.delete(name)
            except Exception:  # noqa: BLE001 - the cluster may be going away with us
                logger.warning("could not delete the %s application", name, exc_info=True)


@dataclass
class Front:
    """What ``launch`` built: the front's state and the fleet behind it."""

    state: ServerState
    fleet: Fleet

    def app(self):
        """The front's FastAPI app: the server's, plus the rollout endpoints (rollout.py)."""
        from tokenmill.scaleout.rollout import rollout_router
        from tokenmill.server.app import build_app

        app = build_app(self.state)
        app.include_router(rollout_router(self.fleet, self.state.engine))
        return app

    def stop(self) -> None:
        self.fleet.stop()


def launch(source: str, options: dict[str, Any], config: ServerConfig, cost: CostConfig,
           scale: ScaleOutConfig) -> Front:
    """Start Ray (unless running), deploy the replicas, wait until they serve, and build the
    front (``tokenmill.server.serve.run(front.state, front.app())`` serves it)."""
    start_ray(scale)
    if scale.attach:
        return attach(options, config, cost, scale)
    key = secrets.token_hex(16)
    fleet = Fleet(options, config, cost, scale, key)
    handle, info = fleet.deploy(APP_NAME, source)
    state = front_state(handle, info, BlockHasher(key), config, cost, scale)
    if scale.prefill_replicas:
        name = f"{APP_NAME}-prefill"
        prefill, prefill_info = fleet.deploy(name, source, scale.prefill_replicas)
        state.engine.prefill = Version(name, prefill, prefill_info, 0.0)
    return Front(state, fleet)


def attach(options: dict[str, Any], config: ServerConfig, cost: CostConfig, scale: ScaleOutConfig) -> Front:
    """Front an application deployed by someone else (a Ray Serve config file): its replicas'
    ``prefix_hash_key`` must be given (``--prefix-hash-key``), and stopping the front leaves it running."""
    from ray import serve

    key = options.get("prefix_hash_key")
    if not key:
        raise InvalidParameterError(f"--attach {scale.attach}: give --prefix-hash-key, the key in that "
                                    "application's engine options (the router matches block hashes with it)")
    try:
        handle = serve.get_app_handle(scale.attach)
    except Exception as exc:  # noqa: BLE001 - Ray's error names no application
        raise InvalidParameterError(f"--attach {scale.attach}: no such Ray Serve application ({exc})") from None
    info: ReplicaInfo = handle.describe.remote().result()
    deployments = serve.status().applications[scale.attach].deployments
    running = sum(d.replica_states.get("RUNNING", 0) for d in deployments.values())
    scale = dataclasses.replace(scale, replicas=max(running, 1), min_replicas=None, max_replicas=None)
    fleet = Fleet(options, config, cost, scale, key)  # owns no application: stop() deletes nothing
    return Front(front_state(handle, info, BlockHasher(key), config, cost, scale, version=scale.attach), fleet)


def front_state(handle, info: ReplicaInfo, hasher: BlockHasher, config: ServerConfig, cost: CostConfig,
                scale: ScaleOutConfig, version: str = APP_NAME) -> ServerState:
    """The front's ServerState: the model as the replicas describe it, RemoteEngine as its engine,
    admission sized for every replica's batch, and the routing metrics."""
    from tokenmill.scaleout.metrics import ReplicaCollector
    from tokenmill.server.app import assemble_state

    high = scale.autoscaling_bounds[1]
    name = config.served_model_name or info.model_name
    model = RemoteModel(info, high)
    max_seqs = info.config.scheduler.max_num_seqs * high
    admission = AdmissionController(max_seqs, config.max_queued_requests, config.max_queued_tokens,
                                    config.retry_after)
    served = {name: ServedModel(name, model, info.tokenizer, admission, info.source, model.kv_cache_bytes)}
    engines: list[RemoteEngine] = []

    def engine_of(meter, metrics) -> RemoteEngine:
        engine = RemoteEngine(handle, info, hasher, meter, scale.max_attempts, name=name, version=version,
                              on_snapshot=metrics.observe_snapshot)
        engines.append(engine)
        metrics.registry.register(ReplicaCollector(engine, name))
        return engine
    return assemble_state(served, engine_of, config, cost)
