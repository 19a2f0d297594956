"""Structure bounds checked on the raw JSON body, off the event loop, before any model parses it
(docs/design.md#admission-and-limits).

A body under the size limit can still be slow to validate: 150,000 content parts in 4 MB kept pydantic (on the
event loop) busy for 1-1.4 s, and ``/health`` waited. :class:`BodyLimitsMiddleware` (inside the guard, which has
already bounded the body's size) parses the body in a worker thread and walks it once, iteratively
(:func:`structure_error`): first the whole body's arrays and objects and its values, counted on its bytes before
any parse (:func:`size_error`: a 3.6 MB body of 900,000 one-element lists held the GIL for seconds in ``json.loads``
alone, from a worker thread too), then nesting depth, entries of any array or object, content parts per message,
tools, and the JSON values in all of the request's schemas, against the bounds :mod:`unmask.engine.limits` declares. A body past
one is a 400 naming the field and the limit, before FastAPI reads it; a body within them is handed on unchanged
(its validation is then bounded by the same counts). Bodies that are not JSON are left to FastAPI's own 400.
"""
from __future__ import annotations

import asyncio
import json

from unmask.engine.limits import (MAX_CONTENT_PARTS, MAX_JSON_CONTAINERS, MAX_JSON_DEPTH, MAX_JSON_ITEMS,
                                  MAX_JSON_VALUES, MAX_SCHEMA_NODES, MAX_TOOLS)

from .errors import APIError, count_refusal

#: every bound this module checks, as published in the OpenAPI schema (``info.x-limits``)
STRUCTURE_LIMITS = {"max_content_parts_per_message": MAX_CONTENT_PARTS, "max_tools": MAX_TOOLS,
                    "max_schema_nodes": MAX_SCHEMA_NODES, "max_json_depth": MAX_JSON_DEPTH,
                    "max_json_items": MAX_JSON_ITEMS, "max_json_containers": MAX_JSON_CONTAINERS,
                    "max_json_values": MAX_JSON_VALUES}
SCHEMA_KEYS = ("parameters", "schema")  # a tool's parameters; response_format.json_schema.schema, text.format.schema
CODE = "request_too_complex"
_CHUNK = 1 << 16  # bytes counted per C call: between two, the event loop's thread may take the GIL


def _too(param: str, what: str, limit: int) -> APIError:
    return APIError(400, f"{param}: {what} exceeds the server's limit of {limit}", param=param, code=CODE)


def _count(node) -> int:
    """JSON values in ``node`` (iteratively)."""
    n, stack = 0, [node]
    while stack:
        cur = stack.pop()
        n += 1
        if isinstance(cur, dict):
            stack.extend(cur.values())
        elif isinstance(cur, list):
            stack.extend(cur)
    return n


def _deeper(path: tuple, key) -> tuple:
    """The param path of a child: up to 4 keys, and none past a schema (``tools.1.function.parameters``)."""
    return path if len(path) >= 4 or (path and path[-1] in SCHEMA_KEYS) else path + (key,)


def _check_top(body: dict) -> APIError | None:
    """The named counts: tools, content parts per message / input item, schema nodes."""
    tools = body.get("tools")
    if isinstance(tools, list) and len(tools) > MAX_TOOLS:
        return _too("tools", f"{len(tools)} tools", MAX_TOOLS)
    for key in ("messages", "input"):
        items = body.get(key)
        for i, item in enumerate(items if isinstance(items, list) else ()):
            content = item.get("content") if isinstance(item, dict) else None
            if isinstance(content, list) and len(content) > MAX_CONTENT_PARTS:
                return _too(f"{key}.{i}.content", f"{len(content)} content parts", MAX_CONTENT_PARTS)
    schemas = []
    for tool in tools if isinstance(tools, list) else ():
        if isinstance(tool, dict):
            fn = tool.get("function")
            schemas.append(("tools", (fn if isinstance(fn, dict) else tool).get("parameters")))
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and isinstance(fmt.get("json_schema"), dict):
        schemas.append(("response_format", fmt["json_schema"].get("schema")))
    text = body.get("text")
    if isinstance(text, dict) and isinstance(text.get("format"), dict):
        schemas.append(("text.format", text["format"].get("schema")))
    total = 0
    for param, schema in schemas:
        if schema is not None:
            total += _count(schema)
            if total > MAX_SCHEMA_NODES:
                return _too(param, f"{total} JSON values in the request's schemas", MAX_SCHEMA_NODES)
    return None


