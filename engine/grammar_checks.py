"""Compile-time checks of a grammar (docs/design.md#constrained-decoding): JSON-schema integer bounds llguidance cannot
handle (refused before it sees them), a compiled matcher probed along its first forced tokens, llguidance's error text.

Integer bounds.
llguidance 1.9's integer-range regex builder crashes the whole process (SIGSEGV) in
``LLMatcher.validate_grammar`` on an integer subschema whose negative bounds reach the edge of int64 (``minimum`` /
``maximum`` / ``exclusive*`` at or below -(2**63 - 1), with or without ``multipleOf``), yields 9223372036854775807
for ``minimum: 1e19`` (below the minimum), and fails ("Failed to generate regex") on bounds beyond about 2**60.
So the bounds and ``multipleOf`` of every subschema that may be an integer (``type`` ``integer``, a list naming it,
or no ``type``: ``allOf`` may merge it with one) must satisfy ``|value| <= 2**53 - 1``: the interoperable JSON
integers (RFC 7493, I-JSON, section 2.2), which every double represents exactly. ``number``-only subschemas are not
limited (llguidance never crashed on them; it refuses huge float bounds itself). Fuzzed in a child process:
``tests/engine/test_constraint_limits.py``.
"""
from __future__ import annotations

import re

from .limits import ParamError

__all__ = ["check_integer_bounds", "INT_LIMIT", "probe", "first_lines", "PROBE_FORCED"]

INT_LIMIT = 2 ** 53 - 1  # |bound| allowed in integer subschemas (I-JSON integers)
_KEYS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")


def _may_be_integer(schema: dict) -> bool:
    t = schema.get("type")
    if t is None:
        return True
    return t == "integer" if isinstance(t, str) else (not isinstance(t, list) or "integer" in t)


def _path(parts: list) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts).lstrip(".") or "(root)"


def check_integer_bounds(schema, field: str) -> None:
    """Walk every subschema of ``schema`` (a JSON schema: dicts and lists at any depth, so ``properties``,
    ``items``, ``$defs``, ``anyOf``/``oneOf``/``allOf``, ``not``, ... are all covered) and refuse an integer bound
    or ``multipleOf`` outside [-(2**53 - 1), 2**53 - 1].

    Raises:
        ParamError: naming ``field`` and the path of the offending keyword, e.g.
            ``response_format: invalid json_schema constraint: schema.properties.n.minimum = -2e+19 is outside the
            supported integer range ...``.
    """
    stack: list[tuple[object, list]] = [(schema, [])]
    while stack:
        node, path = stack.pop()
        if isinstance(node, dict):
            if _may_be_integer(node):
                for key in _KEYS:
                    v = node.get(key)
                    if isinstance(v, (int, float)) and not isinstance(v, bool) and not abs(v) <= INT_LIMIT:
                        raise ParamError(field, f"invalid json_schema constraint: schema.{_path(path + [key])} = "
                                                f"{v!r} is outside the supported integer range [-(2**53-1), 2**53-1] "
                                                f"(I-JSON integers)")
            stack.extend((v, path + [k]) for k, v in node.items() if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            stack.extend((v, path + [i]) for i, v in enumerate(node) if isinstance(v, (dict, list)))


def first_lines(message: str) -> str:
    """llguidance's error without the grammar listing it appends (``   3 | body: ...`` and the caret line): the
    listing is internal grammar text (a tool grammar embeds whole schemas), not what the client wrote."""
    message = message.split("<state>")[0]  # llguidance's parser-state dump follows its error line
    lines = [ln for ln in message.strip().splitlines() if not re.match(r"^\s*(\d+ \||\^)", ln)]
    return " ".join(ln.strip() for ln in lines)


#: forced tokens the compile-time probe follows (docs/design.md#constrained-decoding)
PROBE_FORCED = 64


def probe(m, constraint, forced: int = PROBE_FORCED) -> None:
    """Compute ``m``'s mask (an ``llguidance.LLMatcher``; advanced: it consumes) and follow up to ``forced`` tokens
    the grammar forces (one allowed token, grammar not accepting), checking each mask.

    Raises:
        ParamError: naming ``constraint.field``: llguidance reports an error (a lexer/parser limit), or a mask
            allows nothing while the grammar does not accept (no output satisfies it).
    """
    for i in range(forced + 1):
        mask = None if m.is_error() else m.compute_bitmask()
        if m.is_error():
            raise ParamError(constraint.field, f"invalid {constraint.kind} constraint: {first_lines(m.get_error())}")
        bits = int.from_bytes(mask, "little")
        if not bits and not (m.is_accepting() or m.is_stopped()):
            raise ParamError(constraint.field, f"invalid {constraint.kind} constraint: no output satisfies it (its "
                                               f"grammar allows no next token)")
        if i == forced or bits.bit_count() != 1 or m.is_accepting():
            return
        m.consume_token(bits.bit_length() - 1)  # on failure the matcher is in error: raised above next round
