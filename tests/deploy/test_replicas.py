"""Two ``unmask serve`` replicas behind nginx (Debian's package) on loopback, with the shipped proxy rules
(docker/nginx/unmask.conf, its upstream pointed at the two replicas): streaming passes through unbuffered, and with
one replica killed mid-run the next requests are served by the other."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time

import httpx
import pytest

from helpers import DOCKER
from serving import free_port, require, start_server, stop_server

pytestmark = pytest.mark.system
LONG = {"model": "tiny", "prompt": "One two", "max_tokens": 480, "ignore_eos": True, "seed": 0, "cache": "none",
        "stream": True, "stream_options": {"include_denoising": True}}


def nginx_conf(tmp, port: int, backends: list[str]) -> str:
    """A main nginx.conf around the shipped server block: upstream servers replaced by ``backends``, listening on
    loopback ``port``, every path under ``tmp``."""
    site = (DOCKER / "nginx" / "unmask.conf").read_text()
    servers = "".join(f"    server {b} max_fails=1 fail_timeout=10s;\n" for b in backends)
    site, n = re.subn(r"    server unmask:8000[^\n]*\n", servers, site)
    assert n == 1, "docker/nginx/unmask.conf: expected one `server unmask:8000 ...;` line"
    site, n = re.subn(r"listen 8000;", f"listen 127.0.0.1:{port};", site)
    assert n == 1
    temp = "".join(f"    {k}_temp_path {tmp}/{k};\n" for k in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    user = "user root;\n" if os.geteuid() == 0 else ""
    return (f"{user}worker_processes 1;\npid {tmp}/nginx.pid;\nerror_log {tmp}/error.log info;\n"
            f"events {{ worker_connections 256; }}\nhttp {{\n    access_log {tmp}/access.log;\n{temp}{site}}}\n")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    nginx = require("nginx")
    tmp = tmp_path_factory.mktemp("replicas")
    replicas = []
    try:
        for i in range(2):
            d = tmp / f"replica{i}"
            d.mkdir()
            replicas.append(start_server(d, "--served-model-name", "tiny"))
        port = free_port()
        conf = tmp / "nginx.conf"
        conf.write_text(nginx_conf(tmp, port, [b.removeprefix("http://") for _, b, _ in replicas]))
        check = subprocess.run([nginx, "-t", "-c", str(conf), "-p", str(tmp)], capture_output=True, text=True)
        assert check.returncode == 0, check.stderr
        proxy = subprocess.Popen([nginx, "-c", str(conf), "-p", str(tmp), "-g", "daemon off;"],
                                 stdout=subprocess.DEVNULL, stderr=open(tmp / "nginx.out", "w"))
        url = f"http://127.0.0.1:{port}"
        for _ in range(50):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        yield {"url": url, "replicas": replicas, "tmp": tmp}
        proxy.send_signal(signal.SIGQUIT)
        proxy.wait(timeout=20)
    finally:
        for proc, _, _ in replicas:
            if proc.poll() is None:
                stop_server(proc)


def running(replicas) -> list[int]:
    """Requests running on each replica that is still up (-1 for one that is down)."""
    out = []
    for proc, base, _ in replicas:
        try:
            out.append(httpx.get(base + "/health", timeout=5).json()["running"])
        except httpx.HTTPError:
            out.append(-1)
    return out


def test_streaming_passes_through_unbuffered(cluster):
    first_chunk_at, busy = None, None
    with httpx.stream("POST", cluster["url"] + "/v1/completions", json=LONG, timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                first_chunk_at = time.time()
                busy = running(cluster["replicas"])  # the request is still decoding on its replica
                break
        rest = [ln for ln in lines if ln.startswith("data: ")]
    ended_at = time.time()
    assert first_chunk_at is not None and sum(busy) == 1, busy
    assert rest[-1] == "data: [DONE]" and len(rest) > 400  # every step's chunk came through
    assert ended_at - first_chunk_at > 0.5  # the first chunk arrived well before the stream ended


def test_a_killed_replica_and_the_next_requests_go_to_the_other(cluster):
    replicas = cluster["replicas"]
    # a long stream in flight on one replica
    started = threading.Event()
    outcome: dict = {}

    def stream():
        try:
            with httpx.stream("POST", cluster["url"] + "/v1/completions", json=LONG, timeout=120) as r:
                for line in r.iter_lines():
                    started.set()
                    if line == "data: [DONE]":
                        outcome["done"] = True
        except httpx.HTTPError as exc:
            outcome["error"] = repr(exc)
        outcome.setdefault("done", False)

    t = threading.Thread(target=stream, daemon=True)
    t.start()
    assert started.wait(60)
    busy = running(replicas)
    assert sorted(busy) == [0, 1], busy
    victim = busy.index(1)
    replicas[victim][0].kill()  # SIGKILL mid-run: no graceful shutdown
    replicas[victim][0].wait(timeout=10)
    t.join(timeout=60)
    assert outcome.get("done") is False  # the cut stream does not pretend to have finished
    # the next requests are all answered, by the surviving replica
    survivor = replicas[1 - victim][1]
    before = _completed(survivor)
    for i in range(6):
        r = httpx.post(cluster["url"] + "/v1/completions",
                       json={"model": "tiny", "prompt": "Hi", "max_tokens": 4, "seed": i}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] > 0
    assert _completed(survivor) - before == 6


def _completed(base: str) -> float:
    """Finished choices a replica has counted (``unmask:request_success_total`` over finish reasons)."""
    total = 0.0
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        if line.startswith("unmask:request_success_total{"):
            total += float(line.rsplit(" ", 1)[1])
    return total
