"""Request model of ``POST /v1/responses`` (OpenAI's Responses API; docs/design.md#tools-and-the-responses-api) and its
translation into a chat request (:meth:`ResponsesRequest.chat_body`), so that one path renders, constrains and decodes
both.

* ``input``: a string (one user message) or items: messages (``role`` user | system | developer | assistant,
  ``content`` a string or ``input_text`` / ``output_text`` parts), ``function_call`` (``call_id``, ``name``,
  ``arguments``) and ``function_call_output`` (``call_id``, ``output``); ``instructions`` becomes a leading
  system message. Consecutive ``function_call`` items join the assistant message before them.
* ``tools``: function tools in the Responses shape (``{"type": "function", "name", "parameters", ...}``);
  ``tool_choice``: ``none`` | ``auto`` | ``required`` | ``{"type": "function", "name"}``.
* ``text.format``: ``text`` | ``json_object`` | ``json_schema`` (``name``, ``schema``, ``strict``) ->
  ``response_format``.
* Accepted without effect: ``metadata``, ``store`` (nothing is stored), ``user``, ``service_tier``,
  ``truncation: disabled``, ``include: []``, ``reasoning: null``. Refused (400 naming the field):
  ``previous_response_id`` (nothing is stored), ``background``, ``truncation: auto``, other item and tool types.
* Ours: ``seed``, ``stream_options.include_denoising`` (a ``response.denoising_step`` event per denoising step) and
  the diffusion extras (``steps``, ``block_size``, ``threshold``, ``remasking``, ``cfg_scale``, ``top_k``,
  ``cache``, ``speculative``, ``sub_block_size``, ``multi_block``, token editing's ``editing_threshold`` /
  ``max_post_steps`` and the uniform canvas's ``max_denoising_steps``, ``t_min``, ``t_max``, ``entropy_bound``,
  ``stability_threshold``, ``confidence_threshold``), as on chat completions.
"""
from __future__ import annotations

import copy
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, ConfigDict, Discriminator, Field, Tag, model_validator
from pydantic_core import PydanticCustomError

from unmask.engine.limits import MAX_CONTENT_PARTS

from .field_text import CACHE_DESCRIPTION
from .protocol import STREAM_OPTIONS_RULE, TOP_K_OFF, CacheName, RemaskingName, _Common, ranged
from .tool_protocol import (FUNCTION_NAME, MAX_DESCRIPTION_CHARS, MAX_TOOLS, RequestBody, Strict, _bounded_schema,
                            integral_fields)

MAX_ITEMS = 1024


def _only_false(value: Any) -> Any:
    """``background`` is ``false`` or null as the schema says: pydantic's literal check takes ``0`` for ``False``."""
    if value is not None and value is not False:
        raise PydanticCustomError("literal_error", "Input should be False (background responses are not supported)")
    return value


class InputText(Strict):
    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: list | None = None
    logprobs: list | None = None


class MessageItem(Strict):
    """A message item (``type: "message"`` optional, as OpenAI's EasyInputMessage)."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | Annotated[list[InputText], Field(min_length=1, max_length=MAX_CONTENT_PARTS)]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(Strict):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1, max_length=64)
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(Strict):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=256, description="the call_id of a function_call item earlier in "
                                                                   "input (else a 400 naming input.N.call_id)")
    output: str
    id: str | None = None
    status: str | None = None


_ITEM_TAGS = {"message": "Message", "function_call": "FunctionCall", "function_call_output": "FunctionCallOutput"}


def _item_kind(v: Any) -> str | None:
    """The member tag of an input item (a message may omit ``type``, OpenAI's EasyInputMessage); CamelCase, so that
    an error's ``param`` is ``input.0.call_id``, not ``input.0.function_call.call_id``."""
    kind = (v.get("type") or "message") if isinstance(v, dict) else getattr(v, "type", "message")
    return _ITEM_TAGS.get(kind) if isinstance(kind, str) else None


Item = Annotated[Annotated[MessageItem, Tag("Message")] | Annotated[FunctionCallItem, Tag("FunctionCall")]
                 | Annotated[FunctionCallOutputItem, Tag("FunctionCallOutput")], Discriminator(_item_kind)]


class FunctionTool(Strict):
    """A function tool in the Responses shape (flat: no ``function`` wrapper)."""

    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = Field(None, max_length=MAX_DESCRIPTION_CHARS)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def chat(self) -> dict:
        fn = {"name": self.name, "parameters": _bounded_schema(self.parameters, "parameters")}
        if self.description is not None:
            fn["description"] = self.description
        return {"type": "function", "function": {k: v for k, v in fn.items() if v is not None}}


class NamedFunctionChoice(Strict):
    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME)


