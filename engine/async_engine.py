"""The engine the server talks to: one background thread owns the model and the scheduler; asyncio code submits
requests and consumes their :class:`~unmask.engine.outputs.StepEvent` streams (docs/design.md#layout-and-layers and
#decoding, "Scheduling"). The loop itself is :class:`~unmask.engine.engine.Engine`'s; this module adds the thread.

Threading model:

* The **engine thread** is the only code that drives the :class:`~unmask.engine.engine.Engine` (its scheduler,
  the requests' canvases and the model). It sleeps on a condition variable while there is no work, otherwise it
  moves newly submitted sequences into the scheduler, applies pending aborts, and runs one step.
* The **event loop** side calls :meth:`AsyncEngine.submit` (validation, building the sequences, admission checks:
  synchronous, so errors surface at the call) and iterates the returned :class:`RequestStream`. Events cross
  threads with ``loop.call_soon_threadsafe(queue.put_nowait, ...)`` into one ``asyncio.Queue`` per request.
* :meth:`AsyncEngine.abort` only records the request id; the engine thread applies it before its next step (a
  cancelled request takes part in at most the step already running; its slot and KV cache are freed then).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
import time

from .engine import Engine
from .event_stream import EventStream
from .model import LoadedModel
from .options import EngineConfig
from .outputs import CompletionOutput, StepEvent
from .params import ParamError, SamplingParams
from .request import Request
from .scheduler import CacheFull, QueueFull

__all__ = ["AsyncEngine", "RequestStream", "EngineError", "EngineClosed", "QueueFull", "CacheFull", "ParamError"]

log = logging.getLogger("unmask.engine")
_END = EventStream.END
_auto_ids = itertools.count()


class EngineError(RuntimeError):
    """A genuine fault inside the engine thread (e.g. a model forward raised); the request was dropped."""


class EngineClosed(RuntimeError):
    """The engine is shut down (or its thread died) and accepts no more requests."""


class RequestStream(EventStream):
    """The events of one submitted request, as an async iterator (returned by :meth:`AsyncEngine.submit`).

    Every :class:`StepEvent` of every choice is yielded in the order the engine produced them; the iterator ends
    after the last choice's ``finished`` event. :meth:`index_of` gives an event's choice index. The attributes are
    :class:`~unmask.engine.event_stream.EventStream`'s (``outputs`` set before a choice's finished event is
    delivered).

    Raises (while iterating):
        EngineError: the engine failed while running this request.
        EngineClosed: the engine shut down before the request finished.
    """

    def __init__(self, engine: "AsyncEngine", request_id: str, sequences: list[Request],
                 loop: asyncio.AbstractEventLoop):
        super().__init__(request_id, len(sequences), sequences[0].plan)
        self._choices = sequences  # engine side only: callers read outputs, resolved and the events
        self._engine = engine
        self._loop = loop
        self._open = len(sequences)  # choices not finished yet (engine thread only)

    def abort(self) -> None:
        """Cancel the request (same as ``engine.abort(request_id)``)."""
        self._engine.abort(self.request_id)

    # ------------------------------------------------------------------ engine-thread side
    def _put(self, item) -> None:
        try:
            self._loop.call_soon_threadsafe(self._put_now, item)
        except RuntimeError:  # the consumer's event loop is closed: nobody is listening any more
            pass


class AsyncEngine:
    """Continuous-batching engine for asyncio servers.

    Args:
        loaded_model: the :class:`LoadedModel` to serve.
        config: the engine options (:class:`~unmask.engine.options.EngineConfig`; the loading ones are unused here);
            ``**options``: single fields of it, replacing ``config``'s (``max_batch_size=8``). ``max_queue``: most
            sequences waiting for a batch slot (``n`` choices count ``n``); beyond it :class:`QueueFull`.
            ``max_cached_tokens``: KV budget in canvas tokens (see :class:`Scheduler`); a request that can never fit
            raises :class:`ParamError` (HTTP 400; an unset ``max_tokens`` is lowered to fit first), one that fits the
            budget but not what is left of it waits in the queue; ``None`` = unlimited. ``default_drafts``,
            ``block_size``, ``max_model_len``: the decoding plan's inputs (``unmask.engine.plan.engine_defaults``).
            ``enable_prefix_caching``: reuse committed KV across requests that share a prompt prefix
            (docs/design.md#prefix-reuse; the store counts against ``max_cached_tokens`` and is evicted first).
            ``prefill_chunk``: row-equivalents per step before a sequence's first step (chunked prefill,
            docs/design.md#decoding).

    Counters (read from any thread; updated by the engine thread after every step):
        ``num_running`` / ``num_waiting``: requests with a sequence in the running batch / all other unfinished
        requests. ``nfe``: batched model forwards run by the engine (engine-level NFE; a request's own NFE is
        ``CompletionOutput.nfe``). ``steps``: scheduler steps run.

    Example::

        engine = AsyncEngine(load_model("ckpt"))
        stream = engine.submit(prompt_ids, SamplingParams(max_tokens=32, seed=0), "req-1")
        async for event in stream:
            print(event.text)
        engine.shutdown()
    """

    def __init__(self, loaded_model: LoadedModel, config: EngineConfig | None = None, **options):
        self.engine = Engine(loaded_model, config, **options)
        self.config = config = self.engine.config
        self.model = loaded_model
        # read-only for the server: the tokenizer, the context length in tokens (the engine's), the DllmConfig
        self.tokenizer, self.dllm = loaded_model.tokenizer, loaded_model.dllm
        self.max_context = self.engine.max_context
        self.denoiser = self.engine.denoiser
        self.scheduler = self.engine.scheduler
        self.max_batch_size = config.max_batch_size
        self.max_queue = config.max_queue
        self.max_cached_tokens = config.max_cached_tokens
        self._cond = threading.Condition()
        self._inbox: list[tuple[RequestStream, list[Request]]] = []  # guarded by _cond
        self._aborts: set[str] = set()  # guarded by _cond
        self._jobs: list[tuple] = []  # (function, concurrent Future) run by the engine thread; guarded by _cond
        self._queued_seqs = 0  # sequences in _inbox + scheduler.waiting; guarded by _cond
        self._requests: dict[str, RequestStream] = {}  # guarded by _cond (written by both sides)
        self._owner: dict[str, RequestStream] = {}  # request id -> its stream; engine thread only
        self._stopping = False
        self.num_running = 0
        self.num_waiting = 0
        self.steps = 0
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="unmask-engine", daemon=True)
        self._thread.start()

    @property
    def defaults(self):
        """The engine's :class:`~unmask.engine.plan.EngineDefaults` (what a request that sets nothing gets)."""
        return self.engine.defaults

    def describe_defaults(self) -> str:
        """What a request that sets nothing gets (the decoding plan's own line, :meth:`Engine.describe_defaults`)."""
        return self.engine.describe_defaults()

    # ------------------------------------------------------------------ public API (event-loop side)
    @property
    def nfe(self) -> int:
        """Batched model forwards run so far (engine-level NFE)."""
        return self.denoiser.forwards

    @property
    def alive(self) -> bool:
        """True while the engine thread runs and accepts requests."""
        return self._thread.is_alive() and not self._stopping

    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None, n: int = 1,
               fit_max_tokens: bool = False, loop: asyncio.AbstractEventLoop | None = None,
               group: str | None = None, cache_salt: str | None = None) -> RequestStream:
        """Queue one request (``n`` choices with seeds seed, seed+1, ...) and return its event stream.

        Must be called from a running event loop (the stream's events are delivered to it), or from a worker
        thread with that ``loop`` given (the server builds requests off its event loop).

        Args:
            prompt_ids: prompt token ids (already templated).
            params: sampling parameters (``temperature``/``seed`` ``None`` = checkpoint default / random).
            request_id: unique id (default: generated). n: number of choices. group: the unit of fair admission
            (default ``request_id``; the server passes one id for every prompt of a completions request).
            cache_salt: the prefix cache's salt: stored KV is shared only among requests with the same salt (the
                server's tenant and the request's ``cache_salt``; docs/design.md#prefix-reuse). None: unsalted.
            fit_max_tokens: ``params.max_tokens`` is a default rather than the client's value: lower it until the
                canvas fits the model's context (docs/design.md#decisions: "lowered to the remaining context when
                unset") and the KV budget.

        Raises:
            ParamError: invalid or unsatisfiable parameters (names the field; e.g. ``max_tokens`` when prompt +
                generation region exceed the context, with both numbers, or when the request alone exceeds the KV
                budget: retrying could never help, so it is a client error, not :class:`CacheFull`).
            QueueFull: ``max_queue`` sequences are already waiting (retry later).
            EngineClosed: the engine is shut down or its thread died.
        """
        return self.submit_many([prompt_ids], params, [request_id or f"req-{next(_auto_ids)}"], n=n,
                                fit_max_tokens=fit_max_tokens, loop=loop, group=group, cache_salt=cache_salt)[0]

    def submit_many(self, prompts: list[list[int]], params: SamplingParams, request_ids: list[str], n: int = 1,
                    fit_max_tokens: bool = False, loop: asyncio.AbstractEventLoop | None = None,
                    group: str | None = None, cache_salt: str | None = None) -> list[RequestStream]:
        """Queue several prompts (one engine request each, ``request_ids[i]`` for ``prompts[i]``) atomically: all
        of them are admitted or none is (docs/design.md#admission-and-limits, "Atomic admission"). The arguments and
        errors are :meth:`submit`'s (a prompt's own error names ``prompt.i`` when there are several); ``group`` defaults
        to the first request id. A refused call leaves no trace in the queue.

        Raises:
            ValueError: ``len(prompts) != len(request_ids)`` or no prompt (a programming error).
        """
        if len(prompts) != len(request_ids) or not prompts:
            raise ValueError(f"submit_many: {len(prompts)} prompts for {len(request_ids)} request ids")
        loop = loop or asyncio.get_running_loop()
        if not self.alive:
            raise EngineClosed("the engine is not running" + (f" ({self.error})" if self.error else ""))
        group = group or request_ids[0]
        built: list[tuple[str, list[Request]]] = []
        for i, (ids, rid) in enumerate(zip(prompts, request_ids)):  # checks every prompt id: outside the lock
            try:
                seqs = self.engine.make_request(list(ids), params, rid, n, fit_max_tokens)
            except ParamError as exc:  # name the prompt of several (``prompt.1``), as the request's schema does
                raise ParamError(f"prompt.{i}", exc.reason) if exc.field == "prompt" and len(prompts) > 1 else exc
            # the unit of fair admission: the client's whole request (docs/design.md#admission-and-limits)
            for s in seqs:
                s.group = group
                s.cache_salt = cache_salt
            self.scheduler.check_fits(seqs)
            built.append((rid, seqs))
        self.scheduler.check_rows([s for _, seqs in built for s in seqs])  # the whole request's cost, every prompt
        streams = [RequestStream(self, rid, seqs, loop) for rid, seqs in built]
        with self._cond:  # one check against the capacity for the whole call, then register all of it
            for rid in request_ids:
                if rid in self._requests or request_ids.count(rid) > 1:
                    raise ParamError("request_id", f"{rid!r} is already in flight")
            self.scheduler.check_queue(sum(len(seqs) for _, seqs in built), self._queued_seqs)
            for stream, (_, seqs) in zip(streams, built):
                self._queued_seqs += len(seqs)
                self._requests[stream.request_id] = stream
                self._inbox.append((stream, seqs))
                self.num_waiting += 1
            self._cond.notify()
        return streams

    async def score(self, prompt_ids: list[int], top_k: int = 0, samples: int | None = None, seed: int = 0):
        """The log-probabilities of ``prompt_ids`` (:meth:`Engine.score`), computed by the engine thread between
        two steps (it owns the model); checked first, at the call.

        Raises:
            ParamError: the checkpoint cannot score prompts, the prompt is empty or too long, ``samples`` out of range.
            EngineClosed: the engine is shut down or its thread died.
        """
        from .scoring import check_scoring

        check_scoring(self.model, prompt_ids, samples)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if not self.alive:
                raise EngineClosed("the engine is not running" + (f" ({self.error})" if self.error else ""))
            self._jobs.append((lambda: self.engine.score(prompt_ids, top_k, samples, seed), fut))
            self._cond.notify()
        return await asyncio.wrap_future(fut)

    def abort(self, request_id: str) -> None:
        """Cancel a request (waiting or running). Safe to call from any thread, twice, or after it finished.
        The engine thread drops it before its next step and frees its batch slot and KV cache; the stream then
        yields a final event per unfinished choice with ``finish_reason="abort"``."""
        with self._cond:
            if request_id in self._requests:
                self._aborts.add(request_id)
                self._cond.notify()

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Stop the engine thread after its current step; unfinished requests get :class:`EngineClosed`."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def stats(self) -> dict:
        """Counters for /health and logs: running/waiting, ``batched_forwards`` (model calls, not ``usage.nfe``),
        steps, ``prefix_cache`` (docs/design.md#http-contract and #prefix-reuse)."""
        return {"running": self.num_running, "waiting": self.num_waiting, "batched_forwards": self.nfe,
                "steps": self.steps, "prefix_cache": self.engine.prefix_cache_stats()}

    def kv_usage(self) -> dict:
        """KV-cache use, read from any thread (the server's gauges, docs/design.md#deployment-and-metrics):
        ``reserved`` (cached tokens the running and paused sequences reserve), ``prefix`` (tokens the prefix store
        holds) and ``capacity`` (the KV budget ``max_cached_tokens``; without one the most the running batch can
        reserve, ``max_batch_size`` x the context)."""
        reserved, prefix = self.scheduler.kv_usage()
        capacity = self.max_cached_tokens or self.max_batch_size * self.max_context
        return {"reserved": reserved, "prefix": prefix, "capacity": capacity}

    prefix_cache_queries = property(lambda self: self.engine.prefix_cache_stats()["queries"],
                                    doc="Prompt tokens looked up in the prefix cache so far (0 without one).")
    prefix_cache_hits = property(lambda self: self.engine.prefix_cache_stats()["hits"],
                                 doc="Prompt tokens loaded from the prefix cache so far (0 without one).")

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                with self._cond:
                    while not (self._stopping or self._inbox or self._aborts or self._jobs
                               or engine.has_unfinished()):
                        self._cond.wait()
                    if self._stopping:
                        break
                    new, self._inbox = self._inbox, []
                    aborts, self._aborts = self._aborts, set()
                    jobs, self._jobs = self._jobs, []
                _run_jobs(jobs)
                for stream, seqs in new:
                    self._owner[stream.request_id] = stream
                    engine.enqueue(seqs)  # admission was checked at submit
                for rid in aborts:
                    self._abort_now(rid)
                if not engine.has_unfinished():
                    self._update_counters()
                    continue
                t_step = time.time()
                try:
                    events = engine.step()
                except Exception as exc:  # a genuine fault: fail the requests in the batch, keep serving
                    log.exception("engine step failed")
                    self._fail_running(EngineError(f"engine step failed: {type(exc).__name__}: {exc}"))
                    self._update_counters()
                    continue
                self.steps += 1
                puts = self._deliver(events, t_step)
                self._update_counters()  # before the consumers hear of it: a finished stream sees settled counters
                self._flush(puts)
        except BaseException as exc:  # pragma: no cover - the thread itself died
            self.error = exc
            log.exception("engine thread died")
        finally:
            self._close_all()

    def _deliver(self, events: list[StepEvent], t_step: float) -> list[tuple[RequestStream, object]]:
        """Bookkeeping for a step's events; returns the (stream, item) pairs to send with :meth:`_flush`."""
        puts: list[tuple[RequestStream, object]] = []
        for ev in events:
            stream = self._owner.get(ev.request_id)
            if stream is None:  # pragma: no cover - defensive
                continue
            if stream.first_step_time is None:
                stream.first_step_time = t_step
            puts.append((stream, ev))
            if ev.finished:
                stream.outputs[ev.index] = ev.output
                stream._open -= 1
                if stream._open == 0:
                    del self._owner[ev.request_id]
                    puts.append((stream, _END))
                    with self._cond:
                        self._requests.pop(stream.request_id, None)
        return puts

    @staticmethod
    def _flush(puts: list[tuple[RequestStream, object]]) -> None:
        for stream, item in puts:
            stream._put(item)

    def _abort_now(self, request_id: str) -> None:
        stream = self._requests.get(request_id)
        if stream is None:
            return
        events = self.engine.abort(request_id) if request_id in self._owner else []
        puts = self._deliver(events, time.time())
        self._update_counters()
        self._flush(puts)

    def _fail_running(self, error: BaseException) -> None:
        failed = []
        for stream in {self._owner[s.request_id] for s in self.scheduler.running if s.request_id in self._owner}:
            self.engine.abort(stream.request_id)
            del self._owner[stream.request_id]
            failed.append(stream)
            with self._cond:
                self._requests.pop(stream.request_id, None)
        self._update_counters()
        for stream in failed:
            stream._put(error)

    def _update_counters(self) -> None:
        running_ids = {self._owner[s.request_id].request_id for s in self.scheduler.running
                       if s.request_id in self._owner}
        with self._cond:
            self._queued_seqs = len(self.scheduler.waiting) + sum(len(seqs) for _, seqs in self._inbox)
            self.num_running = len(running_ids)
            self.num_waiting = len(self._requests) - len(running_ids & self._requests.keys())

    def _close_all(self) -> None:
        closed = EngineClosed("the engine shut down before the request finished")
        with self._cond:
            streams = list(self._requests.values())
            self._requests.clear()
            self._inbox.clear()
            jobs, self._jobs = self._jobs, []
            self._stopping = True
        for _, fut in jobs:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(closed)
        for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
            seq.release()
        self.scheduler.running.clear()
        self.scheduler.waiting.clear()
        self.scheduler.paused.clear()
        self._owner.clear()
        for stream in streams:
            stream._put(closed)
        self.num_running = self.num_waiting = 0


def _run_jobs(jobs: list[tuple]) -> None:
    """Run the engine thread's jobs (:meth:`AsyncEngine.score`), each result or error into its future."""
    for fn, fut in jobs:
        if not fut.set_running_or_notify_cancel():
            continue
        try:
            fut.set_result(fn())
        except Exception as exc:  # the caller sees it (a ParamError is a 400)
            fut.set_exception(exc)
