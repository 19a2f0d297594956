"""The run's clocks (docs/design.md#training): which examples a step consumes (an epoch-seeded permutation, so the
data position *is* the step), the learning-rate schedule, and the wall-clock budget's spent fraction.
"""
from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from .common import seed_of

SCHEDULES = ("cosine", "linear", "constant", "cosine_time")


def repeated_data_order_note(cfg) -> str | None:
    """A warning when a new run starts from a checkpoint that ``unmask train`` made on the same data with the same
    ``--seed``, else ``None``.

    The data order depends only on ``(seed, epoch)`` (:func:`example_indices`), so such a run draws the very examples
    its starting checkpoint was trained on first, in the same order, and the same masking noise per step: a
    continued run (e.g. more drafter training from a finished run) should pass another ``--seed``, or ``--resume``
    the original run. Reads only the ``config``/``step`` of ``<model>/training_state.pt`` (memory-mapped, with
    ``weights_only=True``: a checkpoint from elsewhere cannot run code here; a missing or unreadable file means no
    note).
    """
    state_file = Path(cfg.model).expanduser() / "training_state.pt"
    if not state_file.is_file():
        return None
    try:
        state = torch.load(state_file, map_location="cpu", weights_only=True, mmap=True)  # no pickled code
        saved, step = state["config"], int(state["step"])
        same_data = Path(saved["data"]).expanduser().resolve() == Path(cfg.data).expanduser().resolve()
        consumed = step * int(saved["batch_size"]) * int(saved.get("grad_accum", 1)) * int(state.get("world_size", 1))
    except Exception:  # an older or foreign state file: nothing to say
        return None
    if not same_data or int(saved.get("seed", 0)) != int(cfg.seed):
        return None
    return (f"unmask train: note: --model {cfg.model} was trained by `unmask train` on this --data with --seed "
            f"{cfg.seed} for {step} steps ({consumed} examples); this run draws the same examples in the same order "
            f"first. Pass another --seed for a fresh order (or --resume that run's --out to continue it).")


def example_indices(n: int, seed: int, start: int, count: int) -> list[int]:
    """Indices ``start .. start+count-1`` of the endless example stream (epoch ``e`` = permutation seeded by
    ``(seed, e)``)."""
    out, cache = [], {}
    for i in range(start, start + count):
        e, j = divmod(i, n)
        if e not in cache:
            g = torch.Generator().manual_seed(seed_of(seed, e, 17))
            cache[e] = torch.randperm(n, generator=g).tolist()
        out.append(cache[e][j])
    return out


class BudgetClock:
    """Fraction of a wall-clock budget spent: ``(minutes_before + minutes since start()) / span_minutes``, in
    [0, 1]; 0 until :meth:`start` is called."""

    def __init__(self, minutes_before: float, span_minutes: float):
        self.minutes_before = minutes_before
        self.span = span_minutes
        self.t0: float | None = None

    def start(self) -> None:
        """Start counting this process's minutes (``time.perf_counter``)."""
        self.t0 = time.perf_counter()

    def fraction(self) -> float:
        """Spent fraction of the budget in [0, 1]; 0.0 when ``span_minutes <= 0``."""
        if self.span <= 0:
            return 0.0
        here = 0.0 if self.t0 is None else (time.perf_counter() - self.t0) / 60.0
        return min(1.0, max(0.0, (self.minutes_before + here) / self.span))


def make_scheduler(optimizer, name: str, warmup: int, total: int, clock: BudgetClock | None = None):
    """Learning-rate schedule: transformers ``get_scheduler`` (``cosine`` / ``linear`` decay to 0 over ``total``
    steps, or ``constant`` after linear warmup), or ``cosine_time``: linear warmup over ``warmup`` steps, then
    ``0.5 * (1 + cos(pi * clock.fraction()))`` (a cosine over the wall-clock budget; SGDR's cosine, Loshchilov &
    Hutter 2017, indexed by time instead of steps).

    Raises:
        ValueError: ``cosine_time`` without a clock.
    """
    if name == "cosine_time":
        if clock is None:
            raise ValueError("cosine_time: needs a BudgetClock")
        from torch.optim.lr_scheduler import LambdaLR

        def factor(step: int) -> float:
            if step < warmup:
                return step / max(1, warmup)
            return 0.5 * (1.0 + math.cos(math.pi * clock.fraction()))
        return LambdaLR(optimizer, factor)
    from transformers import get_scheduler

    kind = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}[name]
    return get_scheduler(kind, optimizer, num_warmup_steps=warmup, num_training_steps=total)
