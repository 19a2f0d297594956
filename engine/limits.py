"""The one declaration of every request range (docs/design.md#http-contract and #decisions).

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

from .step_cost import SEQUENCE_ROWS

REMASKING_STRATEGIES = ("low_confidence", "margin", "entropy", "random", "left_to_right")
CACHE_MODES = ("auto", "none", "prefix", "dual")
MAX_SEED = 2**63 - 1
MAX_STOP = 4
MAX_SPECULATIVE_BLOCK = 32  # self-speculative steps forward up to ~block_size^2 rows: the draft block is bounded
MAX_NO_REPEAT_NGRAM = 64
MIN_SAMPLING_TEMPERATURE = 1e-100  # below this a positive temperature decodes as argmax (l / T would overflow)

# Size bounds (docs/design.md#admission-and-limits): every size-like request field has a declared maximum here, and the
# engine checks the bounds that depend on the request and the model (block <= context, sub_block_size <=
# block_size, speculative_branches <= block_size - 1) where it resolves them; a value past either is a ParamError
# naming the field (HTTP 400), never silently clamped. (Steps beyond a block's masks are never run: free, accepted.)
MAX_POSITIONS = 2**20      # max_tokens / steps / min_tokens: no served model has a longer context
MAX_BLOCK_SIZE = 512       # a block this long costs what a max_tokens=512 request costs (block x block rows)
MAX_N = 16                 # choices per prompt (and best_of)
MAX_PROMPTS = 32           # prompts per completions request
MAX_MESSAGES = 1024        # chat messages per request
MAX_STOP_CHARS = 1024      # characters per stop string
MAX_STOP_TOKEN_IDS = 64    # stop_token_ids per request
MAX_TOKEN_ID = 2**31 - 1   # a token id fits int32 (the vocabulary check is the engine's)
MAX_NAME_CHARS = 512       # model, user, safety_identifier, prompt_cache_key
MAX_MESSAGE_NAME_CHARS = 256
MAX_TOP_LOGPROBS = 20      # alternatives recorded per token (OpenAI's chat maximum, top_logprobs)
MAX_COMPLETION_LOGPROBS = 5  # completions' logprobs: OpenAI's maximum (vLLM allows 20; OpenAI's limit is kept)
# Structure bounds (docs/design.md#admission-and-limits): counts that make a small body expensive to validate, checked
# on the raw JSON off the event loop before any model parses it (server/body_limits.py) and published in the OpenAPI
# schema (info.x-limits; maxItems where a field has one). 150,000 content parts in 4 MB stalled /health 1-1.4 s.
MAX_CONTENT_PARTS = 256    # content parts per message (chat messages, responses input items)
MAX_SCHEMA_NODES = 4096    # JSON values in all of a request's schemas (tool parameters, response_format/text.format)
MAX_JSON_DEPTH = 64        # nesting of the request body
MAX_JSON_ITEMS = MAX_POSITIONS  # entries of any one array or object of the body (a token-id prompt at most)
MAX_TOOLS = 128            # OpenAI's limit on tools per request
# Bounds on the whole body, counted on its bytes before it is parsed: json.loads of 900,000 one-element lists (3.6 MB)
# held the GIL 6-14 s (the cyclic GC runs again and again while it builds them), freezing the event loop even from a
# worker thread. Every container costs a parse, a GC and a validation: a chat of 1,024 messages with 8 content parts
# each has ~10,000; a value is cheap: 32 token-id prompts of 8,192 tokens are 262,144.
MAX_JSON_CONTAINERS = 2**14  # arrays and objects in the body
MAX_JSON_VALUES = 2**18      # values in the body (numbers, strings, literals, arrays and objects; keys not counted)

# Checkpoint sanity (docs/design.md#checks-at-load): no trained model's weight reaches this magnitude (SmolLM2-135M's
# largest is 9.3, its adapter's 0.62; large models' outliers stay in the hundreds); a weight past it is refused at
# load unless --max-weight-magnitude raises it (0 = no bound). Adapter scales alpha / rank past MAX_ADAPTER_SCALE or
# ranks past MAX_ADAPTER_RANK are refused too (LoRA practice: scale 0.5-16, rank 4-256).
MAX_WEIGHT_MAGNITUDE = 1e3
MAX_ADAPTER_SCALE = 1024.0
MAX_ADAPTER_RANK = 4096
ADAPTER_VERSIONS = (1,)    # mask_adapter.json format versions this server reads
# what one request may cost a step (--max-step-rows, engine/step_cost.py): one block of 128 rows and its sequence's
# term; ~0.3 s a step on 2 cores for SmolLM2-135M
DEFAULT_MAX_STEP_ROWS = 128 + SEQUENCE_ROWS
DEFAULT_MAX_SEQS_PER_REQUEST = 64  # prompts x n of one request (--max-seqs-per-request), at most the queue
#: row-equivalents per chunk of a long prompt's prefill, rows at the prompt's start (docs/design.md#decoding,
#: "Chunked prefill"; engine/prefill_cost.py; measured in benchmarks/results/bench_long_prefill.md): small enough
#: that other requests keep stepping during a long prefill, large enough that a forward's fixed cost stays a small
#: share of the chunk's
DEFAULT_PREFILL_CHUNK = 256


def check_prefill_chunk(value) -> int:
    """``value`` as a chunked-prefill size (row-equivalents of prompt rows per step, 0 = off).

    Raises:
        ValueError: not an integer >= 0 (names ``prefill_chunk``).
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"prefill_chunk: must be an integer >= 0, got {value!r}")
    return value


