"""Pure ASGI guards before routing (docs/design.md#http-contract and #admission-and-limits): the API key (401) on every
route but the open ones, then, for a request some route takes with its method, the body size (413), the JSON content
type (415) and UTF-8 (400: no BOM, no UTF-16/32). ``HEAD`` is answered as the ``GET`` of the same path without its
body.

The routes open without the key are listed here and nowhere else (:data:`OPEN_ROUTES`, :data:`OPEN_PREFIXES`,
:func:`needs_key`; the OpenAPI schema marks the others as needing it): ``/health`` (probes), ``/metrics``
(Prometheus), ``/``, ``/favicon.ico`` and ``/visualizer/*`` (the page; its own calls go to ``/v1``), ``/docs``,
``/redoc`` and ``/openapi.json``. Everything else needs it: ``/v1/*``, ``/tokenize``, ``/detokenize``, ``/version``,
and an unknown path (a 401 before the 404, so that the key guards which routes exist). A method no route takes
(``PUT /health``) goes on to the router's 405 with ``Allow`` before any body check.

The key is decided on what the application routes to, not on the request's spelling (issue 41): :func:`needs_key`
is applied to the very path the router matches (Starlette's ``get_route_path``: the ASGI path without the
``root_path``, so ``--root-path`` in any spelling, doubled slashes, percent-encoding and dot segments are seen as the
router sees them), and only the exact open paths are open; a path no route takes needs the key. ``X-Forwarded-Prefix`` is
never read (the prefix comes from ``--root-path`` only). ``OPTIONS`` (CORS preflights; the CORS middleware, when
configured, answers real ones before this guard) is answered here with an empty 204 naming the route's methods and
never reaches a handler; on a path no route takes it needs the key like any method.
"""
from __future__ import annotations

import hmac
import logging

from starlette._utils import get_route_path
from starlette.responses import Response
from starlette.routing import Match

from .body_limits import replay_body
from .errors import APIError, count_refusal

log = logging.getLogger("unmask.server")

#: the paths open without the API key (the one list)
OPEN_ROUTES = frozenset({"/health", "/metrics", "/", "/favicon.ico", "/docs", "/docs/oauth2-redirect", "/redoc",
                         "/openapi.json"})
#: path prefixes open without the API key (the page's files)
OPEN_PREFIXES = ("/visualizer/",)


#: the ASGI scope key the guard sets to the caller's tenant (the name of its key; None: the unnamed tenant)
TENANT = "unmask.tenant"


def cache_salt(scope, salt: str | None) -> str | None:
    """The prefix cache's salt of a request (``unmask.engine.AsyncEngine.submit``'s ``cache_salt``): its tenant
    and its own ``cache_salt`` field, joined unambiguously (no salt a client sends can spell another tenant's);
    None when neither is set (one tenant, no salt: the unsalted store)."""
    import json

    tenant = scope.get(TENANT)
    return None if tenant is None and salt is None else json.dumps([tenant, salt])


def needs_key(path: str) -> bool:
    """Whether a request for ``path`` (the path the router routes on: without the root path, as Starlette's
    ``get_route_path`` gives it) needs the API key when the server has one: every path but :data:`OPEN_ROUTES` and
    one segment under :data:`OPEN_PREFIXES` (``/visualizer/app.js``, not ``/visualizer/../v1/models``)."""
    if path in OPEN_ROUTES:
        return False
    return not any(path.startswith(p) and "/" not in path[len(p):] and path[len(p):] not in ("", ".", "..")
                   for p in OPEN_PREFIXES)


def not_utf8(head: bytes) -> APIError | None:
    """A 400 when a body whose first bytes are ``head`` is not plain UTF-8 JSON, else None.

    RFC 8259 section 8.1: JSON exchanged between systems MUST be UTF-8 and a sender MUST NOT add a byte order mark;
    the OpenAI API takes UTF-8 JSON. Python's ``json.loads`` (hence FastAPI, hence vLLM) would decode UTF-16/32 and
    skip a BOM silently; we refuse both, naming the encoding seen (``json.detect_encoding``: a BOM, or the NUL
    bytes of UTF-16/32 around the first ASCII character)."""
    import json

    enc = json.detect_encoding(head)
    if enc == "utf-8":
        return None
    what = "starts with a UTF-8 byte order mark" if enc == "utf-8-sig" else f"is {enc.upper()}, not UTF-8"
    return APIError(400, f"request body {what}: send UTF-8 JSON without a byte order mark (RFC 8259 section 8.1)",
                    code="invalid_encoding")


def _without_body(send):
    """``send`` for a HEAD request: the GET's status and headers (``Content-Length`` included), an empty body."""
    async def head_send(message):
        if message["type"] == "http.response.body":
            if message.get("more_body", False):
                return
            message = {"type": "http.response.body", "body": b"", "more_body": False}
        await send(message)
    return head_send


