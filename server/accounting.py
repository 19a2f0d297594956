"""What one API request cost: its usage, its metrics and its log line (docs/design.md#decisions).

Everything is read from the engine's outputs: a finished choice's :class:`CompletionOutput` (tokens up to and
including the first EOS, NFE, steps, drafts), and for a choice that never finished (timeout, disconnect, engine
fault) the last :class:`StepEvent` the server saw of it (the revealed left-to-right prefix, NFE and steps so far).
"""
from __future__ import annotations

import logging
from dataclasses import astuple, dataclass

from unmask.engine import CompletionOutput, StepEvent

from .errors import APIError
from .responses import PromptTokensDetails, Usage

log = logging.getLogger("unmask.server")


@dataclass(frozen=True)
class Work:
    """The work of one choice so far: tokens generated (up to and including the first EOS; of an unfinished choice
    the revealed left-to-right prefix), model forwards (CFG counts twice), denoising steps, drafts verified and
    accepted (self-speculative decoding; 0 otherwise)."""

    tokens: int = 0
    nfe: int = 0
    steps: int = 0
    drafts_proposed: int = 0
    drafts_accepted: int = 0

    @classmethod
    def of_output(cls, out: CompletionOutput) -> "Work":
        return cls(len(out.token_ids), out.nfe, out.steps, out.drafts_proposed, out.drafts_accepted)

    @classmethod
    def of_event(cls, ev: StepEvent) -> "Work":
        """After the step ``ev`` reports (steps are numbered from 0)."""
        if ev.output is not None:
            return cls.of_output(ev.output)
        return cls(ev.num_tokens, ev.nfe, ev.step + 1, ev.drafts_proposed, ev.drafts_accepted)


class Tally:
    """One API request's share of the work counters, counted as its choices advance
    (docs/design.md#deployment-and-metrics).

    The counters only grow, so a tally adds per choice the increase of each :class:`Work` field since its last
    count, and a prompt's tokens once, at the first forward of one of its choices. The revealed prefix
    (``StepEvent.num_tokens``) and the forward, step and draft counts never shrink while a choice runs, and its
    final work is at least the last prefix it showed (the stopping rules of ``unmask.engine.stopping`` cut a stop
    string out of tokens revealed in the same step), so after :meth:`settle` the request added exactly its usage.

    Args:
        count: ``count(prompt_tokens, work_increase)``, :meth:`Metrics.count_work`.
        prompt_tokens: tokens per prompt. n: choices per prompt (choice index ``p * n + i``).
    """

    def __init__(self, count, prompt_tokens: list[int], n: int):
        self._count = count
        self._prompt_tokens = prompt_tokens
        self._n = n
        self._counted = [Work()] * (len(prompt_tokens) * n)
        self._prompt_counted = [False] * len(prompt_tokens)

    def advance(self, c: int, work: Work) -> None:
        """Count what choice ``c`` did since its last count; ``work``: its work so far."""
        old = self._counted[c]
        now = Work(*(max(a, b) for a, b in zip(astuple(work), astuple(old))))
        p = c // self._n
        prompt = 0
        if work.nfe and not self._prompt_counted[p]:
            self._prompt_counted[p] = True
            prompt = self._prompt_tokens[p]
        if now != old or prompt:
            self._counted[c] = now
            self._count(prompt, Work(*(a - b for a, b in zip(astuple(now), astuple(old)))))

    def settle(self, work: list[Work], completed: bool) -> None:
        """Top the counters up to every choice's final ``work``; a ``completed`` request also counts the prompts
        none of whose choices ran a forward (its usage counts every prompt)."""
        for c, w in enumerate(work):
            self.advance(c, w)
        if completed:
            rest = sum(t for t, done in zip(self._prompt_tokens, self._prompt_counted) if not done)
            self._prompt_counted = [True] * len(self._prompt_tokens)
            if rest:
                self._count(rest, Work())


def finished_work(stream) -> list[Work]:
    """Each choice's work as far as a stream's outputs tell (``Work()`` for a choice that has not finished): for a
    request refused before any of its events was read."""
    return [Work.of_output(o) if o is not None else Work() for o in stream.outputs]


def usage(prompt_tokens: int, work: list[Work], cached_tokens: int = 0) -> Usage:
    """OpenAI usage (+ ``nfe``, ``denoising_steps``) of all choices; ``cached_tokens``: of ``prompt_tokens``, those
    read from the prefix cache."""
    completion = sum(w.tokens for w in work)
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion, total_tokens=prompt_tokens + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
                 nfe=sum(w.nfe for w in work), denoising_steps=sum(w.steps for w in work))


def failure_reason(exc: BaseException, err: APIError) -> str:
    """The ``request_failure_total`` reason of a request that failed with ``exc`` (answered as ``err``)."""
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, APIError) and exc.code in ("server_shutdown", "aborted"):
        return "abort"
    return err.code if err.code in ("queue_full", "cache_full") else "error"


def decoding(outputs: list[CompletionOutput | None], resolved) -> str:
    """How the request was decoded, for the log: ``diffusion`` or ``speculative, ...`` (from the first speculative
    finished choice, else from the resolved plan of the request's first prompt)."""
    spec = [o for o in outputs if o is not None and o.speculative]
    if spec:
        block = spec[0].draft_block
    elif resolved.speculative:
        block = resolved.draft_block
    else:
        return "diffusion"
    return "speculative, one token per forward (no drafts)" if block == 1 else f"speculative, draft block {block}"


def log_line(response_id: str, status: int, u: Usage, seconds: float, reasons: list[str | None], how: str,
             failure: str | None) -> None:
    """The request's one log line."""
    tpf = u.completion_tokens / u.nfe if u.nfe else 0.0
    log.info("%s status=%d prompt_tokens=%d completion_tokens=%d nfe=%d tpf=%.2f steps=%d seconds=%.3f "
             "finish=%s decoding=%s%s", response_id, status, u.prompt_tokens, u.completion_tokens, u.nfe, tpf,
             u.denoising_steps, seconds, ",".join(str(r) for r in reasons), how,
             f" failure={failure}" if failure else "")
