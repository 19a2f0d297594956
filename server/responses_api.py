"""``POST /v1/responses``: OpenAI's Responses API over the chat path (docs/design.md#tools-and-the-responses-api).

A request is translated into a chat request (:meth:`ResponsesRequest.chat_body`), rendered, constrained and decoded
exactly as ``/v1/chat/completions`` (one choice), and the chat answer is re-shaped: the body into a ``response``
object (:func:`response_object`), the chat chunks into the Responses stream's typed events (:class:`EventWriter`):
``response.created``, ``response.in_progress``, ``response.output_item.added``, ``response.content_part.added``,
``response.output_text.delta`` / ``.done``, ``response.content_part.done``, ``response.function_call_arguments.delta``
/ ``.done``, ``response.output_item.done``, then ``response.completed`` (``response.incomplete`` when
``max_output_tokens`` ended it); ours: ``response.denoising_step`` per denoising step with
``stream_options.include_denoising`` (the chat stream's ``denoising`` object, docs/design.md#decisions). Every
event carries ``type`` and an increasing ``sequence_number``; an error is an ``error`` event then
``response.failed``. Nothing is stored (``store`` is accepted, ``previous_response_id`` refused).
"""
from __future__ import annotations

import asyncio
import re

import secrets
import time

import anyio
from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from . import protocol as P
from .sse import dumps
from .accounting import failure_reason
from .prompt_input import chat_ids
from .disconnect import collect
from .errors import APIError, check_model, from_exception, validation_error
from .guard import cache_salt
from .send_buffer import bounded, stream_response
from .sse import until_shutdown
from .render import Render
from .responses_protocol import ResponsesRequest
from .run import Run
from .tool_parsers import parser_factory

router = APIRouter()

def _renamed(err: APIError, body: ResponsesRequest) -> APIError:
    """``err`` of the translated chat request, naming the Responses request's own fields
    (:meth:`ResponsesRequest.field_name`) in ``param`` and in the message's leading ``field:``."""
    if err.param:
        old, new = err.param, body.field_name(err.param)
        err.param = new
        if err.message.startswith(f"{old}:"):
            err.message = f"{new}:{err.message[len(old) + 1:]}"
    # a Responses request has no max_tokens: every mention is of its max_output_tokens (e.g. block_size's bound)
    err.message = re.sub(r"\bmax_(completion_)?tokens\b", "max_output_tokens", err.message)
    return err


def _hex() -> str:
    return secrets.token_hex(12)


