"""One API request in flight (:class:`Run`): its engine streams, what each choice has done so far, its end.

A request with ``P`` prompts is ``P`` engine requests of ``n`` choices each (choice index ``p * n + i``). The run
watches every event that passes (:meth:`Run.events`), keeping per choice the last :class:`Work` and the finished
:class:`CompletionOutput`, and counts the work into the metrics as it goes (:class:`Tally`); from those it answers
usage and, once (:meth:`Run.finish`), records the rest of the metrics and writes the request's log line. It reads
only the engine's outputs.
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator

from unmask.engine import CompletionOutput, RequestStream, StepEvent

from .accounting import Tally, Work, decoding, log_line, usage
from .merge import choice_events
from .render import Render
from .responses import Usage


class Run:
    """A submitted API request.

    Args:
        state: the app's :class:`~unmask.server.app.ServerState` (metrics).
        render: builds this response's bodies and chunks.
        prompt_ids: token ids per prompt. streams: engine streams, one per prompt. n: choices per prompt.
        arrival: ``time.time()`` when the request arrived.
    """

    def __init__(self, state, render: Render, prompt_ids: list[list[int]], streams: list[RequestStream], n: int,
                 arrival: float):
        self.state = state
        self.render = render
        self.id = render.id
        self.prompt_ids = prompt_ids
        self.streams = streams
        self.n = n
        self.arrival = arrival
        self.num_choices = len(streams) * n
        self.work = [Work()] * self.num_choices
        self.outputs: list[CompletionOutput | None] = [None] * self.num_choices
        self.cached = [0] * self.num_choices  # prompt tokens each choice loaded from the prefix cache, per its events
        self.first_content_time: float | None = None
        self._last_content: dict[int, tuple[float, int]] = {}  # choice -> (time, tokens) of its last content chunk
        self.done = False
        self.tally = Tally(state.metrics.count_work, [len(p) for p in prompt_ids], n)

    async def events(self, timeout: float | None) -> AsyncIterator[tuple[int, StepEvent]]:
        """``(choice index, event)`` for every engine event of every prompt, until all choices finished.

        Raises:
            TimeoutError: ``timeout`` seconds after arrival. EngineError / EngineClosed from the engine.
        """
        deadline = None if timeout is None else self.arrival + timeout
        async for c, ev in choice_events(self.streams, self.n, deadline, timeout):
            self.work[c] = Work.of_event(ev)
            self.cached[c] = ev.cached_tokens
            # the work counters grow per step (docs/design.md#deployment-and-metrics)
            self.tally.advance(c, self.work[c])
            if ev.output is not None:
                self.outputs[c] = ev.output
            yield c, ev

    def content_sent(self, c: int, num_tokens: int) -> None:
        """Choice ``c`` streamed new content with ``num_tokens`` tokens in its revealed prefix: the request's first
        content time, and one inter-token latency since the choice's previous content (the tokens revealed since)."""
        now = time.time()
        if self.first_content_time is None:
            self.first_content_time = now
        prev = self._last_content.get(c)
        if prev is not None:
            self.state.metrics.observe_itl(now - prev[0], num_tokens - prev[1])
        self._last_content[c] = (now, num_tokens)

    def abort(self) -> None:
        """Cancel every unfinished engine request of this run (idempotent)."""
        for s in self.streams:
            if not all(o is not None for o in s.outputs):
                s.abort()

    def _output(self, c: int) -> CompletionOutput | None:
        """Choice ``c``'s output: seen on its finished event, or filled in by the engine since."""
        if self.outputs[c] is None:
            p, i = divmod(c, self.n)
            outs = self.streams[p].outputs
            if i < len(outs) and outs[i] is not None:
                self.outputs[c] = outs[i]
        return self.outputs[c]

    def _work(self, seen_only: bool = False) -> list[Work]:
        outs = self.outputs if seen_only else [self._output(c) for c in range(self.num_choices)]
        return [Work.of_output(o) if o is not None else self.work[c] for c, o in enumerate(outs)]

    def usage(self, seen_only: bool = False) -> Usage:
        """OpenAI usage (+ ``nfe``, ``denoising_steps``); an unfinished (failed) choice counts its work so far.
        A prompt's cached tokens are the most any of its choices loaded (choices joining together share nothing,
        docs/design.md#prefix-reuse). ``seen_only``: only what the events consumed so far say (a streamed chunk's
        usage so far), not what the engine has produced since."""
        outs = list(self.outputs) if seen_only else [self._output(c) for c in range(self.num_choices)]
        per_choice = [o.cached_tokens if o is not None else self.cached[c] for c, o in enumerate(outs)]
        cached = sum(max(per_choice[p * self.n:(p + 1) * self.n], default=0) for p in range(len(self.prompt_ids)))
        return usage(sum(len(p) for p in self.prompt_ids), self._work(seen_only), cached)

    def body(self) -> dict:
        """The non-streamed response (every choice finished)."""
        return self.render.body([self._output(c) for c in range(self.num_choices)], self.usage())

    def finish(self, status: int, failure: str | None = None) -> None:
        """Record metrics and write the request's log line (once)."""
        if self.done:
            return
        self.done = True
        end = time.time()
        u = self.usage()
        outputs = [self._output(c) for c in range(self.num_choices)]
        metrics = self.state.metrics
        self.tally.settle(self._work(), completed=failure is None)
        if failure is None:
            firsts = [o.first_token_time for o in outputs if o.first_token_time]
            first = self.first_content_time or (min(firsts) if firsts else None)
            queue_times = [s.queue_time for s in self.streams if s.queue_time is not None]
            metrics.record_success(outputs, self.arrival, end, first, min(queue_times) if queue_times else None)
        else:
            metrics.record_failure(failure)
        log_line(self.id, status, u, end - self.arrival, [o.finish_reason if o else None for o in outputs],
                 decoding(outputs, self.streams[0].resolved), failure)
