"""ScaleOutConfig: replicas of one model on Ray Serve behind one endpoint (``tokenmill serve --replicas N``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from tokenmill.config import Config
from tokenmill.errors import InvalidParameterError
from tokenmill.options import option

ROUTING = ("prefix", "round_robin")


@dataclass(frozen=True)
class ScaleOutConfig(Config):
    """Replicas on Ray Serve: how many, how they are routed to and scaled."""

    title: ClassVar[str] = "scale-out"

    replicas: int = option(0, "serve the model from N Ray Serve replicas behind this endpoint (0: in this process, "
                              "no Ray); with --max-replicas, the number they start at")
    min_replicas: int | None = option(None, "autoscaling: fewest replicas (default: --replicas)")
    max_replicas: int | None = option(None, "autoscaling: most replicas; above --replicas turns autoscaling on")
    target_queue: float | None = option(
        None, "autoscaling: sequences per replica (running and waiting) it aims for (default: --max-num-seqs); a "
              "replica's TTFT p90 over --slo-ttft asks for one more")
    upscale_delay: float = option(5.0, "autoscaling: seconds the load must ask for more replicas before they start")
    downscale_delay: float = option(30.0, "autoscaling: seconds the load must ask for fewer before a replica drains")
    replica_threads: int = option(1, "CPU threads (and Ray CPUs) per replica")
    routing: str = option("prefix", "how requests pick a replica: prefix (the longest cached prefix, from the "
                                    "replicas' block hashes, balanced against queues) or round_robin",
                          choices=ROUTING)
    max_imbalance: int = option(8, "prefix routing: a replica more than this many requests busier than the "
                                   "idlest is passed over even when it holds the prefix")
    optimistic_ttl: float = option(
        2.0, "prefix routing: seconds a routed request's blocks count as held by its replica before that "
             "replica's own reports (which also show evictions) take over, for requests the front does not "
             "track (its own requests count until a report taken after their prefill)")
    routing_stats_period: float = option(0.5, "seconds between the replicas' reports of their cached blocks")
    max_attempts: int = option(3, "tries per request when a replica is lost before any of it reached the client")
    ray_address: str | None = option(None, "Ray cluster to join (default: start a local one)")
    attach: str | None = option(
        None, "front the replicas of a Ray Serve application already running on --ray-address (deployed from a "
              "config file with tokenmill.scaleout.deploy:build_engine_app) instead of deploying them; give the "
              "--prefix-hash-key its options name")
    prefill_replicas: int = option(
        0, "prototype, disaggregated prefill/decode: this many more replicas only prefill prompts and hand "
           "their KV blocks through Ray's object store to the --replicas ones, which decode")

    def __post_init__(self) -> None:
        if self.replicas < 0:
            raise InvalidParameterError(f"replicas must be >= 0, got {self.replicas}")
        if self.replica_threads < 1:
            raise InvalidParameterError(f"replica_threads must be >= 1, got {self.replica_threads}")
        low, high = self.autoscaling_bounds
        if self.replicas and not low <= self.replicas <= high:
            raise InvalidParameterError(f"replicas ({self.replicas}) must lie in [min_replicas, max_replicas] = "
                                        f"[{low}, {high}]")
        if low < 1 and self.replicas:
            raise InvalidParameterError(f"min_replicas must be >= 1, got {low}")
        if self.prefill_replicas < 0:
            raise InvalidParameterError(f"prefill_replicas must be >= 0, got {self.prefill_replicas}")
        if self.max_attempts < 1:
            raise InvalidParameterError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.routing_stats_period <= 0:
            raise InvalidParameterError(f"routing_stats_period must be > 0, got {self.routing_stats_period}")

    @property
    def autoscaling_bounds(self) -> tuple[int, int]:
        low = self.min_replicas if self.min_replicas is not None else self.replicas
        high = self.max_replicas if self.max_replicas is not None else self.replicas
        return low, high

    @property
    def autoscaling(self) -> bool:
        low, high = self.autoscaling_bounds
        return high > low
