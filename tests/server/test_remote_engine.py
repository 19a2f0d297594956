"""The Ray Serve ingress's engine without Ray (docs/design.md#scale-out): the unchanged app over a
:class:`RemoteEngine` whose handle runs the replica's end of the wire (``replica_call``) in-process on a tiny
engine. Bodies equal the app over the engine itself; the replica's refusals are the same 400/429; a replica that
dies mid-stream gives an error event and ``[DONE]`` (a 500 when not streamed); a client that leaves aborts the
replica's engine requests. The real cluster: tests/server/test_ray_serve.py (system)."""
from __future__ import annotations

import asyncio
import json
import time

import pytest
from fastapi.testclient import TestClient

from tiny import loaded
from unmask.engine.async_engine import AsyncEngine
from unmask.server.app import build_app
from unmask.server.remote_engine import RemoteEngine, replica_call

WHERE = {"replica": "r0", "node": "n0", "metrics": "http://n0/metrics"}


class _Call:
    """What ``handle.options(stream=True).generate.remote(...)`` returns: an async iterator with ``cancel``."""

    def __init__(self, gen, die_after: int | None):
        self.gen, self.die_after, self.items = gen, die_after, 0

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.die_after is not None and self.items > self.die_after:
            await self.gen.aclose()  # the replica's generator ends with it (its engine requests aborted)
            raise RuntimeError("The actor died unexpectedly before finishing this task.")
        self.items += 1
        return await self.gen.__anext__()

    def cancel(self):
        asyncio.ensure_future(self.gen.aclose())


class FakeHandle:
    """A deployment handle whose one replica is ``engine`` in this process (``die_after``: items before it dies)."""

    def __init__(self, engine: AsyncEngine, die_after: int | None = None):
        self.engine, self.die_after = engine, die_after
        self.keys: list = []

    def options(self, **_):
        return self

    @property
    def generate(self):
        outer = self

        class Method:
            def remote(self, *args, route_keys=None, **kw):
                outer.keys.append(route_keys)
                return _Call(replica_call(outer.engine, WHERE, *args, **kw), outer.die_after)
        return Method()

    @property
    def score(self):
        engine = self.engine

        class Method:
            async def remote(self, ids, top_k, samples, seed, route_keys=None):  # noqa: ARG002
                try:
                    return ("ok", await engine.score(ids, top_k, samples, seed))
                except Exception as exc:
                    return ("refused", exc)
        return Method()


def _info(engine) -> dict:
    return {"tokenizer": engine.tokenizer, "dllm": engine.dllm, "max_context": engine.max_context,
            "max_queue": engine.max_queue}


@pytest.fixture(scope="module")
def engines():
    local, remote = AsyncEngine(loaded(block_size=4)), AsyncEngine(loaded(block_size=4))
    yield local, remote
    local.shutdown()
    remote.shutdown()


def _strip(body: dict) -> dict:
    return {k: v for k, v in body.items() if k not in ("id", "created")}


def _sse(client, path: str, body: dict) -> list[str]:
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        return [line[6:] for line in r.iter_lines() if line.startswith("data: ")]


def test_bodies_and_refusals_equal_the_local_engines(engines):
    local, remote = engines
    handle = FakeHandle(remote)
    with TestClient(build_app(local, "m", shutdown_engine=False)) as a, \
            TestClient(build_app(RemoteEngine(handle, _info(remote)), "m", shutdown_engine=False)) as b:
        for path, body in (("/v1/completions", {"prompt": ["One two three", "Paris is"], "max_tokens": 6, "n": 2}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi " * 20}],
                                                     "max_tokens": 8, "logprobs": True, "top_logprobs": 2})):
            body = {"model": "m", "temperature": 0, **body}
            ra, rb = a.post(path, json=body), b.post(path, json=body)
            assert ra.status_code == rb.status_code == 200, rb.text
            assert _strip(ra.json()) == _strip(rb.json())
        chat = {"model": "m", "temperature": 0, "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}
        sa, sb = _sse(a, "/v1/chat/completions", chat), _sse(b, "/v1/chat/completions", chat)
        assert [_strip(json.loads(x)) for x in sa[:-1]] == [_strip(json.loads(x)) for x in sb[:-1]] and sb[-1] == "[DONE]"
        bad = {"model": "m", "prompt": "x", "max_tokens": 100000}  # the replica's ParamError, raised at the ingress
        ra, rb = a.post("/v1/completions", json=bad), b.post("/v1/completions", json=bad)
        assert ra.status_code == rb.status_code == 400 and ra.json() == rb.json()
        score = {"model": "m", "prompt": "One two three", "max_tokens": 0, "echo": True, "logprobs": 1}
        ra, rb = a.post("/v1/completions", json=score), b.post("/v1/completions", json=score)
        assert ra.status_code == rb.status_code and _strip(ra.json()) == _strip(rb.json())
        assert b.get("/health").json()["replicas"] == 1
        assert "unmask:num_requests_waiting" not in b.get("/metrics").text  # each replica exports its own
        assert "unmask:request_success_total" in b.get("/metrics").text
    assert all(isinstance(k, list) for k in handle.keys) and any(len(k) >= 1 for k in handle.keys)  # chunk keys


def test_a_replica_dying_mid_stream_ends_the_stream_with_an_error_and_done(engines):
    _, remote = engines
    with TestClient(build_app(RemoteEngine(FakeHandle(remote, die_after=2), _info(remote)), "m",
                              shutdown_engine=False)) as c:
        body = {"model": "m", "prompt": "One two three", "max_tokens": 64, "temperature": 0}
        lines = _sse(c, "/v1/completions", body)
        assert lines[-1] == "[DONE]"
        err = json.loads(lines[-2])["error"]
        assert "engine replica r0 failed" in err["message"] and "actor died" in err["message"], err
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 500 and "engine replica r0 failed" in r.json()["error"]["message"]
    for _ in range(200):  # the dead call's generator aborted its engine requests: the engine is idle again
        if remote.num_running == remote.num_waiting == 0:
            break
        time.sleep(0.05)
    assert remote.num_running == remote.num_waiting == 0