class ParamError(ValueError):
    """An invalid request parameter; ``field`` names it (the server turns this into a 400 with ``param``)."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.reason = message

    def __reduce__(self):  # pickled with its two arguments: it crosses processes (Ray Serve replicas)
        return type(self), (self.field, self.reason)


@dataclass(frozen=True)
class Range:
    """A numeric range: ``lo`` (``None`` = unbounded; exclusive when ``lo_open``) to ``hi`` (inclusive, ``None`` =
    unbounded); ``integer``: whole numbers only."""

    lo: float | None = None
    hi: float | None = None
    integer: bool = False
    lo_open: bool = False


MAX_DENOISING_STEPS = 1024  # a uniform canvas's denoising steps (DiffusionGemma's generate(): 48 by default)
MAX_POST_STEPS = 256  # editing steps after a block's last mask (LLaDA2Pipeline's max_post_steps, default 16)

RANGES: dict[str, Range] = {
    "max_tokens": Range(1, MAX_POSITIONS, integer=True),
    "n": Range(1, MAX_N, integer=True),
    "temperature": Range(0, 2),
    "top_k": Range(0, None, integer=True),  # unbounded: a k past the vocabulary keeps every token, at no cost
    "top_p": Range(0, 1, lo_open=True),
    "steps": Range(1, MAX_POSITIONS, integer=True),
    "block_size": Range(1, MAX_BLOCK_SIZE, integer=True),
    "sub_block_size": Range(1, MAX_BLOCK_SIZE, integer=True),
    "threshold": Range(0, 1),
    "cfg_scale": Range(0, 100),
    "seed": Range(0, MAX_SEED, integer=True),
    "presence_penalty": Range(-2, 2),
    "frequency_penalty": Range(-2, 2),
    "repetition_penalty": Range(0, 100, lo_open=True),
    "min_tokens": Range(0, MAX_POSITIONS, integer=True),
    "stop_token_ids": Range(0, MAX_TOKEN_ID, integer=True),
    "speculative_branches": Range(0, MAX_SPECULATIVE_BLOCK - 1, integer=True),
    "speculative_epsilon": Range(0, 1, lo_open=True),
    "speculative_ratio": Range(0, 1, lo_open=True),
    "speculative_no_repeat_ngram": Range(0, MAX_NO_REPEAT_NGRAM, integer=True),
    "logit_bias": Range(-100, 100),  # OpenAI's: each bias value
    "top_logprobs": Range(0, MAX_TOP_LOGPROBS, integer=True),
    # fraction of a block decoded before the next joins (docs/design.md#the-seeds-methods)
    "multi_block": Range(0, 1, lo_open=True),
    # block refinement's token editing (LLaDA2.1; docs/design.md#decoding): 0 = off, as diffusers' pipeline
    "editing_threshold": Range(0, 1),
    "max_post_steps": Range(0, MAX_POST_STEPS, integer=True),
    # the uniform-canvas sampler (DiffusionGemma; unmask.engine.uniform_options): transformers' names
    "max_denoising_steps": Range(1, MAX_DENOISING_STEPS, integer=True),
    "t_min": Range(0, 100),
    "t_max": Range(0, 100, lo_open=True),
    "entropy_bound": Range(0, 1e6, lo_open=True),
    "stability_threshold": Range(0, MAX_DENOISING_STEPS, integer=True),
    "confidence_threshold": Range(0, 1e6, lo_open=True),
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


def prompt_chars_limit(max_context: int, max_token_chars: int) -> int:
    """Characters beyond which a text surely holds more than ``max_context`` tokens: no token covers more than
    ``max_token_chars`` characters (the longest vocabulary entry; byte-level BPE entries are at least as long as
    the text they cover), so a text longer than ``max_context * max_token_chars`` characters is refused before it
    is tokenized (docs/design.md#admission-and-limits)."""
    return max_context * max(1, max_token_chars)


def check_block_use(block_size: int | None, max_tokens: int, model_block_size: int) -> None:
    """Raise :class:`ParamError` (``block_size``) when a request's own ``block_size`` is longer than it can use:
    more than both the model's block size and ``max_tokens`` rounded up to a power of two. The generation region
    is ``max_tokens`` rounded up to whole blocks and every masked position costs a step, so a block of 4096 for
    ``max_tokens: 1`` would decode 4095 positions that are thrown away (docs/design.md#admission-and-limits)."""
    if block_size is None:
        return
    usable = max(model_block_size, 1 << max(0, int(max_tokens) - 1).bit_length())
    if block_size > usable:
        raise ParamError("block_size", f"must be <= {usable} for max_tokens {max_tokens} (max_tokens rounded up to "
                                       f"a power of two, or the model's block size {model_block_size}): a longer "
                                       f"block decodes positions that are never returned; got {block_size}")


def check(name: str, value) -> None:
    """Check ``value`` against ``RANGES[name]`` (``None`` passes); raises :class:`ParamError` naming ``name``."""
    r = RANGES[name]
    check_number(name, value, r.lo, r.hi, r.integer, r.lo_open)
