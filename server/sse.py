"""The server-sent events of a streamed request (docs/design.md#http-contract and #decisions, issue 3).

Streaming rules:

* every chunk of a response carries the same ``id`` and ``created`` (seconds);
* chat: the first chunk of each choice carries ``delta.role = "assistant"``;
* content deltas are differences of ``StepEvent.text``, the engine's stream-safe text (a left-to-right prefix
  that is final, never ends inside a multi-byte character, never ends with a stop-string prefix), so joined deltas
  equal the non-streamed text for the same seed;
* ``finish_reason`` is null until the last chunk of each choice;
* with ``stream_options.include_denoising`` each denoising step of each choice that reveals a token is one extra
  chunk with empty delta/text and a top-level ``denoising`` object (docs/design.md#decisions);
* with ``stream_options.include_usage`` every chunk has ``usage: null`` and a last chunk has ``choices: []`` and
  the usage; with ``continuous_usage_stats`` too (vLLM's), every chunk's ``usage`` is the request's usage so far;
* with ``stream_options.include_obfuscation`` every chunk with choices has an ``obfuscation`` field of random
  alphanumeric padding (OpenAI's side-channel mitigation: the padded content is a multiple of 32 characters);
* ``data: [DONE]`` ends every stream, also after an error, which is sent as ``data: {"error": {...}}``.
"""
from __future__ import annotations

import asyncio
import json
import logging
import secrets
import string

from .accounting import failure_reason
from .errors import APIError, from_exception, shutdown_error
from .run import Run

log = logging.getLogger("unmask.server")


# characters that Python's str.splitlines (and so httpx's iter_lines) takes as line breaks inside a data line
_LINE_BREAKS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"})


_PAD_ALPHABET = string.ascii_letters + string.digits


def obfuscation(chunk: dict) -> str:
    """Random alphanumeric padding (1 to 32 characters) taking the chunk's content length to a multiple of 32."""
    chars = sum(len((c.get("delta") or {}).get("content") or c.get("text") or "") for c in chunk["choices"])
    return "".join(secrets.choice(_PAD_ALPHABET) for _ in range(32 - chars % 32))


def dumps(obj) -> str:
    """Compact JSON for one SSE data line: UTF-8 text kept as is, except U+2028, U+2029 and U+0085, which are
    escaped (valid JSON either way; unescaped, line-splitting clients cut the line in two)."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).translate(_LINE_BREAKS)


async def until_shutdown(events, shutdown_event):
    """The items of ``events`` until ``shutdown_event`` is set: then :func:`shutdown_error` at once, from the event
    loop, without waiting for the engine's next event (a step of a heavy request may outlast the grace period)."""
    if shutdown_event is None:
        async for item in events:
            yield item
        return
    it = events.__aiter__()
    stop = asyncio.ensure_future(shutdown_event.wait())
    try:
        while True:
            nxt = asyncio.ensure_future(it.__anext__())
            await asyncio.wait({nxt, stop}, return_when=asyncio.FIRST_COMPLETED)
            if not nxt.done():
                nxt.cancel()
                raise shutdown_error()
            try:
                item = nxt.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        stop.cancel()


async def sse_events(run: Run, include_denoising: bool, timeout: float | None, shutdown_event=None):
    """The SSE ``data:`` payloads of a streamed request (strings; sse-starlette frames them).

    ``shutdown_event`` (an ``anyio.Event`` that sse-starlette sets when the server shuts down): the engine requests
    are aborted and the stream ends with an error event (``server_shutdown``) and ``[DONE]`` instead of a cut
    connection."""
    render = run.render
    sent = [""] * run.num_choices

    def out(chunk: dict) -> str:
        """A chunk as its data line, with the usage so far (``continuous_usage_stats``) and padding."""
        if render.continuous_usage:  # what this stream has shown so far, not what the engine made since
            chunk["usage"] = run.usage(seen_only=True).model_dump()
        if render.obfuscate:
            chunk["obfuscation"] = obfuscation(chunk)
        return dumps(chunk)

    shutting_down = False

    async def on_shutdown():
        nonlocal shutting_down
        await shutdown_event.wait()
        shutting_down = True
        run.abort()

    watcher = asyncio.create_task(on_shutdown()) if shutdown_event is not None else None
    try:
        for chunk in render.start_chunks(run.num_choices):
            yield out(chunk)
        async for c, ev in until_shutdown(run.events(timeout), shutdown_event):
            render.observe(c, ev)
            if include_denoising and ev.revealed:
                yield out(render.denoising_chunk(c, ev))
            if len(ev.text) > len(sent[c]):
                if ev.text.startswith(sent[c]):
                    delta, sent[c] = ev.text[len(sent[c]):], ev.text
                    run.content_sent(c, ev.num_tokens)
                    for chunk in render.text_chunks(c, delta):
                        yield out(chunk)
                else:  # pragma: no cover - the engine guarantees a growing prefix
                    log.warning("%s: choice %d text is not an extension of what was streamed", run.id, c)
            if ev.finished:
                if ev.finish_reason == "abort":
                    if shutting_down:
                        raise shutdown_error()
                    raise APIError(503, "the request was aborted by the server", code="aborted")
                for chunk in render.finish_chunks(c, ev.output):
                    yield out(chunk)
        if render.include_usage:
            yield dumps(render.usage_chunk(run.usage()))
        run.finish(200)
    except Exception as exc:
        run.abort()
        err = from_exception(exc)
        if err.status >= 500 and not isinstance(exc, (TimeoutError, APIError)):
            log.error("%s: stream failed", run.id, exc_info=exc)
        run.finish(err.status, failure_reason(exc, err))
        yield dumps(err.body())
    finally:
        if watcher is not None:
            watcher.cancel()
        if not run.done:  # client disconnected (cancelled) or the generator was closed
            run.abort()
            run.finish(499, "abort")
    yield "[DONE]"
