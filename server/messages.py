"""Chat messages of ``POST /v1/chat/completions`` (docs/design.md#http-contract and #tools-and-the-responses-api), one
model per role so that the schema states each role's required fields: ``system`` / ``developer`` / ``user``
(``content``), ``assistant`` (``content`` and/or ``tool_calls``), ``tool`` (``content`` and ``tool_call_id``). Content
is a string or a list of text parts; other part types (images, audio) are rejected.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Discriminator, Field, Tag, model_validator
from pydantic_core import PydanticCustomError

from unmask.engine.limits import MAX_MESSAGE_NAME_CHARS

from .tool_protocol import Strict, Text, ToolCalls

class TextPart(Strict):
    """A text content part of a chat message (``{"type": "text", "text": ...}``); other part types are rejected."""

    type: Literal["text"]
    text: Text


Content = Text | Annotated[list[TextPart], Field(min_length=1)]


class _Message(Strict):
    """What every chat message has; the role's own fields are in its subclass (the schema says each role's
    required fields)."""

    name: Text | None = Field(None, max_length=MAX_MESSAGE_NAME_CHARS)

    def text(self) -> str | None:
        """The content as one string (text parts joined without a separator)."""
        c = self.content
        return c if c is None or isinstance(c, str) else "".join(p.text for p in c)

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
    content: Content | None = None
    tool_calls: ToolCalls | None = None
    refusal: str | None = None

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
    tool_call_id: str = Field(min_length=1, max_length=256)


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
