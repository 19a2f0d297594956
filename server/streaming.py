"""One API request in flight (:class:`Run`) and its OpenAI responses: the non-streamed body and the SSE stream.

Streaming rules (DESIGN.md sections 5 and 10, issue 3):

* every chunk of a response carries the same ``id`` and ``created`` (seconds);
* chat: the first chunk of each choice carries ``delta.role = "assistant"``;
* content deltas are differences of ``StepEvent.text``, the engine's stream-safe text (a left-to-right prefix
  that is final, never ends inside a multi-byte character, never ends with a stop-string prefix), so joined deltas
  equal the non-streamed text for the same seed;
* ``finish_reason`` is null until the last chunk of each choice;
* with ``stream_options.include_denoising`` each denoising step of each choice is one extra chunk with empty
  delta/text and a top-level ``denoising`` object (DESIGN.md section 10);
* with ``stream_options.include_usage`` every chunk has ``usage: null`` and a last chunk has ``choices: []`` and
  the usage;
* ``data: [DONE]`` ends every stream, also after an error, which is sent as ``data: {"error": {...}}``.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator

from unmask.engine.async_engine import RequestStream
from unmask.engine.sequence import StepEvent

from .errors import APIError, from_exception

log = logging.getLogger("unmask.server")


def dumps(obj) -> str:
    """Compact JSON (UTF-8 text kept as is)."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


