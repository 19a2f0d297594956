"""A stream's send buffer, bounded (docs/design.md#admission-and-limits, issue 41).

sse-starlette sends each event as its generator yields it, and uvicorn's ``send`` waits while the socket's buffer
is full: a client that stops reading stops the generator, and the engine's events for the request pile up unread
in its queue (0.5 -> 1.2 GB in 40 s with denoising chunks, n 16), the request holding its batch slot all along.
:func:`bounded` runs the generator ahead of the sender in a task of its own: what it has produced and the sender
has not yet taken is the stream's buffer, counted in bytes; past ``cap`` the request is aborted (``on_overflow``:
the engine frees its slot and stops producing) and the stream ends. The connection itself is released by the
response's ``send_timeout`` (a send that waits longer than the read timeout closes it).
"""
from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable

log = logging.getLogger("unmask.server")

DEFAULT_STREAM_BUFFER_BYTES = 8 * 1024 * 1024


def stream_response(events, **kw):
    """sse-starlette's ``EventSourceResponse`` over ``events``, whose ``send_timeout`` (a client that accepts no
    chunk for that long) ends the stream in one log line rather than a traceback (the generator's cleanup aborts
    the request; the connection is closed)."""
    from sse_starlette.sse import EventSourceResponse, SendTimeoutError

    class StreamResponse(EventSourceResponse):
        async def __call__(self, scope, receive, send):
            try:
                await super().__call__(scope, receive, send)
            except SendTimeoutError:
                log.warning("%s %s: the client accepted no data for %s s; stream ended, request aborted",
                            scope.get("method"), scope.get("path"), self.send_timeout)

    return StreamResponse(events, **kw)


def _size(item) -> int:
    if isinstance(item, (str, bytes)):
        return len(item)
    data = item.get("data", "") if isinstance(item, dict) else getattr(item, "data", "")
    return len(data or "")


async def bounded(events: AsyncIterator, cap: int, on_overflow: Callable[[], None],
                  name: str = "stream") -> AsyncIterator:
    """The items of ``events``, produced ahead of the consumer; once more than ``cap`` bytes wait unsent,
    ``on_overflow()`` is called, ``events`` is closed (its own cleanup runs) and the stream ends."""
    buf: deque = deque()
    state = {"bytes": 0, "done": False, "overflow": False}
    ready = asyncio.Event()

    async def produce() -> None:
        try:
            async for item in events:
                buf.append(item)
                state["bytes"] += _size(item)
                ready.set()
                if state["bytes"] > cap:
                    state["overflow"] = True
                    log.warning("%s: the client is not reading: %d bytes unsent exceed the stream buffer of %d "
                                "bytes; request aborted", name, state["bytes"], cap)
                    on_overflow()
                    await events.aclose()
                    return
        finally:
            state["done"] = True
            ready.set()

    task = asyncio.create_task(produce())
    try:
        while True:
            if not buf:
                if state["done"]:
                    break
                ready.clear()
                await ready.wait()
                continue
            if state["overflow"]:  # nothing more for a client that does not read
                break
            item = buf.popleft()
            state["bytes"] -= _size(item)
            yield item
        if task.done() and not task.cancelled() and task.exception() is not None:
            raise task.exception()
    finally:
        if not task.done():
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - its cleanup ran; the stream is over
                pass
