"""The interface of a training objective (docs/design.md#training): the trainer calls these hooks and never asks
which objective it runs.
"""
from __future__ import annotations

from typing import Protocol

import torch

from ..losses import eval_t_grid


class AuxTerm(Protocol):
    """An auxiliary loss term of the diffusion objectives (``run.aux``; Repr-Align is the one there is): the
    student's hidden states at ``layers`` go in, ``weight * loss(...)`` is added; ``ce_weight`` (or None) reweighs
    each token's CE. Its value is logged in the ``align`` column."""

    layers: list[int]
    weight: float
    ce_weight: object

    def loss(self, states: list[torch.Tensor], batch, layout, logit_shift: bool) -> torch.Tensor: ...


class Objective:
    """One objective of one run (``cfg``: its ``TrainConfig``); ``run``: the :class:`~unmask.training.trainer.Trainer`.

    The trainer calls, in order: :meth:`check` (at ``TrainConfig.validate``), :meth:`resume_keys`, :meth:`attach`,
    :meth:`check_checkpoint`, :meth:`block_size`, :meth:`configure`, :meth:`prepare`, :meth:`forward_module`; then
    :meth:`loss` for every micro-batch, :meth:`eval_grid` at evaluations and :meth:`adapter_files` at saves.

    Class attributes: ``name``; ``mask_lora`` (trains under ``--trainable mask_lora``); ``fsdp_refusal`` (why
    ``--fsdp`` cannot run it, or None); ``aux`` (takes an :class:`AuxTerm`); ``owns`` (options only it reads,
    refused with another objective); ``frozen_init_adapter`` (its ``--init-adapter`` is frozen, so a resumed run
    reads it again).
    """

    name = ""
    mask_lora = False
    fsdp_refusal: str | None = None
    aux = False
    owns: tuple[str, ...] = ()
    frozen_init_adapter = False

    def __init__(self, cfg):
        self.cfg = cfg

    @classmethod
    def check(cls, cfg) -> None:
        """Raise ``TrainError`` naming the option for settings this objective cannot run (nothing loaded yet)."""

    def resume_keys(self) -> list[str]:
        """Options a resumed run must repeat, beyond the trainer's own."""
        return []

    def comparable(self, key: str, value):
        """``value`` of option ``key`` as a resume compares it."""
        return value

    def attach(self, run) -> None:
        """After the model (and ``--init-adapter``) is in place, before a resumed trainable state is loaded."""

    def check_checkpoint(self, dllm) -> None:
        """Raise ``TrainError`` for a checkpoint (its ``DllmConfig``) this objective cannot train."""

    def block_size(self, dllm) -> int | None:
        """The training block size asked for (None: the checkpoint's)."""
        return self.cfg.block_size

    def configure(self, run) -> None:
        """Checks and settings against the loaded checkpoint (``run.tm``, ``run.block_size``), before the data."""

    def prepare(self, run) -> None:
        """What the loss needs beyond the model, once the data is loaded (``run.data``)."""

    def forward_module(self, run) -> torch.nn.Module:
        """The module the loop calls (accelerate wraps it)."""
        raise NotImplementedError

    def loss(self, run, module, batch, generator: torch.Generator, fixed_t: float | None = None):
        """``(LossParts, layout)`` of one micro-batch; ``fixed_t``: held-out evaluation at that noise level."""
        raise NotImplementedError

    def eval_grid(self) -> list:
        """The noise levels held-out evaluation averages over (``None``: the objective's own noise)."""
        return eval_t_grid(self.cfg.eval_t_points)

    def adapter_files(self, run) -> dict[str, bytes] | None:
        """Extra files of an adapter-only checkpoint (name -> bytes), or None."""
        return None
