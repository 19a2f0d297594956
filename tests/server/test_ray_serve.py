"""``unmask serve --ray`` on a local multi-node Ray cluster (system; docs/design.md#scale-out, docs/scale.md).

One module fixture: a Ray cluster of a head and two worker nodes (``ray.cluster_utils.Cluster``, 2 logical CPUs
each), and the one command ``unmask serve MODEL --ray --ray-address ...`` (2..3 engine replicas of the tiny a2d
model, autoscaling delays of seconds) against it; a plain ``unmask serve`` of the same checkpoint for the bodies.

* greedy completions and chats, streamed and not, have the plain server's bodies (ids and timestamps aside);
* the two replicas are on two nodes;
* multi-turn chats go back to the replica that served their earlier turns: every later turn loads cached tokens,
  the replicas' own ``/metrics`` count exactly those hits, and the chats are split between the replicas within
  the stated imbalance (each takes 2 to 4 of 6);
* killing a replica mid-stream ends its client's stream with an error event and ``[DONE]``, a stream on the other
  replica finishes normally, and new requests are served;
* a queue adds a third replica; idle, it is removed again.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from serving import SERVER_ENV, free_port, start_serve, stop_server, wait_healthy

pytestmark = pytest.mark.system

MODEL = "tiny-a2d"
CHATS, TURNS = 6, 3
#: the stated load bound: each replica takes between these many of the CHATS conversations
CHATS_PER_REPLICA = (2, 4)


def _ray():
    if os.environ.get("CI", "").lower() == "true":
        import ray  # noqa: F401 - CI installs it (.ci/pip-packages): a missing Ray is a failure there
    return pytest.importorskip("ray")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    ray = _ray()
    from ray.cluster_utils import Cluster

    from tiny import loaded
    from unmask.engine.checkpoint import write_checkpoint

    tmp = tmp_path_factory.mktemp("ray")
    ckpt = tmp / MODEL
    m = loaded(block_size=4)
    write_checkpoint(str(ckpt), m.model, m.tokenizer, m.dllm)
    del m
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    for _ in range(2):
        c.add_node(num_cpus=2)
    ray.init(address=c.address, logging_level="WARNING")
    yield c, ckpt, tmp
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="module")
def served(cluster):
    c, ckpt, tmp = cluster
    port = free_port()
    log_path = tmp / "ray-serve.log"
    common = ["--max-batch-size", "4", "--threads", "1"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "unmask.cli.main", "serve", str(ckpt), *common, "--ray", "--ray-address",
             c.address, "--ray-min-replicas", "2", "--ray-max-replicas", "3", "--ray-upscale-delay", "1",
             "--ray-downscale-delay", "4", "--ray-max-replicas-per-node", "2", "--port", str(port)],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **SERVER_ENV})
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, base, log_path, timeout=300)
        _wait(lambda: _replica_count() == 2, 120, "2 engine replicas running")
        plain_tmp = tmp / "plain"
        plain_tmp.mkdir()
        plain, plain_base, _ = start_serve(plain_tmp, str(ckpt), *common)
        try:
            yield base, plain_base
        finally:
            stop_server(plain)
    finally:
        stop_server(proc, timeout=60)
        if proc.poll() is None:
            proc.kill()


def _replica_count() -> int:
    from ray import serve

    app = serve.status().applications.get("unmask")
    if app is None or "EngineReplica" not in app.deployments:
        return 0
    return app.deployments["EngineReplica"].replica_states.get("RUNNING", 0)


def _wait(cond, timeout: float, what: str) -> None:
    end = time.time() + timeout
    while not cond():
        if time.time() > end:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.5)


def _strip(body: dict) -> dict:
    return {k: v for k, v in body.items() if k not in ("id", "created")}


def _sse(base: str, path: str, body: dict) -> list:
    with httpx.stream("POST", base + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        return [line[6:] for line in r.iter_lines() if line.startswith("data: ")]


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(f"unmask:{name}{{"))


def _replica_metrics(base: str) -> dict:
    return {rid: httpx.get(where["metrics"], timeout=10).text
            for rid, where in httpx.get(base + "/replicas", timeout=10).json().items()}


def test_bodies_equal_the_plain_server(served):
    base, plain = served
    requests = [("/v1/completions", {"prompt": "The quick brown fox", "max_tokens": 12}),
                ("/v1/completions", {"prompt": ["One two three", "Paris is"], "max_tokens": 6, "n": 2}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "What is the capital?"}],
                                          "max_tokens": 10, "logprobs": True, "top_logprobs": 2})]
    for path, body in requests:
        body = {"model": MODEL, "temperature": 0, **body}
        a, b = httpx.post(base + path, json=body, timeout=120), httpx.post(plain + path, json=body, timeout=120)
        assert a.status_code == b.status_code == 200, (a.text, b.text)
        assert _strip(a.json()) == _strip(b.json())
        if "n" not in body:
            streamed = [_sse(u, path, {**body, "stream_options": {"include_usage": True}}) for u in (base, plain)]
            assert streamed[0][-1] == streamed[1][-1] == "[DONE]"
            chunks = [[_strip(json.loads(d)) for d in s[:-1]] for s in streamed]
            assert chunks[0] == chunks[1] and len(chunks[0]) > 2
    bad = {"model": MODEL, "prompt": "x", "max_tokens": 100000}  # the replica's ParamError, as the plain server's
    a, b = httpx.post(base + "/v1/completions", json=bad), httpx.post(plain + "/v1/completions", json=bad)
    assert a.status_code == b.status_code == 400 and a.json() == b.json()


def test_replicas_are_spread_over_nodes(served):
    base, _ = served
    for i in range(4):  # idle replicas are taken in turn: both get a request and report where they are
        httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": f"hello {i}", "max_tokens": 2},
                   timeout=60).raise_for_status()
    nodes = [w["node"] for w in httpx.get(base + "/replicas").json().values()]
    assert len(nodes) == 2 and len(set(nodes)) == 2, nodes


def _chat_turn(base: str, messages: list) -> tuple[str, int]:
    r = httpx.post(base + "/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 8,
                                                        "temperature": 0}, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["message"]["content"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_multi_turn_chats_return_to_their_replica(served):
    base, _ = served
    before = _replica_metrics(base)
    hits0 = {rid: _metric(t, "prefix_cache_hits_total") for rid, t in before.items()}
    queries0 = {rid: _metric(t, "prefix_cache_queries_total") for rid, t in before.items()}
    chats = [[{"role": "user", "content": f"{i} " + "the quick brown fox jumps over the lazy dog " * 3}]
             for i in range(CHATS)]
    cached = [[] for _ in range(CHATS)]
    first_turns = {}
    with ThreadPoolExecutor(CHATS) as pool:  # every chat's turn at once: the replicas are loaded together
        for turn in range(TURNS):
            for i, (answer, hit) in enumerate(pool.map(lambda msgs: _chat_turn(base, msgs), chats)):
                cached[i].append(hit)
                chats[i] += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And then?"}]
            if turn == 0:  # first turns of one length: the prompt tokens a replica looked up count its chats
                first_turns = {rid: _metric(t, "prefix_cache_queries_total") - queries0.get(rid, 0)
                               for rid, t in _replica_metrics(base).items()}
    assert all(c[0] == 0 for c in cached), cached  # distinct first turns: nothing to reuse
    assert all(hit >= 16 for c in cached for hit in c[1:]), cached  # every later turn found its earlier turns' KV
    after = _replica_metrics(base)
    hits = {rid: _metric(t, "prefix_cache_hits_total") - hits0.get(rid, 0) for rid, t in after.items()}
    assert sum(hits.values()) == sum(sum(c) for c in cached)  # the replicas' own counters say the same
    per_chat = sum(first_turns.values()) / CHATS
    split = sorted(round(q / per_chat, 3) for q in first_turns.values())
    lo, hi = CHATS_PER_REPLICA
    assert len(split) == 2 and all(lo <= n <= hi and n == int(n) for n in split), split  # the stated imbalance
    assert all(h > 0 for h in hits.values()), hits  # and both replicas serve returning turns


def _replica_running(base: str) -> dict:
    return {rid: _metric(t, "num_requests_running") for rid, t in _replica_metrics(base).items()}


def test_a_killed_replica_ends_its_streams_with_an_error_and_others_keep_serving(served):
    import ray

    base, _ = served
    results: dict = {}

    def stream(key: str, prompt: str):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 400, "temperature": 0, "stream": True}
        lines = []
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line[6:])
                    if len(lines) == 1:
                        results.setdefault("started", []).append(key)
        results[key] = lines

    threads = [threading.Thread(target=stream, args=(k, p)) for k, p in (("a", "One two three four"),
                                                                          ("b", "Diffusion language models"))]
    for t in threads:
        t.start()
    _wait(lambda: len(results.get("started", [])) == 2 and sum(_replica_running(base).values()) == 2, 60,
          "two streams running")
    running = _replica_running(base)
    assert sorted(running.values()) == [1, 1], running  # one on each replica (idle replicas are taken in turn)
    victim = next(iter(running))
    ray.kill(ray.get_actor(f"SERVE_REPLICA::unmask#EngineReplica#{victim}", namespace="serve"), no_restart=True)
    for t in threads:
        t.join(120)
    ended = {k: (results[k][-1], json.loads(results[k][-2])) for k in ("a", "b")}
    errors = [k for k, (_, last) in ended.items() if "error" in last]
    assert len(errors) == 1, ended  # the killed replica's client: an error event ...
    assert all(done == "[DONE]" for done, _ in ended.values())  # ... and [DONE]; the other finished normally
    other = next(k for k in ended if k not in errors)
    assert ended[other][1]["choices"][0]["finish_reason"] == "length"
    for i in range(4):  # new requests are served (the dead replica left the router's set)
        r = httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": f"after {i}", "max_tokens": 4},
                       timeout=120)
        assert r.status_code == 200, r.text
    _wait(lambda: _replica_count() == 2, 120, "Ray Serve to replace the killed replica")


def test_a_queue_adds_a_replica_and_idleness_removes_it(served):
    base, _ = served
    stop = threading.Event()

    def load():
        body = {"model": MODEL, "prompt": "Count: one two three", "max_tokens": 256, "temperature": 0}
        while not stop.is_set():
            httpx.post(base + "/v1/completions", json=body, timeout=120)

    workers = [threading.Thread(target=load) for _ in range(16)]  # 16 in flight over 2 replicas of batch 4
    for t in workers:
        t.start()
    try:
        _wait(lambda: _replica_count() == 3, 120, "a third replica under a queue")
    finally:
        stop.set()
        for t in workers:
            t.join(120)
    _wait(lambda: _replica_count() == 2, 120, "the idle third replica to be removed")
    r = httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": "still here", "max_tokens": 4})
    assert r.status_code == 200, r.text

