"""The settings of one training run: :class:`TrainConfig`, the one list of ``unmask train``'s options
(docs/design.md#training), and :func:`config_from_json`.

``TrainConfig.validate`` checks every option before anything is loaded or allocated; the rules that depend on the
checkpoint or the data are the trainer's.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

from .common import TrainError
from .schedule import SCHEDULES
from .scopes import DEFAULT_LORA_TARGETS, SCOPES

PRECISIONS = ("auto", "no", "bf16", "fp16")


@dataclass
class TrainConfig:
    """Settings of one run (the ``unmask train`` options; see ``unmask train --help``).

    Sizes are per process: ``batch_size`` examples per micro-batch, ``grad_accum`` micro-batches per optimizer
    step. ``seq_len`` in tokens. ``lr`` peak learning rate; ``warmup`` steps. ``max_minutes`` wall-clock budget
    (0 = none). ``eps``: lower bound of the mask rate ``t``. ``halt_after``: stop this process after that many
    steps without a final save (simulates an interruption in tests). ``keep_last``: keep only the N newest
    checkpoints (0 = all; the one ``latest`` names is always kept). ``lr_schedule="cosine_time"``: linear warmup
    over ``warmup`` steps, then a cosine decay to 0 over the wall-clock budget instead of over ``max_steps`` (for
    runs bounded by time whose step count is unknown in advance); ``minutes_before`` = budget minutes already
    spent by earlier processes of the same run (the schedule spans ``minutes_before + max_minutes``).
    ``init_adapter`` (``--trainable mask_lora`` only): start the adapter from this adapter-only checkpoint (e.g.
    another run's ``checkpoint-N``, trained with another objective) instead of a fresh one, with a fresh optimizer
    and schedule; ignored when resuming (the resumed state holds the adapter).
    """

    model: str
    data: str
    out: str
    objective: str = "block"
    trainable: str = "full"
    block_size: int | None = None
    complementary: bool = False
    batch_size: int = 8
    grad_accum: int = 1
    seq_len: int = 256
    max_steps: int = 100
    max_minutes: float = 0.0
    eval_every: int = 0
    eval_data: str | None = None
    eval_t_points: int = 5
    save_every: int = 0
    keep_last: int = 0
    seed: int = 0
    resume: bool = False
    lr: float = 5e-5
    lr_schedule: str = "cosine"
    warmup: int = 0
    minutes_before: float = 0.0
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    gradient_checkpointing: bool = False
    teacher: str | None = None
    teacher_kl: float = 0.0
    no_ce: bool = False
    certainty: float = 0.0
    certainty_temperature: float = 0.5
    lora_r: int = 16
    lora_alpha: float = 32.0
    lora_targets: list[str] | None = None
    init_adapter: str | None = None
    eps: float = 1e-3
    mixed_precision: str = "auto"
    progress: bool = True
    halt_after: int | None = None
    verifier: str | None = None
    draft_groups: int = 32
    #: --objective draft: block sizes its draft groups cycle through, one per step (None = --block-size only)
    draft_block_sizes: list[int] | None = None
    fsdp: bool = False
    # Repr-Align (unmask.training.experimental.align, docs/design.md#the-seeds-methods); 0 = off
    align_weight: float = 0.0
    align_layers: str = "all"
    align_exp: float = 0.0
    align_confidence: bool = False
    align_teacher: str | None = None
    align_anchors: str | None = None
    align_anchor_budget_mb: float = 2048.0
    # pseudo-trajectory distillation (--objective trajectory, unmask.training.objectives.trajectory)
    trajectories: str | None = None
    trajectory_mode: str = "engine"
    trajectory_threshold: float = 0.9
    trajectory_steps: int = 8
    trajectory_model: str | None = None
    max_block_size: int | None = None
    # the VFM trial (--objective vfm, unmask.training.experimental.vfm): answer positions, KL weight and its warm-up
    # fraction, the adapter's width, the share of fully masked rows
    vfm_gen_len: int = 32
    vfm_beta: float = 1e-3
    vfm_beta_warmup: float = 0.5
    vfm_width: int = 256
    vfm_full: float = 0.5

    def validate(self) -> None:
        """Raise :class:`TrainError` naming the option for an invalid value (and fill ``lora_targets``): the run's
        own rules here, each objective's in its ``check`` (``unmask.training.registry``)."""
        from .registry import OBJECTIVES, check_aux

        if self.lora_targets is None:
            from unmask.engine.mask_adapter import DEFAULT_TARGETS

            self.lora_targets = list(DEFAULT_TARGETS if self.trainable == "mask_lora" else DEFAULT_LORA_TARGETS)
        self.lora_targets = list(self.lora_targets)
        if self.objective not in OBJECTIVES:
            raise TrainError(f"--objective: {self.objective!r} is not one of {tuple(OBJECTIVES)}")
        for name, allowed in (("trainable", SCOPES), ("lr_schedule", SCHEDULES)):
            if getattr(self, name) not in allowed:
                raise TrainError(f"--{name.replace('_', '-')}: {getattr(self, name)!r} is not one of {allowed}")
        if self.mixed_precision not in PRECISIONS:
            raise TrainError(f"--mixed-precision: {self.mixed_precision!r} is not one of {', '.join(PRECISIONS)}")
        self._check_ranges()
        self._check_combinations()
        objective = OBJECTIVES[self.objective]
        if self.trainable == "mask_lora" and not objective.mask_lora:
            names = [n for n, o in OBJECTIVES.items() if o.mask_lora]
            raise TrainError(f"--trainable mask_lora: trains --objective {', '.join(names[:-1])} or {names[-1]}, "
                             f"not {self.objective}")
        objective.check(self)
        check_aux(self, objective)
        if self.init_adapter and self.trainable != "mask_lora":
            raise TrainError("--init-adapter: only with --trainable mask_lora (it starts the mask-row adapter)")
        if self.trainable == "mask_lora" and self.verifier:
            raise TrainError("--verifier: --trainable mask_lora verifies with the parent itself (no --verifier)")
        for name, other in OBJECTIVES.items():
            for option in other.owns if other is not objective else ():
                if getattr(self, option) not in (None, ""):
                    raise TrainError(f"--{option.replace('_', '-')}: only used by --objective {name}")
        if self.fsdp:
            from .distributed import check_fsdp

            try:
                check_fsdp(self.trainable)
            except ValueError as exc:
                raise TrainError(str(exc)) from exc
            if objective.fsdp_refusal:
                raise TrainError(f"--fsdp: {objective.fsdp_refusal}")

    def _check_ranges(self) -> None:
        for name in ("batch_size", "grad_accum", "max_steps", "eval_t_points"):
            if getattr(self, name) < 1:
                raise TrainError(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(self, name)}")
        if self.seq_len < 2:
            raise TrainError(f"--seq-len: must be >= 2, got {self.seq_len}")
        if self.block_size is not None and not 1 <= self.block_size <= self.seq_len:
            # a block longer than the longest example trains nothing more and its layout grows with the block
            raise TrainError(f"--block-size: must be in 1..--seq-len ({self.seq_len}), got {self.block_size}")
        for name in ("max_minutes", "eval_every", "save_every", "keep_last", "warmup", "weight_decay",
                     "max_grad_norm", "teacher_kl", "certainty"):
            if getattr(self, name) < 0:
                raise TrainError(f"--{name.replace('_', '-')}: must be >= 0, got {getattr(self, name)}")
        for name in ("lr", "max_minutes", "weight_decay", "max_grad_norm", "teacher_kl", "warmup", "certainty",
                     "certainty_temperature"):
            if not math.isfinite(getattr(self, name)):
                raise TrainError(f"--{name.replace('_', '-')}: must be finite, got {getattr(self, name)}")
        if self.lr <= 0:
            raise TrainError(f"--lr: must be > 0, got {self.lr}")
        if self.certainty_temperature <= 0:
            raise TrainError(f"--certainty-temperature: must be > 0, got {self.certainty_temperature}")
        if not 0 < self.eps < 0.5:
            raise TrainError(f"eps: must be in (0, 0.5), got {self.eps}")
        if not (math.isfinite(self.minutes_before) and self.minutes_before >= 0):
            raise TrainError(f"minutes_before: must be finite and >= 0, got {self.minutes_before}")

    def _check_combinations(self) -> None:
        if self.no_ce and self.teacher_kl <= 0:
            raise TrainError("--no-ce: needs --teacher-kl W > 0 (otherwise there is no loss)")
        if self.lr_schedule == "cosine_time" and self.max_minutes <= 0:
            raise TrainError("--lr-schedule cosine_time: needs a time budget (--max-minutes > 0)")
        if self.eval_every and not self.eval_data:
            raise TrainError("--eval-every: needs --eval-data FILE (held-out prompts)")


def config_from_json(path: str | Path) -> TrainConfig:
    """A :class:`TrainConfig` from a JSON object of its fields (for scripted runs)."""
    data = json.loads(Path(path).read_text())
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise TrainError(f"{path}: unknown field(s) {unknown}")
    return TrainConfig(**data)
