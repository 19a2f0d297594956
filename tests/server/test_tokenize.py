"""``/tokenize``, ``/detokenize`` and ``/version`` in vLLM's shapes, and the guard's one list of routes open without the
API key (every other route needs it), in-process on a tiny random model."""
from __future__ import annotations

from importlib.metadata import version

import pytest
from fastapi.testclient import TestClient

from tiny import loaded
from unmask.engine.async_engine import AsyncEngine
from unmask.server.app import build_app
from unmask.server.guard import OPEN_PREFIXES, OPEN_ROUTES, needs_key

KEY = "k-tokenize"
AUTH = {"Authorization": f"Bearer {KEY}"}
USER = [{"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def client():
    engine = AsyncEngine(loaded(block_size=4))
    with TestClient(build_app(engine, "m", api_key=KEY), headers=AUTH) as c:
        yield c


def test_tokenize_a_prompt_as_completions_reads_it(client):
    r = client.post("/tokenize", json={"model": "m", "prompt": "One two three", "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"count", "max_model_len", "tokens", "token_strs"}
    assert body["count"] == len(body["tokens"]) == len(body["token_strs"]) and body["max_model_len"] == 512
    usage = client.post("/v1/completions", json={"model": "m", "prompt": "One two three", "max_tokens": 1}).json()
    assert usage["usage"]["prompt_tokens"] == body["count"]
    assert client.post("/tokenize", json={"prompt": "One two three"}).json()["token_strs"] is None
    back = client.post("/detokenize", json={"model": "m", "tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": "One two three"}


def test_tokenize_messages_as_chat_renders_them(client):
    r = client.post("/tokenize", json={"messages": USER})
    assert r.status_code == 200, r.text
    chat = client.post("/v1/chat/completions", json={"model": "m", "messages": USER, "max_tokens": 1}).json()
    assert r.json()["count"] == chat["usage"]["prompt_tokens"]
    bare = client.post("/tokenize", json={"messages": USER, "add_generation_prompt": False}).json()
    assert bare["tokens"] == r.json()["tokens"][:bare["count"]] and bare["count"] < r.json()["count"]


@pytest.mark.parametrize("path,body,status,param", [
    ("/tokenize", {"model": "other", "prompt": "x"}, 404, "model"),
    ("/tokenize", {"prompt": "x", "bogus": 1}, 400, "bogus"),
    ("/tokenize", {"messages": USER, "continue_final_message": True}, 400, "continue_final_message"),
    ("/detokenize", {"tokens": [10 ** 6]}, 400, "tokens.0"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens.0"),
])
def test_bad_requests_name_the_field(client, path, body, status, param):
    r = client.post(path, json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_version(client):
    r = client.get("/version")
    assert r.status_code == 200 and r.json() == {"version": version("unmask")}


def test_the_key_guards_every_route_but_the_open_ones(client):
    app = client.app
    for path in ("/tokenize", "/detokenize", "/version", "/v1/models", "/nope", "/v1/nope"):
        assert needs_key(path)
        r = client.request("POST" if "tokenize" in path else "GET", path, headers={"Authorization": ""},
                           json={"prompt": "x", "tokens": [1]})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, r.text)
    for path in ("/health", "/metrics", "/", "/favicon.ico", "/docs", "/openapi.json", "/visualizer/app.js"):
        assert not needs_key(path)
        assert client.get(path, headers={"Authorization": ""}).status_code == 200, path
    assert client.get("/favicon.ico").headers["content-type"].startswith("image/svg+xml")
    # every route the app serves is either open by the guard's list or needs the key; the schema says which
    paths = {getattr(r, "path", "") for r in app.routes}
    assert {p for p in paths if not needs_key(p)} <= OPEN_ROUTES | {p for p in paths if p.startswith(OPEN_PREFIXES)}
    schema = client.get("/openapi.json").json()
    for path in ("/tokenize", "/detokenize", "/version", "/v1/chat/completions"):
        assert all(op.get("security") == [{"bearer": []}] for op in schema["paths"][path].values()), path
    assert "security" not in schema["paths"]["/health"]["get"]
