"""Step sequences through one :class:`unmask.engine.scheduler.Scheduler` until all are done: the batching checks
(a request's tokens in a batch equal its tokens alone) of the engine tests."""
from __future__ import annotations


def step_together(denoiser, seqs: list, max_batch_size: int = 8) -> list:
    """Add every sequence of ``seqs`` to a fresh scheduler over ``denoiser`` and step until none has work left;
    returns ``seqs`` (finished in place)."""
    from unmask.engine.scheduler import Scheduler

    sched = Scheduler(denoiser, max_batch_size=max_batch_size)
    for s in seqs:
        sched.add(s)
    while sched.has_work():
        sched.step()
    return seqs
