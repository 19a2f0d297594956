"""A leak check (issue 22): mixed traffic through a real uvicorn server running in this process (so that live
objects and traced memory are those of the server), measured after a warm-up and again after more requests.

Traffic per round (``ROUND``): plain completions and chats, a streamed chat, ``n: 2``, a client that disconnects
in the middle of a stream, one that gives up before a plain answer, and rejected requests (invalid JSON, an
over-limit value, an unknown model, an unknown route). After each phase the engine is drained (no running or
waiting request), ``gc.collect()`` runs, and the live objects (``len(gc.get_objects())``) and the memory traced by
``tracemalloc`` are read.

Bounds (for ``MEASURED_ROUNDS`` rounds = 12 requests each): live objects may grow by at most ``OBJECT_BOUND``
(less than one object per request: a leak of any per-request object - a request, a stream, a task, a future -
adds at least one per request) and traced memory by at most ``MEMORY_BOUND_BYTES`` (a few KiB per request).

Sensitivity, checked by injecting a leak into the app (a middleware keeping one ``[path]`` list per request):
the test fails with "+96 live objects, grown types: list". ``gc.get_objects()`` sees only objects the garbage
collector tracks (containers); a leak of untracked objects (strings, ``object()``, dicts of atoms) shows only in
the traced memory, so it is caught from about 2.7 KB per request; the soak benchmark watches RSS for the rest.
"""
from __future__ import annotations

import contextlib
import gc
import json
import logging
import threading
import time
import tracemalloc
from collections import Counter

import httpx
import pytest

from serving import free_port, health_ok
from tiny import loaded
from unmask.engine.async_engine import AsyncEngine
from unmask.server.app import build_app

WARMUP_ROUNDS = 4
MEASURED_ROUNDS = 8
OBJECT_BOUND = 48           # live Python objects gained over MEASURED_ROUNDS * 12 = 96 requests
MEMORY_BOUND_BYTES = 256 * 1024  # traced memory gained over the same requests


@pytest.fixture(scope="module")
def server():
    import uvicorn

    engine = AsyncEngine(loaded(block_size=4))
    # the prefix cache (docs/design.md#prefix-reuse) grows until its bound, then holds steady: a bound the warm-up
    # fills, so that the measured rounds see a full store (one chunk evicted per chunk added)
    engine.engine.prefix_cache.max_tokens = 64
    app = build_app(engine, "m", shutdown_engine=True)
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False,
                                        lifespan="on"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while not health_ok(base):
        assert time.time() < deadline, "server did not start"
        time.sleep(0.1)
    yield base, engine
    srv.should_exit = True
    thread.join(timeout=30)


def one_round(client: httpx.Client, i: int) -> Counter:
    """Twelve requests of every kind; returns their outcomes (status codes / "disconnected")."""
    out = Counter()
    chat = {"model": "m", "messages": [{"role": "user", "content": f"Hello {i}"}], "max_tokens": 4, "seed": i}
    out[client.post("/v1/completions", json={"model": "m", "prompt": f"One two {i}", "max_tokens": 4}).status_code] += 1
    out[client.post("/v1/chat/completions", json=chat).status_code] += 1
    out[client.post("/v1/chat/completions", json={**chat, "n": 2}).status_code] += 1
    with client.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        out[r.status_code if lines[-1] == "data: [DONE]" else "stream-unfinished"] += 1
    with client.stream("POST", "/v1/completions", json={"model": "m", "prompt": "Hi", "max_tokens": 64,
                                                        "ignore_eos": True, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # leaving the block closes the connection mid-stream
        out["disconnected"] += 1
    try:
        client.post("/v1/completions", json={"model": "m", "prompt": "Hi", "max_tokens": 64, "ignore_eos": True},
                    timeout=0.02)
        out["answered-before-timeout"] += 1
    except httpx.TimeoutException:
        out["disconnected"] += 1
    out[client.post("/v1/chat/completions", content=b'{"model": ', headers={"Content-Type": "application/json"})
        .status_code] += 1
    out[client.post("/v1/chat/completions", json={**chat, "temperature": 9}).status_code] += 1
    out[client.post("/v1/chat/completions", json={**chat, "model": "other"}).status_code] += 1
    out[client.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 10 ** 6}).status_code] += 1
    out[client.get("/v1/nothing").status_code] += 1
    out[client.post("/v1/completions", json={"model": "m", "prompt": "Hi", "max_tokens": 2, "stream": True,
                                             "stream_options": {"include_denoising": True}}).status_code] += 1
    return out


