"""The deployment files check without Docker (docs/deploy.md): hadolint on both Dockerfiles, ``docker compose config
-q`` on every compose file, the files they mount exist, and the dashboard asks only for metrics the server exports
(parsed from a live tiny server's /metrics)."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from helpers import (COMPOSE_FILES, COMPOSE_OVERRIDES, COMPOSE_STACKS, DASHBOARDS, DOCKER, METRIC, ROOT, compose,
                     compose_config, panel_queries, venv_tool)


@pytest.mark.parametrize("dockerfile", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_hadolint_passes(dockerfile):
    r = subprocess.run([venv_tool("hadolint"), str(DOCKER / dockerfile)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_compose_file_is_a_stack_or_an_override():
    names = {p.name for p in COMPOSE_FILES}
    assert names >= {"compose.yaml", "compose.replicas.yaml", "compose.cuda.yaml"}
    assert set(COMPOSE_OVERRIDES) <= names
    validated = {Path(f).name for files, _ in COMPOSE_STACKS for f in files}
    assert validated == names, f"not validated: {sorted(names - validated)}"


@pytest.mark.parametrize("files, env", COMPOSE_STACKS,
                         ids=[" + ".join(f.name for f in files) for files, _ in COMPOSE_STACKS])
def test_every_compose_stack_validates_and_its_mounts_exist(files, env):
    r = compose(files, "config", "-q", env=env)
    assert r.returncode == 0, r.stderr
    cfg = compose_config(files, env)
    for name, svc in cfg["services"].items():
        for v in svc.get("volumes", []):
            if v["type"] == "bind":  # compose resolves sources against the file's directory
                assert Path(v["source"]).exists(), f"service {name} mounts the missing {v['source']}"
        if "build" in svc:
            assert Path(svc["build"]["context"]).resolve() == ROOT.resolve(), f"{name}'s build context"
            assert (ROOT / svc["build"]["dockerfile"]).is_file(), f"{name}'s Dockerfile"
            assert ("cuda" in svc["build"]["dockerfile"]) == ("cuda" in svc["image"]), f"{name}: image vs Dockerfile"


def test_the_replicas_variant_publishes_only_nginx():
    cfg = compose_config([DOCKER / "compose.replicas.yaml"], {"UNMASK_REPLICAS": "3"})
    assert cfg["services"]["unmask"]["deploy"]["replicas"] == 3
    assert not cfg["services"]["unmask"].get("ports")  # N replicas cannot share a host port; nginx has it
    assert [p["target"] for p in cfg["services"]["nginx"]["ports"]] == [8000]
    # one writer prepares the shared model volume before the replicas read it
    assert cfg["services"]["unmask"]["depends_on"]["prepare"]["condition"] == "service_completed_successfully"
    assert "default_model" in " ".join(cfg["services"]["prepare"]["entrypoint"])


def _gpus(svc) -> list[dict]:
    return svc.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])


@pytest.mark.parametrize("gpus, count", [(None, -1), ("1", 1)])  # compose writes "all" as -1
def test_the_cuda_override_builds_the_cuda_image_and_reserves_gpus(gpus, count):
    env = {"UNMASK_GPUS": gpus} if gpus else {}
    cfg = compose_config([DOCKER / "compose.yaml", DOCKER / "compose.cuda.yaml"], env)
    svc = cfg["services"]["unmask"]
    assert svc["build"]["dockerfile"] == "docker/Dockerfile.cuda" and svc["image"] == "unmask:cuda"
    assert [(d["driver"], d["count"], d["capabilities"]) for d in _gpus(svc)] == [("nvidia", count, ["gpu"])]
    assert all(not _gpus(s) for n, s in cfg["services"].items() if n != "unmask")


def test_the_cuda_replicas_run_one_image_and_reserve_gpus():
    """With the variables docs/deploy.md gives, the one-shot `prepare` runs the replicas' (CUDA) image."""
    env = {**COMPOSE_OVERRIDES["compose.cuda.yaml"]["compose.replicas.yaml"], "UNMASK_REPLICAS": "2"}
    cfg = compose_config([DOCKER / "compose.replicas.yaml", DOCKER / "compose.cuda.yaml"], env)
    unmask, prepare = cfg["services"]["unmask"], cfg["services"]["prepare"]
    assert (prepare["image"], prepare["build"]["dockerfile"]) == (unmask["image"], unmask["build"]["dockerfile"])
    assert unmask["build"]["dockerfile"] == "docker/Dockerfile.cuda" and unmask["deploy"]["replicas"] == 2
    assert _gpus(unmask) and not _gpus(prepare)


@pytest.fixture(scope="module")
def exported():
    """Metric sample names a live tiny server exports (``unmask:x_total``, ``unmask:y_bucket``, ...)."""
    from tiny import loaded
    from unmask.engine.async_engine import AsyncEngine
    from unmask.server.app import build_app

    engine = AsyncEngine(loaded(block_size=4))
    try:
        with TestClient(build_app(engine, "m", shutdown_engine=False)) as c:
            assert c.post("/v1/completions", json={"model": "m", "prompt": "Hi", "max_tokens": 4}).status_code == 200
            text = c.get("/metrics").text
    finally:
        engine.shutdown()
    names = set()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            names.add(s.name)
    return names


def test_every_dashboard_query_names_an_exported_metric(exported):
    assert DASHBOARDS, "no dashboard under docker/grafana/dashboards"
    for path in DASHBOARDS:
        queries = panel_queries(path)
        assert queries, path
        for title, expr in queries:
            names = METRIC.findall(expr)
            assert names, f"{path.name}: panel {title!r} queries no unmask metric: {expr}"
            for name in names:
                assert name in exported, f"{path.name}: panel {title!r} asks for {name}, which /metrics lacks"


def test_the_dashboard_has_the_panels_docs_deploy_lists():
    text = " ".join(expr for path in DASHBOARDS for _, expr in panel_queries(path))
    for needle in ("rate(unmask:generation_tokens_total", "unmask:tokens_per_forward_bucket",
                   "unmask:steps_per_block_bucket", "unmask:nfe_total", "unmask:time_to_first_token_seconds_bucket",
                   "unmask:e2e_request_latency_seconds_bucket", "unmask:num_requests_running",
                   "unmask:num_requests_waiting", "unmask:request_success_total", "unmask:request_failure_total",
                   "unmask:spec_decode_num_accepted_tokens_total"):
        assert needle in text, needle
    for q in ("0.5", "0.95", "0.99"):
        assert f"histogram_quantile({q}, sum by (le) (rate(unmask:e2e_request_latency_seconds_bucket" in text


@pytest.mark.parametrize("dockerfile", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_the_image_copies_every_package_directory(dockerfile):
    """Each source directory pyproject.toml packages is in the build context (.dockerignore) and copied into the build
    stage, so that pip's metadata step finds it: CI's image build once failed on a new package (default_adapter)."""
    import tomllib

    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    roots = {d.split("/")[0] for d in cfg["package-dir"].values()}
    allowed = {line.strip().lstrip("!").rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip().startswith("!")}
    copies = {line.split()[1].rstrip("/") for line in (DOCKER / dockerfile).read_text().splitlines()
              if line.startswith("COPY ") and not line.startswith("COPY --from")}
    assert roots - allowed == set(), f".dockerignore leaves out {sorted(roots - allowed)}"
    assert roots - copies == set(), f"{dockerfile} does not COPY {sorted(roots - copies)}"