def _outside_strings(data: bytes) -> tuple[int, int]:
    """``(arrays and objects, commas)`` of a JSON text outside its strings: escaped backslashes and quotes dropped,
    then the text split at its quotes (every other piece is inside a string), 64 KiB at a time."""
    data = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    containers = commas = 0
    inside = False
    for i in range(0, len(data), _CHUNK):
        pieces = data[i:i + _CHUNK].split(b'"')
        out = b"".join(pieces[1::2] if inside else pieces[0::2])
        containers += out.count(b"[") + out.count(b"{")
        commas += out.count(b",")
        inside ^= len(pieces) % 2 == 0  # an odd number of quotes in the chunk
    return containers, commas


def size_error(data: bytes) -> APIError | None:
    """The body's arrays and objects past :data:`MAX_JSON_CONTAINERS` or its values past :data:`MAX_JSON_VALUES`,
    counted on the bytes before any parse (a parse of too many containers is the stall itself: it holds the GIL):
    brackets and braces outside strings are the containers, commas outside strings + containers + 1 bound the
    values. Byte counts first; the strings are set aside only when the brackets in them could matter."""
    containers = data.count(b"[") + data.count(b"{")
    if containers <= MAX_JSON_CONTAINERS and data.count(b",") + containers < MAX_JSON_VALUES:
        return None
    containers, commas = _outside_strings(data)
    if containers > MAX_JSON_CONTAINERS:
        return _too("body", f"{containers} JSON arrays and objects", MAX_JSON_CONTAINERS)
    if commas + containers + 1 > MAX_JSON_VALUES:
        return _too("body", f"{commas + containers + 1} JSON values", MAX_JSON_VALUES)
    return None


def structure_error(data: bytes) -> APIError | None:
    """The first bound ``data`` (a JSON body) exceeds, as a 400; None when it is within every bound or is not JSON
    (FastAPI answers that). The whole body's counts on its bytes (:func:`size_error`), then one iterative pass over
    the parsed value."""
    err = size_error(data)
    if err is not None:
        return err
    try:
        body = json.loads(data)
    except (ValueError, RecursionError):  # FastAPI's parse fails the same way, as fast: its invalid_json 400
        return None
    stack = [(body, 1, ())]  # the 400's param: _deeper
    while stack:
        node, depth, path = stack.pop()
        if isinstance(node, (dict, list)):
            param = ".".join(map(str, path)) or "body"
            if depth > MAX_JSON_DEPTH:
                return _too(param, "JSON nesting", MAX_JSON_DEPTH)
            if len(node) > MAX_JSON_ITEMS:
                return _too(param, f"{len(node)} entries", MAX_JSON_ITEMS)
            items = node.items() if isinstance(node, dict) else enumerate(node)
            stack.extend((v, depth + 1, _deeper(path, k)) for k, v in items)
    return _check_top(body) if isinstance(body, dict) else None


class BodyLimitsMiddleware:
    """Pure ASGI: for a request with a body (POST/PUT/PATCH), read it, run :func:`structure_error` in a worker
    thread, answer its 400 or replay the body to the app. Other requests pass through untouched."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        data = b"".join(chunks)
        err = await asyncio.to_thread(structure_error, data) if data else None
        if err is not None:
            count_refusal(scope, err)
            return await err.response()(scope, receive, send)
        await self.app(scope, replay_body(data, receive), send)


def replay_body(data: bytes, receive):
    """An ASGI ``receive`` that hands the app the already read body ``data`` as one message, then defers to
    ``receive`` (a disconnect after the body)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": data, "more_body": False}
        return await receive()

    return replay
