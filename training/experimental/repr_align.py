"""Repr-Align's hook-up to the trainer (docs/design.md#the-seeds-methods): the ``--align-*`` options' checks, and the
auxiliary loss term (:class:`~unmask.training.objectives.base.AuxTerm`) the diffusion objectives add when
``--align-weight W > 0``. The loss itself: ``unmask.training.experimental.align``; the anchor cache: ``.anchors``.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

from ..common import TrainError
from .align import AlignError, LiveTeacher, alignment_loss, confidence_weighted, layer_weights, parse_layers
from .anchors import AnchorCache

#: options a resumed run must repeat (runs saved before Repr-Align existed have no align keys)
RESUME_KEYS = ["align_weight", "align_layers", "align_exp", "align_confidence"]


def check(cfg, objective) -> None:
    """Raise ``TrainError`` naming the option for ``--align-*`` settings this run cannot use (``objective``: the
    run's objective class)."""
    if not (math.isfinite(cfg.align_weight) and cfg.align_weight >= 0):
        raise TrainError(f"--align-weight: must be a finite number >= 0, got {cfg.align_weight}")
    if cfg.align_weight == 0 and (cfg.align_anchors or cfg.align_teacher or cfg.align_confidence):
        raise TrainError("--align-anchors/--align-teacher/--align-confidence: need --align-weight W > 0")
    if cfg.align_weight > 0 and not objective.aux:
        raise TrainError(f"--align-weight: does not apply to --objective {cfg.objective}")
    if cfg.align_weight > 0 and cfg.fsdp:
        raise TrainError("--fsdp: not with --align-weight or --objective trajectory (untested together; "
                         "docs/design.md#scale-out)")


def resume_keys(cfg) -> list[str]:
    """The ``--align-*`` options a resumed run must repeat (none when Repr-Align is off)."""
    return list(RESUME_KEYS) if cfg.align_weight > 0 else []


class Aligner:
    """Repr-Align as an auxiliary term: the layers, their weights and the teacher's states (live or cached).

    Args:
        layers: 1-based layers. weights: ``[len(layers)]`` (:func:`layer_weights`). source: a :class:`LiveTeacher`
            or an :class:`AnchorCache` (both have ``states(batch, label_row, label_pos, shift)``).
        weight: ``--align-weight``. ce_weight: the per-token CE reweighting (``--align-confidence``) or None.
    """

    def __init__(self, layers: list[int], weights: torch.Tensor, source, weight: float = 0.0, ce_weight=None):
        self.layers, self.weights, self.source = list(layers), weights, source
        self.weight, self.ce_weight = weight, ce_weight

    def loss(self, student_states: list[torch.Tensor], batch, layout, logit_shift: bool) -> torch.Tensor:
        """:func:`alignment_loss` of the student's ``[N, H]`` states against the source's for ``layout``'s scored
        tokens."""
        teacher = self.source.states(batch, layout.label_row, layout.label_pos, logit_shift)
        dev = student_states[0].device
        return alignment_loss(student_states, [t.to(dev) for t in teacher], self.weights)


def make_aligner(cfg, device, tm, data) -> Aligner | None:
    """The :class:`Aligner` of a run (``TrainConfig``'s ``align_*`` fields), or None without ``--align-weight``: the
    teacher is ``--align-teacher``, else ``--teacher``, else ``--model`` (an a2d conversion run causally is its AR
    parent). With ``--align-anchors DIR`` the states come from that cache, built first when DIR has none.

    Raises:
        TrainError: bad layers, an unloadable teacher, a teacher of another shape, an anchor-cache mismatch.
    """
    if cfg.align_weight <= 0:
        return None
    try:
        return _make(cfg, device, tm, data)
    except AlignError as exc:
        raise TrainError(str(exc)) from exc


def _make(cfg, device, tm, data) -> Aligner:
    path = cfg.align_teacher or cfg.teacher or cfg.model
    n_layers = int(tm.base.config.num_hidden_layers)
    layers = parse_layers(cfg.align_layers, n_layers)
    teacher = LiveTeacher(path, device, layers)
    if (teacher.n_layers, teacher.model.config.hidden_size) != (n_layers, tm.base.config.hidden_size):
        raise AlignError(f"--align-teacher {path}: {teacher.n_layers} layers x {teacher.model.config.hidden_size} "
                         f"dims, the model has {n_layers} x {tm.base.config.hidden_size}")
    source = teacher
    if cfg.align_anchors:
        shift = bool(tm.dllm.logit_shift)
        budget = int(cfg.align_anchor_budget_mb * 1e6)
        if not (Path(cfg.align_anchors) / "manifest.json").is_file():
            AnchorCache.build(cfg.align_anchors, teacher, tm.tokenizer, data.examples, logit_shift=shift,
                              budget_bytes=budget)
        source = AnchorCache.open(cfg.align_anchors, teacher, tm.tokenizer, logit_shift=shift)
        teacher.model = None  # opened and checked: the weights are not needed during training
    return Aligner(layers, layer_weights(layers, n_layers, cfg.align_exp), source, cfg.align_weight,
                   confidence_weighted if cfg.align_confidence else None)
