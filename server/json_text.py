"""JSON text inside a request (tool-call ``arguments``) or in the model's output (a tool call's body), parsed under
the request body's nesting rule (docs/design.md#admission-and-limits), and the nesting depth of parsed values.

The body itself is parsed by FastAPI with Python's ``json``, whose C scanner stops at the interpreter's recursion
limit; a body nested deeper is a 400 ``invalid_json`` (:mod:`unmask.server.errors`). :func:`loads` applies the same
parser, hence the same limit, to JSON strings: nesting past it raises :class:`TooDeep`, a ``ValueError`` like any
other malformed JSON, never a ``RecursionError`` (which would surface as a 500).
"""
from __future__ import annotations

import json
from typing import Any

#: the nesting rule, as the 400s state it (the limit is the parser's, so it is not a fixed number)
DEPTH_RULE = "nested at most a few hundred levels deep"


class TooDeep(ValueError):
    """JSON text nested past the parser's recursion limit."""


def loads(text: str) -> Any:
    """``json.loads(text)``.

    Raises:
        TooDeep: nested past the parser's recursion limit (the request body's rule).
        ValueError: (``json.JSONDecodeError``) not JSON.
    """
    try:
        return json.loads(text)
    except RecursionError:
        raise TooDeep(f"JSON {DEPTH_RULE}") from None


def depth(value: Any) -> int:
    """Nesting depth of a parsed JSON value (a scalar 0, ``[]`` 1, ``[[1]]`` 2), counted without recursion."""
    best, stack = 0, [(value, 0)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            best = max(best, d + 1)
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return best
