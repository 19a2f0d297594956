"""Request models of tool calling and structured output (docs/design.md#tools-and-the-responses-api; OpenAI's chat API
shapes).

* ``tools``: ``[{"type": "function", "function": {"name", "description"?, "parameters"?, "strict"?}}]``; a name
  matches ``^[a-zA-Z0-9_-]{1,64}$`` (OpenAI's rule) and names are unique;
* ``tool_choice``: ``"none"`` | ``"auto"`` | ``"required"`` | ``{"type": "function", "function": {"name"}}``;
* assistant messages may carry ``tool_calls`` (``{"id", "type": "function", "function": {"name", "arguments"}}``,
  ``arguments`` a JSON string as OpenAI sends it), ``role: "tool"`` messages answer one by ``tool_call_id``;
* ``response_format``: ``{"type": "text" | "json_object"}`` or ``{"type": "json_schema", "json_schema": {"name",
  "description"?, "schema"?, "strict"?}}``.

The shared strict base (:class:`Strict`) lives here so that :mod:`unmask.server.protocol` and the Responses API
models (:mod:`unmask.server.responses_protocol`) use one definition.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator
from pydantic_core import PydanticCustomError

from unmask.engine.limits import MAX_TOOLS  # noqa: F401  (re-exported: the protocol modules' import)

from . import json_text

MAX_TOOL_CALLS = 128           # tool calls in one assistant message
MAX_SCHEMA_CHARS = 64 * 1024   # a tool's parameters / a response_format schema, as JSON text
MAX_DESCRIPTION_CHARS = 8192
FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"


class Strict(BaseModel):
    """No type coercion, unknown fields rejected, no NaN/inf (docs/design.md#http-contract)."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class RequestBody(Strict):
    """A whole request body: also no lone surrogate in any string, however deeply nested
    (:func:`check_no_surrogates`)."""

    @model_validator(mode="before")
    @classmethod
    def _no_surrogates(cls, data: Any) -> Any:
        return check_no_surrogates(data)


def _integral(value: Any) -> Any:
    """JSON Schema's ``integer`` includes numbers written with a zero fraction (``7.0``): take them as the integer
    (also inside lists of ids); every other value goes on to the strict int check (``"7"``, ``true`` and ``7.5``
    stay errors)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_integral(v) for v in value]
    return value


def integral_fields(data: Any, names: frozenset[str] | set[str]) -> Any:
    """A request body (before validation) with :func:`_integral` applied to its fields ``names``."""
    if isinstance(data, dict):
        return {k: _integral(v) if k in names else v for k, v in data.items()}
    return data


def _well_formed(text: str) -> str:
    """Refuse a lone UTF-16 surrogate (JSON ``"\\ud800"`` decodes to one): no tokenizer or chat template can
    encode it, so it is a 400 naming the field, not a template or tokenizer failure."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise PydanticCustomError("invalid_text", "text is not valid Unicode: a lone surrogate {char} at "
                                                  "character {pos}", {"char": repr(text[exc.start]),
                                                                      "pos": exc.start}) from None
    return text


def check_no_surrogates(data: Any, path: str = "") -> Any:
    """Refuse a lone UTF-16 surrogate anywhere in a request body (nested tool-call arguments, schema
    descriptions and keys included): no tokenizer or chat template can encode one, so it is a 400 naming the field
    (``messages.1.tool_calls.0.function.arguments``) instead of a tokenizer failure. Returns ``data``."""
    stack = [(data, path)]
    while stack:
        value, where = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise PydanticCustomError("invalid_field", "{field}: {why}", {
                    "field": where or "body", "why": f"text is not valid Unicode: a lone surrogate "
                                                     f"{value[exc.start]!r} at character {exc.start}"}) from None
        elif isinstance(value, dict):
            for k, v in value.items():
                stack.append((k, where or "body"))
                stack.append((v, f"{where}.{k}" if where else str(k)))
        elif isinstance(value, list):
            stack.extend((v, f"{where}.{i}") for i, v in enumerate(value))
    return data


Text = Annotated[str, AfterValidator(_well_formed)]  # every string the tokenizer or the chat template reads


def _bounded_schema(v: dict | None, what: str) -> dict | None:
    if v is not None and len(json.dumps(v)) > MAX_SCHEMA_CHARS:
        raise ValueError(f"{what} is longer than {MAX_SCHEMA_CHARS} characters as JSON")
    return v


