"""The consumer side of one request's events, shared by the local engine's :class:`~unmask.engine.RequestStream`
and the Ray ingress' ``RemoteStream`` (docs/design.md#threading-model): an ``asyncio.Queue`` of
:class:`~unmask.engine.outputs.StepEvent` s read as an async iterator that ends at :data:`EventStream.END` and
re-raises an exception put in its place. Standard library only (the server imports it through ``unmask.engine``).
"""
from __future__ import annotations

import asyncio
import time

__all__ = ["EventStream"]


class EventStream:
    """Events of one request with ``n`` choices, in the order they were put.

    Attributes:
        request_id, n: the request's id and number of choices.
        outputs: one ``CompletionOutput`` per choice (index = choice index), ``None`` until its finished event.
        resolved: the resolved ``DecodingPlan`` of choice 0 (read-only).
        submitted: wall time (``time.time()``, seconds) of the submit; first_step_time: wall time of the request's
            first step (None before).

    A producer puts events, then :data:`END` (or an exception, which the consumer's iteration raises) with
    :meth:`_put_now` on the consumer's event loop.
    """

    END = object()  # the last item: iteration stops

    def __init__(self, request_id: str, n: int, resolved):
        self.request_id, self.n, self.resolved = request_id, n, resolved
        self.outputs: list = [None] * n
        self.submitted = time.time()
        self.first_step_time: float | None = None
        self._queue: asyncio.Queue = asyncio.Queue()
        self._closed = False

    def __aiter__(self) -> "EventStream":
        return self

    async def __anext__(self):
        if self._closed:
            raise StopAsyncIteration
        item = await self._queue.get()
        if item is self.END:
            self._closed = True
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self._closed = True
            raise item
        return item

    def index_of(self, event) -> int:
        """Choice index (0..n-1) of one of this request's events."""
        return event.index

    @property
    def finished(self) -> bool:
        """True when every choice has finished (stop, length or abort)."""
        return all(o is not None for o in self.outputs)

    @property
    def queue_time(self) -> float | None:
        """Seconds between the submit and the request's first step (None while still waiting; clamped at 0: the
        two times may come from two machines' clocks)."""
        return None if self.first_step_time is None else max(0.0, self.first_step_time - self.submitted)

    def abort(self) -> None:
        raise NotImplementedError

    def _put_now(self, item) -> None:
        """Put ``item`` (an event, :data:`END` or an exception); call on the consumer's event loop."""
        self._queue.put_nowait(item)
