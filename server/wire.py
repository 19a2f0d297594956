"""The HTTP/1.1 parser's own refusals in the OpenAI error shape (docs/design.md section 15).

A request whose head the parser rejects (``Content-Length: abc``, a malformed request line, a bad header) never
reaches the app: uvicorn answers it itself with a plain-text ``Invalid HTTP request received.``. The protocol
classes here answer the same 400 as JSON, ``{"error": {"message", "type", "param", "code": "invalid_http"}}``,
with an ``X-Request-Id``, so every answer of the server is a JSON error body a client can parse.

``unmask serve`` passes :func:`protocol_class` (h11) to uvicorn as ``http=``.
"""
from __future__ import annotations

import json

from .request_id import new_id

MESSAGE = ("invalid HTTP request: the request line or a header could not be parsed (e.g. a Content-Length that is "
           "not a number)")


def error_body() -> bytes:
    """The JSON body of the parser's 400."""
    return json.dumps({"error": {"message": MESSAGE, "type": "invalid_request_error", "param": None,
                                 "code": "invalid_http"}}).encode()


def _headers(body: bytes) -> list[tuple[bytes, bytes]]:
    return [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"x-request-id", new_id().encode()), (b"connection", b"close")]


def _h11_class():
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class JsonErrorH11Protocol(H11Protocol):
        """uvicorn's h11 protocol; its 400 for an unparsable request is a JSON error body."""

        def send_400_response(self, msg: str) -> None:  # noqa: ARG002 - uvicorn's plain message, replaced
            body = error_body()
            self.transport.write(self.conn.send(h11.Response(status_code=400, headers=_headers(body),
                                                             reason=b"Bad Request")))
            self.transport.write(self.conn.send(h11.Data(data=body)))
            self.transport.write(self.conn.send(h11.EndOfMessage()))
            self.transport.close()

    return JsonErrorH11Protocol


def protocol_class():
    """uvicorn's h11 protocol with the JSON 400 (h11 always, also where httptools is installed: one parser, the
    one the tests exercise)."""
    return _h11_class()
