"""The options of serving on a Ray cluster (:class:`RayServeConfig`, ``unmask serve --ray``; docs/scale.md): each
option once, with the metadata its flag and ``UNMASK_*`` variable are generated from, as
:class:`~unmask.server.config.ServerConfig`. Importing this module does not import Ray."""
from __future__ import annotations

from dataclasses import dataclass

from unmask.engine import option

from .prefix_routing import DEFAULT_IMBALANCE, DEFAULT_LOAD_WEIGHT

__all__ = ["RayServeConfig", "RAY_ROUTERS"]

#: --ray-router: unmask's prefix-aware router, a plain rotation, Ray Serve's default (two random choices, the less
#: loaded)
RAY_ROUTERS = ("prefix", "round_robin", "power_of_two")


@dataclass(frozen=True)
class RayServeConfig:
    """How ``unmask serve --ray`` deploys: engine replicas behind one ingress on a Ray cluster (defaults here and
    nowhere else).

    Raises (:meth:`validate`):
        ValueError: a value out of range, naming the field.
    """

    ray: bool = option(False, "serve on a Ray cluster with Ray Serve: an ingress (this HTTP API) and engine "
                              "replicas, routed by prompt prefix, autoscaled on queued requests (pip install "
                              "'unmask[ray]'; docs/scale.md)", action="store_true")
    ray_address: str | None = option(None, "the Ray cluster to join (ray.init's address, e.g. auto or "
                                           "ray://head:10001); default: start a local one")
    ray_min_replicas: int = option(1, "fewest engine replicas (default 1)")
    ray_max_replicas: int | None = option(None, "most engine replicas: above --ray-min-replicas the replicas "
                                                "autoscale on queued requests (default: --ray-min-replicas, fixed)")
    ray_target_ongoing: int | None = option(
        None, "requests in flight per replica the autoscaler aims at (Ray's target_ongoing_requests); default "
              "--max-batch-size: a replica gets company once requests queue behind a full batch")
    ray_upscale_delay: float = option(30.0, "seconds a queue must last before a replica is added (default 30)")
    ray_downscale_delay: float = option(600.0, "seconds replicas must be idle before one is removed (default 600)")
    ray_max_replicas_per_node: int | None = option(
        None, "most engine replicas on one Ray node (default: no limit; Ray spreads replicas over nodes)")
    ray_replica_cpus: float = option(1.0, "CPUs Ray reserves per engine replica (default 1)")
    ray_replica_gpus: float = option(0.0, "GPUs Ray reserves per engine replica (default 0; 1 with --device cuda)")
    ray_router: str = option("prefix", "how requests pick an engine replica: prefix (the replica holding the "
                                       "longest part of the prompt's prefix within --ray-imbalance; default), "
                                       "round_robin, power_of_two (Ray Serve's default)", choices=RAY_ROUTERS)
    ray_imbalance: int = option(DEFAULT_IMBALANCE, "requests in flight by which the prefix router's choice may "
                                                   f"exceed the least loaded replica (default {DEFAULT_IMBALANCE})")
    ray_load_weight: float = option(
        DEFAULT_LOAD_WEIGHT, "chunks of held prompt prefix (16 tokens each) that waiting behind one request is "
                             "worth to the prefix router: it picks the replica with the most held chunks minus this "
                             "per request the new one would wait behind (beyond --max-batch-size in flight) "
                             f"(default {DEFAULT_LOAD_WEIGHT:g}; 0: longest match within --ray-imbalance)")
    ray_metrics_port: int = option(0, "port of each engine replica's own /metrics on its node (default 0: any "
                                      "free port; GET /replicas on the ingress lists them)")

    @property
    def max_replicas(self) -> int:
        """The most replicas (``ray_max_replicas``, else ``ray_min_replicas``)."""
        return self.ray_max_replicas if self.ray_max_replicas is not None else self.ray_min_replicas

    def validate(self) -> "RayServeConfig":
        """Check every range; returns self.

        Raises:
            ValueError: naming the field.
        """
        for name in ("ray_min_replicas", "ray_target_ongoing", "ray_max_replicas_per_node"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}: must be >= 1, got {value}")
        if self.max_replicas < self.ray_min_replicas:
            raise ValueError(f"ray_max_replicas: must be >= ray_min_replicas ({self.ray_min_replicas}), got "
                             f"{self.ray_max_replicas}")
        for name in ("ray_upscale_delay", "ray_downscale_delay", "ray_replica_cpus", "ray_replica_gpus"):
            if not getattr(self, name) >= 0:  # NaN too
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if not self.ray_load_weight >= 0:  # NaN too
            raise ValueError(f"ray_load_weight: must be >= 0, got {self.ray_load_weight}")
        if self.ray_imbalance < 0:
            raise ValueError(f"ray_imbalance: must be >= 0, got {self.ray_imbalance}")
        if not 0 <= self.ray_metrics_port <= 65535:
            raise ValueError(f"ray_metrics_port: must be in 0..65535, got {self.ray_metrics_port}")
        if self.ray_router not in RAY_ROUTERS:
            raise ValueError(f"ray_router: must be one of {list(RAY_ROUTERS)}, got {self.ray_router!r}")
        return self
