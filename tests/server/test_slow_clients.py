"""Bounded buffers and timeouts (issue 41; docs/design.md#admission-and-limits) against real `unmask serve`
processes: a client that does not read its stream is aborted once the stream's send buffer passes its cap (the
server's RSS grows by < 100 MB and the batch slot is freed); clients that send half a request head are dropped
after the read timeout while the server keeps answering; at SIGTERM during an engine step longer than the grace
period every open stream still gets its ``server_shutdown`` event and ``[DONE]``, and the process exits 0."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from serving import (SERVE, SERVER_ENV, TESTS, assert_exits_cleanly, free_port, start_server, stop_server,
                     wait_healthy)

C = "/v1/completions"


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _post_head(port: int, body: dict) -> socket.socket:
    """A streamed POST whose response is never read (a small receive buffer: the server's sends block soon)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    data = json.dumps(body).encode()
    s.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
              % (C.encode(), len(data), data))
    return s


@pytest.mark.system
@pytest.mark.parametrize("cap", [pytest.param(65536, id="64KiB"), pytest.param(None, id="default-8MiB")])
def test_a_client_that_does_not_read_is_aborted_at_the_cap(tmp_path, cap):
    # a long read timeout: the buffer's cap, not the send timeout, ends the stream
    args = ["--max-batch-size", "16", "--read-timeout", "600"] + (["--stream-buffer-bytes", str(cap)] if cap else [])
    proc, base, log = start_server(tmp_path, *args)
    port = int(base.rsplit(":", 1)[1])
    try:
        before = rss_mb(proc.pid)
        body = {"model": "tiny-a2d", "prompt": "One two three", "max_tokens": 480, "ignore_eos": True, "n": 16,
                "cache": "none", "stream": True, "stream_options": {"include_denoising": True}}
        model = httpx.get(base + "/v1/models").json()["data"][0]["id"]
        s = _post_head(port, {**body, "model": model})
        deadline = time.time() + 120
        while "stream buffer" not in log.read_text():
            assert time.time() < deadline and proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.2)
        grown = rss_mb(proc.pid) - before
        for _ in range(50):  # the abort frees the batch slots
            if httpx.get(base + "/health").json()["running"] == 0:
                break
            time.sleep(0.1)
        assert httpx.get(base + "/health").json()["running"] == 0
        assert grown < 100, grown
        # the server still serves everyone else
        r = httpx.post(base + C, json={"model": model, "prompt": "Hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200, r.text
        s.close()
    finally:
        stop_server(proc)


def _half_heads(port: int, count: int) -> list[socket.socket]:
    socks = []
    for _ in range(count):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Len")  # never finished
        socks.append(s)
    return socks


def _closed(s: socket.socket) -> bool:
    s.settimeout(10)
    try:
        data = b""
        while chunk := s.recv(65536):
            data += chunk
        return data == b"" or b" 408 " in data.split(b"\r\n", 1)[0]
    except OSError:
        return True


@pytest.mark.parametrize("count", [pytest.param(40, id="40"), pytest.param(400, id="400",
                                                                         marks=pytest.mark.system)])
def test_slow_header_clients_are_dropped_after_the_timeout(tmp_path, count):
    proc, base, log = start_server(tmp_path, "--read-timeout", "1")
    port = int(base.rsplit(":", 1)[1])
    try:
        socks = _half_heads(port, count)
        t0 = time.time()
        r = httpx.get(base + "/health", timeout=5)  # served meanwhile
        assert r.status_code == 200
        half_body = socket.create_connection(("127.0.0.1", port), timeout=10)  # a body that never comes
        half_body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 100\r\n\r\n{\"model\"")
        assert all(_closed(s) for s in socks)
        assert _closed(half_body)
        assert time.time() - t0 < 8
        assert httpx.get(base + "/health", timeout=5).status_code == 200
        for s in socks:
            s.close()
        # a client that sends its request on time is not affected, also on a kept-alive connection
        with httpx.Client(base_url=base, timeout=10) as c:
            for _ in range(3):
                assert c.get("/health").status_code == 200
                time.sleep(0.6)
    finally:
        stop_server(proc)


SLOW_STEP = """
import os, time
from unmask.engine import scheduler
_step = scheduler.Scheduler.step
def step(self):
    if os.path.exists({flag!r}):
        os.remove({flag!r})
        time.sleep(8)  # one engine step longer than the 3 s grace period
    return _step(self)
scheduler.Scheduler.step = step
"""


@pytest.mark.system
def test_sigterm_during_a_long_step_ends_every_stream(tmp_path):
    flag = str(tmp_path / "slow-step")
    script = SLOW_STEP.format(flag=flag) + SERVE.format(tests=str(TESTS), ckpt=str(tmp_path / "tiny-a2d"),
                                                        block_size=4)
    port = free_port()
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as out:
        proc = subprocess.Popen([sys.executable, "-c", script, "--port", str(port)], stdout=out,
                                stderr=subprocess.STDOUT, env={**os.environ, **SERVER_ENV}, cwd=str(tmp_path))
    base = f"http://127.0.0.1:{port}"
    wait_healthy(proc, base, log_path)
    model = httpx.get(base + "/v1/models").json()["data"][0]["id"]
    tails: list[list[str]] = [[] for _ in range(3)]
    started = [threading.Event() for _ in range(3)]

    def stream(i: int) -> None:
        body = {"model": model, "prompt": f"Go {i}", "max_tokens": 480, "ignore_eos": True, "cache": "none",
                "stream": True}
        try:
            with httpx.stream("POST", base + C, json=body, timeout=60) as r:
                for line in r.iter_lines():
                    started[i].set()
                    if line.startswith("data: "):
                        tails[i].append(line[6:])
        except httpx.HTTPError as exc:  # reported by the assertions below
            tails[i].append(repr(exc))

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(3)]
    for t in threads:
        t.start()
    for e in started:
        assert e.wait(30)
    open(flag, "w").close()
    while os.path.exists(flag):  # the engine is now inside its 8 s step
        time.sleep(0.05)
    sent = time.time()
    proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(10)
    ended = time.time() - sent
    for tail in tails:
        assert tail[-1] == "[DONE]" and json.loads(tail[-2])["error"]["code"] == "server_shutdown", tail[-3:]
    assert ended < 3.0 + 1.5, ended  # within the grace period, though the step still runs
    assert_exits_cleanly(proc, log_path)
