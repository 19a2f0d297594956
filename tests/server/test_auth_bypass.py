"""The API key cannot be routed around (issue 41; docs/design.md#http-contract): against real `unmask serve`
processes (uvicorn) under each proxy setting (no root path, ``--root-path /unmask`` and ``/unmask/``), every route
the app serves is tried without the key, with a wrong one, and through each bypass kind: the root path in the
request or not, ``X-Forwarded-Prefix`` (never trusted), percent-encoded and doubled slashes, dot segments through
an open prefix, HEAD for GET and OPTIONS (answered by the guard, never by a handler). A bypass is any answer that is
not the guard's 401 (an open route's files may 404)."""
from __future__ import annotations

import socket

import httpx
import pytest

from serving import start_server, stop_server

KEY = "sk-bypass-Lw49Xe"
#: every route the app serves that needs the key, with its method (the schema's paths must be among these)
PROTECTED = [("GET", "/v1/models"), ("GET", "/v1/models/tiny"), ("POST", "/v1/completions"),
             ("POST", "/v1/chat/completions"), ("POST", "/v1/responses"), ("POST", "/tokenize"),
             ("POST", "/detokenize"), ("GET", "/version")]
OPEN = {"/health", "/metrics", "/", "/favicon.ico", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"}
BODY = b'{"model": "tiny", "prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "input": "hi", ' \
       b'"tokens": [1], "max_tokens": 1}'


@pytest.fixture(scope="module", params=[pytest.param("", marks=pytest.mark.system), "/unmask",
                                        pytest.param("/unmask/", marks=pytest.mark.system)])
def port(request, tmp_path_factory):
    """A server per root path spelling (``/unmask`` in the quick run, the others under ``-m system``)."""
    tmp = tmp_path_factory.mktemp("bypass")
    root = request.param
    proc, base, _ = start_server(tmp, "--served-model-name", "tiny", "--api-key", KEY,
                                 *(["--root-path", root] if root else []))
    yield int(base.rsplit(":", 1)[1])
    stop_server(proc)


def raw(port: int, method: str, target: str, headers: dict | None = None, body: bytes = b"") -> tuple[int, bytes]:
    """Send ``target`` byte for byte (no client normalizes it) and return (status, body)."""
    hs = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    head = (f"{method} {target} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{hs}Connection: close\r\n\r\n")
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(head.encode() + body)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    status_line, _, rest = data.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


def variants(path: str) -> list[str]:
    """The bypass spellings of ``path`` (what a proxy or a client may send for it)."""
    tail = path[len("/"):]
    return [path, "/" + path, path.replace("/", "//"), "/%s" % tail.replace("v", "%76", 1), path.replace("/", "%2F"),
            f"/health/..{path}", f"/visualizer/..{path}", f"/visualizer/%2e%2e{path}", f"/./{tail}",
            f"{path}?next=/health", f"/unmask{path}", f"/unmask/{path}"]


def _refused(status: int, payload: bytes, target: str) -> None:
    assert status == 401 or (status == 404 and target.startswith(("/visualizer/", "/unmask/visualizer/"))), \
        (target, status, payload[:200])


def test_no_route_answers_without_the_key(port):
    for method, path in PROTECTED:
        for target in variants(path):
            for headers in ({}, {"X-Forwarded-Prefix": "/health"}, {"Authorization": f"Bearer {KEY}x"}):
                methods = [method, "HEAD"] if method == "GET" else [method]
                for m in methods:
                    status, payload = raw(port, m, target, headers, BODY if m == "POST" else b"")
                    _refused(status, payload, target)


def test_options_never_reaches_a_handler(port):
    """OPTIONS is open (CORS preflights) but the guard answers it: an empty 204 naming the methods, no handler's
    body; on a path no route takes, the key's 401 as for any method."""
    for method, path in PROTECTED:
        status, payload = raw(port, "OPTIONS", path, body=BODY)
        assert status == 204 and payload == b"", (path, status, payload[:200])
    assert raw(port, "OPTIONS", "/health")[0] == 204
    assert raw(port, "OPTIONS", "/nowhere")[0] == 401


def test_every_route_is_guarded_or_listed_open(port):
    """The schema's routes are the protected list plus the open one (a new route must be placed), and with the key
    each protected route is reached under this root path."""
    paths = set(httpx.get(f"http://127.0.0.1:{port}/openapi.json").json()["paths"])
    assert paths <= {p for _, p in PROTECTED} | OPEN | {"/v1/models/{model_id}"}, paths
    auth = {"Authorization": f"Bearer {KEY}"}
    for method, path in PROTECTED:
        status, payload = raw(port, method, path, auth, BODY if method == "POST" else b"")
        assert status in (200, 400), (path, status, payload[:300])  # reached the handler (400: a field it refuses)
    for path in ("/health", "/metrics", "/", "/openapi.json"):
        assert raw(port, "GET", path)[0] == 200, path


def test_a_404_names_the_path_once(port):
    """An unknown route's 404 names the path the client sent, the root path once (it was doubled:
    ``no route /unmask/unmask/v1/nope``)."""
    status, payload = raw(port, "GET", "/unmask/v1/nope", {"Authorization": f"Bearer {KEY}"})
    assert status == 404, payload
    assert b"no route /unmask/v1/nope" in payload and b"/unmask/unmask" not in payload
