"""Merging the per-prompt engine streams of one API request into one stream of ``(choice index, event)``.

A request with ``P`` prompts and ``n`` choices each is ``P`` engine requests; choice index ``p * n + i`` is choice
``i`` (``StepEvent.index``) of prompt ``p``. Events come in the order the engine delivered them; a deadline (the
server's ``--request-timeout``, counted from the request's arrival) raises :class:`TimeoutError`.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from unmask.engine import RequestStream, StepEvent


async def choice_events(streams: list[RequestStream], n: int, deadline: float | None = None,
                        timeout: float | None = None) -> AsyncIterator[tuple[int, StepEvent]]:
    """``(choice index, event)`` for every event of every stream, until all choices finished.

    Args:
        streams: one engine stream per prompt. n: choices per prompt.
        deadline: ``time.time()`` after which :class:`TimeoutError` is raised (None = none); timeout: the seconds it
            stands for (for the message).

    Raises:
        TimeoutError: at the deadline. EngineError / EngineClosed from the engine.
    """
    source = _tagged(0, streams[0]) if len(streams) == 1 else _interleave(streams)
    try:
        while True:
            remaining = None if deadline is None else deadline - time.time()
            if remaining is not None and remaining <= 0:
                raise TimeoutError(f"{timeout:g} s (--request-timeout)")
            try:
                p, ev = await asyncio.wait_for(source.__anext__(), remaining)
            except StopAsyncIteration:
                return
            except asyncio.TimeoutError:
                raise TimeoutError(f"{timeout:g} s (--request-timeout)") from None
            yield p * n + ev.index, ev
    finally:
        await source.aclose()


async def _tagged(p: int, stream: RequestStream):
    async for ev in stream:
        yield p, ev


async def _interleave(streams: list[RequestStream]):
    """Several engine streams as ``(prompt index, event)`` in arrival order."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(p: int, stream: RequestStream):
        try:
            async for ev in stream:
                queue.put_nowait((p, ev))
        except Exception as exc:
            queue.put_nowait((p, exc))
            return
        queue.put_nowait((p, None))

    tasks = [asyncio.create_task(pump(p, s)) for p, s in enumerate(streams)]
    try:
        open_streams = len(streams)
        while open_streams:
            p, item = await queue.get()
            if item is None:
                open_streams -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield p, item
    finally:
        for t in tasks:
            t.cancel()
