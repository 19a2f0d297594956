"""Structure bounds on the raw body, off the event loop (issue 41; server/body_limits.py,
docs/design.md#admission-and-limits): each count over its bound is a 400 naming the field and the limit before any
model parses the body, the bounds are in the OpenAPI schema, and ``/health`` answers within 0.5 s while one abusive
request of each kind is read and refused."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from serving import served_tiny
from unmask.engine.limits import (MAX_CONTENT_PARTS, MAX_JSON_CONTAINERS, MAX_JSON_DEPTH, MAX_JSON_VALUES,
                                  MAX_SCHEMA_NODES, MAX_TOOLS)
from unmask.server.body_limits import STRUCTURE_LIMITS, structure_error

CH = "/v1/chat/completions"


def _chat(**kw) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **kw}


def _parts(n: int) -> dict:
    return _chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}] * n}])


def _tools(n: int, props: int = 1) -> dict:
    params = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(props)}}
    return _chat(tools=[{"type": "function", "function": {"name": f"f{i}", "parameters": params}} for i in range(n)])


ABUSIVE = {  # each under the 4 MB body limit; the named counts under the body's container bound
    "content_parts": (_parts(10_000), "messages.0.content", MAX_CONTENT_PARTS),
    "tools": (_tools(2_000), "tools", MAX_TOOLS),
    "schema_nodes": (_tools(1, props=5_000), "tools", MAX_SCHEMA_NODES),
    "content_parts_body": (_parts(120_000), "body", MAX_JSON_CONTAINERS),
    "nesting": (None, None, MAX_JSON_DEPTH),  # past Python's parser recursion: FastAPI's invalid_json, as fast  # the raw text: see _body
    "responses_parts": ({"model": "tiny", "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "a"}] * 10_000}]}, "input.0.content", MAX_CONTENT_PARTS),
    # 3.6 MB: json.loads alone held the GIL 6-14 s (the cyclic GC over 900,000 new lists), from a worker thread too
    "containers": ({"model": "tiny", "prompt": [[1]] * 900_000}, "body", MAX_JSON_CONTAINERS),
    "values": ({"model": "tiny", "prompt": [7] * 1_000_000}, "body", MAX_JSON_VALUES),
}


def _body(name: str) -> bytes:
    if name == "nesting":  # json.dumps would recurse; the raw text is what a client sends
        return (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "metadata": '
                + b"[" * 200_000 + b"]" * 200_000 + b"}")
    return json.dumps(ABUSIVE[name][0], separators=(",", ":")).encode()


@pytest.mark.parametrize("name", sorted(n for n in ABUSIVE if ABUSIVE[n][1]))
def test_each_count_over_its_bound_is_a_400_naming_the_field_and_the_limit(name):
    err = structure_error(_body(name))
    assert err is not None and err.status == 400 and err.param == ABUSIVE[name][1], err
    assert f"limit of {ABUSIVE[name][2]}" in err.message, err.message


def test_bodies_within_the_bounds_pass():
    assert structure_error(json.dumps(_parts(MAX_CONTENT_PARTS)).encode()) is None
    assert structure_error(json.dumps(_tools(MAX_TOOLS)).encode()) is None
    assert structure_error(json.dumps(_chat(metadata=json.loads("[" * 40 + "]" * 40))).encode()) is None
    assert structure_error(b"not json") is None  # FastAPI's own 400
    # 32 token-id prompts of 8,000 tokens; a string full of brackets and commas is one value
    assert structure_error(json.dumps({"prompt": [[1] * 8000] * 32}).encode()) is None
    assert structure_error(json.dumps(_chat(messages=[{"role": "user", "content": "[{,\\\"" * 200_000}])).encode()) is None
    deep = structure_error(json.dumps(_chat(metadata=json.loads("[" * 100 + "]" * 100))).encode())
    assert deep is not None and deep.param == "metadata.0.0.0" and "limit of 64" in deep.message


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from served_tiny(tmp_path_factory.mktemp("limits"))


def test_health_answers_within_half_a_second_under_each_abusive_request(server):
    with httpx.Client(base_url=server, timeout=60) as c:
        schema = c.get("/openapi.json").json()
        assert schema["info"]["x-limits"] == STRUCTURE_LIMITS
        for name in sorted(ABUSIVE):
            body, worst, done, answers = _body(name), [0.0], threading.Event(), []

            def abuse():
                try:
                    with httpx.Client(base_url=server, timeout=60) as a:
                        path = {"responses_parts": "/v1/responses", "containers": "/v1/completions",
                                "values": "/v1/completions"}.get(name, CH)
                        answers.append(a.post(path, content=body, headers={"Content-Type": "application/json"}))
                except httpx.HTTPError as exc:
                    answers.append(exc)
                finally:
                    done.set()

            t = threading.Thread(target=abuse)
            t.start()
            while not done.is_set():
                t0 = time.perf_counter()
                assert c.get("/health").status_code == 200
                worst[0] = max(worst[0], time.perf_counter() - t0)
            t.join()
            assert answers and answers[0].status_code == 400, (name, answers)
            assert answers[0].json()["error"]["param"] == ABUSIVE[name][1] or ABUSIVE[name][1] is None, answers[0].text
            assert worst[0] < 0.5, (name, worst[0])
        # the server keeps serving: a well-formed request after all of them
        r = c.post(CH, json=_chat())
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None, r.text
