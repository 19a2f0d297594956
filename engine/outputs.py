"""The engine's output objects: what every caller (``LLM``, ``AsyncEngine``, the server) reads, and nothing else
(docs/design.md#decoding, step 8; vLLM's shapes).

* :class:`StepEvent`: one per choice per denoising step (frozen); the finished one carries the choice's
  :class:`CompletionOutput` (aborts too: the partial output).
* :class:`CompletionOutput`: one finished choice (frozen): text, token ids, logprobs, usage counters.
* :class:`RequestOutput`: one finished request: prompt and choices.

Token counting (docs/design.md#decisions): ``token_ids`` runs up to and including the first EOS/stop id;
``ended_by_eos`` says the last id is such an id (counted in usage, never rendered in ``text``).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields


@dataclass(frozen=True)
class Revealed:
    """A token revealed in one step. ``position`` counts from the first generated position; ``confidence`` is the
    candidate's probability (float), ``logprob`` its natural log-probability (the value ``CompletionOutput.logprobs``
    records); ``top``: with ``SamplingParams.top_logprobs``, the most likely ``(token id, logprob)`` at that position
    and step, most likely first (else empty)."""

    position: int
    token_id: int
    confidence: float
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class CompletionOutput:
    """One choice.

    Attributes:
        index: choice index (``n`` > 1 gives seeds seed, seed+1, ...).
        text: generated text (EOS not rendered, cut before a stop string).
        token_ids: generated ids up to and including the first EOS (docs/design.md#decisions counting).
        finish_reason: ``stop`` | ``length`` | ``abort``.
        logprobs: per returned token, its log-probability at the step it was revealed (natural log), or None.
        top_logprobs: with ``SamplingParams.top_logprobs``, per returned token its most likely ``(token id,
            logprob)`` alternatives at that step, most likely first; else None.
        steps: denoising steps. nfe: model forwards (CFG counts two per step).
        ended_by_eos: the last of ``token_ids`` is an EOS/stop id (counted in usage, not rendered).
        steps_per_block: denoising steps of each finished block, in order.
        drafts_proposed / drafts_accepted: draft tokens verified / accepted (self-speculative decoding; else 0).
        speculative: decoded self-speculatively. draft_block: its draft block (``None`` otherwise).
        first_token_time / finish_time: wall times (``time.time()``) of the first shown text and of the finish.
        cached_tokens: prompt tokens whose KV came from the prefix cache (docs/design.md#prefix-reuse; vLLM's
            ``num_cached_tokens``, OpenAI's ``usage.prompt_tokens_details.cached_tokens``).
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[float] | None
    steps: int
    nfe: int
    ended_by_eos: bool = False
    steps_per_block: list[int] = field(default_factory=list)
    drafts_proposed: int = 0
    drafts_accepted: int = 0
    speculative: bool = False
    draft_block: int | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    cached_tokens: int = 0
    top_logprobs: list[list[tuple[int, float]]] | None = None

    @property
    def tokens_per_forward(self) -> float:
        """TPF = generated tokens / NFE."""
        return len(self.token_ids) / self.nfe if self.nfe else 0.0


@dataclass(frozen=True)
class StepEvent:
    """What one denoising step did to one choice of a request (docs/design.md#decoding, step 8).

    Attributes:
        request_id: the request (the same for every choice). index: the choice (0..n-1).
        block: block index. step: denoising step of the choice, from 0, across blocks.
        nfe: model forwards the choice has taken part in so far (CFG counts twice).
        revealed: tokens revealed in this step.
        canvas: ``[max_tokens]`` token id per generated position, ``None`` where still masked.
        text: the final, stream-safe text so far (UTF-8 complete, no stop-string prefix); grows monotonically.
        num_tokens: tokens generated so far (the revealed left-to-right prefix; on the finished event
            ``len(output.token_ids)``).
        drafts_proposed / drafts_accepted: speculative counters so far (0 for plain decoding).
        finished: True on the choice's last event; then ``finish_reason`` is ``stop`` | ``length`` | ``abort``
            and ``output`` is the choice's :class:`CompletionOutput` (partial for an abort).
        final: where the revisable canvas's provisional region starts (docs/design.md#http-contract, "Revisable
            canvases"): ``canvas`` positions ``>= final`` may still change in a later step (token editing,
            ``unmask.engine.refinement``); ``None``: every revealed position is final (the usual rule).
        cached_tokens: prompt tokens whose KV came from the prefix cache (known from the choice's admission on,
            the same on every event; ``CompletionOutput.cached_tokens`` at the end).
    """

    request_id: str
    block: int
    step: int
    nfe: int
    revealed: list[Revealed]
    canvas: list[int | None]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    index: int = 0
    num_tokens: int = 0
    drafts_proposed: int = 0
    drafts_accepted: int = 0
    output: CompletionOutput | None = None
    final: int | None = None
    cached_tokens: int = 0


@dataclass
class RequestOutput:
    """A finished request: prompt, choices and timing (seconds, wall clock)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    seconds: float = 0.0
    time_to_first_token: float | None = None

    @property
    def finished(self) -> bool:
        """True when every choice has a ``finish_reason`` (vacuously True with no choices)."""
        return all(o.finish_reason is not None for o in self.outputs)


def filled(cls, **values):
    """An instance of the frozen dataclass ``cls`` (whose fields have no ``default_factory``) with ``values`` (every
    field without a default must be among them; not checked) and the defaults of the others, its ``__dict__``
    filled at once: the object ``cls(**values)`` makes (equal, same repr, pickled the same) without the frozen
    ``__init__``'s ``object.__setattr__`` per field (one :class:`StepEvent` per choice per step, issue 42)."""
    defaults = _DEFAULTS.get(cls)
    if defaults is None:  # every field, in the class's order (dataclasses.MISSING where it has none): ``update`` keeps
        defaults = _DEFAULTS[cls] = {f.name: f.default for f in fields(cls)}  # that order, as ``__init__`` sets it
    obj = object.__new__(cls)
    d = obj.__dict__
    d.update(defaults)
    d.update(values)
    return obj


def revealed_token(position: int, token_id: int, confidence: float, logprob: float,
                   top: tuple[tuple[int, float], ...] = ()) -> Revealed:
    """``Revealed(position, token_id, confidence, logprob, top)``, built as :func:`filled` builds it (one per
    revealed token)."""
    obj = object.__new__(Revealed)
    d = obj.__dict__
    d["position"] = position
    d["token_id"] = token_id
    d["confidence"] = confidence
    d["logprob"] = logprob
    d["top"] = top
    return obj


_DEFAULTS: dict[type, dict] = {}  # filled(): per class, its fields' defaults
