"""The one declaration of every request range (docs/design.md sections 5 and 10).

The HTTP protocol (``unmask.server.protocol``), the CLI (``unmask generate``) and the Python API
(:class:`~unmask.engine.params.SamplingParams`) all check their fields against :data:`RANGES`; no other module
writes a bound as a literal number. OpenAI's ranges where OpenAI has one (temperature [0, 2], top_p (0, 1],
presence/frequency penalty [-2, 2], seed [0, 2**63 - 1], n >= 1, at most 4 stop strings); ours elsewhere.

Errors: :func:`check` raises :class:`ParamError` naming the field (the server turns it into a 400 with
``param``), e.g. ``ParamError("temperature", "must be <= 2, got 3.0")``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

REMASKING_STRATEGIES = ("low_confidence", "margin", "entropy", "random")
CACHE_MODES = ("auto", "none", "prefix", "dual")
MAX_SEED = 2**63 - 1
MAX_STOP = 4
MAX_SPECULATIVE_BLOCK = 32  # self-speculative steps forward up to ~block_size^2 rows: the draft block is bounded
MAX_NO_REPEAT_NGRAM = 64
MIN_SAMPLING_TEMPERATURE = 1e-100  # below this a positive temperature decodes as argmax (l / T would overflow)


class ParamError(ValueError):
    """An invalid request parameter; ``field`` names it (the server turns this into a 400 with ``param``)."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.reason = message


@dataclass(frozen=True)
class Range:
    """A numeric range: ``lo`` (``None`` = unbounded; exclusive when ``lo_open``) to ``hi`` (inclusive, ``None`` =
    unbounded); ``integer``: whole numbers only."""

    lo: float | None = None
    hi: float | None = None
    integer: bool = False
    lo_open: bool = False


RANGES: dict[str, Range] = {
    "max_tokens": Range(1, None, integer=True),
    "n": Range(1, None, integer=True),
    "temperature": Range(0, 2),
    "top_k": Range(0, None, integer=True),
    "top_p": Range(0, 1, lo_open=True),
    "steps": Range(1, None, integer=True),
    "block_size": Range(1, None, integer=True),
    "sub_block_size": Range(1, None, integer=True),
    "threshold": Range(0, 1),
    "cfg_scale": Range(0, 100),
    "seed": Range(0, MAX_SEED, integer=True),
    "presence_penalty": Range(-2, 2),
    "frequency_penalty": Range(-2, 2),
    "repetition_penalty": Range(0, 100, lo_open=True),
    "min_tokens": Range(0, None, integer=True),
    "stop_token_ids": Range(0, None, integer=True),
    "speculative_branches": Range(0, None, integer=True),
    "speculative_epsilon": Range(0, 1, lo_open=True),
    "speculative_ratio": Range(0, 1, lo_open=True),
    "speculative_no_repeat_ngram": Range(0, MAX_NO_REPEAT_NGRAM, integer=True),
    "multi_block": Range(0, 1, lo_open=True),  # fraction of a block decoded before the next joins (section 22)
}


def check_number(name: str, value, lo=None, hi=None, integer=False, lo_open=False) -> None:
    """Raise :class:`ParamError` naming ``name`` unless ``value`` (``None`` passes) is a finite number in range."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ParamError(name, f"must be a number, got {type(value).__name__}")
    if isinstance(value, float):  # Python ints are exact at any size; only floats can be inf/nan or fractional
        if not math.isfinite(value):
            raise ParamError(name, f"must be finite, got {value!r}")
        if integer and not value.is_integer():
            raise ParamError(name, f"must be an integer, got {value!r}")
    if lo is not None and (value <= lo if lo_open else value < lo):
        raise ParamError(name, f"must be {'>' if lo_open else '>='} {lo}, got {value!r}")
    if hi is not None and value > hi:
        raise ParamError(name, f"must be <= {hi}, got {value!r}")


def check(name: str, value) -> None:
    """Check ``value`` against ``RANGES[name]`` (``None`` passes); raises :class:`ParamError` naming ``name``."""
    r = RANGES[name]
    check_number(name, value, r.lo, r.hi, r.integer, r.lo_open)