class TextFormat(Strict):
    """``text.format``: ``{"type": "text" | "json_object"}`` or ``{"type": "json_schema", "name", "schema", ...}``."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, pattern=FUNCTION_NAME)
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    def chat(self) -> dict:
        if self.type != "json_schema":
            return {"type": self.type}
        spec = {"name": self.name or "response", "schema": self.schema_, "strict": self.strict}
        return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if v is not None}}


class TextOptions(Strict):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None


class ResponsesStreamOptions(Strict):
    include_denoising: bool = False
    include_obfuscation: bool = Field(False, description="OpenAI's: accepted, no effect on /v1/responses "
                                                         "(events carry no padding)")


# the diffusion extras defined as on chat completions (their bounds and descriptions taken from there), and all
# of them, passed through to the chat request as they are
SHARED_EXTRAS = ("sub_block_size", "multi_block", "editing_threshold", "max_post_steps", "max_denoising_steps",
                 "t_min", "t_max", "entropy_bound", "stability_threshold", "confidence_threshold")
EXTRAS = ("seed", "steps", "block_size", "threshold", "remasking", "cfg_scale", "top_k", "cache", "speculative",
          *SHARED_EXTRAS)
INTEGER_FIELDS = frozenset({"max_output_tokens", "seed", "steps", "block_size", "top_k", "sub_block_size",
                            "max_post_steps", "max_denoising_steps", "stability_threshold"})


def _chat_field(name: str) -> Any:
    """A copy of chat completions' field ``name`` (same bounds, default and description)."""
    return copy.copy(_Common.model_fields[name])


