"""``tool_choice: "required"`` / a named function -> a Lark grammar (llguidance syntax) whose every sentence is a
call the ``hermes`` parser accepts (docs/design.md section 20).

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


def call_schema(tools: list[Tool]) -> dict:
    """The JSON schema of one call object ``{"name", "arguments"}`` over ``tools`` (anyOf when several)."""
    options = [{"type": "object",
                "properties": {"name": {"const": t.function.name}, "arguments": t.function.arguments_schema()},
                "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "x-guidance": X_GUIDANCE}


def tool_call_grammar(tools: list[Tool], name: str | None = None, parallel: bool = True) -> str:
    """The Lark grammar of the calls ``tool_choice`` requires.

    Args:
        tools: the request's tools (non-empty). name: a named ``tool_choice`` (one call of it), else ``required``.
        parallel: ``parallel_tool_calls`` (required only): one or more calls, else exactly one.

    Raises:
        ValueError: ``name`` is not among ``tools`` (the caller names the field ``tool_choice``).
    """
    if name is not None:
        chosen = [t for t in tools if t.function.name == name]
        if not chosen:
            raise ValueError(f"the function {name!r} is not in tools ({[t.function.name for t in tools]})")
        tools, parallel = chosen, False
    start = 'start: call ("\\n" call)*' if parallel else "start: call"
    return (f"{start}\n"
            f'call: "<tool_call>\\n" body "\\n</tool_call>"\n'
            f"body: %json {json.dumps(call_schema(tools), ensure_ascii=False)}\n")
