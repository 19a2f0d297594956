"""The serving metrics of issue 40 in-process: 4xx refusals by status and reason, the KV-cache usage gauges (the
running batch's share of the KV budget, the prefix store's share) and the inter-token latency of streams by tokens
per chunk."""
from __future__ import annotations

import json
import threading

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from tiny import loaded
from unmask.engine.async_engine import AsyncEngine
from unmask.server.app import build_app
from unmask.server.metrics import Metrics, tokens_label

KEY = "k-metrics"
AUTH = {"Authorization": f"Bearer {KEY}"}
BUDGET = 2048


@pytest.fixture(scope="module")
def served():
    engine = AsyncEngine(loaded(block_size=4), max_cached_tokens=BUDGET)
    with TestClient(build_app(engine, "m", api_key=KEY), headers=AUTH) as c:
        yield c, engine


def samples(client) -> dict:
    """``{(name, labels without model_name): value}`` of /metrics."""
    out = {}
    for fam in text_string_to_metric_families(client.get("/metrics").text):
        for s in fam.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


def refused(client, status: str, reason: str) -> float:
    return samples(client).get(("unmask:request_refused_total", (("reason", reason), ("status", status))), 0.0)


@pytest.mark.parametrize("status,reason,request_kw", [
    ("400", "unknown_field", {"json": {"model": "m", "prompt": "Hi", "bogus": 1}}),
    ("400", "invalid_value", {"json": {"model": "m", "prompt": "Hi", "max_tokens": 0}}),
    ("401", "invalid_api_key", {"json": {"model": "m", "prompt": "Hi"}, "headers": {"Authorization": "Bearer no"}}),
    ("404", "model_not_found", {"json": {"model": "other", "prompt": "Hi"}}),
    ("413", "request_too_large", {"json": {"model": "m", "prompt": "x" * (5 * 1024 * 1024)}}),
    ("415", "unsupported_media_type", {"content": b"{}", "headers": {"Content-Type": "text/plain"}}),
])
def test_every_4xx_is_counted_by_status_and_reason(served, status, reason, request_kw):
    client, _ = served
    before = refused(client, status, reason)
    r = client.post("/v1/completions", **request_kw)
    assert r.status_code == int(status) and r.json()["error"]["code"] == reason, r.text
    assert refused(client, status, reason) == before + 1


def test_an_answered_request_is_no_refusal(served):
    client, _ = served
    total = lambda: sum(v for (n, _), v in samples(client).items() if n == "unmask:request_refused_total")  # noqa: E731
    before = total()
    assert client.post("/v1/completions", json={"model": "m", "prompt": "Hi", "max_tokens": 2}).status_code == 200
    assert client.get("/v1/nope").status_code == 404 and total() == before + 1  # an unknown route is one


def test_kv_usage_is_the_running_share_of_the_budget_and_the_prefix_stores_separately(served):
    client, engine = served
    prompt = "One two three four five six seven eight nine ten. " * 4  # several 16-token chunks
    body = {"model": "m", "prompt": prompt, "max_tokens": 64, "ignore_eos": True, "stream": True, "seed": 0,
            "cache": "none", "steps": 64}
    seen, done = [], threading.Event()

    def scrape():
        while not done.is_set():
            seen.append(samples(client)[("unmask:kv_cache_usage_perc", ())])
            usage = engine.kv_usage()
            if usage["reserved"]:
                seen.append(usage["reserved"] / BUDGET)
            done.wait(0.01)

    t = threading.Thread(target=scrape)
    t.start()
    try:
        with client.stream("POST", "/v1/completions", json=body) as r:
            for _ in r.iter_lines():
                pass
    finally:
        done.set()
        t.join()
    assert max(seen) > 0, seen
    after = samples(client)
    assert after[("unmask:kv_cache_usage_perc", ())] == 0.0  # nothing running
    # a request with the exact cache leaves its prompt's committed chunks in the prefix store
    client.post("/v1/completions", json={**body, "stream": False, "cache": "auto", "max_tokens": 4, "steps": 4})
    usage = engine.kv_usage()
    assert usage["capacity"] == BUDGET and usage["prefix"] > 0
    assert samples(client)[("unmask:prefix_cache_usage_perc", ())] == pytest.approx(usage["prefix"] / BUDGET)


def test_without_a_budget_the_capacity_is_the_batch_times_the_context():
    class Fake:
        num_running = num_waiting = prefix_cache_queries = prefix_cache_hits = 0

        def kv_usage(self):
            return {"reserved": 300, "prefix": 100, "capacity": 400}

    text = Metrics("m", Fake()).render()[0].decode()
    assert 'unmask:kv_cache_usage_perc{model_name="m"} 0.75' in text
    assert 'unmask:prefix_cache_usage_perc{model_name="m"} 0.25' in text
    engine = AsyncEngine(loaded(block_size=4), max_batch_size=3)
    try:
        assert engine.kv_usage() == {"reserved": 0, "prefix": 0, "capacity": 3 * 512}
    finally:
        engine.shutdown()


def test_inter_token_latency_is_observed_between_content_chunks(served):
    """One observation per content chunk after the first, labelled by the tokens the later chunk carries (a chunk
    may carry several steps' tokens when text was held back, e.g. a character cut between byte tokens)."""
    client, _ = served

    def by_label():
        return {dict(lb).get("tokens_per_chunk"): v for (n, lb), v in samples(client).items()
                if n == "unmask:inter_token_latency_seconds_count"}

    before = by_label()
    body = {"model": "m", "prompt": "Hi", "max_tokens": 12, "ignore_eos": True, "stream": True, "seed": 0,
            "steps": 6, "remasking": "left_to_right", "logprobs": 1}
    tokens = []
    with client.stream("POST", "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                if choice["text"]:
                    tokens.append(len(choice["logprobs"]["tokens"]))
    after = by_label()
    grew = {label: after[label] - before.get(label, 0) for label in after if after[label] > before.get(label, 0)}
    assert len(tokens) >= 2 and sum(grew.values()) == len(tokens) - 1
    # 12 tokens, 2 revealed a step left to right: a chunk carries 2, or more after text held back (at most 12)
    assert set(grew) <= {"1", "2", "3-4", "5-8", "9-16"} and "17+" not in grew


def test_tokens_per_chunk_labels():
    assert [tokens_label(n) for n in (0, 1, 2, 3, 4, 5, 8, 9, 16, 17, 500)] == [
        "1", "1", "2", "3-4", "3-4", "5-8", "5-8", "9-16", "9-16", "17+", "17+"]
