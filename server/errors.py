"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with the right HTTP status.

Status codes (docs/design.md#http-contract, issue 3):

======  ==========================================================================================
400     invalid JSON or field value (``param`` names the field), unsupported field, a size past its bound
        (docs/design.md#admission-and-limits), prompt + max_tokens beyond the context (the message gives both numbers),
        an unparsable request head (answered by the HTTP parser itself: ``server/wire.py``)
401     missing or wrong API key when the server has one (``Authorization: Bearer KEY``)
404     unknown model id or route
405     wrong method on a known route
413     request body larger than the server's limit
415     request body that is not ``application/json``
429     waiting queue full (``Retry-After`` header, seconds)
503     KV budget cannot hold the request, request timeout, or the engine is shutting down
        (``Retry-After``)
500     genuine server faults only
======  ==========================================================================================
"""
from __future__ import annotations

import logging
import re
import sys

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from unmask.engine import CacheFull, EngineClosed, EngineError, ParamError, QueueFull

from .json_text import DEPTH_RULE
from .responses import ErrorDetail, ErrorResponse

log = logging.getLogger("unmask.server")

_TYPE_BY_STATUS = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
                   405: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
                   429: "rate_limit_error", 503: "service_unavailable", 500: "server_error"}
RETRY_AFTER_SECONDS = 1


class APIError(Exception):
    """An error answered as an OpenAI error body.

    Args:
        status: HTTP status. message: human-readable reason (names the field where there is one).
        param: the offending request field (dotted path), or None. code: a short machine-readable code.
        headers: extra response headers (e.g. ``Retry-After``).
    """

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None, type: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}
        self.type = type or _TYPE_BY_STATUS.get(status, "invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        """The OpenAI error body as a dict."""
        return ErrorResponse(error=ErrorDetail(message=self.message, type=self.type, param=self.param,
                                               code=self.code)).model_dump()

    def response(self) -> JSONResponse:
        """The error as a ``JSONResponse`` with this error's status and headers."""
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def check_model(requested: str | None, served: str) -> None:
    """The 404 of a request naming another model than the ``served`` one (None: not named, fine); the message names
    the served id, as a client configured with another name needs it.

    Raises:
        APIError: 404 ``model_not_found``, param ``model``.
    """
    if requested is not None and requested != served:
        raise APIError(404, f"the model `{requested}` does not exist; this server serves `{served}` (GET /v1/models)",
                       param="model", code="model_not_found")


def shutdown_error() -> APIError:
    """The 503 of a request cut short because the server is shutting down (retry elsewhere)."""
    return APIError(503, "the server is shutting down; retry on another instance or later", code="server_shutdown",
                    headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


def from_exception(exc: BaseException) -> APIError:
    """Map engine exceptions (and APIError itself) to an :class:`APIError`; anything else is a 500."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ParamError):
        return APIError(400, str(exc), param=exc.field, code="invalid_value")
    if isinstance(exc, QueueFull):
        return APIError(429, f"server busy: {exc}; retry later", code="queue_full",
                        headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    if isinstance(exc, CacheFull):
        return APIError(503, f"{exc}; retry later or send a shorter request", code="cache_full",
                        headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    if isinstance(exc, EngineClosed):
        return APIError(503, f"{exc}", code="engine_unavailable", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    if isinstance(exc, (TimeoutError,)):
        return APIError(503, f"request timed out{': ' + str(exc) if str(exc) else ''}", code="timeout",
                        headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    if isinstance(exc, EngineError):
        return APIError(500, str(exc), code="engine_error", type="server_error")
    return APIError(500, "internal server error", code="internal_error", type="server_error")


# pydantic puts union-member and validator tags into ``loc``; they are not request fields
_TAG = re.compile(r"^(str|int|float|bool|none|list\[.*\]|dict\[.*\]|literal\[.*\]|function-.*|constrained-.*"
                  r"|[A-Z]\w*(\[.*\])?|json-or-python\[.*\]|tagged-union\[.*\]|union\[.*\])$")


def param_path(loc: tuple) -> str | None:
    """``("body", "messages", 0, "content", "str")`` -> ``"messages.0.content"``."""
    parts = [str(p) for p in loc[1:] if not (isinstance(p, str) and _TAG.match(p))] if loc and loc[0] == "body" \
        else [str(p) for p in loc if not (isinstance(p, str) and _TAG.match(p))]
    return ".".join(parts) or None


# pydantic error types that only say "not this member's type" (one per member of a union field)
_TYPE_MISMATCH = frozenset({"string_type", "list_type", "int_type", "int_parsing", "int_from_float", "float_type",
                            "float_parsing", "bool_type", "bool_parsing", "dict_type", "model_type",
                            "model_attributes_type", "is_instance_of", "none_required"})

#: FastAPI's detail when the body is not decodable JSON (not UTF-8, or nested beyond the parser's recursion limit)
_BODY_PARSE_DETAIL = "There was an error parsing the body"


def _body_parse_why(cause: BaseException | None) -> str:
    """Why Python's ``json`` could not parse the body (FastAPI chains its exception as the cause): not UTF-8,
    nested past the parser's recursion limit, or an integer past Python's digit limit (``sys.int_info``)."""
    if isinstance(cause, UnicodeDecodeError):
        return "it must be UTF-8 encoded JSON (RFC 8259)"
    if isinstance(cause, RecursionError):
        return f"JSON must be {DEPTH_RULE}"
    if isinstance(cause, ValueError) and "integer string conversion" in str(cause):
        return (f"an integer has more than {sys.get_int_max_str_digits()} digits (the most Python's JSON parser "
                f"converts)")
    return f"it must be UTF-8 encoded JSON (RFC 8259) {DEPTH_RULE}"


def _union_loc(loc: tuple) -> tuple | None:
    """The location of the innermost union field an error belongs to: ``loc`` up to its last member tag (``("body",
    "messages", 1, "content", "str")`` -> ``("body", "messages", 1, "content")``; a message's role tag before
    ``content`` stays in: ``("body", "messages", 1, "Message", "content", "str")`` -> ``(..., "Message",
    "content")``); ``None`` when no tag."""
    for i in range(len(loc) - 1, 1, -1):
        if isinstance(loc[i], str) and _TAG.match(loc[i]):
            return loc[:i]
    return None


def _outer_union_loc(loc: tuple) -> tuple | None:
    """``loc`` up to its first member tag (the outermost union field); ``None`` when no tag."""
    for i, part in enumerate(loc):
        if i > 1 and isinstance(part, str) and _TAG.match(part):
            return loc[:i]
    return None


def _deepest_into_a_member(err: dict, errors: list[dict]) -> dict | None:
    """The error of the same outermost union as ``err`` that lies deepest inside a member's value, when it lies
    deeper than ``err``: the member whose shape the value matched (``input: str | list[item]`` given a list whose
    ``function_call`` item has object ``arguments`` names ``input.0.arguments``, not ``input``); else None."""
    outer = _outer_union_loc(tuple(err.get("loc", ())))
    if outer is None:
        return None
    def depth(e: dict) -> int:
        return len((param_path(tuple(e.get("loc", ()))) or "").split("."))

    deepest = max((e for e in errors if _outer_union_loc(tuple(e.get("loc", ()))) == outer), key=depth)
    return deepest if depth(deepest) > depth(err) else None


def validation_error(exc: RequestValidationError) -> APIError:
    """The first meaningful pydantic error as a 400 that names the field."""
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request", code="invalid_request")
    # a custom error (unsupported field, cross-field rule) is more specific than union noise
    err = next((e for e in errors if e.get("type") in ("unsupported_field", "invalid_field")), None)
    if err is not None:
        ctx = err.get("ctx") or {}
        field = ctx.get("field")
        code = "unsupported_field" if err["type"] == "unsupported_field" else "invalid_value"
        return APIError(400, f"{field}: {ctx.get('why')}", param=field, code=code)
    err = errors[0]
    union = _union_loc(tuple(err.get("loc", ())))
    if err.get("type") in _TYPE_MISMATCH and union is not None:
        # a union field (``prompt``, ``content``, ...) reports one error per member; a constraint error of the
        # member the value's shape matched (too many prompts, a negative token id) says more than "should be a
        # valid string" from the first member
        same = [e for e in errors if _union_loc(tuple(e.get("loc", ()))) == union]
        specific = [e for e in same if e.get("type") not in _TYPE_MISMATCH]
        if not specific:  # the value's shape may have matched a member of an enclosing union (input: str | list)
            outer = _outer_union_loc(tuple(err.get("loc", ())))
            specific = [e for e in errors if e.get("type") not in _TYPE_MISMATCH
                        and _outer_union_loc(tuple(e.get("loc", ()))) == outer]
        deeper = _deepest_into_a_member(err, errors)
        if specific:
            err = specific[0]
        elif deeper is not None:
            err = deeper
        else:
            msgs = list(dict.fromkeys(e.get("msg", "") for e in same))
            if len(msgs) > 1:  # every member of the union refused the value's type
                param = param_path(union)
                return APIError(400, f"{param}: none of the accepted forms matches ({'; '.join(msgs)})",
                                param=param, code="invalid_value")
    kind = err.get("type", "")
    if kind == "json_too_deep":  # a JSON string inside the body (tool-call arguments): the body's own rule
        param = param_path(tuple(err.get("loc", ())))
        return APIError(400, f"{param}: {err.get('msg')}", param=param, code="invalid_json")
    if kind == "json_invalid":
        ctx = err.get("ctx") or {}
        return APIError(400, f"invalid JSON body: {ctx.get('error', err.get('msg'))}", code="invalid_json")
    loc = tuple(err.get("loc", ()))
    if kind == "missing" and loc == ("body",):
        return APIError(400, "a JSON object body is required", code="invalid_request")
    param = param_path(loc)
    if kind == "invalid_role":  # the message union's discriminator (unmask.server.messages): name the field
        param = f"{param}.role"
    if kind == "extra_forbidden":
        return APIError(400, f"{param}: unknown field (not part of this API)", param=param, code="unknown_field")
    if param is None:
        return APIError(400, f"request body: {err.get('msg')}", code="invalid_request")
    msg = err.get("msg", "invalid value").replace(" after validation", "")
    if kind == "missing":
        msg = "required field is missing"
    elif kind.removeprefix("string_") in ("too_long", "too_short") and isinstance(err.get("input"), str):
        # one wording for a string's length bound (pydantic says "Value should have at most N items" for a
        # constrained string type, and omits the actual length for a plain one)
        ctx = err.get("ctx") or {}
        longer = kind.endswith("too_long")
        bound = ctx.get("max_length") if longer else ctx.get("min_length")
        msg = (f"String should have at {'most' if longer else 'least'} {bound} character{'s' * (bound != 1)}, "
               f"not {len(err['input'])}")
    return APIError(400, f"{param}: {msg}", param=param, code="invalid_value")


def routed_path(scope) -> str:
    """The path the router looked for, as the server received it: uvicorn puts ``--root-path`` in front of the path
    it received (so ``root_path + path``, Starlette's ``request.url``, names the prefix twice for a request that
    already carries it: ``no route /unmask/unmask/v1/x``), and the router strips it once."""
    root, path = (scope.get("root_path") or "").rstrip("/"), scope.get("path") or "/"
    return (path[len(root):] or "/") if root and (path == root or path.startswith(root + "/")) else path


def _rejected(request: Request, err: APIError) -> JSONResponse:
    """The error response, with the request's one log line (requests that reach the engine log in
    ``run.Run.finish`` instead)."""
    log.info("%s %s status=%d code=%s param=%s", request.method, request.url.path, err.status, err.code, err.param)
    count_refusal(request.scope, err)
    return err.response()


def count_refusal(scope, err: APIError) -> None:
    """Count a 4xx answer in the app's ``request_refused_total`` (the app: ``scope["app"]``, which Starlette sets
    before any middleware runs)."""
    state = getattr(getattr(scope.get("app"), "state", None), "unmask", None)
    if state is not None:
        state.metrics.record_refusal(err.status, err.code)


def install_handlers(app) -> None:
    """Register the exception handlers that turn every failure into an OpenAI error body."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return _rejected(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return _rejected(request, validation_error(exc))

    @app.exception_handler(ParamError)
    async def _param(request: Request, exc: ParamError):
        return _rejected(request, from_exception(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 400 and exc.detail == _BODY_PARSE_DETAIL:
            return _rejected(request, APIError(400, f"invalid JSON body: {_body_parse_why(exc.__cause__)}",
                                               code="invalid_json"))
        path = routed_path(request.scope)
        msg = {404: f"no route {path}", 405: f"method {request.method} not allowed on {path}"}.get(
            exc.status_code, str(exc.detail))
        return _rejected(request, APIError(exc.status_code, msg, code={404: "not_found", 405: "method_not_allowed"}.get(
            exc.status_code), headers=getattr(exc, "headers", None)))

    @app.exception_handler(Exception)
    async def _fault(request: Request, exc: Exception):
        err = from_exception(exc)
        if err.status >= 500:
            log.error("request %s %s failed", request.method, request.url.path, exc_info=exc)
            return err.response()
        return _rejected(request, err)
