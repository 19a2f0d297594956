"""The engine as the ingress of a Ray Serve deployment sees it (docs/design.md#scale-out): :class:`RemoteEngine`
has the part of :class:`~unmask.engine.AsyncEngine`'s surface the app uses (``submit_many``, ``submit``,
``score``, the tokenizer and limits, ``alive``, ``stats``, the request counters), and runs every request on an
engine replica through a Ray Serve deployment handle. So the ingress is the unchanged app of ``build_app``:
validation, templates, tokenizing, rendering and SSE happen there, the replicas only decode.

Wire protocol of ``EngineReplica.generate`` (a streaming handle call, one per API request): the first item is
``("admitted", {"resolved", "replica", "node", "metrics"})`` or ``("refused", exception)`` (the engine's own
``ParamError`` / ``QueueFull`` / ``CacheFull`` / ``EngineClosed``, raised here at the submit as the local engine
raises them); then lists of ``(prompt index, item, first step time)``, ``item`` a ``StepEvent``, ``None`` (that
prompt's stream ended) or an exception. A replica that dies mid-stream fails the handle's iteration: every
unfinished stream of that call gets :class:`~unmask.engine.EngineError`, which the app turns into an error event
and ``[DONE]`` (a JSON 500 when not streamed). Aborting a stream cancels the call; the replica's generator then
aborts its engine requests. Ray is not imported here (the handle is passed in).
"""
from __future__ import annotations

import asyncio
import time

from unmask.engine import EngineClosed, EngineError, EventStream, route_keys

__all__ = ["RemoteEngine", "RemoteStream", "replica_call"]

_END = EventStream.END


class RemoteStream(EventStream):
    """One prompt's events from a replica: :class:`~unmask.engine.RequestStream`'s interface (the shared
    :class:`~unmask.engine.EventStream`; ``queue_time`` compares two machines' clocks)."""

    def __init__(self, call: "_Call", request_id: str, n: int, resolved):
        super().__init__(request_id, n, resolved)
        self._call = call
        self._ended = False  # producer side: nothing more will be put

    def abort(self) -> None:
        """Cancel the request: the whole call (every prompt of the API request) on its replica."""
        self._call.cancel()

    def _put(self, item) -> None:
        if not self._ended:
            if item is _END or isinstance(item, BaseException):
                self._ended = True
            self._put_now(item)


class _Call:
    """One ``generate`` call on a replica: its streams, fed by :meth:`pump` on the ingress's event loop."""

    def __init__(self, engine: "RemoteEngine", gen):
        self.engine, self.gen = engine, gen
        self.streams: list[RemoteStream] = []
        self.task: asyncio.Task | None = None
        self.replica = None

    async def pump(self) -> None:
        try:
            async for batch in self.gen:
                for p, item, first_step in batch:
                    self._deliver(self.streams[p], item, first_step)
        except asyncio.CancelledError:
            pass
        except Exception as exc:  # the replica died or its call failed: the clients hear of it
            error = EngineError(f"engine replica {self.replica} failed: {type(exc).__name__}: "
                                f"{str(exc).splitlines()[0] if str(exc) else ''}")
            for s in self.streams:
                s._put(error)
        finally:
            for s in self.streams:
                s._put(_END)
            self.engine._calls.discard(self)

    def _deliver(self, stream: RemoteStream, item, first_step: float | None) -> None:
        if first_step is not None and stream.first_step_time is None:
            stream.first_step_time = first_step
        if item is None:
            stream._put(_END)
            return
        if not isinstance(item, BaseException) and item.finished:
            stream.outputs[item.index] = item.output
        stream._put(item)

    def cancel(self) -> None:
        if self.task is not None and not self.task.done():
            self.gen.cancel()
            self.task.cancel()


