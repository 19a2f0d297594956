"""The deployment files check without Docker (docs/deploy.md): hadolint on both Dockerfiles, ``docker compose config
-q`` on every compose file, the files they mount exist, the dashboard asks only for metrics the server exports
(parsed from a live tiny server's /metrics), and both images take torch from scripts/torch_build.py (the CPU wheel
in docker/wheels/ cannot enter the CUDA image, whose runtime has a compiler for Triton)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
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
                   "unmask:spec_decode_num_accepted_tokens_total", "unmask:kv_cache_usage_perc",
                   "unmask:prefix_cache_usage_perc", "unmask:inter_token_latency_seconds_bucket",
                   "unmask:request_refused_total", "unmask:prefix_cache_hits_total"):
        assert needle in text, needle
    for q in ("0.5", "0.95", "0.99"):
        assert f"histogram_quantile({q}, sum by (le) (rate(unmask:e2e_request_latency_seconds_bucket" in text


@pytest.mark.parametrize("dockerfile", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_the_image_copies_every_package_directory(dockerfile):
    """Each source directory pyproject.toml packages is in the build context (.dockerignore) and copied into the build
    stage, so that pip's metadata step finds it: CI's image build once failed on a new package (default_adapter)."""
    import tomllib

    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = set(cfg["package-dir"].values())  # e.g. engine, server/templates, benchmarks/data (unmask eval's prompts)
    allowed = {line.strip().lstrip("!").rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip().startswith("!")}
    copies = {line.split()[1].rstrip("/") for line in (DOCKER / dockerfile).read_text().splitlines()
              if line.startswith("COPY ") and not line.startswith("COPY --from")}

    def missing(paths: set[str]) -> list[str]:  # package directories no path of ``paths`` is or contains
        return sorted(d for d in dirs if not any(d == p or d.startswith(p + "/") for p in paths))

    assert missing(allowed) == [], f".dockerignore leaves out {missing(allowed)}"
    assert missing(copies) == [], f"{dockerfile} does not COPY {missing(copies)}"


def _stage(dockerfile: str, name: str) -> str:
    """The text of one stage (``FROM ... AS name`` up to the next ``FROM``)."""
    text = (DOCKER / dockerfile).read_text()
    start = text.index(f" AS {name}\n")
    end = text.find("\nFROM ", start)
    return text[start:] if end < 0 else text[start:end]


def _arg_default(dockerfile: str, name: str) -> str:
    (value,) = [line.split("=", 1)[1] for line in (DOCKER / dockerfile).read_text().splitlines()
                if line.startswith(f"ARG {name}=")]
    return value


@pytest.mark.parametrize("dockerfile", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_the_images_take_torch_from_the_rule_setup_sh_follows(dockerfile):
    """No index of their own (the CUDA image once hard-coded cu128, which torch 2.13 no longer has): both run
    scripts/torch_build.py (copied into the build stage and let through .dockerignore) via docker/install.sh;
    the CUDA image passes the driver its hosts have, the CPU image none (the CPU build)."""
    text = (DOCKER / dockerfile).read_text()
    assert "download.pytorch.org" not in text and "cu128" not in text
    assert _arg_default(dockerfile, "TORCH_INDEX_URL") == ""  # set only to pick another build yourself
    assert "COPY scripts/torch_build.py /usr/local/bin/torch-build" in _stage(dockerfile, "build")
    assert "scripts/torch_build.py" in {line.strip().lstrip("!") for line in
                                        (ROOT / ".dockerignore").read_text().splitlines()}
    deps = [line for line in _stage(dockerfile, "build").split("RUN ")[1:] if "--dependencies" in line]
    assert len(deps) == 1 and ('NVIDIA_DRIVER="${NVIDIA_DRIVER}"' in deps[0]) == (dockerfile == "Dockerfile.cuda")
    install = (DOCKER / "install.sh").read_text()
    assert 'rule+=(--driver "$NVIDIA_DRIVER")' in install and "rule+=(--cpu)" in install


def test_the_cuda_image_cannot_install_a_cpu_wheel_left_in_docker_wheels(tmp_path):
    """CI leaves this machine's CPU wheel in docker/wheels/ (the build's /wheels, a find-links folder of every pip
    call in install.sh): for the CUDA image's default driver the rule names the CUDA build exactly, and pip, asked
    offline for that requirement over a folder holding only the +cpu wheel, finds nothing."""
    driver = _arg_default("Dockerfile.cuda", "NVIDIA_DRIVER")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    info = "torch-2.13.0.dist-info"
    with zipfile.ZipFile(wheels / "torch-2.13.0+cpu-py3-none-any.whl", "w") as z:
        z.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: torch\nVersion: 2.13.0+cpu\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: t\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "TORCH_INDEX_URL"))}
    env["PIP_CONFIG_FILE"] = os.devnull
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "torch_build.py"), "--driver", driver,
                        "--find-links", str(wheels)], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    requirement = r.stdout.split()[-1]
    assert "cpu" not in requirement and "CUDA 13.0" in r.stderr, (requirement, r.stderr)
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--no-deps",
                          "--ignore-installed", "--find-links", str(wheels), requirement],
                         capture_output=True, text=True, env=env, timeout=120)
    assert pip.returncode != 0 and "+cpu" not in pip.stdout, pip.stdout + pip.stderr


def test_the_cuda_runtime_can_compile_and_reach_the_gpu():
    """`unmask serve --compile` on a GPU: Triton builds a C launcher per kernel at run time, so the runtime stage
    has gcc and Python's headers; the base is plain Ubuntu (the wheels bring CUDA), so the image asks the NVIDIA
    container toolkit for the GPUs and the driver's compute libraries itself."""
    runtime = _stage("Dockerfile.cuda", "runtime")
    assert "unmask-install --python-only --compiler" in runtime
    install = (DOCKER / "install.sh").read_text()
    assert 'pkgs+=(gcc libc6-dev python3-dev)' in install
    assert "NVIDIA_VISIBLE_DEVICES=all" in runtime and "NVIDIA_DRIVER_CAPABILITIES=compute,utility" in runtime
    assert not _arg_default("Dockerfile.cuda", "BASE_IMAGE").startswith("nvidia/cuda")
