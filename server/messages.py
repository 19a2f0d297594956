"""Chat messages of ``POST /v1/chat/completions`` (docs/design.md#http-contract and #tools-and-the-responses-api), one
model per role so that the schema states each role's required fields: ``system`` / ``developer`` / ``user``
(``content``), ``assistant`` (``content`` and/or ``tool_calls``), ``tool`` (``content`` and ``tool_call_id``). Content
is a string or a list of text parts (an assistant's also refusal parts); other part types (images, audio) are rejected.

An assistant message is accepted exactly as OpenAI returns it (the openai SDK's ``messages.append(message)`` and
``message.model_dump()``): ``refusal`` (rendered as what the assistant said when it has no content), ``annotations``
(url citations: metadata, not rendered), ``audio: null`` and ``function_call: null``; a non-null ``audio`` or
``function_call`` is a 400 naming the field (docs/api-fields.md).
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Discriminator, Field, Tag, field_validator, model_validator
from pydantic_core import PydanticCustomError

from unmask.engine.limits import MAX_CONTENT_PARTS, MAX_MESSAGE_NAME_CHARS

from .tool_protocol import Strict, Text, ToolCalls

class TextPart(Strict):
    """A text content part of a chat message (``{"type": "text", "text": ...}``); other part types are rejected."""

    type: Literal["text"]
    text: Text


class RefusalPart(Strict):
    """A refusal part of an assistant message's content (``{"type": "refusal", "refusal": ...}``)."""

    type: Literal["refusal"]
    refusal: Text


Content = Text | Annotated[list[TextPart], Field(min_length=1, max_length=MAX_CONTENT_PARTS)]
AssistantContent = Text | Annotated[list[TextPart | RefusalPart], Field(min_length=1, max_length=MAX_CONTENT_PARTS)]


class UrlCitation(Strict):
    """OpenAI's ``url_citation`` of an annotation (character offsets into the content)."""

    start_index: int
    end_index: int
    title: str
    url: str


class Annotation(Strict):
    """An annotation of a returned assistant message (OpenAI's web-search citations); accepted, not rendered."""

    type: Literal["url_citation"]
    url_citation: UrlCitation


def _null_only(value, why: str):
    """A field accepted only as ``null`` (what the SDK's ``model_dump()`` sends); another value is a 400."""
    if value is not None:
        raise PydanticCustomError("unsupported_value", why)
    return value


class _Message(Strict):
    """What every chat message has; the role's own fields are in its subclass (the schema says each role's
    required fields)."""

    name: Text | None = Field(None, max_length=MAX_MESSAGE_NAME_CHARS)

    def text(self) -> str | None:
        """The content as one string (text parts joined without a separator)."""
        c = self.content
        if c is None or isinstance(c, str):
            return c
        return "".join(p.text if p.type == "text" else p.refusal for p in c)

    def as_template_dict(self) -> dict:
        """The Hugging Face chat-template dict: ``{"role", "content"[, "name"][, "tool_calls"][, "tool_call_id"]}``
        (``content`` "" for an assistant message that only called tools)."""
        d = {"role": self.role, "content": self.text() or ""}
        if self.name:
            d["name"] = self.name
        if getattr(self, "tool_calls", None):
            d["tool_calls"] = [c.as_template_dict() for c in self.tool_calls]
        if getattr(self, "tool_call_id", None) is not None:
            d["tool_call_id"] = self.tool_call_id
        return d


class SystemMessage(_Message):
    """A ``system`` / ``developer`` / ``user`` message: ``content`` a string or a list of text parts."""

    role: Literal["system", "developer", "user"]
    content: Content


class AssistantTurn(_Message):
    """An earlier assistant message: ``content`` (may be null/absent with ``tool_calls``), its ``tool_calls``."""

    # the published schema states the rule the validator below enforces (docs/design.md#admission-and-limits)
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, json_schema_extra={"anyOf": [
        {"properties": {"content": {"not": {"type": "null"}}}, "required": ["content"]},
        {"properties": {"tool_calls": {"type": "array", "minItems": 1}}, "required": ["tool_calls"]},
        {"properties": {"refusal": {"type": "string"}}, "required": ["refusal"]}]})

    role: Literal["assistant"]
    content: AssistantContent | None = None
    tool_calls: ToolCalls | None = None
    refusal: Text | None = None
    annotations: list[Annotation] | None = Field(None, description="accepted as returned; not rendered")
    # only null (the SDK's model_dump()): the schema says so, the validators name the field and why
    audio: None = Field(None, description="only null: no audio answers exist here")
    function_call: None = Field(None, description="only null (deprecated): send tool_calls")

    @field_validator("audio", mode="before")
    @classmethod
    def _no_audio(cls, v):
        return _null_only(v, "must be null: this server has no audio answers to refer to")

    @field_validator("function_call", mode="before")
    @classmethod
    def _no_function_call(cls, v):
        return _null_only(v, "must be null: the deprecated function_call is not supported, send tool_calls")

    def text(self) -> str | None:
        """The content as one string; an assistant message with only a ``refusal`` said that refusal."""
        text = super().text()
        return self.refusal if text is None and self.refusal is not None else text

    @model_validator(mode="after")
    def _something(self):
        if self.content is None and not self.tool_calls and self.refusal is None:
            raise PydanticCustomError("invalid_field", "{field}: {why}", {
                "field": "content", "why": "required unless the assistant message has tool_calls"})
        return self


class ToolMessage(_Message):
    """A ``tool`` message: the result of the call ``tool_call_id``."""

    role: Literal["tool"]
    content: Content
    tool_call_id: str = Field(min_length=1, max_length=256, description="the id of a tool call of an earlier "
                                                                        "assistant message (else a 400 naming "
                                                                        "messages.N.tool_call_id)")


ROLES = ("system", "developer", "user", "assistant", "tool")


def _role_tag(v: Any) -> str | None:
    """The member tag of a message; ``None`` (the ``invalid_role`` error, which lists every role) for a role that
    is none of :data:`ROLES`; a missing role is ``Message``'s "required" error."""
    if isinstance(v, dict):
        if "role" in v and v["role"] not in ROLES:  # null included: only a missing role is "required"
            return None
        role = v.get("role")
    else:
        role = getattr(v, "role", None)
    return {"assistant": "Assistant", "tool": "Tool"}.get(role, "Message")


ChatMessage = Annotated[Annotated[SystemMessage, Tag("Message")] | Annotated[AssistantTurn, Tag("Assistant")]
                        | Annotated[ToolMessage, Tag("Tool")],
                        Discriminator(_role_tag, custom_error_type="invalid_role",
                                      custom_error_message="role must be one of " + ", ".join(map(repr, ROLES)))]