class ResponsesRequest(RequestBody):
    """``POST /v1/responses`` (see the module docstring)."""

    model_config = ConfigDict(json_schema_extra={"allOf": [STREAM_OPTIONS_RULE]})  # validated by _cross_field

    model: str = Field(min_length=1, max_length=512)
    input: str | Annotated[list[Item], Field(min_length=1, max_length=MAX_ITEMS)]
    instructions: str | None = None
    max_output_tokens: int | None = ranged("max_tokens", None)
    temperature: float | None = ranged("temperature", None)
    top_p: float | None = ranged("top_p", None)
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    metadata: Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
                        Field(max_length=16)] | None = None
    store: bool | None = None
    user: str | None = Field(None, max_length=512)
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    truncation: Literal["disabled"] | None = None
    include: Annotated[list[str], Field(max_length=0)] | None = None
    reasoning: None = None
    previous_response_id: None = Field(None, description="not supported: nothing is stored (send the history "
                                                         "as input items)")
    background: Annotated[Literal[False] | None, BeforeValidator(_only_false)] = None  # 0 is not false
    prompt_cache_key: str | None = Field(None, max_length=512)
    safety_identifier: str | None = Field(None, max_length=512)
    # --- ours ---
    # (bounds: unmask.engine.limits.RANGES through protocol.ranged, as on chat completions; absent = its default)
    seed: int | None = ranged("seed", None)
    steps: int | None = ranged("steps", None)
    block_size: int | None = ranged("block_size", None)
    threshold: float | None = _chat_field("threshold")  # null: not the checkpoint's default threshold
    remasking: RemaskingName | None = None
    cfg_scale: float | None = ranged("cfg_scale", None)
    top_k: int | None = ranged("top_k", None, lo=TOP_K_OFF)
    cache: CacheName | None = Field(None, description=CACHE_DESCRIPTION)
    speculative: bool | None = None
    sub_block_size: int | None = _chat_field("sub_block_size")
    multi_block: float | None = _chat_field("multi_block")
    editing_threshold: float | None = _chat_field("editing_threshold")
    max_post_steps: int | None = _chat_field("max_post_steps")
    max_denoising_steps: int | None = _chat_field("max_denoising_steps")  # the uniform canvas (diffusion_gemma)
    t_min: float | None = _chat_field("t_min")
    t_max: float | None = _chat_field("t_max")
    entropy_bound: float | None = _chat_field("entropy_bound")
    stability_threshold: int | None = _chat_field("stability_threshold")
    confidence_threshold: float | None = _chat_field("confidence_threshold")

    def messages(self) -> list[dict]:
        """The chat messages of ``instructions`` + ``input`` (chat request dicts)."""
        return self._translated()[0]

    def _translated(self) -> tuple[list[dict], list[dict[str, str]]]:
        """The chat messages and, per message, where its parts came from: ``{"": "input.3"}`` (or
        ``"instructions"``, ``"input"``), plus ``"tool_calls.J": "input.K"`` for calls joined from items."""
        out: list[dict] = [{"role": "system", "content": self.instructions}] if self.instructions else []
        src: list[dict[str, str]] = [{"": "instructions"}] if self.instructions else []
        if isinstance(self.input, str):
            return out + [{"role": "user", "content": self.input}], src + [{"": "input"}]
        for k, item in enumerate(self.input):
            if isinstance(item, MessageItem):
                out.append({"role": item.role, "content": item.text()})
                src.append({"": f"input.{k}"})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                if out and out[-1]["role"] == "assistant":
                    out[-1].setdefault("tool_calls", []).append(call)
                else:
                    out.append({"role": "assistant", "content": None, "tool_calls": [call]})
                    src.append({"": f"input.{k}"})
                src[-1][f"tool_calls.{len(out[-1]['tool_calls']) - 1}"] = f"input.{k}"
            else:
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
                src.append({"": f"input.{k}"})
        return out, src

    def field_name(self, param: str) -> str:
        """The Responses request's own name of a field of its translated chat request (for errors):
        ``messages.I.content`` -> ``input.K.content`` (or ``instructions``), ``messages.I.tool_call_id`` ->
        ``input.K.call_id``, ``tools.N.function.X`` -> ``tools.N.X``, ``max_tokens`` / ``max_completion_tokens`` ->
        ``max_output_tokens``, ``response_format[.json_schema].X`` -> ``text.format.X``, ``prompt`` -> ``input``."""
        head, _, rest = param.partition(".")
        if head in ("max_tokens", "max_completion_tokens"):
            return "max_output_tokens" + (f".{rest}" if rest else "")
        if head == "response_format":
            rest = rest.removeprefix("json_schema").lstrip(".")
            return "text.format" + (f".{rest}" if rest else "")
        if head == "tools" and ".function" in param:
            return param.replace(".function", "", 1)
        if head == "prompt":  # the whole prompt (too long in tokens): the part holding most of it, as the
            # character pre-check names the longest message (docs/design.md#admission-and-limits)
            messages = self.messages()
            longest = max(range(len(messages)), key=lambda i: len(messages[i].get("content") or ""))
            return self.field_name(f"messages.{longest}.content")
        if head != "messages":
            return param
        index, _, rest = rest.partition(".")
        sources = self._translated()[1]
        if not index.isdigit() or int(index) >= len(sources):
            return "input" + (f".{index}" if index else "")
        src = sources[int(index)]
        parts = rest.split(".") if rest else []
        if parts[:1] == ["tool_calls"] and len(parts) > 1 and f"tool_calls.{parts[1]}" in src:
            tail = {"function": "", "id": "call_id"}
            named = [tail.get(p, p) for p in parts[2:]]
            return ".".join([src[f"tool_calls.{parts[1]}"], *[p for p in named if p]])
        if src[""] in ("instructions", "input"):   # a string: no parts
            return src[""]
        if parts[:1] == ["tool_call_id"]:
            parts[0] = "call_id"
        return ".".join([src[""], *parts])

    @model_validator(mode="before")
    @classmethod
    def _integers(cls, data: Any) -> Any:
        """``7.0`` is the integer 7 in the integer fields, as in the schema and on chat completions."""
        return integral_fields(data, INTEGER_FIELDS)

    @model_validator(mode="after")
    def _cross_field(self):
        if self.stream_options is not None and not self.stream:
            raise PydanticCustomError("invalid_field", "{field}: {why}",
                                      {"field": "stream_options", "why": "only allowed when stream is true"})
        self._unique_call_ids()
        return self

    def _unique_call_ids(self) -> None:
        """``call_id`` links a ``function_call`` item to its ``function_call_output`` (OpenAI's docs), so it is
        unique among the calls and answered at most once: a repeated one would make the link ambiguous (which
        call's result is it?). OpenAI refuses repeated input items ("Duplicate item found"); a 400 naming
        ``input.K.call_id`` of the repeat."""
        if isinstance(self.input, str):
            return
        called: set[str] = set()
        answered: set[str] = set()
        for k, item in enumerate(self.input):
            if isinstance(item, FunctionCallItem):
                seen, why = called, "is the call_id of an earlier function_call item (call ids are unique)"
            elif isinstance(item, FunctionCallOutputItem):
                seen, why = answered, "was answered by an earlier function_call_output item"
            else:
                continue
            if item.call_id in seen:
                raise PydanticCustomError("invalid_field", "{field}: {why}",
                                          {"field": f"input.{k}.call_id", "why": f"{item.call_id!r} {why}"})
            seen.add(item.call_id)

    def chat_body(self) -> dict:
        """The equivalent ``/v1/chat/completions`` body (validated by the caller as a ChatCompletionRequest)."""
        body: dict[str, Any] = {"model": self.model, "messages": self.messages(), "stream": self.stream}
        if self.max_output_tokens is not None:
            body["max_completion_tokens"] = self.max_output_tokens
        for name in ("temperature", "top_p", "parallel_tool_calls", "user", "prompt_cache_key",
                     "safety_identifier", *EXTRAS):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        if self.threshold is None and "threshold" in self.model_fields_set:
            body["threshold"] = None  # an explicit null turns the checkpoint's default threshold off, as on chat
        if self.tools:
            body["tools"] = [t.chat() for t in self.tools]
        if self.tool_choice is not None:
            tc = self.tool_choice
            body["tool_choice"] = tc if isinstance(tc, str) else {"type": "function", "function": {"name": tc.name}}
        if self.text is not None and self.text.format is not None:
            body["response_format"] = self.text.format.chat()
        if self.stream:
            body["stream_options"] = {"include_usage": True,
                                      "include_denoising": bool(self.stream_options and
                                                                self.stream_options.include_denoising)}
        return body
