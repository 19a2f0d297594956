"""Tool-call parsers: generated text -> content and tool calls (docs/design.md#tools-and-the-responses-api;
``--tool-call-parser``).

A parser is incremental: :meth:`ToolParser.feed` takes the next piece of a choice's text (the stream-safe text the
engine reveals left to right) and returns what is final so far, :meth:`ToolParser.finish` the rest. A non-streamed
answer runs the same parser over the whole text (:func:`parse`), so streamed and non-streamed choices agree.

``hermes`` (Hermes 2 Pro / Qwen2.5 / Qwen3 templates, vLLM's ``hermes``): a call is
``<tool_call>{"name": NAME, "arguments": {...}}</tool_call>``; the body is JSON (surrounding whitespace ignored);
an unclosed call at the end of the text counts when its body parses (without a close tag cut short there). A body that is not such an object, or names
a function the request did not offer, is returned as text (content), never an error. Trailing whitespace of the
content is held back until more content follows (so the result does not depend on how the text was cut into
pieces). Whitespace around calls belongs to them: between calls, and before or after them at the edges of the
content, it is dropped; content before and after a run of calls is joined by the whitespace that preceded the run.

``max_calls`` (``parallel_tool_calls: false`` -> 1): the answer ends with its last allowed call: once that call is
closed, the rest of the text (content, further calls, malformed or not) is dropped and :attr:`ToolParser.ended` is
set, as if the model had stopped there (docs/design.md#tools-and-the-responses-api says why this and not a grammar).
"""
from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field

from . import json_text


@dataclass(frozen=True)
class ParsedCall:
    """One parsed tool call: ``arguments`` is compact JSON text of an object (OpenAI sends a string)."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{secrets.token_hex(12)}")


Piece = tuple[str, "str | ParsedCall"]  # ("content", text) | ("call", ParsedCall)


class ToolParser:
    """Base: subclasses set ``name`` and implement :meth:`feed` / :meth:`finish`.

    Args:
        tool_names: the functions the request offered (a call of another name is text).
        max_calls: the most calls one answer may make (None: no limit); the closed call that reaches it ends the
            answer (:attr:`ended`), and what follows is dropped.
    """

    name = ""

    def __init__(self, tool_names: set[str], max_calls: int | None = None):
        if max_calls is not None and max_calls < 1:
            raise ValueError(f"max_calls: must be >= 1 or None, got {max_calls}")
        self.tool_names = set(tool_names)
        self.max_calls = max_calls
        self.calls = 0
        self.ended = False   # the answer ended at its last allowed call; the rest of the text is dropped

    def feed(self, text: str) -> list[Piece]:  # pragma: no cover - interface
        raise NotImplementedError

    def finish(self) -> list[Piece]:  # pragma: no cover - interface
        raise NotImplementedError


class HermesParser(ToolParser):
    """``<tool_call>{json}</tool_call>`` (see the module docstring)."""

    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, tool_names: set[str], max_calls: int | None = None):
        super().__init__(tool_names, max_calls)
        self._buf = ""          # text not yet decided (a possible tag prefix, or an open call's body)
        self._in_call = False
        self._space = ""        # whitespace-only content held back
        self._after_call = False  # the last piece was a call: leading whitespace of the next content is dropped
        self._gap = ""          # the whitespace before that run of calls (joins content before and after it)
        self._sent = False      # some content was sent

    def _content(self, text: str, out: list[Piece]) -> None:
        if self._after_call:  # the whitespace after calls is theirs; content resumes after the gap before them
            text = text.lstrip()
            if not text:
                return
            text, self._gap, self._after_call = (self._gap if self._sent else "") + text, "", False
        head = text.rstrip()
        if head:  # trailing whitespace waits for more content, however the text was cut into pieces
            out.append(("content", self._space + head))
            self._space, self._sent = text[len(head):], True
        else:
            self._space += text

    def _call(self, body: str) -> ParsedCall | None:
        """The call in a ``<tool_call>`` body, or None (the body comes back as text): not JSON, nested past the
        request body's rule (:func:`unmask.server.json_text.loads`), or not ``{"name", "arguments"}`` of a tool."""
        try:
            obj = json_text.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in self.tool_names:
            return None
        args = obj.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json_text.loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict) or set(obj) - {"name", "arguments"}:
            return None
        try:
            return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False, separators=(",", ":")))
        except RecursionError:  # parsed just under the limit, one frame deeper here: still text, never a 500
            return None

    def feed(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        if self.ended:
            return out
        self._buf += text
        while self._buf and not self.ended:
            if not self._in_call:
                at = self._buf.find(self.OPEN)
                if at < 0:  # keep a tail that could still become the open tag
                    keep = _tag_prefix_len(self._buf, self.OPEN)
                    self._content(self._buf[: len(self._buf) - keep], out)
                    self._buf = self._buf[len(self._buf) - keep:]
                    break
                self._content(self._buf[:at], out)
                self._buf = self._buf[at + len(self.OPEN):]
                self._in_call = True
            else:
                at = self._buf.find(self.CLOSE)
                if at < 0:
                    break
                body, self._buf = self._buf[:at], self._buf[at + len(self.CLOSE):]
                self._in_call = False
                self._emit(body, closed=True, out=out)
        return out

    def _emit(self, body: str, closed: bool, out: list[Piece]) -> None:
        call = self._call(body)
        if call is None:
            self._content(self.OPEN + body + (self.CLOSE if closed else ""), out)
        else:
            self.calls += 1
            if not self._after_call:  # the first call of a run: the whitespace before it may join content later
                self._gap = self._space
            self._space, self._after_call = "", True
            out.append(("call", call))
            if closed and self.max_calls is not None and self.calls >= self.max_calls:
                self.ended, self._buf = True, ""

    def finish(self) -> list[Piece]:
        out: list[Piece] = []
        if self._in_call and not self.ended:
            body = self._buf  # a close tag cut short by max_tokens ("...}</tool_c") is not part of the body
            partial = _tag_prefix_len(body, self.CLOSE)
            if partial and self._call(body[:-partial]) is not None:
                body = body[:-partial]
            self._emit(body, closed=False, out=out)
        elif not self.ended:
            self._content(self._buf, out)
        self._buf, self._in_call = "", False
        if self._space and not self.calls:
            out.append(("content", self._space))
        self._space = ""
        return out


def _tag_prefix_len(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


PARSERS: dict[str, type[ToolParser]] = {HermesParser.name: HermesParser}


def get_parser(name: str) -> type[ToolParser]:
    """The parser class called ``name``.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    try:
        return PARSERS[name]
    except KeyError:
        raise ValueError(f"--tool-call-parser: unknown parser {name!r}; known: {sorted(PARSERS)}") from None


def parser_factory(name: str, body):
    """A chat request with active tools (``body.tools_active``): a factory of fresh ``name`` parsers over its tool
    names, at most one call per answer when ``body.parallel_tool_calls`` is false (OpenAI's meaning); else None."""
    if not getattr(body, "tools_active", False):
        return None
    cls, names = get_parser(name), {t.function.name for t in body.tools}
    max_calls = None if getattr(body, "parallel_tool_calls", True) else 1
    return lambda: cls(names, max_calls)


def parse(parser: ToolParser, text: str) -> tuple[str | None, list[ParsedCall]]:
    """``(content or None, calls)`` of a whole text (content None when it is empty and a call was made)."""
    pieces = parser.feed(text) + parser.finish()
    content = "".join(p for kind, p in pieces if kind == "content")
    calls = [p for kind, p in pieces if kind == "call"]
    return (content or None) if calls else content, calls