class GuardMiddleware:
    """Pure ASGI checks before routing (so they never depend on body parsing): API key (401, :func:`needs_key`),
    body size (413, Content-Length or counted bytes) and JSON content type on POST (415).

    The body is read here and replayed to the app; after it, ``receive`` passes through, so a route can still wait
    for ``http.disconnect``."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int, router=None, api_keys: dict | None = None):
        self.app = app
        # every accepted key -> its tenant (None: the --api-key one, the unnamed tenant)
        self.keys = {**({api_key: None} if api_key is not None else {}), **(api_keys or {})}
        self.max_body_bytes = max_body_bytes
        self.router = router  # the app's router: a request no route takes with its method goes on to the 404/405

    def _routed(self, scope) -> bool:
        """True when a route takes this path with this method (else the router answers 404 or 405 with an
        ``Allow`` header, before any body check: ``PUT /health`` is a 405, not a 415)."""
        if self.router is None:
            return True
        return any(route.matches(scope)[0] == Match.FULL for route in self.router.routes)

    def _tenant(self, token: str) -> str | None | bool:
        """The tenant of ``token`` (None: the unnamed one), or False for no key; every key is compared (in constant
        time each), so the time taken says nothing of which key came close."""
        found: str | None | bool = False
        for key, tenant in self.keys.items():
            if hmac.compare_digest(token.encode("utf-8", "surrogatepass"), key.encode()):
                found = tenant
        return found

    def _allowed(self, scope) -> list[str]:
        """The methods some route takes at this request's path (empty when no route takes it): ``OPTIONS``'
        ``Allow``, asked of the router itself (an included router's routes too)."""
        routes = self.router.routes if self.router is not None else ()
        return [m for m in ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE")
                if any(r.matches({**scope, "method": "GET" if m == "HEAD" else m})[0] == Match.FULL
                       for r in routes)]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if scope.get("method") == "HEAD":  # HEAD on every GET route (RFC 9110 section 9.3.2): the GET, no body
            scope, send = {**scope, "method": "GET"}, _without_body(send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        allowed = self._allowed(scope) if scope.get("method") == "OPTIONS" else []
        if self.keys and not allowed and needs_key(get_route_path(scope)):
            auth = headers.get("authorization", "")
            scheme, _, token = auth.partition(" ")
            found = self._tenant(token.strip()) if scheme.lower() == "bearer" else False
            if found is False:
                err = APIError(401, "invalid or missing API key: send the header 'Authorization: Bearer <key>'",
                               code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                return await self._reject(scope, err, receive, send)
            scope[TENANT] = found
        if allowed:  # OPTIONS on a routed path: answered here, never by a handler
            return await Response(status_code=204, headers={"Allow": ", ".join(["OPTIONS", *allowed])})(
                scope, receive, send)
        if scope.get("method") not in ("POST", "PUT", "PATCH") or not self._routed(scope):
            return await self.app(scope, receive, send)
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                return await self._reject(scope, APIError(400, f"invalid Content-Length header {length!r}",
                                                          code="invalid_request"), receive, send)
            if int(length) > self.max_body_bytes:
                await self._drain(receive, 16 * self.max_body_bytes)
                return await self._reject(scope, self._too_large(int(length)), receive, send)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_body_bytes:
                await self._drain(receive, 16 * self.max_body_bytes)
                return await self._reject(scope, self._too_large(size), receive, send)
            chunks.append(body)
            more = message.get("more_body", False)
        ctype = headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype != "application/json":
            err = APIError(415, f"Content-Type must be application/json, got {ctype or 'none'!r}",
                           param="Content-Type", code="unsupported_media_type")
            return await self._reject(scope, err, receive, send)
        data = b"".join(chunks)
        err = not_utf8(data[:4])
        if err is not None:
            return await self._reject(scope, err, receive, send)
        await self.app(scope, replay_body(data, receive), send)

    def _too_large(self, size: int) -> APIError:
        return APIError(413, f"request body of {size} bytes exceeds the server's limit of {self.max_body_bytes} "
                             f"bytes", code="request_too_large")

    @staticmethod
    async def _reject(scope, err: APIError, receive, send) -> None:
        log.info("%s %s status=%d code=%s", scope.get("method"), scope.get("path"), err.status, err.code)
        count_refusal(scope, err)
        await err.response()(scope, receive, send)

    @staticmethod
    async def _drain(receive, limit: int) -> None:
        """Read and drop the rest of the body (up to ``limit`` bytes) so that the client sees the response."""
        seen = 0
        while seen <= limit:
            message = await receive()
            if message["type"] != "http.request":
                return
            seen += len(message.get("body", b""))
            if not message.get("more_body", False):
                return
