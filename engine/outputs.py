"""Finished-request objects returned by :class:`~unmask.engine.llm.LLM` (vLLM's shapes)."""
from __future__ import annotations

from dataclasses import dataclass, field

from .sequence import Sequence


@dataclass
class CompletionOutput:
    """One choice.

    Attributes:
        index: choice index (``n`` > 1 gives seeds seed, seed+1, ...).
        text: generated text (EOS not rendered, cut before a stop string).
        token_ids: generated ids up to and including the first EOS (DESIGN.md section 10 counting).
        finish_reason: ``stop`` | ``length`` | ``abort``.
        logprobs: per returned token, its log-probability at the step it was revealed (natural log), or None.
        steps: denoising steps. nfe: model forwards (CFG counts two per step).
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[float] | None
    steps: int
    nfe: int

    @property
    def tokens_per_forward(self) -> float:
        """TPF = generated tokens / NFE."""
        return len(self.token_ids) / self.nfe if self.nfe else 0.0


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


def completion_from(seq: Sequence, index: int = 0) -> CompletionOutput:
    """Build a :class:`CompletionOutput` from a finished sequence."""
    lp = seq.logprobs[: len(seq.output_ids)].tolist() if seq.params.logprobs else None
    return CompletionOutput(index=index, text=seq.text, token_ids=list(seq.output_ids),
                            finish_reason=seq.finish_reason, logprobs=lp, steps=seq.step, nfe=seq.nfe)