def drained(base: str, timeout: float = 30) -> None:
    """Wait until the engine runs and queues nothing (aborted requests of disconnected clients are gone)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        h = httpx.get(f"{base}/health", timeout=5).json()
        text = httpx.get(f"{base}/metrics", timeout=5).text
        busy = [line for line in text.splitlines()
                if line.startswith(("unmask:num_requests_running{", "unmask:num_requests_waiting{"))
                and float(line.rsplit(" ", 1)[1]) > 0]
        if not busy and h.get("status", "ok") in ("ok", "healthy", "ready"):
            return
        time.sleep(0.05)
    pytest.fail(f"engine not idle after {timeout} s: {busy}")


def clear_abc_caches() -> None:
    """Empty every ABC's isinstance caches: ``isinstance(x, Mapping)`` on a new type adds a weak reference to the
    negative cache of each Mapping subclass (about 60 here), the first time a rare path (a disconnect) checks it;
    that is a bounded cache, not a leak, and it made the count depend on timing."""
    import abc

    seen, stack = set(), [object]
    while stack:
        cls = stack.pop()
        for sub in type.__subclasses__(cls) if cls is not type else ():
            if id(sub) not in seen:
                seen.add(id(sub))
                stack.append(sub)
                if isinstance(sub, abc.ABCMeta):
                    sub._abc_caches_clear()


def clear_shape_caches() -> None:
    """Empty the engine's caches keyed by canvas shape (a block's attention metadata and its chunks' slices, the
    layouts: LRU caches of at most 512, 4,096 and 4,096 entries, so bounded by design; which shapes a round reaches
    depends on when its disconnecting clients go away)."""
    from unmask.engine import layout, sequence

    sequence.block_metadata.cache_clear()
    sequence.chunk_metadata.cache_clear()
    layout._cached_layout.cache_clear()


def measure() -> tuple[int, int, dict]:
    """``(live objects, traced bytes, {type name: count})`` with the ABC caches and the shape caches emptied and
    garbage collected."""
    clear_abc_caches()
    clear_shape_caches()
    gc.collect()
    gc.collect()
    objects = gc.get_objects()
    n = len(objects)
    types: dict[str, int] = {}
    for o in objects:  # a plain loop: Counter(iterable) would refill an ABC cache (isinstance(..., Mapping))
        name = type(o).__name__
        types[name] = types.get(name, 0) + 1
    del objects, o
    clear_abc_caches()
    gc.collect()
    return n, tracemalloc.get_traced_memory()[0], types


@contextlib.contextmanager
def without_pytest_log_capture():
    """pytest's own log-capture handlers keep every record of the test phase (the report's "Captured log"
    section): with the server's per-request INFO line enabled by an earlier test, that is one LogRecord per request,
    held by pytest, not the server. They are detached while the test measures (pytest installs the call phase's
    handler after fixture setup, so this runs inside the test body); the server's own handlers stay."""
    root = logging.getLogger()
    held = [h for h in root.handlers if type(h).__module__.startswith("_pytest")]
    for h in held:
        root.removeHandler(h)
    try:
        yield
    finally:
        for h in held:
            root.addHandler(h)


def test_no_growth_in_live_objects_or_memory_over_mixed_traffic(server):
    base, engine = server
    tracemalloc.start(1)
    try:
        with without_pytest_log_capture(), httpx.Client(base_url=base, timeout=60) as client:
            outcomes = Counter()
            for i in range(WARMUP_ROUNDS):
                outcomes += one_round(client, i)
            drained(base)
            objs0, mem0, types0 = measure()
            for i in range(MEASURED_ROUNDS):
                outcomes += one_round(client, 1000 + i)
            drained(base)
            objs1, mem1, types1 = measure()
    finally:
        tracemalloc.stop()
    grown = {k: v - types0.get(k, 0) for k, v in types1.items() if v - types0.get(k, 0) > 2}
    report = (f"live objects {objs0} -> {objs1} ({objs1 - objs0:+d}), traced memory {mem0} -> {mem1} bytes "
              f"({mem1 - mem0:+d}) over {12 * MEASURED_ROUNDS} requests; grown types: "
              f"{json.dumps(dict(sorted(grown.items(), key=lambda kv: -kv[1])[:10]))}")
    print(report, dict(outcomes))
    rounds = WARMUP_ROUNDS + MEASURED_ROUNDS
    assert outcomes[200] == 5 * rounds, outcomes
    assert outcomes["disconnected"] + outcomes["answered-before-timeout"] == 2 * rounds, outcomes
    assert outcomes[400] + outcomes[404] == 5 * rounds, outcomes  # every bad request rejected, none a 500
    assert objs1 - objs0 <= OBJECT_BOUND, report
    assert mem1 - mem0 <= MEMORY_BOUND_BYTES, report
