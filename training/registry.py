"""The registry of training objectives (docs/design.md#training): ``--objective`` names one of :data:`OBJECTIVES`,
each a class with the interface of :class:`~unmask.training.objectives.base.Objective`; the experiments register
here too (``vfm``, and Repr-Align's auxiliary term), so the trainer imports neither them nor an objective by name.
"""
from __future__ import annotations

from .experimental import repr_align
from .experimental.vfm import VfmObjective
from .objectives.base import AuxTerm, Objective
from .objectives.diffusion import Block, Mdlm
from .objectives.draft import Draft
from .objectives.trajectory import Trajectory

#: ``--objective`` name -> its class, in the order the help lists them
OBJECTIVES: dict[str, type[Objective]] = {o.name: o for o in (Mdlm, Block, Draft, Trajectory, VfmObjective)}


def make_objective(cfg) -> Objective:
    """The objective of a run (``cfg.objective``, validated)."""
    return OBJECTIVES[cfg.objective](cfg)


def check_aux(cfg, objective: type[Objective]) -> None:
    """Raise ``TrainError`` for auxiliary-term options this run cannot use."""
    repr_align.check(cfg, objective)


def aux_resume_keys(cfg) -> list[str]:
    """Options of the configured auxiliary term a resumed run must repeat."""
    return repr_align.resume_keys(cfg)


def make_aux(cfg, device, tm, data) -> AuxTerm | None:
    """The run's auxiliary loss term (Repr-Align with ``--align-weight W > 0``), or None."""
    return repr_align.make_aligner(cfg, device, tm, data)