class Run:
    """A submitted API request: one engine request per prompt, ``n`` choices each (choice index = p * n + i).

    Args:
        state: the app's :class:`~unmask.server.app.ServerState`.
        kind: ``chat`` | ``completion``.
        response_id: ``chatcmpl-...`` / ``cmpl-...``. created: unix seconds.
        prompt_ids: token ids per prompt. streams: engine streams, one per prompt. n: choices per prompt.
        arrival: ``time.time()`` when the request arrived. logprobs: 0 = off, 1 = on (chat: ``top_logprobs``
            decides whether the single alternative is listed).
    """

    def __init__(self, state, kind: str, response_id: str, created: int, prompt_ids: list[list[int]],
                 streams: list[RequestStream], n: int, arrival: float, logprobs: bool = False,
                 top_logprobs: int = 0):
        self.state = state
        self.kind = kind
        self.id = response_id
        self.created = created
        self.prompt_ids = prompt_ids
        self.streams = streams
        self.n = n
        self.arrival = arrival
        self.logprobs = logprobs
        self.top_logprobs = top_logprobs
        self.sequences = [seq for s in streams for seq in s.sequences]
        self.first_content_time: float | None = None
        self.done = False

    # ------------------------------------------------------------------ events
    async def events(self, timeout: float | None) -> AsyncIterator[tuple[int, StepEvent]]:
        """``(choice index, event)`` for every engine event of every prompt, until all choices finished.

        Raises:
            TimeoutError: ``timeout`` seconds after arrival. EngineError / EngineClosed from the engine.
        """
        deadline = None if timeout is None else self.arrival + timeout
        if len(self.streams) == 1:
            source = _tagged(0, self.streams[0])
        else:
            source = _merge(self.streams)
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
                yield p * self.n + self.streams[p].index_of(ev), ev
        finally:
            await source.aclose()

    def abort(self) -> None:
        """Cancel every unfinished engine request of this run (idempotent)."""
        for s in self.streams:
            if not s.finished:
                s.abort()

    # ------------------------------------------------------------------ accounting
    def usage(self) -> dict:
        """OpenAI usage (+ ``nfe``, ``denoising_steps``)."""
        prompt = sum(len(p) for p in self.prompt_ids)
        completion = sum(s.num_output_tokens for s in self.sequences)  # an unfinished (failed) one: its prefix
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "nfe": sum(s.nfe for s in self.sequences), "denoising_steps": sum(s.step for s in self.sequences)}

    def finish(self, status: int, failure: str | None = None) -> None:
        """Record metrics and write the request's log line (once)."""
        if self.done:
            return
        self.done = True
        end = time.time()
        u = self.usage()
        metrics = self.state.metrics
        if failure is None:
            firsts = [s.first_token_time for s in self.sequences if s.first_token_time]
            first = self.first_content_time or (min(firsts) if firsts else None)
            queue_times = [s.queue_time for s in self.streams if s.queue_time is not None]
            metrics.record_success(u["prompt_tokens"], self.sequences, self.arrival, end, first,
                                   min(queue_times) if queue_times else None)
        else:
            metrics.record_failure(failure, [(len(p), s.sequences) for p, s in zip(self.prompt_ids, self.streams)])
        tpf = u["completion_tokens"] / u["nfe"] if u["nfe"] else 0.0
        reasons = ",".join(str(s.finish_reason) for s in self.sequences)
        spec = [s for s in self.sequences if s.params.speculative]
        decoding = "diffusion"
        if spec:
            block = getattr(spec[0], "draft_block", None)
            decoding = ("speculative, one token per forward (no drafts)" if block == 1
                        else f"speculative, draft block {block}")
        log.info("%s status=%d prompt_tokens=%d completion_tokens=%d nfe=%d tpf=%.2f steps=%d seconds=%.3f "
                 "finish=%s decoding=%s%s", self.id, status, u["prompt_tokens"], u["completion_tokens"], u["nfe"], tpf,
                 u["denoising_steps"], end - self.arrival, reasons, decoding,
                 f" failure={failure}" if failure else "")

    # ------------------------------------------------------------------ response pieces
    def _token_entries(self, seq) -> list[tuple[str, float]]:
        ids = list(seq.output_ids)
        lps = seq.logprobs[: len(ids)].tolist()
        if ids and seq.finish_reason == "stop" and ids[-1] in seq.eos_ids:  # EOS: counted, never rendered
            ids, lps = ids[:-1], lps[:-1]
        # JSON has no -inf: clamp like vLLM (-9999.0 = "impossible"); the engine only reveals finite ones
        return [(self.state.token_text(t), lp if lp >= -9999.0 else -9999.0) for t, lp in zip(ids, lps)]

    def completion_logprobs(self, seq) -> dict | None:
        """Legacy-completions ``logprobs`` of one choice (EOS dropped, -inf clamped to -9999.0), or None when off."""
        if not self.logprobs:
            return None
        entries = self._token_entries(seq)
        offsets, pos = [], 0
        for tok, _ in entries:
            offsets.append(pos)
            pos += len(tok)
        return {"tokens": [t for t, _ in entries], "token_logprobs": [lp for _, lp in entries],
                "top_logprobs": [{t: lp} for t, lp in entries], "text_offset": offsets}

    def chat_logprobs(self, seq) -> dict | None:
        """Chat ``logprobs`` of one choice (EOS dropped, -inf clamped to -9999.0; ``bytes`` None for a token with
        U+FFFD), or None when off."""
        if not self.logprobs:
            return None
        content = []
        for tok, lp in self._token_entries(seq):
            b = None if "\ufffd" in tok else list(tok.encode("utf-8"))
            top = [{"token": tok, "logprob": lp, "bytes": b}] if self.top_logprobs else []
            content.append({"token": tok, "logprob": lp, "bytes": b, "top_logprobs": top})
        return {"content": content, "refusal": None}

    def response_body(self) -> dict:
        """The non-streamed ``chat.completion`` / ``text_completion`` object."""
        choices = []
        for i, seq in enumerate(self.sequences):
            if self.kind == "chat":
                choices.append({"index": i, "message": {"role": "assistant", "content": seq.text, "refusal": None},
                                "logprobs": self.chat_logprobs(seq), "finish_reason": seq.finish_reason})
            else:
                choices.append({"index": i, "text": seq.text, "logprobs": self.completion_logprobs(seq),
                                "finish_reason": seq.finish_reason})
        return {"id": self.id, "object": "chat.completion" if self.kind == "chat" else "text_completion",
                "created": self.created, "model": self.state.model_name, "choices": choices, "usage": self.usage()}


async def _tagged(p: int, stream: RequestStream):
    async for ev in stream:
        yield p, ev


async def _merge(streams: list[RequestStream]):
    """Interleave several engine streams as ``(prompt index, event)`` in arrival order."""
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


async def collect(run: Run, request, timeout: float | None, shutdown: asyncio.Event | None = None) -> dict | None:
    """Run a non-streamed request to the end while watching for a client disconnect and a server shutdown.

    Returns the response body, or None when the client went away (the engine requests are aborted).

    Raises:
        APIError (timeout -> 503; ``shutdown`` set -> 503 ``server_shutdown``), EngineError (500), EngineClosed
        (503): the engine requests are aborted first.
    """

    async def drain():
        async for _ in run.events(timeout):
            pass

    consume = asyncio.create_task(drain())
    watch = asyncio.create_task(_wait_disconnect(request))
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
            raise APIError(503, "the server is shutting down; retry on another instance or later",
                           code="server_shutdown", headers={"Retry-After": "1"})
        try:
            consume.result()
        except Exception as exc:
            run.abort()
            err = from_exception(exc)
            run.finish(err.status, _failure_reason(exc, err))
            raise err from exc
        run.finish(200)
        return run.response_body()
    finally:
        watch.cancel()
        if stop is not None:
            stop.cancel()
        if not consume.done():
            consume.cancel()
        if not run.done:  # cancelled from outside
            run.abort()
            run.finish(499, "abort")


