"""Request ids: every HTTP response carries ``X-Request-Id``, and every log line written while the request is
handled names it (docs/design.md#admission-and-limits).

* :class:`RequestIdMiddleware` (pure ASGI, outermost but CORS) takes the client's ``X-Request-Id`` when it is sane
  (1..:data:`MAX_REQUEST_ID_CHARS` printable ASCII characters, no spaces: see :func:`sane`), else makes one
  (``req-`` + 24 hex digits); it sets :data:`request_id` for the request's task and adds the header to the
  response start, whatever the status (errors of the guards, 404/405, 500s, SSE streams).
* :class:`RequestIdFilter` puts the current id into every log record as ``record.request_id`` (``-`` outside a
  request); :data:`LOG_FORMAT` prints it. ``unmask serve`` installs both on the root handlers.

The engine thread does not see the contextvar (it serves every request at once); the server's own line per
request (``server/run.py``) is written on the event loop and carries the id.
"""
from __future__ import annotations

import contextvars
import logging
import re
import secrets

HEADER = "X-Request-Id"
MAX_REQUEST_ID_CHARS = 128
_SANE = re.compile(r"[\x21-\x7e]{1,%d}" % MAX_REQUEST_ID_CHARS)  # printable ASCII, no space, bounded
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s"

request_id: contextvars.ContextVar[str] = contextvars.ContextVar("unmask_request_id", default="-")


log = logging.getLogger("unmask.server")

def sane(value: str | None) -> bool:
    """True when a client's id may be echoed and logged as it is: 1..128 printable ASCII characters without
    spaces (nothing that could forge a log line or a header)."""
    return value is not None and _SANE.fullmatch(value) is not None


def new_id() -> str:
    """A fresh id: ``req-`` + 24 hex digits."""
    return f"req-{secrets.token_hex(12)}"


class RequestIdFilter(logging.Filter):
    """Adds ``record.request_id`` (the current request's id, ``-`` outside one) to every record it sees."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = request_id.get()
        return True


def install_log_filter() -> None:
    """Add :class:`RequestIdFilter` to every handler of the root logger and print the id (:data:`LOG_FORMAT`)
    (``unmask serve`` calls it after ``logging.basicConfig``); idempotent."""
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, RequestIdFilter) for f in handler.filters):
            handler.addFilter(RequestIdFilter())
        handler.setFormatter(logging.Formatter(LOG_FORMAT))


class RequestIdMiddleware:
    """Pure ASGI middleware: the request's id in :data:`request_id` and in the response's ``X-Request-Id``."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = None
        for k, v in scope.get("headers", []):
            if k.lower() == b"x-request-id":
                given = v.decode("latin-1")
                break
        rid = given if sane(given) else new_id()
        token = request_id.set(rid)
        scope.setdefault("state", {})["request_id"] = rid

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                message = {**message, "headers": headers + [(b"x-request-id", rid.encode("latin-1"))]}
            await send(message)

        # at debug level: the request line as received (method and path only: never headers, so never a key)
        log.debug("%s %r", scope.get("method", "?"), scope.get("path", "?"))  # repr: no forged lines
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            request_id.reset(token)
