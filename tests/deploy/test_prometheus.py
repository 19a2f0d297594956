"""A real Prometheus (Debian's package) scrapes a running tiny ``unmask serve`` with the shipped scrape config
(docker/prometheus/prometheus.yml, pointed at loopback); PromQL through Prometheus' HTTP API finds the
generation-token rate above 0 and the tokens-per-forward histogram populated."""
from __future__ import annotations

import subprocess
import time

import httpx
import pytest
import yaml

from helpers import DOCKER
from serving import free_port, require, start_server, stop_server

pytestmark = pytest.mark.system


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    prometheus = require("prometheus")
    tmp = tmp_path_factory.mktemp("prometheus")
    proc, base, _ = start_server(tmp, "--served-model-name", "tiny")
    cfg = yaml.safe_load((DOCKER / "prometheus" / "prometheus.yml").read_text())
    cfg["global"]["scrape_interval"] = cfg["global"]["evaluation_interval"] = "1s"
    cfg["scrape_configs"][0]["static_configs"] = [{"targets": [base.removeprefix("http://")]}]
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    port = free_port()
    log = open(tmp / "prometheus.log", "w")
    prom = subprocess.Popen([prometheus, f"--config.file={tmp / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(120):
            try:
                if httpx.get(url + "/-/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert prom.poll() is None, (tmp / "prometheus.log").read_text()[-2000:]
            time.sleep(0.5)
        yield {"server": base, "prometheus": url}
    finally:
        prom.terminate()
        prom.wait(timeout=20)
        log.close()
        stop_server(proc)


def query(url: str, promql: str) -> list[dict]:
    r = httpx.get(url + "/api/v1/query", params={"query": promql}, timeout=10).json()
    assert r["status"] == "success", r
    return r["data"]["result"]


def poll(url: str, promql: str, at_least: float = 0.0, timeout: float = 60.0) -> float:
    """The first value of ``promql`` (a one-series instant vector) above 0 and at least ``at_least``, polling until
    ``timeout``."""
    deadline = time.time() + timeout
    while True:
        result = query(url, promql)
        if result and float(result[0]["value"][1]) > 0 and float(result[0]["value"][1]) >= at_least:
            return float(result[0]["value"][1])
        assert time.time() < deadline, f"{promql}: {result}"
        time.sleep(1)


def test_prometheus_scrapes_the_server_and_promql_sees_the_tokens(stack):
    url = stack["prometheus"]
    poll(url, 'up{job="unmask"}')  # the target is scraped
    # a few requests, one long enough (480 steps without a KV cache) to span several 1 s scrapes
    body = {"model": "tiny", "prompt": "One two", "max_tokens": 480, "ignore_eos": True, "seed": 0, "cache": "none"}
    for i in range(3):
        r = httpx.post(stack["server"] + "/v1/completions", json={**body, "max_tokens": 16, "seed": i}, timeout=60)
        assert r.status_code == 200, r.text
    r = httpx.post(stack["server"] + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    rate = poll(url, "sum(rate(unmask:generation_tokens_total[30s]))")
    assert rate > 0
    assert poll(url, "sum(unmask:tokens_per_forward_count)", at_least=4) == 4  # one observation per choice
    tpf = poll(url, "histogram_quantile(0.5, sum by (le) (rate(unmask:tokens_per_forward_bucket[1m])))")
    assert 0 < tpf <= 32  # a real quantile from populated buckets, not NaN
    total = poll(url, "sum(unmask:generation_tokens_total)", at_least=3 * 16 + 480)
    assert total == 3 * 16 + 480  # the scraped counter is the usage the server reported
