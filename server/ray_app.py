"""Serving on a Ray cluster with Ray Serve (docs/design.md#scale-out; how-to: docs/scale.md): two deployments.

* ``EngineReplica`` (N replicas, spread over the Ray nodes, autoscaled on queued requests): one
  :class:`~unmask.engine.AsyncEngine` each, built by the ``engine_factory`` it is given (``unmask serve --ray``
  passes the CLI's own loader), and its own Prometheus endpoint (the engine-read gauges: queued and running
  requests, KV-cache usage, prefix-cache counters) on its node. ``generate`` streams the engine's events
  (:mod:`.remote_engine` has the wire protocol); requests reach it through :class:`~.ray_router.PrefixAwareRouter`.
* ``Ingress`` (one replica): the unchanged app of :func:`~unmask.server.app.build_app` over a
  :class:`~.remote_engine.RemoteEngine`, plus ``GET /replicas`` (the engine replicas it has used: node and
  ``/metrics`` address). Ray's HTTP proxy forwards to it, SSE included.

:func:`build_application` binds both from the configs. Imports Ray: only the ``--ray`` path imports this module.
"""
from __future__ import annotations

import logging

import ray
from ray import serve
from ray.serve.config import AutoscalingConfig, RequestRouterConfig

from .metrics import engine_metrics
from .ray_config import RayServeConfig
from .ray_router import PrefixAwareRouter, RoundRobinRouter
from .remote_engine import replica_call

__all__ = ["EngineReplica", "Ingress", "build_application"]

log = logging.getLogger("unmask.server")


class EngineReplica:
    """One engine on a Ray node.

    Args:
        engine_factory: a picklable callable returning the started :class:`~unmask.engine.AsyncEngine`.
        model_name: the ``model_name`` label of its metrics. metrics_port: its ``/metrics`` port (0: any free one).
    """

    def __init__(self, engine_factory, model_name: str, metrics_port: int = 0):
        from prometheus_client import CollectorRegistry, start_http_server

        self.engine = engine_factory()
        registry = CollectorRegistry()
        engine_metrics(registry, model_name, self.engine)
        self._http, _ = start_http_server(metrics_port, registry=registry)
        self.where = {"replica": serve.get_replica_context().replica_id.unique_id,
                      "node": ray.get_runtime_context().get_node_id(),
                      "metrics": f"http://{ray.util.get_node_ip_address()}:{self._http.server_port}/metrics"}

    def info(self) -> dict:
        """What the ingress needs to validate and render: tokenizer, ``dllm``, context, queue bound; where this
        replica is."""
        e = self.engine
        return {"tokenizer": e.tokenizer, "dllm": e.dllm, "max_context": e.max_context, "max_queue": e.max_queue,
                **self.where}

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose engine thread died is replaced."""
        if not self.engine.alive:
            raise RuntimeError(f"the engine is not running ({self.engine.error})")

    async def generate(self, prompts, params, request_ids, n=1, fit_max_tokens=False, group=None, cache_salt=None,
                       route_keys=None):  # noqa: ARG002 - route_keys: read by the router, not here
        """``AsyncEngine.submit_many`` and its events in :mod:`.remote_engine`'s wire protocol
        (:func:`~.remote_engine.replica_call`). A cancelled call aborts its engine requests."""
        async for item in replica_call(self.engine, self.where, prompts, params, request_ids, n, fit_max_tokens,
                                       group, cache_salt):
            yield item

    async def score(self, prompt_ids, top_k=0, samples=None, seed=0, route_keys=None):  # noqa: ARG002
        """``AsyncEngine.score``: ``("ok", result)`` or ``("refused", the engine's exception)``."""
        try:
            return ("ok", await self.engine.score(prompt_ids, top_k, samples, seed))
        except Exception as exc:
            return ("refused", exc)

    def __del__(self):
        engine, http = getattr(self, "engine", None), getattr(self, "_http", None)
        if http is not None:
            http.shutdown()
        if engine is not None:
            engine.shutdown()


@serve.ingress()
class Ingress:
    """The HTTP API over the engine replicas (``engine``: their deployment handle)."""

    async def __init__(self, engine, model_name: str, server_config):
        from .remote_engine import RemoteEngine

        self.remote = RemoteEngine(engine, await engine.info.remote())
        self.model_name, self.server_config = model_name, server_config

    def __serve_build_asgi_app__(self):
        from .app import build_app

        app = build_app(self.remote, self.model_name, self.server_config, shutdown_engine=False)
        remote = self.remote

        @app.get("/replicas", include_in_schema=False)
        async def replicas():
            """The engine replicas this ingress has sent requests to: id -> node and ``/metrics`` address."""
            return remote.replicas

        return app


def autoscaling(config: RayServeConfig, max_batch_size: int) -> AutoscalingConfig:
    """Ray's autoscaling of the engine replicas: ``target_ongoing_requests`` per replica (default the engine's
    batch, so a replica gets company once requests queue behind a full batch), the configured delays, and a
    look-back and metrics period no longer than the upscale delay (short delays then react in seconds)."""
    period = max(0.5, min(10.0, config.ray_upscale_delay / 2))
    return AutoscalingConfig(min_replicas=config.ray_min_replicas, initial_replicas=config.ray_min_replicas,
                             max_replicas=config.max_replicas,
                             target_ongoing_requests=config.ray_target_ongoing or max_batch_size,
                             upscale_delay_s=config.ray_upscale_delay, downscale_delay_s=config.ray_downscale_delay,
                             metrics_interval_s=period, look_back_period_s=max(1.0, min(30.0, 2 * period)))


def build_application(engine_factory, model_name: str, server_config, config: RayServeConfig, *,
                      max_batch_size: int, max_queue: int):
    """The Serve application: the ingress bound to the engine replicas (``serve.run`` it).

    Args:
        engine_factory: picklable, returns a started ``AsyncEngine`` (called once per replica, on its node).
        model_name: the served model id. server_config: the ingress's :class:`~.config.ServerConfig`.
        config: the deployment's options. max_batch_size, max_queue: the engine's (a replica takes up to both
            at once before Ray holds requests back; the autoscaler's default target is one batch).
    """
    config.validate()
    options: dict = {"ray_actor_options": {"num_cpus": config.ray_replica_cpus, "num_gpus": config.ray_replica_gpus},
                     "max_ongoing_requests": max_queue + max_batch_size}
    if config.ray_max_replicas_per_node is not None:
        options["max_replicas_per_node"] = config.ray_max_replicas_per_node
    if config.max_replicas > config.ray_min_replicas:
        options["autoscaling_config"] = autoscaling(config, max_batch_size)
    else:
        options["num_replicas"] = config.ray_min_replicas
    router = {"prefix": PrefixAwareRouter, "round_robin": RoundRobinRouter}.get(config.ray_router)
    if router is not None:
        kwargs = ({"imbalance": config.ray_imbalance, "load_weight": config.ray_load_weight,
                   "slots": max_batch_size} if router is PrefixAwareRouter else {})
        options["request_router_config"] = RequestRouterConfig(request_router_class=router,
                                                               request_router_kwargs=kwargs)
    engine = serve.deployment(EngineReplica, name="EngineReplica").options(**options).bind(
        engine_factory, model_name, config.ray_metrics_port)
    # the ingress takes every request the replicas could (Ray's default of 5 would keep the queue in the proxy,
    # where the autoscaler never sees it)
    ingress = {"ray_actor_options": {"num_cpus": 0},
               "max_ongoing_requests": options["max_ongoing_requests"] * config.max_replicas}
    return serve.deployment(Ingress, name="Ingress").options(**ingress).bind(engine, model_name, server_config)
