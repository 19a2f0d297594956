"""The HTTP/1.1 parser's own refusals in the OpenAI error shape (docs/design.md#admission-and-limits).

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


HEAD_TOO_LARGE = ("request header fields too large: the request line and headers exceed the server's limit of "
                  "{limit} bytes (an X-Request-Id is kept up to 128 characters)")
READ_TIMEOUT = "request timeout: the request's head and body did not arrive within {seconds:g} s"
DRAIN_BYTES = 1 << 20   # after a refusal, unread request bytes dropped before the connection closes
DRAIN_SECONDS = 2.0     # ... or this long after the answer


def error_body(message: str = MESSAGE, code: str = "invalid_http") -> bytes:
    """The JSON body of the parser's 400 (or 431)."""
    return json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()


def _headers(body: bytes) -> list[tuple[bytes, bytes]]:
    return [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"x-request-id", new_id().encode()), (b"connection", b"close")]


def _h11_class():
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class JsonErrorH11Protocol(H11Protocol):
        """uvicorn's h11 protocol; its 400 for an unparsable request is a JSON error body, a head past h11's limit
        (``h11_max_incomplete_event_size``, 16 KiB) a 431. After the answer the connection half-closes and drops
        what the client still sends (up to :data:`DRAIN_BYTES` or :data:`DRAIN_SECONDS`): closing at once with
        unread bytes made the kernel reset the connection, and the client never read the answer (a 200 KB
        ``X-Request-Id``, breaker)."""

        _draining = 0
        def data_received(self, data: bytes) -> None:
            if self._draining:
                self._draining += len(data)
                if self._draining > DRAIN_BYTES:
                    self.transport.close()
                return
            limit = getattr(self.conn, "_max_incomplete_event_size", 16 * 1024)
            if self.conn.their_state is h11.IDLE:  # h11 checks its limit only on a head still incomplete, so a
                buf = bytes(self.conn.trailing_data[0]) + data  # large head that arrives whole passed (breaker)
                if buf.find(b"\r\n\r\n") > limit:
                    body = error_body(HEAD_TOO_LARGE.format(limit=limit), "header_too_large")
                    head = b"".join(k + b": " + v + b"\r\n" for k, v in _headers(body))
                    self.transport.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\n" + head + b"\r\n" + body)
                    self._drain()
                    return
            super().data_received(data)

        def _drain(self) -> None:
            self._draining = 1
            if self.transport.can_write_eof():
                self.transport.write_eof()
            self.loop.call_later(DRAIN_SECONDS, self.transport.close)

        def send_400_response(self, msg: str) -> None:  # noqa: ARG002 - uvicorn's plain message, replaced
            limit = getattr(self.conn, "_max_incomplete_event_size", 16 * 1024)
            if len(self.conn.trailing_data[0]) > limit:   # h11's "Receive buffer too long" (its status hint 431)
                status, reason = 431, b"Request Header Fields Too Large"
                body = error_body(HEAD_TOO_LARGE.format(limit=limit), "header_too_large")
            else:
                status, reason, body = 400, b"Bad Request", error_body()
            self.transport.write(self.conn.send(h11.Response(status_code=status, headers=_headers(body),
                                                             reason=reason)))
            self.transport.write(self.conn.send(h11.Data(data=body)))
            self.transport.write(self.conn.send(h11.EndOfMessage()))
            self._drain()

    return JsonErrorH11Protocol


def _timed_class(base, read_timeout: float):
    """``base`` (a uvicorn h11 protocol) with a read timeout: a client that has not sent a request's head and body
    within ``read_timeout`` seconds of starting it gets a 408 (no request started yet) or a closed connection."""
    import h11

    class ReadTimeoutH11Protocol(base):
        _read_timer = None
        _armed_for = None  # the cycle (None: none yet) that was current when the timer started

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            """Start the read timeout of the request the client is starting to send (issue 41: a client that sends
            half a head, or a body slower than this, held its connection and buffers without limit)."""
            if self._read_timer is None:
                self._armed_for = self.cycle
                self._read_timer = self.loop.call_later(read_timeout, self._read_timed_out)

        def _disarm(self) -> None:
            if self._read_timer is not None:
                self._read_timer.cancel()
                self._read_timer = None

        def _read_timed_out(self) -> None:
            self._read_timer = None
            started = self.cycle is not None and self.cycle is not self._armed_for
            if not started and self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE) and not self._draining:
                body = error_body(READ_TIMEOUT.format(seconds=read_timeout), "request_timeout")
                head = b"".join(k + b": " + v + b"\r\n" for k, v in _headers(body))
                self.transport.write(b"HTTP/1.1 408 Request Timeout\r\n" + head + b"\r\n" + body)
            self.transport.close()  # a request whose body was late: the app sees the disconnect

        def _reading_done(self) -> None:
            c = self.cycle
            if c is not None and c is not self._armed_for and not c.more_body:
                self._disarm()

        def data_received(self, data: bytes) -> None:
            if self.cycle is None or self.cycle.response_complete:  # a new request starts (or the first one)
                self._arm()
            super().data_received(data)
            self._reading_done()

    return ReadTimeoutH11Protocol


def protocol_class(read_timeout: float | None = None):
    """uvicorn's h11 protocol with the JSON 400 (h11 always, also where httptools is installed: one parser, the
    one the tests exercise); ``read_timeout``: seconds a client may take to send a request's head and body (then a
    408 when no request has started, else the connection closes; None: no limit)."""
    base = _h11_class()
    return base if read_timeout is None else _timed_class(base, read_timeout)