class FunctionDef(Strict):
    """A function the model may call; ``parameters`` is a JSON schema of its arguments (absent: no arguments)."""

    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = Field(None, max_length=MAX_DESCRIPTION_CHARS)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _size(cls, v):
        return _bounded_schema(v, "parameters")

    def arguments_schema(self) -> dict:
        """The JSON schema of the arguments object (``{"type": "object"}`` when ``parameters`` is absent/empty)."""
        return dict(self.parameters) if self.parameters else {"type": "object", "properties": {}}


class Tool(Strict):
    """One entry of ``tools`` (only function tools exist in the chat API)."""

    type: Literal["function"]
    function: FunctionDef


class NamedFunction(Strict):
    name: str = Field(pattern=FUNCTION_NAME)


class NamedToolChoice(Strict):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``: call exactly this function."""

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(Strict):
    """``{"name", "arguments"}`` of a tool call in an assistant message (``arguments``: JSON text)."""

    name: str = Field(min_length=1, max_length=64)
    arguments: str

    @field_validator("arguments")
    @classmethod
    def _nesting(cls, v: str) -> str:
        """JSON nested past the request body's rule is a 400 ``invalid_json`` naming this field (a
        ``RecursionError`` at template time was a 500); text that is not JSON stays text (OpenAI takes it)."""
        try:
            json_text.loads(v)
        except json_text.TooDeep as exc:
            raise PydanticCustomError("json_too_deep", "{why}", {"why": str(exc)}) from None
        except ValueError:
            pass
        return v


class ToolCall(Strict):
    """A tool call an assistant message made (sent back by the client as history)."""

    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"]
    function: FunctionCall

    def as_template_dict(self) -> dict:
        """The Hugging Face chat-template shape: ``arguments`` as an object when it parses (templates ``tojson``
        it), else the text as sent."""
        try:
            args: Any = json_text.loads(self.function.arguments)
        except ValueError:  # not JSON, or (validated elsewhere) too deep
            args = self.function.arguments
        return {"id": self.id, "type": "function", "function": {"name": self.function.name, "arguments": args}}


ToolCalls = Annotated[list[ToolCall], Field(min_length=1, max_length=MAX_TOOL_CALLS)]


class JsonSchemaFormat(Strict):
    """``response_format.json_schema``: a named schema (``schema`` absent: any JSON object)."""

    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = Field(None, max_length=MAX_DESCRIPTION_CHARS)
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, populate_by_name=True)

    @field_validator("schema_")
    @classmethod
    def _size(cls, v):
        return _bounded_schema(v, "schema")


class TextFormat(Strict):
    type: Literal["text"]


class JsonObjectFormat(Strict):
    type: Literal["json_object"]


class JsonSchemaResponseFormat(Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


def _format_tag(v: Any) -> str | None:
    """The member tag of a ``response_format`` value: CamelCase, so that it is no request field in an error's
    ``param`` (``Field(discriminator="type")`` put the type's value into the path:
    ``response_format.json_schema.json_schema.name``)."""
    kind = v.get("type") if isinstance(v, dict) else getattr(v, "type", None)
    return _FORMAT_TAGS.get(kind) if isinstance(kind, str) else None


_FORMAT_TAGS = {"text": "Text", "json_object": "JsonObject", "json_schema": "JsonSchema"}
ResponseFormat = Annotated[Annotated[TextFormat, Tag("Text")] | Annotated[JsonObjectFormat, Tag("JsonObject")]
                           | Annotated[JsonSchemaResponseFormat, Tag("JsonSchema")],
                           Discriminator(_format_tag, custom_error_type="invalid_format",
                                         custom_error_message="type must be one of 'text', 'json_object', "
                                                              "'json_schema'")]


def check_tool_messages(messages: list) -> None:
    """Every ``tool`` message answers a call of an earlier assistant message (OpenAI's rule).

    Raises:
        PydanticCustomError: naming ``messages.I.tool_call_id``.
    """
    seen: set[str] = set()
    for i, m in enumerate(messages):
        for c in getattr(m, "tool_calls", None) or []:
            seen.add(c.id)
        if m.role == "tool" and m.tool_call_id not in seen:
            raise PydanticCustomError("invalid_field", "{field}: {why}", {
                "field": f"messages.{i}.tool_call_id",
                "why": f"{m.tool_call_id!r} answers no tool call of an earlier assistant message"})
