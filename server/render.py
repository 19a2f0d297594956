"""Engine outputs -> the response models of :mod:`unmask.server.responses` (docs/design.md#http-contract and
#decisions).

One :class:`Render` per response knows its kind (``chat`` | ``completion``), id, ``created``, the served name and
whether logprobs were asked for; it builds the non-streamed body from the choices' :class:`CompletionOutput` and
each stream chunk from a :class:`StepEvent` or a piece of text. It reads nothing but those outputs (and the token
texts of the tokenizer).

Logprobs: an EOS that ended a choice (``ended_by_eos`` with ``finish_reason`` ``stop``; with ``ignore_eos`` an EOS
id is an ordinary token) is counted in usage but never rendered, so it has no logprob entry; JSON has no -inf, so a
log-probability below -9999.0 is sent as -9999.0 (vLLM's "impossible"; the engine only reveals finite ones).
Alternatives: chat ``top_logprobs`` lists the k most likely tokens at the step that revealed the token (k up to 20,
OpenAI's chat maximum); completions ``top_logprobs`` maps the k most likely (k = ``logprobs``, up to 5, OpenAI's
maximum) and the sampled token itself, as OpenAI's. Streamed, each chunk carries the logprobs of the tokens whose
text it first shows (:mod:`unmask.server.stream_logprobs`); the rest (text a stop string cut) goes with the choice's
last chunk, so the chunks' logprobs joined equal the non-streamed ones.
"""
from __future__ import annotations

from collections.abc import Callable

from unmask.engine import CompletionOutput, Revealed, StepEvent

from .responses import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionResponse,
                        ChatLogprobs, CompletionChoice, CompletionChunk, CompletionLogprobs, CompletionResponse, Delta,
                        Denoising, FunctionCallOut, FunctionDelta, RevealedToken, TokenLogprob, ToolCallDelta,
                        ToolCallOut, TopLogprob, Usage, UsageChunk)
from .stream_logprobs import TokenCursor
from .tool_parsers import ParsedCall, Piece, ToolParser, parse

LOGPROB_FLOOR = -9999.0

Entry = tuple[int, float, tuple]  # a rendered token: id, log-probability, its ((id, logprob), ...) alternatives


def _floor(lp: float) -> float:
    return lp if lp >= LOGPROB_FLOOR else LOGPROB_FLOOR


