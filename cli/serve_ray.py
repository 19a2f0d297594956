"""``unmask serve --ray``: the HTTP API as a Ray Serve application (docs/scale.md; docs/design.md#scale-out):
engine replicas spread over a Ray cluster's nodes, one ingress, Ray's HTTP proxy on ``--host``/``--port``.

Every replica loads MODEL itself, on its node, through :func:`replica_engine` (the plain server's own loader,
``unmask.cli.serve.start_engine``): MODEL must be a path each node can read (or the default model, which each node
prepares in its own ``$UNMASK_HOME``). Runs until SIGINT/SIGTERM, then deletes the application, and stops Ray Serve
when no other application runs on the cluster (a cluster it joined keeps running; a local one it started stops).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import signal
import threading
from pathlib import Path

log = logging.getLogger("unmask.server")

#: the Serve application's name on the cluster
APP_NAME = "unmask"


def replica_engine(args: argparse.Namespace, config):
    """The started ``AsyncEngine`` of one replica (``unmask serve``'s loader, first-forward check included)."""
    from unmask.cli.serve import start_engine

    return start_engine(args, config)[1]


def ray_options(args: argparse.Namespace, engine_config):
    """The validated :class:`~unmask.server.ray_config.RayServeConfig` of ``args`` (``--ray-replica-gpus`` 1 with
    a CUDA ``--device`` unless set).

    Raises:
        UsageError: a value out of range (names the flag or its variable); ``--tensor-parallel-size`` above 1; Ray
            not installed.
    """
    from unmask.cli.flags import config_from_args, name_option, option_name
    from unmask.cli.main import UsageError
    from unmask.server.ray_config import RayServeConfig

    try:
        config = config_from_args(RayServeConfig, args).validate()
    except ValueError as exc:
        raise UsageError(name_option(args, str(exc), {f.name for f in dataclasses.fields(RayServeConfig)})) from None
    if engine_config.tensor_parallel_size > 1:  # each replica would need its own group of processes: not built
        raise UsageError(f"{option_name(args, 'tensor_parallel_size')}: not with --ray yet (a replica is one "
                         "process); serve a tensor-parallel model without --ray")
    if str(engine_config.device).startswith("cuda") and config.ray_replica_gpus == 0:
        config = dataclasses.replace(config, ray_replica_gpus=1.0)
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError as exc:
        raise UsageError(f"--ray: Ray Serve is not installed ({exc}); pip install 'unmask[ray]'") from None
    return config


def deploy(args: argparse.Namespace, engine_config, server_config, ray_config) -> str:
    """Deploy the application on the connected Ray cluster (the HTTP proxy on ``server_config``'s host and port);
    returns the served model's name."""
    from ray import serve

    from unmask.cli.serve import OPTION_FIELDS, resolve_model
    from unmask.server.ray_app import build_application

    engine_config, model_path, what = resolve_model(engine_config)
    name = server_config.served_model_name or Path(str(model_path).rstrip("/")).name or str(model_path)
    # what a replica needs to name a bad option the way the user set it; nothing else of the parsed namespace
    kept = argparse.Namespace(**{k: v for k, v in vars(args).items() if k in OPTION_FIELDS or k == "env_origins"})
    factory = functools.partial(replica_engine, kept, dataclasses.replace(engine_config, model=model_path))
    app = build_application(factory, name, server_config, ray_config, max_batch_size=engine_config.max_batch_size,
                            max_queue=engine_config.max_queue)
    serve.start(http_options={"host": server_config.host, "port": server_config.port})
    check_proxy_address(server_config)
    serve.run(app, name=APP_NAME, route_prefix=server_config.root_path.rstrip("/") or "/")
    log.info("serving %s as %r on http://%s:%d through Ray Serve: %s", what or model_path, name, server_config.host,
             server_config.port, ray_summary(ray_config))
    return name


def check_proxy_address(server_config) -> None:
    """Ray Serve listens where ``--host``/``--port`` say: on a cluster whose Serve already runs, its proxies keep
    their own address (Ray ignores a new one with a log line), and the server would answer elsewhere.

    Raises:
        UsageError: naming ``--port`` and the address Ray Serve uses.
    """
    from ray.serve.context import _get_global_client

    from unmask.cli.main import UsageError

    http = _get_global_client().http_config
    if (http.host, http.port) != (server_config.host, server_config.port):
        raise UsageError(f"--port: Ray Serve already runs on this cluster on {http.host}:{http.port}, not "
                         f"{server_config.host}:{server_config.port}; serve there (--host {http.host} --port "
                         f"{http.port}) or stop it first (serve shutdown)")


def ray_summary(config) -> str:
    """The deployment in words, for the start-up log."""
    scale = (f"{config.ray_min_replicas} engine replica(s)" if config.max_replicas == config.ray_min_replicas else
             f"{config.ray_min_replicas}..{config.max_replicas} engine replicas (autoscaled on queued requests)")
    return f"{scale}, router {config.ray_router}"


def run_ray(args: argparse.Namespace, engine_config, server_config) -> int:
    """Join (``--ray-address``) or start a Ray cluster, deploy, serve until SIGINT/SIGTERM; returns 0."""
    import ray
    from ray import serve

    ray_config = ray_options(args, engine_config)
    ray.init(address=ray_config.ray_address, logging_level=logging.WARNING)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        deploy(args, engine_config, server_config, ray_config)
        stop.wait()
    finally:
        stop_serving()
        ray.shutdown()
    return 0


def stop_serving() -> None:
    """Delete the application; with no other application left, stop Ray Serve too (its proxies would keep this
    server's port on the cluster)."""
    from ray import serve

    serve.delete(APP_NAME)
    if not serve.status().applications:
        serve.shutdown()
