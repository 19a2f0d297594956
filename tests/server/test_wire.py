"""The HTTP parser's refusals over a real socket (uvicorn with ``server/wire.py``'s protocol, a minimal app behind
the request-id middleware; docs/design.md#admission-and-limits): a head past h11's 16 KiB limit is a 431 the client
reads (it was a connection reset: the server closed with the rest of the request unread), a malformed head a JSON 400,
an over-long X-Request-Id replaced, and the server keeps serving."""
from __future__ import annotations

import json
import socket
import threading
import time

import pytest
import uvicorn

from serving import free_port
from unmask.server.request_id import RequestIdMiddleware
from unmask.server.wire import protocol_class


async def _ok(scope, receive, send):
    assert scope["type"] in ("http", "lifespan")
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        return await send({"type": "lifespan.shutdown.complete"})
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture(scope="module")
def port():
    p = free_port()
    server = uvicorn.Server(uvicorn.Config(RequestIdMiddleware(_ok), host="127.0.0.1", port=p, log_level="error",
                                           http=protocol_class(), lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(100):
        if server.started:
            break
        time.sleep(0.05)
    yield p
    server.should_exit = True
    thread.join(5)


def _exchange(port: int, request: bytes) -> bytes:
    """Send ``request`` (all of it, as a client does) and read the answer until the server closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(request)
        chunks = []
        while True:
            data = s.recv(65536)
            if not data:
                return b"".join(chunks)
            chunks.append(data)


def _get(rid: str) -> bytes:
    return f"GET /health HTTP/1.1\r\nHost: x\r\nX-Request-Id: {rid}\r\nConnection: close\r\n\r\n".encode()


@pytest.mark.parametrize("size", [17_000, 60_000, 200_000, 1_000_000])  # whole or in pieces (breaker: 17-60 KB whole passed)
def test_a_huge_header_is_a_431_not_a_reset(port, size):
    answer = _exchange(port, _get("a" * size))
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431 "), answer[:200]
    err = json.loads(body)["error"]
    assert err["code"] == "header_too_large" and "16384" in err["message"], err
    assert b"aaaa" not in head  # the bad id is not echoed
    assert _exchange(port, _get("after")).startswith(b"HTTP/1.1 200 ")


def test_a_malformed_head_is_still_a_json_400(port):
    answer = _exchange(port, b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 400 ") and b'"invalid_http"' in answer, answer[:300]


def test_an_over_long_request_id_within_the_limit_is_replaced(port):
    answer = _exchange(port, _get("b" * 10_000))
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
    rid = [ln for ln in answer.split(b"\r\n") if ln.lower().startswith(b"x-request-id:")][0].split(b":", 1)[1].strip()
    assert rid.startswith(b"req-") and len(rid) == 28
