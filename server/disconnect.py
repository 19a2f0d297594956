"""A non-streamed request run to its end while watching for a client disconnect and a server shutdown.

The engine streams are drained in one task, the ASGI ``receive`` channel (``http.disconnect``) in another, the
serving loop's shutdown event in a third; whichever ends first decides: the body, nothing (the client went away:
the engine requests are aborted) or a 503 ``server_shutdown``.
"""
from __future__ import annotations

import asyncio
import logging

from .accounting import failure_reason
from .errors import from_exception, shutdown_error
from .run import Run

log = logging.getLogger("unmask.server")


async def collect(run: Run, request, timeout: float | None, shutdown: asyncio.Event | None = None) -> dict | None:
    """Run a non-streamed request to the end.

    Returns the response body, or None when the client went away (the engine requests are aborted).

    Raises:
        APIError (timeout -> 503; ``shutdown`` set -> 503 ``server_shutdown``), EngineError (500), EngineClosed
        (503): the engine requests are aborted first.
    """

    async def drain():
        async for _ in run.events(timeout):
            pass

    consume = asyncio.create_task(drain())
    watch = asyncio.create_task(wait_disconnect(request))
    stop = asyncio.create_task(shutdown.wait()) if shutdown is not None else None
    try:
        waiting = {consume, watch} | ({stop} if stop else set())
        while True:
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if done == {stop} and stop.exception() is not None:  # no usable shutdown signal: keep serving
                log.warning("%s: shutdown watcher failed (%r); serving on without it", run.id, stop.exception())
                waiting.discard(stop)
                continue
            break
        if consume not in done:
            consume.cancel()
            run.abort()
            if watch in done:  # the client disconnected
                run.finish(499, "abort")
                return None
            run.finish(503, "abort")
            raise shutdown_error()
        try:
            consume.result()
        except Exception as exc:
            run.abort()
            err = from_exception(exc)
            run.finish(err.status, failure_reason(exc, err))
            raise err from exc
        run.finish(200)
        return run.body()
    finally:
        watch.cancel()
        if stop is not None:
            stop.cancel()
        if not consume.done():
            consume.cancel()
        if not run.done:  # cancelled from outside
            run.abort()
            run.finish(499, "abort")


async def wait_disconnect(request) -> None:
    """Return when the client disconnects (the ASGI ``http.disconnect`` message)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
