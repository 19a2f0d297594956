"""A tiny random-model `unmask serve` for the client tests (tests/serving.py starts it)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from serving import ROOT, TESTS, free_port, require, start_server as _start, stop_server  # noqa: F401

KEY = "sk-test-clients"
MODEL = "tiny"


def start_server(tmp: Path, *extra: str, python: str = sys.executable, api_key: str | None = KEY):
    """Start `unmask serve` on a tiny checkpoint; returns (process, base URL, log path)."""
    args = ["--served-model-name", MODEL, "--max-batch-size", "4", "--default-max-tokens", "16", *extra]
    if api_key:
        args += ["--api-key", api_key]
    return _start(tmp, *args, python=python)


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    proc, base, log_path = start_server(tmp_path_factory.mktemp("clients-server"))
    yield {"url": base, "v1": base + "/v1", "key": KEY, "model": MODEL, "log": log_path, "proc": proc}
    stop_server(proc)


def running(base: str) -> float:
    """The server's `unmask:num_requests_running` gauge."""
    text = httpx.get(base + "/metrics", timeout=5).text
    for line in text.splitlines():
        if line.startswith("unmask:num_requests_running"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no unmask:num_requests_running in /metrics")


def install_wheel(tmp_path: Path) -> tuple[Path, str, Path]:
    """Build the wheel (``pip wheel --no-deps``) and install it alone (no dependencies, not editable) into a fresh
    venv without pip: ``(venv python, its site-packages, the wheel)``. The dependencies are this interpreter's
    site-packages, which a check appends to ``sys.path`` (its ``.pth`` files, the editable finder's among them, are
    not processed)."""
    import setuptools

    wheel_dir, venv = tmp_path / "wheel", tmp_path / "venv"
    isolation = [] if int(setuptools.__version__.split(".")[0]) < 77 else ["--no-build-isolation"]
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", *isolation, "-q",
                    "-w", str(wheel_dir)], check=True, timeout=300, cwd=str(tmp_path))
    wheel = next(wheel_dir.glob("unmask-*.whl"))
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", site, str(wheel)],
                   check=True, timeout=300)
    return py, site, wheel
