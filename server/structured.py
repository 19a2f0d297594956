"""Request fields -> the engine's constrained decoding and logit bias (docs/design.md#constrained-decoding and
#tools-and-the-responses-api).

* ``response_format``: ``json_object`` -> ``Constraint("json_object", {})``; ``json_schema`` ->
  ``Constraint("json_schema", schema)`` (no ``schema``: as ``json_object``); ``text`` -> none;
* ``tool_choice``: ``required`` / a named function -> ``Constraint("lark", grammar)`` (:mod:`.tool_grammar`), so
  the answer always parses as tool calls; ``auto`` / ``none`` -> none;
* ``logit_bias``: OpenAI's string token-id keys -> ``{int: float}`` (``SamplingParams.logit_bias``; the engine
  checks the ids against the vocabulary and the range [-100, 100]).

The engine names the fields of its errors (``Constraint(..., field=...)``), so an invalid schema is a 400 naming
``response_format`` or ``tool_choice``.
"""
from __future__ import annotations

import re

import dataclasses

from unmask.engine import Constraint, ParamError, SamplingParams, check_constraint

from .errors import APIError
from .tool_grammar import enforced_tools, tool_call_grammar

MAX_LOGIT_BIAS = 300  # entries (OpenAI documents no cap; a bound on request size)


def constraint(kind: str, spec, field: str) -> Constraint:
    """An engine ``Constraint`` whose errors name ``field`` (ParamError from the engine for an invalid spec)."""
    return Constraint(kind, spec, field=field)


def response_format_constraint(fmt):
    """``response_format`` (a :mod:`.tool_protocol` model or None) -> a Constraint or None."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_schema" and fmt.json_schema.schema_:
        return constraint("json_schema", fmt.json_schema.schema_, "response_format")
    return constraint("json_object", {}, "response_format")


def tool_choice_constraint(tools, tool_choice, parallel: bool):
    """``tool_choice`` ``required`` / named over ``tools`` -> a lark Constraint, else None.

    Raises:
        APIError: 400 naming ``tool_choice`` (no tools, or a name not among them).
    """
    if tool_choice in (None, "auto", "none"):
        return None
    if not tools:
        raise APIError(400, "tool_choice: requires tools", param="tool_choice", code="invalid_value")
    name = None if tool_choice == "required" else tool_choice.function.name
    try:
        grammar = tool_call_grammar(tools, name, parallel)
    except ValueError as exc:
        raise APIError(400, f"tool_choice: {exc}", param="tool_choice", code="invalid_value") from exc
    for i in enforced_tools(tools, name):  # a bad schema is named as the client wrote it, not as grammar text
        field = f"tools.{i}.function.parameters"
        try:
            check_constraint(constraint("json_schema", tools[i].function.arguments_schema(), field))
        except ParamError as exc:
            raise APIError(400, f"{field}: {str(exc).split(': ', 1)[-1].replace('json_schema constraint', 'JSON schema')}"
                                f" (tool_choice enforces it)", param=field, code="invalid_value") from exc
    return constraint("lark", grammar, "tool_choice")


LOGIT_BIAS_KEY = r"^[0-9]{1,10}$"  # a decimal token id (ASCII digits: the schema's propertyNames pattern)


def bad_bias_key(key: str) -> str:
    """The 400 reason for a ``logit_bias`` key that is not a token id, quoting at most its first 16 characters (a
    5000-digit key must not come back whole)."""
    shown = repr(key) if len(key) <= 16 else f"{key[:16]!r}... ({len(key)} characters)"
    return f"keys are token ids (decimal integers of at most 10 digits), got {shown}"


def logit_bias_ids(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's ``{"token id": bias}`` -> ``{id: bias}`` (None / ``{}`` -> None).

    Raises:
        APIError: 400 naming ``logit_bias`` (a key that is not a decimal token id; the request schema checks it
            first, this guards other callers).
    """
    if not bias:
        return None
    bad = [k for k in bias if not re.fullmatch(LOGIT_BIAS_KEY, k)]
    if bad:
        raise APIError(400, f"logit_bias: {bad_bias_key(bad[0])}", param="logit_bias", code="invalid_value")
    return {int(k): v for k, v in bias.items()}


def with_extras(params: SamplingParams, constraint=None, logit_bias: dict[int, float] | None = None):
    """``params`` with ``constraint`` / ``logit_bias`` set (unchanged when both are None).

    Raises:
        ParamError: from the engine (out-of-vocabulary id, bias out of range, invalid grammar).
    """
    changes = {k: v for k, v in (("constraint", constraint), ("logit_bias", logit_bias)) if v is not None}
    return dataclasses.replace(params, **changes) if changes else params
