"""``tool_choice: "required"`` / a named function -> a Lark grammar (llguidance syntax) whose every sentence is a
call the ``hermes`` parser accepts (docs/design.md#tools-and-the-responses-api).

A call is ``<tool_call>\\n{"name": NAME, "arguments": ARGS}\\n</tool_call>`` with ARGS valid under that tool's
``parameters`` schema (embedded with llguidance's ``%json``), the layout of the Hermes/Qwen templates (``tojson``
separators ``", "`` and ``": "``, no other whitespace, so a model cannot wander in whitespace). ``required``
allows any offered tool; with ``parallel_tool_calls`` one or more calls separated by a newline, else exactly one;
a named choice is exactly one call of that function.
"""
from __future__ import annotations

import json

from .tool_protocol import Tool

# llguidance JSON options: one fixed layout (https://github.com/guidance-ai/llguidance/blob/main/docs/json_schema.md)
X_GUIDANCE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _relocated(schema, base: str):
    """``schema`` with every local ``$ref`` (``#``, ``#/$defs/X``, ``#/definitions/X``, any JSON pointer) re-rooted
    at ``base`` (``#/$defs/tool_0``): the tool's parameters move from the document root into the call schema's
    ``$defs``, and a pointer into them must follow (else "Pointer '/$defs/X' does not exist")."""
    if isinstance(schema, dict):
        return {k: (base + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#") else _relocated(v, base))
                for k, v in schema.items()}
    if isinstance(schema, list):
        return [_relocated(v, base) for v in schema]
    return schema


def call_schema(tools: list[Tool], indices: list[int] | None = None) -> dict:
    """The JSON schema of one call object ``{"name", "arguments"}`` over ``tools`` (anyOf when several).

    Each tool's ``parameters`` sit in the top-level ``$defs`` as ``tool_I`` (I: its index in the request,
    ``indices``, default 0, 1, ...) with their local ``$ref``s re-rooted there, and ``arguments`` refers to them:
    the parameters' own ``$defs``/``definitions`` and recursive ``#`` refs keep resolving."""
    indices = list(range(len(tools))) if indices is None else indices
    defs = {f"tool_{i}": _relocated(t.function.arguments_schema(), f"#/$defs/tool_{i}") for i, t in zip(indices, tools)}
    options = [{"type": "object",
                "properties": {"name": {"const": t.function.name}, "arguments": {"$ref": f"#/$defs/tool_{i}"}},
                "required": ["name", "arguments"], "additionalProperties": False} for i, t in zip(indices, tools)]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "$defs": defs, "x-guidance": X_GUIDANCE}


def tool_call_grammar(tools: list[Tool], name: str | None = None, parallel: bool = True) -> str:
    """The Lark grammar of the calls ``tool_choice`` requires.

    Args:
        tools: the request's tools (non-empty). name: a named ``tool_choice`` (one call of it), else ``required``.
        parallel: ``parallel_tool_calls`` (required only): one or more calls, else exactly one.

    Raises:
        ValueError: ``name`` is not among ``tools`` (the caller names the field ``tool_choice``).
    """
    indices = list(range(len(tools)))
    if name is not None:
        indices = [i for i, t in enumerate(tools) if t.function.name == name]
        if not indices:
            raise ValueError(f"the function {name!r} is not in tools ({[t.function.name for t in tools]})")
        parallel = False
    start = 'start: call ("\\n" call)*' if parallel else "start: call"
    schema = call_schema([tools[i] for i in indices], indices)
    return (f"{start}\n"
            f'call: "<tool_call>\\n" body "\\n</tool_call>"\n'
            f"body: %json {json.dumps(schema, ensure_ascii=False)}\n")


def enforced_tools(tools: list[Tool], name: str | None) -> list[int]:
    """The indices (in ``tools``) of the tools a ``tool_choice`` grammar embeds: all, or those named ``name``."""
    return [i for i, t in enumerate(tools) if name is None or t.function.name == name]
