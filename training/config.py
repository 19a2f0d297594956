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
from .losses import OBJECTIVES
from .scopes import SCOPES

SCHEDULES = ("cosine", "linear", "constant", "cosine_time")


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
    # Repr-Align (unmask.training.align, docs/design.md#the-seeds-methods); 0 = off
    align_weight: float = 0.0
    align_layers: str = "all"
    align_exp: float = 0.0
    align_confidence: bool = False
    align_teacher: str | None = None
    align_anchors: str | None = None
    align_anchor_budget_mb: float = 2048.0
    # pseudo-trajectory distillation (--objective trajectory, unmask.training.trajectory)
    trajectories: str | None = None
    trajectory_mode: str = "engine"
    trajectory_threshold: float = 0.9
    trajectory_steps: int = 8
    trajectory_model: str | None = None
    max_block_size: int | None = None
    # the VFM trial (--objective vfm, unmask.training.vfm): answer positions, KL weight and its warm-up fraction,
    # the adapter's width, the share of fully masked rows
    vfm_gen_len: int = 32
    vfm_beta: float = 1e-3
    vfm_beta_warmup: float = 0.5
    vfm_width: int = 256
    vfm_full: float = 0.5

    def validate(self) -> None:
        """Raise :class:`TrainError` naming the option for an invalid value (and fill ``lora_targets``)."""
        from .scopes import DEFAULT_LORA_TARGETS

        if self.lora_targets is None:
            from unmask.engine.mask_adapter import DEFAULT_TARGETS

            self.lora_targets = list(DEFAULT_TARGETS if self.trainable == "mask_lora" else DEFAULT_LORA_TARGETS)
        self.lora_targets = list(self.lora_targets)
        if self.objective not in OBJECTIVES:
            raise TrainError(f"--objective: {self.objective!r} is not one of {OBJECTIVES}")
        if self.trainable not in SCOPES:
            raise TrainError(f"--trainable: {self.trainable!r} is not one of {SCOPES}")
        if self.lr_schedule not in SCHEDULES:
            raise TrainError(f"--lr-schedule: {self.lr_schedule!r} is not one of {SCHEDULES}")
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
        if not (math.isfinite(self.align_weight) and self.align_weight >= 0):
            raise TrainError(f"--align-weight: must be a finite number >= 0, got {self.align_weight}")
        if self.align_weight == 0 and (self.align_anchors or self.align_teacher or self.align_confidence):
            raise TrainError("--align-anchors/--align-teacher/--align-confidence: need --align-weight W > 0")
        if self.align_weight > 0 and self.objective == "draft":
            raise TrainError("--align-weight: does not apply to --objective draft")
        if self.objective == "trajectory":
            if self.trajectory_mode not in ("engine", "entropy"):
                raise TrainError(f"--trajectory-mode: {self.trajectory_mode!r} is not one of engine, entropy")
            if not 0 <= self.trajectory_threshold <= 1:
                raise TrainError(f"--trajectory-threshold: must be in [0, 1], got {self.trajectory_threshold}")
            if self.trajectory_steps < 1:
                raise TrainError(f"--trajectory-steps: must be >= 1, got {self.trajectory_steps}")
            if self.max_block_size is not None and not (self.block_size or 1) <= self.max_block_size <= self.seq_len:
                raise TrainError(f"--max-block-size: must be in --block-size..--seq-len ({self.block_size or 1}.."
                                 f"{self.seq_len}), got {self.max_block_size}")
        if self.no_ce and self.teacher_kl <= 0:
            raise TrainError("--no-ce: needs --teacher-kl W > 0 (otherwise there is no loss)")
        if self.lr_schedule == "cosine_time" and self.max_minutes <= 0:
            raise TrainError("--lr-schedule cosine_time: needs a time budget (--max-minutes > 0)")
        if not (math.isfinite(self.minutes_before) and self.minutes_before >= 0):
            raise TrainError(f"minutes_before: must be finite and >= 0, got {self.minutes_before}")
        if self.eval_every and not self.eval_data:
            raise TrainError("--eval-every: needs --eval-data FILE (held-out prompts)")
        if self.mixed_precision not in ("auto", "no", "bf16", "fp16"):
            raise TrainError(f"--mixed-precision: {self.mixed_precision!r} is not one of auto, no, bf16, fp16")
        if self.trainable == "mask_lora" and self.objective not in ("block", "draft", "vfm"):
            raise TrainError(f"--trainable mask_lora: trains --objective block, draft or vfm, not {self.objective}")
        if self.objective == "vfm":
            self._validate_vfm()
        if self.init_adapter and self.trainable != "mask_lora":
            raise TrainError("--init-adapter: only with --trainable mask_lora (it starts the mask-row adapter)")
        if self.trainable == "mask_lora" and self.verifier:
            raise TrainError("--verifier: --trainable mask_lora verifies with the parent itself (no --verifier)")
        if self.objective == "draft":
            if not self.verifier and self.trainable != "mask_lora":
                raise TrainError("--objective draft: needs --verifier DIR (the checkpoint whose causal path verifies "
                                 "the drafts, e.g. the untrained conversion of the AR parent)")
            if self.teacher_kl > 0 or self.complementary or self.certainty > 0:
                raise TrainError("--objective draft: --teacher-kl, --complementary and --certainty do not apply")
            if self.draft_groups < 1:
                raise TrainError(f"--draft-groups: must be >= 1, got {self.draft_groups}")
            if self.block_size is not None and self.block_size < 2:
                raise TrainError(f"--block-size: the draft objective drafts groups of >= 2 masks and its checkpoints "
                                 f"draft at --block-size by default, got {self.block_size}; give K >= 2, or leave it "
                                 f"out with --draft-block-sizes (a block-1 checkpoint then drafts at the largest)")
            if self.draft_block_sizes is not None and (not self.draft_block_sizes
                                                       or any(not 2 <= int(b) <= self.seq_len
                                                              for b in self.draft_block_sizes)):
                raise TrainError(f"--draft-block-sizes: each must be in 2..--seq-len ({self.seq_len}; a group of one "
                                 f"mask drafts nothing), got {self.draft_block_sizes}")
            if self.gradient_checkpointing:
                raise TrainError("--objective draft: --gradient-checkpointing is not supported (the checkpointed "
                                 "layers drop the verifier's keys/values)")
        elif self.verifier:
            raise TrainError("--verifier: only used by --objective draft")
        elif self.draft_block_sizes is not None:
            raise TrainError("--draft-block-sizes: only used by --objective draft")
        if self.fsdp:
            from .distributed import check_fsdp

            try:
                check_fsdp(self.trainable, self.objective)
            except ValueError as exc:
                raise TrainError(str(exc)) from exc


    def _validate_vfm(self) -> None:
        if self.trainable != "mask_lora":
            raise TrainError("--objective vfm: needs --trainable mask_lora (the parent and the mask-row adapter are "
                             "frozen; only the noise adapter trains)")
        if self.eval_every or self.teacher_kl > 0 or self.certainty > 0 or self.complementary or \
                self.align_weight > 0 or self.fsdp:
            raise TrainError("--objective vfm: --eval-every, --teacher-kl, --certainty, --complementary, "
                             "--align-weight and --fsdp do not apply")
        for name in ("vfm_gen_len", "vfm_width"):
            if getattr(self, name) < 1:
                raise TrainError(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(self, name)}")
        if not (math.isfinite(self.vfm_beta) and self.vfm_beta >= 0):
            raise TrainError(f"--vfm-beta: must be a finite number >= 0, got {self.vfm_beta}")
        for name in ("vfm_beta_warmup", "vfm_full"):
            if not 0 <= getattr(self, name) <= 1:
                raise TrainError(f"--{name.replace('_', '-')}: must be in [0, 1], got {getattr(self, name)}")


def config_from_json(path: str | Path) -> TrainConfig:
    """A :class:`TrainConfig` from a JSON object of its fields (for scripted runs)."""
    data = json.loads(Path(path).read_text())
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise TrainError(f"{path}: unknown field(s) {unknown}")
    return TrainConfig(**data)