async def _wait_disconnect(request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _failure_reason(exc: BaseException, err: APIError) -> str:
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, APIError) and exc.code in ("server_shutdown", "aborted"):
        return "abort"
    return err.code if err.code in ("queue_full", "cache_full") else "error"


async def sse_events(run: Run, include_usage: bool, include_denoising: bool, timeout: float | None,
                     shutdown_event=None):
    """The SSE ``data:`` payloads of a streamed request (strings; sse-starlette frames them).

    ``shutdown_event`` (an ``anyio.Event`` that sse-starlette sets when the server shuts down): the engine requests
    are aborted and the stream ends with an error event (``server_shutdown``) and ``[DONE]`` instead of a cut
    connection."""
    chat = run.kind == "chat"
    obj = "chat.completion.chunk" if chat else "text_completion"
    model = run.state.model_name
    base = {"id": run.id, "object": obj, "created": run.created, "model": model}
    if include_usage:
        base["usage"] = None

    def chunk(index: int, text: str | None = None, role: bool = False, finish: str | None = None,
              logprobs=None) -> str:
        if chat:
            delta = {}
            if role:
                delta["role"] = "assistant"
                delta["content"] = ""
            if text:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        return dumps({**base, "choices": [choice]})

    num = len(run.sequences)
    sent = [""] * num
    texts = run.state.token_text
    shutting_down = False

    async def on_shutdown():
        nonlocal shutting_down
        await shutdown_event.wait()
        shutting_down = True
        run.abort()

    watcher = asyncio.create_task(on_shutdown()) if shutdown_event is not None else None
    try:
        if chat:
            for i in range(num):
                yield chunk(i, role=True)
        async for c, ev in run.events(timeout):
            if include_denoising and ev.revealed:  # DESIGN.md section 10 shape: empty delta / text, no logprobs
                choice = ({"index": c, "delta": {}, "finish_reason": None} if chat
                          else {"index": c, "text": "", "finish_reason": None})
                yield dumps({**base, "choices": [choice], "denoising": {
                    "index": c, "block": ev.block, "step": ev.step, "nfe": ev.nfe,
                    "revealed": [{"position": r.position, "token_id": r.token_id, "text": texts(r.token_id),
                                  "confidence": r.confidence} for r in ev.revealed],
                    "canvas": [None if t is None else texts(t) for t in ev.canvas]}})
            if len(ev.text) > len(sent[c]):
                if ev.text.startswith(sent[c]):
                    delta, sent[c] = ev.text[len(sent[c]):], ev.text
                    if run.first_content_time is None:
                        run.first_content_time = time.time()
                    yield chunk(c, text=delta)
                else:  # pragma: no cover - the engine guarantees a growing prefix
                    log.warning("%s: choice %d text is not an extension of what was streamed", run.id, c)
            if ev.finished:
                seq = run.sequences[c]
                if seq.finish_reason == "abort":
                    if shutting_down:
                        raise APIError(503, "the server is shutting down; retry on another instance or later",
                                       code="server_shutdown", headers={"Retry-After": "1"})
                    raise APIError(503, "the request was aborted by the server", code="aborted")
                lp = run.chat_logprobs(seq) if chat else run.completion_logprobs(seq)
                yield chunk(c, finish=seq.finish_reason, logprobs=lp)
        if include_usage:
            yield dumps({"id": run.id, "object": obj, "created": run.created, "model": model, "choices": [],
                         "usage": run.usage()})
        run.finish(200)
    except Exception as exc:
        run.abort()
        err = from_exception(exc)
        if err.status >= 500 and not isinstance(exc, (TimeoutError, APIError)):
            log.error("%s: stream failed", run.id, exc_info=exc)
        run.finish(err.status, _failure_reason(exc, err))
        yield dumps(err.body())
    finally:
        if watcher is not None:
            watcher.cancel()
        if not run.done:  # client disconnected (cancelled) or the generator was closed
            run.abort()
            run.finish(499, "abort")
    yield "[DONE]"