class RemoteEngine:
    """The engine replicas behind a Ray Serve handle, as the app's engine.

    Args:
        handle: the ``EngineReplica`` deployment's handle (``generate`` streaming, ``score``).
        info: what ``EngineReplica.info()`` returned: ``tokenizer``, ``dllm``, ``max_context``, ``max_queue``.

    Counters (``/health``): ``num_running`` / ``num_waiting``: this ingress's requests in flight whose first step
    has / has not run. The gauges read from an engine (queued and running requests, KV usage, prefix-cache
    counters) are each replica's own ``/metrics``, not the ingress's (``exports_engine_metrics``).
    """

    exports_engine_metrics = False

    def __init__(self, handle, info: dict):
        self.handle = handle
        self.tokenizer, self.dllm = info["tokenizer"], info["dllm"]
        self.max_context, self.max_queue = info["max_context"], info["max_queue"]
        self.replicas: dict[str, dict] = {}  # replica id -> {"node", "metrics"}: every replica that admitted a request
        self._calls: set[_Call] = set()
        self._stopping = False

    @property
    def alive(self) -> bool:
        return not self._stopping

    @property
    def num_running(self) -> int:
        return sum(1 for c in self._calls for s in c.streams if s.first_step_time is not None and not s._ended)

    @property
    def num_waiting(self) -> int:
        return sum(1 for c in self._calls for s in c.streams if s.first_step_time is None and not s._ended)

    def stats(self) -> dict:
        return {"running": self.num_running, "waiting": self.num_waiting, "replicas": len(self.replicas)}

    def shutdown(self, timeout: float | None = None) -> None:  # noqa: ARG002 - AsyncEngine's signature
        self._stopping = True
        for call in list(self._calls):
            call.cancel()

    def submit(self, prompt_ids, params, request_id=None, n=1, fit_max_tokens=False, loop=None, group=None,
               cache_salt=None):
        return self.submit_many([prompt_ids], params, [request_id or f"req-{time.time_ns()}"], n=n,
                                fit_max_tokens=fit_max_tokens, loop=loop, group=group, cache_salt=cache_salt)[0]

    def submit_many(self, prompts, params, request_ids, n=1, fit_max_tokens=False, loop=None, group=None,
                    cache_salt=None) -> list[RemoteStream]:
        """:meth:`AsyncEngine.submit_many` on a replica chosen by the deployment's router. Called from a worker
        thread with the serving ``loop`` (as the app calls it); waits for the replica's admission.

        Raises:
            the replica's ParamError / QueueFull / CacheFull / EngineClosed; EngineClosed when no replica answers.
        """
        if self._stopping:
            raise EngineClosed("the ingress is shutting down")
        coro = self._open(prompts, params, request_ids, n, fit_max_tokens, group, cache_salt)
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if loop is None or running is loop:
            raise RuntimeError("RemoteEngine.submit_many: call it from a worker thread with the serving loop")
        return asyncio.run_coroutine_threadsafe(coro, loop).result()

    async def _open(self, prompts, params, request_ids, n, fit_max_tokens, group, cache_salt) -> list[RemoteStream]:
        keys = route_keys(prompts[0], cache_salt)  # the first prompt's chain (a completions batch's others follow it)
        gen = self.handle.options(stream=True).generate.remote(
            [list(p) for p in prompts], params, list(request_ids), n=n, fit_max_tokens=fit_max_tokens, group=group,
            cache_salt=cache_salt, route_keys=keys)
        try:
            kind, payload = await gen.__anext__()
        except Exception as exc:
            raise EngineClosed(f"no engine replica took the request: {type(exc).__name__}: "
                               f"{str(exc).splitlines()[0] if str(exc) else ''}") from exc
        if kind == "refused":
            raise payload
        call = _Call(self, gen)
        call.replica = payload["replica"]
        self.replicas[payload["replica"]] = {"node": payload["node"], "metrics": payload["metrics"]}
        call.streams = [RemoteStream(call, rid, n, resolved) for rid, resolved in zip(request_ids,
                                                                                     payload["resolved"])]
        self._calls.add(call)
        call.task = asyncio.create_task(call.pump())
        return call.streams

    async def score(self, prompt_ids, top_k: int = 0, samples: int | None = None, seed: int = 0):
        """:meth:`AsyncEngine.score` on a replica (the prompt's own prefix routes it)."""
        kind, payload = await self.handle.score.remote(list(prompt_ids), top_k, samples, seed,
                                                       route_keys=route_keys(prompt_ids))
        if kind == "refused":
            raise payload
        return payload


# ---------------------------------------------------------------------------------------------- the replica's end
async def replica_call(engine, where: dict, prompts, params, request_ids, n=1, fit_max_tokens=False, group=None,
                       cache_salt=None):
    """The replica's end of one call: ``engine.submit_many`` (an :class:`~unmask.engine.AsyncEngine`) and its
    events in the wire protocol above; ``where``: the replica's ``replica`` / ``node`` / ``metrics``. A cancelled
    or closed generator aborts the engine requests not finished."""
    loop = asyncio.get_running_loop()
    try:  # building the requests checks every prompt id: off the event loop, as the app does
        streams = await asyncio.to_thread(lambda: engine.submit_many(
            prompts, params, request_ids, n=n, fit_max_tokens=fit_max_tokens, loop=loop, group=group,
            cache_salt=cache_salt))
    except Exception as exc:  # ParamError, QueueFull, CacheFull, EngineClosed: the ingress raises it
        yield ("refused", exc)
        return
    yield ("admitted", {"resolved": [s.resolved for s in streams], **where})
    queue: asyncio.Queue = asyncio.Queue()
    tasks = [asyncio.create_task(_pump(p, s, queue)) for p, s in enumerate(streams)]
    try:
        open_streams = len(streams)
        while open_streams:
            batch = [await queue.get()]
            while not queue.empty():  # every event ready now in one message
                batch.append(queue.get_nowait())
            open_streams -= sum(1 for _, item, _ in batch if item is None or isinstance(item, BaseException))
            yield batch
    finally:
        for s in streams:
            if not s.finished:
                s.abort()
        for t in tasks:
            t.cancel()


async def _pump(p: int, stream, queue: asyncio.Queue) -> None:
    """Stream ``p``'s events into ``queue`` as ``(p, event, first step time)``; then ``(p, None, t)``, or
    ``(p, exception, t)`` when it failed."""
    try:
        async for ev in stream:
            queue.put_nowait((p, ev, stream.first_step_time))
    except Exception as exc:
        queue.put_nowait((p, exc, stream.first_step_time))
        return
    queue.put_nowait((p, None, stream.first_step_time))
