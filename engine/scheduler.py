"""Continuous batching: a FIFO waiting queue and a running batch that sequences join and leave every step.

New sequences join at the next step (their prompt prefill runs in that step, in the same forward as the others'
denoising steps or, when padding it into their rows would waste more than a forward costs, in its own:
``unmask.engine.denoiser.plan_forwards``); finished and cancelled sequences leave at once, freeing their slot
and their KV cache. A sequence's tokens never depend on who else is in the batch (batch invariance), so joining
mid-block is exact; this is finer-grained than joining at block boundaries and gives a lower TTFT.
"""
from __future__ import annotations

import collections

from .denoiser import Denoiser
from .sequence import Sequence, StepEvent


class QueueFull(RuntimeError):
    """The waiting queue holds ``max_queue`` sequences (HTTP 429)."""


class CacheFull(RuntimeError):
    """Admitting the sequence would exceed the KV-cache token budget (HTTP 503)."""


class Scheduler:
    """Owns the running batch. Not thread-safe: one thread (the engine thread) calls it.

    Args:
        denoiser: runs the steps.
        max_batch_size: most sequences in one step.
        max_queue: most sequences waiting (beyond it :meth:`add` raises :class:`QueueFull`).
        max_cached_tokens: budget of canvas tokens held by running sequences (each sequence reserves its whole
            canvas length, an upper bound on its cache); ``None`` = unlimited. A sequence longer than the whole
            budget is refused with :class:`CacheFull`.
    """

    def __init__(self, denoiser: Denoiser, max_batch_size: int = 16, max_queue: int = 1024,
                 max_cached_tokens: int | None = None):
        if max_batch_size < 1:
            raise ValueError("max_batch_size: must be >= 1")
        self.denoiser = denoiser
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        self.max_cached_tokens = max_cached_tokens
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        """Queue a sequence. Raises QueueFull / CacheFull."""
        if self.max_cached_tokens is not None and seq.length * len(seq.lanes) > self.max_cached_tokens:
            raise CacheFull(f"request needs {seq.length * len(seq.lanes)} cached tokens; the engine's KV budget "
                            f"is {self.max_cached_tokens}")
        if len(self.waiting) >= self.max_queue:
            raise QueueFull(f"waiting queue is full ({self.max_queue} requests)")
        self.waiting.append(seq)

    def reserved_tokens(self) -> int:
        """Canvas tokens reserved by running sequences: canvas length x lanes (2 under CFG), summed."""
        return sum(s.length * len(s.lanes) for s in self.running)

    def abort(self, request_id: str) -> list[StepEvent]:
        """Cancel every sequence of ``request_id`` (waiting or running); returns their final events."""
        events = []
        for seq in [s for s in self.waiting if s.request_id == request_id]:
            self.waiting.remove(seq)
            events.append(seq.abort())
        for seq in [s for s in self.running if s.request_id == request_id]:
            self.running.remove(seq)
            events.append(seq.abort())
        return events

    def has_work(self) -> bool:
        """True while any sequence is waiting or running."""
        return bool(self.waiting or self.running)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_batch_size:
            seq = self.waiting[0]
            if (self.max_cached_tokens is not None and self.running
                    and self.reserved_tokens() + seq.length * len(seq.lanes) > self.max_cached_tokens):
                break
            self.waiting.popleft()
            self.running.append(seq)

    def step(self) -> list[StepEvent]:
        """Admit waiting sequences, run one step for the batch, drop finished ones. Returns the step's events."""
        self._admit()
        done_before = [s.final_event() for s in self.running if s.finished]  # e.g. nothing left to decode
        active = [s for s in self.running if not s.finished]
        events = done_before + self.denoiser.step(active)
        for seq in [s for s in self.running if s.finished]:
            seq.release()
            self.running.remove(seq)
        return events
