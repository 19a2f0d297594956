"""A tiny random-model `unmask serve` for the client tests (the approach of tests/server/test_server.py), and the
`system` marker's selection: system tests (tmux, Chromium, wheel build) run only with ``-m system``; under
``CI=true`` a missing tool is a failure, never a skip."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

KEY = "sk-test-clients"
MODEL = "tiny"
TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent

SERVE = """
import sys
sys.path.insert(0, {tests!r})
from tiny import loaded
from unmask.engine.checkpoint import write_checkpoint
m = loaded(block_size=4)
write_checkpoint({ckpt!r}, m.model, m.tokenizer, m.dllm)
del m
from unmask.cli.main import main
sys.exit(main(["serve", {ckpt!r}] + sys.argv[1:]))
"""


def pytest_collection_modifyitems(config, items):
    if "system" in (config.getoption("markexpr") or ""):
        return
    keep, drop = [], []
    for item in items:
        (drop if item.get_closest_marker("system") and "tests/clients" in str(item.fspath) else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def require(binary: str) -> str:
    """The path of ``binary``; skip when missing, except under CI=true where it is a failure."""
    path = shutil.which(binary)
    if path is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{binary} is not installed (CI: .ci/run installs it with apt-get)")
        pytest.skip(f"{binary} is not installed")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(tmp: Path, *extra: str, python: str = sys.executable, api_key: str | None = KEY):
    """Start `unmask serve` on a tiny checkpoint; returns (process, base URL, log path)."""
    port = free_port()
    log_path = tmp / "server.log"
    ckpt = str(tmp / "tiny-a2d")
    script = SERVE.format(tests=str(TESTS), ckpt=ckpt)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONUNBUFFERED": "1"}
    args = ["--port", str(port), "--served-model-name", MODEL, "--max-batch-size", "4", "--default-max-tokens",
            "16", *extra]
    if api_key:
        args += ["--api-key", api_key]
    with open(log_path, "w") as log:
        proc = subprocess.Popen([python, "-c", script, *args], stdout=log, stderr=subprocess.STDOUT, env=env,
                                cwd=str(tmp))
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 150
    while True:
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            pytest.fail(f"server did not start:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.2)
    return proc, base, log_path


def stop_server(proc) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()


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