def usage_object(u: dict) -> dict:
    """Chat usage -> Responses usage (``input_tokens``, ``output_tokens``, ...; extras ``nfe``, ``denoising_steps``)."""
    return {"input_tokens": u["prompt_tokens"], "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u["total_tokens"], "nfe": u.get("nfe", 0), "denoising_steps": u.get("denoising_steps", 0)}


def message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict:
    return {"type": "message", "id": item_id or f"msg_{_hex()}", "status": status, "role": "assistant",
            "content": [] if status == "in_progress" else [output_text(text)]}


def output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(call_id: str, name: str, arguments: str, status: str = "completed",
                       item_id: str | None = None) -> dict:
    return {"type": "function_call", "id": item_id or f"fc_{_hex()}", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def response_object(rid: str, created: int, req: ResponsesRequest, status: str, output: list[dict],
                    usage: dict | None, finish_reason: str | None = None, error: dict | None = None) -> dict:
    """The ``response`` object (``status``: in_progress | completed | incomplete | failed)."""
    fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format else \
        {"type": "text"}
    tool_choice = req.tool_choice if isinstance(req.tool_choice, str) or req.tool_choice is None else \
        req.tool_choice.model_dump()
    return {
        "id": rid, "object": "response", "created_at": created, "status": status, "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": req.model,
        "output": output, "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": None, "reasoning": {"effort": None, "summary": None}, "store": False,
        "temperature": req.temperature, "text": {"format": fmt}, "tool_choice": tool_choice or "auto",
        "tools": [t.model_dump(exclude_none=True) for t in req.tools or []], "top_p": req.top_p,
        "truncation": "disabled", "usage": usage, "user": req.user, "metadata": req.metadata or {},
        "service_tier": "default",
    }


def from_chat_body(rid: str, created: int, req: ResponsesRequest, chat: dict) -> dict:
    """A non-streamed chat completion body -> the ``response`` object."""
    choice = chat["choices"][0]
    msg = choice["message"]
    calls = msg.get("tool_calls") or []
    status = "incomplete" if choice["finish_reason"] == "length" else "completed"  # the items carry it too
    output = [message_item(msg["content"], status)] if msg["content"] is not None or not calls else []
    output += [function_call_item(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls]
    return response_object(rid, created, req, status, output, usage_object(chat["usage"]))


class EventWriter:
    """Chat stream chunks (:class:`~unmask.server.render.Render`'s) -> the Responses stream's typed events."""

    def __init__(self, rid: str, created: int, req: ResponsesRequest):
        self.rid, self.created, self.req = rid, created, req
        self.seq = 0
        self.output: list[dict] = []
        self.msg: int | None = None   # output index of the open message item
        self.text = ""
        self.finish_reason: str | None = None

    def event(self, type_: str, **fields) -> dict:
        ev = {"type": type_, "sequence_number": self.seq, **fields}
        self.seq += 1
        return ev

    def start(self) -> list[dict]:
        r = response_object(self.rid, self.created, self.req, "in_progress", [], None)
        return [self.event("response.created", response=r), self.event("response.in_progress", response=r)]

    def _open_message(self) -> list[dict]:
        self.msg = len(self.output)
        item = message_item("", "in_progress")
        self.output.append(item)
        return [self.event("response.output_item.added", output_index=self.msg, item=dict(item)),
                self.event("response.content_part.added", item_id=item["id"], output_index=self.msg,
                           content_index=0, part=output_text(""))]

    def chunk(self, chunk: dict) -> list[dict]:
        """The events of one chat chunk (content delta, tool-call delta, denoising step, finish)."""
        events: list[dict] = []
        if "denoising" in chunk:
            events.append(self.event("response.denoising_step", output_index=self.msg or 0,
                                     denoising=chunk["denoising"]))
        for choice in chunk.get("choices", []):
            delta = choice.get("delta", {})
            if delta.get("content"):
                if self.msg is None:
                    events += self._open_message()
                self.text += delta["content"]
                events.append(self.event("response.output_text.delta", item_id=self.output[self.msg]["id"],
                                         output_index=self.msg, content_index=0, delta=delta["content"],
                                         logprobs=[]))
            for tc in delta.get("tool_calls") or []:
                events += self._tool_delta(tc)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return events

    def _tool_delta(self, tc: dict) -> list[dict]:
        fn = tc.get("function", {})
        if tc.get("id"):  # a new call (Render sends id + name first, then the whole arguments)
            item = function_call_item(tc["id"], fn["name"], "", "in_progress")
            self.output.append(item)
            return [self.event("response.output_item.added", output_index=len(self.output) - 1, item=dict(item))]
        index = len(self.output) - 1
        item = self.output[index]
        item["arguments"] += fn.get("arguments") or ""
        item["status"] = "completed"
        return [self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                           delta=fn.get("arguments") or ""),
                self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                           name=item["name"], arguments=item["arguments"]),
                self.event("response.output_item.done", output_index=index, item=dict(item))]

    def end(self, usage: dict) -> list[dict]:
        """Close the message item (an empty one when nothing was output) and the terminal event."""
        events: list[dict] = []
        if self.msg is None and not self.output:
            events += self._open_message()
        status = "incomplete" if self.finish_reason == "length" else "completed"
        if self.msg is not None:
            item = self.output[self.msg]
            item.update(status=status, content=[output_text(self.text)])
            events += [self.event("response.output_text.done", item_id=item["id"], output_index=self.msg,
                                  content_index=0, text=self.text, logprobs=[]),
                       self.event("response.content_part.done", item_id=item["id"], output_index=self.msg,
                                  content_index=0, part=output_text(self.text)),
                       self.event("response.output_item.done", output_index=self.msg, item=dict(item))]
        r = response_object(self.rid, self.created, self.req, status, self.output, usage_object(usage))
        return events + [self.event(f"response.{status}", response=r)]

    def failed(self, err: APIError) -> list[dict]:
        body = err.body()["error"]
        r = response_object(self.rid, self.created, self.req, "failed", self.output, None,
                            error={"code": body["code"] or "server_error", "message": body["message"]})
        return [self.event("error", code=body["code"], message=body["message"], param=body["param"]),
                self.event("response.failed", response=r)]


async def _stream(run: Run, writer: EventWriter, include_denoising: bool, timeout: float | None,
                  shutdown_event=None):
    """The SSE events (``event:`` the type, ``data:`` the JSON) of a streamed response; at shutdown
    (``shutdown_event``) an ``error`` (``server_shutdown``) and ``response.failed`` at once."""
    render, sent = run.render, ""

    def sse(events):
        return [{"event": e["type"], "data": dumps(e)}
                for e in events]

    try:
        for e in sse(writer.start()):
            yield e
        async for _, ev in until_shutdown(run.events(timeout), shutdown_event):
            chunks = [render.denoising_chunk(0, ev)] if include_denoising and ev.revealed else []
            if len(ev.text) > len(sent) and ev.text.startswith(sent):
                chunks += render.text_chunks(0, ev.text[len(sent):])
                sent = ev.text
                if run.first_content_time is None:
                    run.first_content_time = time.time()
            if ev.finished:
                if ev.finish_reason == "abort":
                    raise APIError(503, "the request was aborted by the server", code="aborted")
                chunks += render.finish_chunks(0, ev.output)
            for chunk in chunks:
                for e in sse(writer.chunk(chunk)):
                    yield e
        run.finish(200)
        for e in sse(writer.end(run.usage().model_dump())):
            yield e
    except Exception as exc:
        run.abort()
        err = from_exception(exc)
        run.finish(err.status, failure_reason(exc, err))
        for e in sse(writer.failed(err)):
            yield e
    finally:
        if not run.done:  # the client went away
            run.abort()
            run.finish(499, "abort")


@router.post("/v1/responses", responses={200: {"content": {"text/event-stream": {}},
                                               "description": "a response object, or SSE events when stream is true"}})
async def create_response(body: ResponsesRequest, request: Request):
    """OpenAI Responses API: text (and tool calls) out of ``instructions`` + ``input`` items."""
    state = request.app.state.unmask
    arrival = time.time()
    check_model(body.model, state.model_name)
    try:
        chat = P.ChatCompletionRequest.model_validate(body.chat_body())
    except ValidationError as exc:
        raise _renamed(validation_error(RequestValidationError(exc.errors())), body) from None
    try:
        # templated, tokenized and submitted off the event loop, as chat completions are
        # (docs/design.md#admission-and-limits)
        ids = await chat_ids(state, [m.as_template_dict() for m in chat.messages], chat.template_tools())
        explicit = chat.max_completion_tokens
        rid = f"resp_{_hex()}"
        loop = asyncio.get_running_loop()
        stream = await anyio.to_thread.run_sync(lambda: state.engine.submit(  # sampling_params: schema checks
            ids, chat.sampling_params(explicit or state.default_max_tokens, False, state.default_cache), rid, n=1,
            fit_max_tokens=explicit is None, loop=loop, cache_salt=cache_salt(request.scope, None)))
    except Exception as exc:
        raise _renamed(from_exception(exc), body) from exc
    render = Render("chat", rid, int(arrival), state.model_name, state.token_text,
                    tool_parser=parser_factory(state.tool_call_parser, chat))
    run = Run(state, render, [ids], [stream], 1, arrival)
    if body.stream:
        writer = EventWriter(rid, int(arrival), body)
        shutdown = anyio.Event()
        events = _stream(run, writer, chat.include_denoising, state.request_timeout, shutdown)
        return stream_response(bounded(events, state.config.stream_buffer_bytes, run.abort, rid),
                                   ping=15, sep="\n", headers={"Cache-Control": "no-cache",
                                                               "X-Accel-Buffering": "no"},
                                   send_timeout=state.config.read_timeout,
                                   shutdown_event=shutdown, shutdown_grace_period=3.0)
    result = await collect(run, request, state.request_timeout, state.shutdown_event())
    if result is None:
        return Response(status_code=499)
    return JSONResponse(from_chat_body(rid, int(arrival), body, result))