class Render:
    """Builds the bodies and chunks of one response.

    Args:
        kind: ``chat`` | ``completion``. response_id: ``chatcmpl-...`` / ``cmpl-...``. created: unix seconds.
        model: the served model name. token_text: token id -> its text (``TokenTexts``).
        logprobs: whether logprobs were asked for. top_logprobs: alternatives listed per token (chat's
            ``top_logprobs``, completions' ``logprobs``).
        include_usage: stream chunks carry ``"usage": null`` (and a last usage chunk follows).
        tool_parser: chat with tools: makes a fresh :class:`~unmask.server.tool_parsers.ToolParser` per choice;
            the text is split into content and tool calls (streamed as tool-call deltas), and a choice that called a
            tool and stopped finishes with ``tool_calls`` (docs/design.md#tools-and-the-responses-api).
        echo: completions ``echo``: the text of each prompt, prepended to its choices (``n`` choices a prompt).
        stream_options: the request's (``continuous_usage_stats`` with ``include_usage``: :attr:`continuous_usage`;
            ``include_obfuscation``: :attr:`obfuscate`; the stream adds both, :mod:`unmask.server.sse`).
    """

    def __init__(self, kind: str, response_id: str, created: int, model: str, token_text: Callable[[int], str],
                 logprobs: bool = False, top_logprobs: int = 0, include_usage: bool = False,
                 tool_parser: Callable[[], ToolParser] | None = None, echo: list[str] | None = None, n: int = 1,
                 stream_options=None):
        self.chat = kind == "chat"
        self.id = response_id
        self.created = created
        self.model = model
        self.token_text = token_text
        self.logprobs = logprobs
        self.top_logprobs = top_logprobs
        self.include_usage = include_usage
        self.continuous_usage = include_usage and bool(getattr(stream_options, "continuous_usage_stats", False))
        self.obfuscate = bool(getattr(stream_options, "include_obfuscation", False))
        self.tool_parser = tool_parser if self.chat else None
        self.echo = echo if not self.chat else None
        self.n = n
        self._parsers: dict[int, ToolParser] = {}
        self._calls: dict[int, int] = {}
        # streamed logprobs per choice: which tokens the text carries, those not sent yet, entries and characters sent
        self._cursors: dict[int, TokenCursor] = {}
        self._pending: dict[int, list[Revealed]] = {}
        self._sent: dict[int, int] = {}
        self._offset: dict[int, int] = {}

    # ------------------------------------------------------------------ logprobs
    def _entries(self, out: CompletionOutput) -> list[Entry]:
        """The rendered tokens of a choice with their log-probabilities and alternatives (EOS that ended it left
        out)."""
        ids, lps = list(out.token_ids), list(out.logprobs or [])[: len(out.token_ids)]
        tops = list(out.top_logprobs or [])[: len(ids)] or [()] * len(ids)
        if ids and out.ended_by_eos and out.finish_reason == "stop":  # EOS: counted, never rendered
            ids, lps, tops = ids[:-1], lps[:-1], tops[:-1]
        return list(zip(ids, lps, tops))

    def _render_logprobs(self, entries: list[Entry], offset: int = 0):
        """``entries`` as the kind's logprobs object (completions: ``text_offset`` from ``offset``)."""
        if self.chat:
            content = []
            for t, lp, top in entries:
                tok = self.token_text(t)
                top_list = [self._top(a, alp) for a, alp in list(top)[: self.top_logprobs]]
                content.append(TokenLogprob(token=tok, logprob=_floor(lp), bytes=_bytes(tok), top_logprobs=top_list))
            return ChatLogprobs(content=content, refusal=None)
        tokens, offsets, tops = [], [], []
        for t, lp, top in entries:
            tok = self.token_text(t)
            tokens.append(tok)
            offsets.append(offset)
            offset += len(tok)
            alts = {self.token_text(a): _floor(alp) for a, alp in list(top)[: self.top_logprobs]}
            alts.setdefault(tok, _floor(lp))  # the sampled token is always listed (OpenAI's)
            tops.append(alts)
        return CompletionLogprobs(tokens=tokens, token_logprobs=[_floor(lp) for _, lp, _ in entries],
                                  top_logprobs=tops, text_offset=offsets)

    def _top(self, token_id: int, lp: float) -> TopLogprob:
        tok = self.token_text(token_id)
        return TopLogprob(token=tok, logprob=_floor(lp), bytes=_bytes(tok))

    def completion_logprobs(self, out: CompletionOutput) -> CompletionLogprobs | None:
        """Legacy-completions ``logprobs`` of one choice, or None when off."""
        return self._render_logprobs(self._entries(out)) if self.logprobs else None

    def chat_logprobs(self, out: CompletionOutput) -> ChatLogprobs | None:
        """Chat ``logprobs`` of one choice (``bytes`` None for a token with U+FFFD), or None when off."""
        return self._render_logprobs(self._entries(out)) if self.logprobs else None

    # ------------------------------------------------------------------ streamed logprobs
    def observe(self, index: int, ev: StepEvent) -> None:
        """Every event of choice ``index``, in order (its revealed tokens, for streamed logprobs)."""
        if self.logprobs:
            if index not in self._cursors:
                decode = getattr(self.token_text, "decode", None) or (lambda ids: "".join(map(self.token_text, ids)))
                self._cursors[index] = TokenCursor(decode)
            self._cursors[index].add(ev.revealed)

    def _carry(self, index: int, chars: int, chunks: list[dict]) -> list[dict]:
        """Streamed ``chars`` more characters of choice ``index`` in ``chunks``: the first carries the logprobs of the
        tokens that text completes (with any still waiting for a chunk)."""
        if not self.logprobs or index not in self._cursors:
            return chunks
        self._pending.setdefault(index, []).extend(self._cursors[index].advance(chars))
        if chunks and self._pending[index]:
            entries = [(r.token_id, r.logprob, r.top) for r in self._pending.pop(index)]
            self._attach(index, chunks[0], entries)
        return chunks

    def _attach(self, index: int, chunk: dict, entries: list[Entry]) -> None:
        rendered = self._render_logprobs(entries, self._offset.get(index, 0))
        if not self.chat:
            self._offset[index] = self._offset.get(index, 0) + sum(len(t) for t in rendered.tokens)
        self._sent[index] = self._sent.get(index, 0) + len(entries)
        chunk["choices"][0]["logprobs"] = rendered.model_dump()

    def _rest(self, index: int, out: CompletionOutput):
        """The logprobs of choice ``index`` not streamed yet (its last chunk's), or None (off, or none left)."""
        if not self.logprobs:
            return None
        rest = self._entries(out)[self._sent.get(index, 0):]
        return self._render_logprobs(rest, self._offset.get(index, 0)) if rest else None

    # ------------------------------------------------------------------ the non-streamed body
    def body(self, outputs: list[CompletionOutput], usage: Usage) -> dict:
        """The ``chat.completion`` / ``text_completion`` object (choice i = ``outputs[i]``), as a JSON-ready dict."""
        if self.chat:
            choices = []
            for i, o in enumerate(outputs):
                message, finish = self._message(o)
                choices.append(ChatChoice(index=i, message=message, logprobs=self.chat_logprobs(o),
                                          finish_reason=finish))
            return ChatCompletionResponse(id=self.id, created=self.created, model=self.model, usage=usage,
                                          choices=choices).model_dump()
        return CompletionResponse(
            id=self.id, created=self.created, model=self.model, usage=usage,
            choices=[CompletionChoice(index=i, text=self._echo(i) + o.text, logprobs=self.completion_logprobs(o),
                                      finish_reason=o.finish_reason) for i, o in enumerate(outputs)]).model_dump()

    def _echo(self, index: int) -> str:
        return self.echo[index // self.n] if self.echo else ""

    def _message(self, out: CompletionOutput) -> tuple[AssistantMessage, str]:
        """A choice's message and finish reason: with tools, its text parsed into content and tool calls."""
        if self.tool_parser is None:
            return AssistantMessage(content=out.text), out.finish_reason
        parser = self.tool_parser()
        content, calls = parse(parser, out.text)
        return (AssistantMessage(content=content, tool_calls=[
            ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments)) for c in calls] or None),
            _finish(out.finish_reason, bool(calls), parser.ended))

    # ------------------------------------------------------------------ stream chunks (JSON-ready dicts)
    def _chunk(self, choice, denoising: Denoising | None = None) -> dict:
        head = {"id": self.id, "created": self.created, "model": self.model, "choices": [choice]}
        if self.include_usage:
            head["usage"] = None
        if denoising is not None:
            head["denoising"] = denoising
        if self.chat:
            chunk = ChatCompletionChunk(object="chat.completion.chunk", **head)
        else:
            chunk = CompletionChunk(object="text_completion", **head)
        return chunk.model_dump(exclude_unset=True)

    def role_chunk(self, index: int) -> dict:
        """The first chunk of a chat choice: ``delta = {"role": "assistant", "content": ""}``."""
        return self._chunk(ChatChunkChoice(index=index, delta=Delta(role="assistant", content=""), logprobs=None,
                                           finish_reason=None))

    def text_chunk(self, index: int, text: str) -> dict:
        """A content delta of one choice."""
        if self.chat:
            return self._chunk(ChatChunkChoice(index=index, delta=Delta(content=text), logprobs=None,
                                               finish_reason=None))
        return self._chunk(CompletionChoice(index=index, text=text, logprobs=None, finish_reason=None))

    def start_chunks(self, num_choices: int) -> list[dict]:
        """The chunks before any event: chat: each choice's role chunk; completions with ``echo``: each choice's
        prompt text."""
        if self.chat:
            return [self.role_chunk(i) for i in range(num_choices)]
        return [self.text_chunk(i, self._echo(i)) for i in range(num_choices) if self._echo(i)]

    def text_chunks(self, index: int, text: str) -> list[dict]:
        """The chunks of a new piece of one choice's text: one content delta, or with tools what the choice's
        parser makes final (content deltas, tool-call deltas); the first carries the logprobs of the tokens the
        text completes."""
        if self.tool_parser is None:
            return self._carry(index, len(text), [self.text_chunk(index, text)])
        return self._carry(index, len(text), self._pieces(index, self._parser(index).feed(text)))

    def _parser(self, index: int) -> ToolParser:
        if index not in self._parsers:
            self._parsers[index] = self.tool_parser()
        return self._parsers[index]

    def _pieces(self, index: int, pieces: list[Piece]) -> list[dict]:
        chunks = []
        for kind, piece in pieces:
            if kind == "content":
                chunks.append(self.text_chunk(index, piece))
            else:
                chunks.extend(self._call_chunks(index, piece))
        return chunks

    def _call_chunks(self, index: int, call: ParsedCall) -> list[dict]:
        """A tool call as OpenAI streams one: id, type and name first, then the arguments."""
        k = self._calls.get(index, 0)
        self._calls[index] = k + 1
        head = ToolCallDelta(index=k, id=call.id, type="function", function=FunctionDelta(name=call.name,
                                                                                         arguments=""))
        args = ToolCallDelta(index=k, function=FunctionDelta(arguments=call.arguments))
        return [self._chunk(ChatChunkChoice(index=index, delta=Delta(tool_calls=[d]), logprobs=None,
                                            finish_reason=None)) for d in (head, args)]

    def finish_chunks(self, index: int, out: CompletionOutput) -> list[dict]:
        """The last chunks of one choice: what its tool parser still held, then :meth:`finish_chunk`."""
        if self.tool_parser is None:
            return [self.finish_chunk(index, out)]
        parser = self._parser(index)
        chunks = self._pieces(index, parser.finish())
        return chunks + [self.finish_chunk(index, out, _finish(out.finish_reason, self._calls.get(index, 0) > 0,
                                                               parser.ended))]

    def finish_chunk(self, index: int, out: CompletionOutput, finish_reason: str | None = None) -> dict:
        """The last chunk of one choice: its ``finish_reason`` (default the output's) and the logprobs not streamed
        yet (None when every token's went with its text), no new text."""
        if self.chat:
            return self._chunk(ChatChunkChoice(index=index, delta=Delta(), logprobs=self._rest(index, out),
                                               finish_reason=finish_reason or out.finish_reason))
        return self._chunk(CompletionChoice(index=index, text="", logprobs=self._rest(index, out),
                                            finish_reason=out.finish_reason))

    def denoising_chunk(self, index: int, ev: StepEvent) -> dict:
        """One denoising step of choice ``index``: empty delta / text, no logprobs, a ``denoising`` object."""
        texts = self.token_text
        denoising = Denoising(index=index, block=ev.block, step=ev.step, nfe=ev.nfe,
                              revealed=[RevealedToken(position=r.position, token_id=r.token_id, text=texts(r.token_id),
                                                      confidence=r.confidence) for r in ev.revealed],
                              canvas=[None if t is None else texts(t) for t in ev.canvas],
                              **({"final": ev.final} if ev.final is not None else {}))
        choice = (ChatChunkChoice(index=index, delta=Delta(), finish_reason=None) if self.chat
                  else CompletionChoice(index=index, text="", finish_reason=None))
        return self._chunk(choice, denoising)

    def usage_chunk(self, usage: Usage) -> dict:
        """The last chunk with ``include_usage``: ``choices: []`` and the request's usage."""
        return UsageChunk(id=self.id, object="chat.completion.chunk" if self.chat else "text_completion",
                          created=self.created, model=self.model, choices=[], usage=usage).model_dump(
                              exclude_unset=True)


def _bytes(token: str) -> list[int] | None:
    """A token's UTF-8 bytes, None when its text holds U+FFFD (a piece of a character: its bytes are unknown)."""
    return None if "\ufffd" in token else list(token.encode("utf-8"))


def _finish(reason: str | None, called: bool, ended: bool = False) -> str | None:
    """OpenAI's ``tool_calls`` for a choice that called a tool and stopped (``length`` stays ``length``), or whose
    answer its parser ended at its last allowed call (``ended``: ``parallel_tool_calls: false``; what the engine
    decoded after that call, up to any ``length``, is dropped, so the answer returned is complete)."""
    return "tool_calls" if called and (reason == "stop" or (ended and reason == "length")) else reason


def echo_texts(tokenizer, body, prompts: list[list[int]]) -> list[str] | None:
    """Completions ``echo``: each prompt's text (a string prompt as sent, token ids decoded), else None."""
    if not getattr(body, "echo", False):
        return None
    return [p if isinstance(p, str) else tokenizer.decode(ids) for p, ids in zip(body.prompts(), prompts)]
