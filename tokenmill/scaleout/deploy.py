"""``tokenmill serve --replicas N``: a model's replicas on Ray Serve, one OpenAI endpoint in front.

::

    clients ─► front (this process: tokenmill's HTTP server, auth, quotas, budgets, /metrics)
                 │ RemoteEngine: each engine request -> handle.generate(ReplicaRequest), streamed
                 ▼
               Ray Serve deployment "tokenmill-engine" (num_replicas, or autoscaling min..max)
                 PrefixRequestRouter (in this process): the replica holding the longest cached
                 prefix of the request, by the block hashes each replica reports
                 replica 0: EngineReplica (LLM + AsyncEngine)   replica 1: ...   replica N-1: ...

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

import logging
import os
import secrets
from typing import Any

from tokenmill.engine import BlockHasher
from tokenmill.scaleout.config import ScaleOutConfig
from tokenmill.scaleout.remote import RemoteEngine, RemoteModel
from tokenmill.scaleout.replica import EngineReplica, ReplicaInfo
from tokenmill.server.admission import AdmissionController
from tokenmill.server.config import CostConfig, ServerConfig
from tokenmill.server.state import ServedModel, ServerState

logger = logging.getLogger("tokenmill.scaleout")

APP_NAME = "tokenmill"
DEPLOYMENT = "tokenmill-engine"


def engine_deployment(source: str, options: dict[str, Any], scale: ScaleOutConfig, config: ServerConfig,
                      cost: CostConfig):
    """The bound Ray Serve application of EngineReplica (``serve.run`` it)."""
    from ray import serve
    from ray.serve.config import AutoscalingConfig, RequestRouterConfig

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
        kwargs["autoscaling_config"] = AutoscalingConfig(
            min_replicas=low, max_replicas=high, initial_replicas=scale.replicas or low,
            target_ongoing_requests=scale.target_queue or max_seqs, upscale_delay_s=5.0, downscale_delay_s=30.0)
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
    return engine_deployment(source, options, ScaleOutConfig.from_dict(args), ServerConfig(), CostConfig())


def _default_max_num_seqs() -> int:
    from tokenmill.engine import SchedulerConfig

    return SchedulerConfig().max_num_seqs


def start_ray(scale: ScaleOutConfig) -> None:
    import ray
    from ray import serve

    if not ray.is_initialized():
        if scale.ray_address:
            ray.init(address=scale.ray_address, logging_level=logging.WARNING)
        else:
            high = scale.autoscaling_bounds[1]
            ray.init(num_cpus=max(os.cpu_count() or 1, high * scale.replica_threads), include_dashboard=False,
                     logging_level=logging.WARNING, configure_logging=False)
    serve.start(proxy_location="Disabled")


def launch(source: str, options: dict[str, Any], config: ServerConfig, cost: CostConfig,
           scale: ScaleOutConfig) -> ServerState:
    """Start Ray (unless running), deploy the replicas, wait until they serve, and build the
    front's state (``tokenmill.server.serve.run`` serves it)."""
    from ray import serve

    start_ray(scale)
    key = secrets.token_hex(16)
    options = {**options, "prefix_hash_key": key}
    app = engine_deployment(source, options, scale, config, cost)
    logger.info("starting %d replica(s) of %s on Ray Serve", scale.replicas, source)
    handle = serve.run(app, name=APP_NAME, route_prefix=None)
    info: ReplicaInfo = handle.describe.remote().result()
    return front_state(handle, info, BlockHasher(key), config, cost, scale)


def stop() -> None:
    """Delete the replicas' application (they drain), when Ray runs."""
    import ray
    from ray import serve

    if ray.is_initialized():
        try:
            serve.delete(APP_NAME)
        except Exception:  # noqa: BLE001 - the cluster may be going away with us
            logger.warning("could not delete the %s application", APP_NAME, exc_info=True)


def front_state(handle, info: ReplicaInfo, hasher: BlockHasher, config: ServerConfig, cost: CostConfig,
                scale: ScaleOutConfig) -> ServerState:
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
        engine = RemoteEngine(handle, info, hasher, meter, scale.max_attempts, name=name)
        engines.append(engine)
        metrics.registry.register(ReplicaCollector(engine, name))
        return engine
    return assemble_state(served, engine_of, config, cost)
