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

from unmask.engine.options import option

from .common import TrainError
from .schedule import SCHEDULES
from .scopes import DEFAULT_LORA_TARGETS, SCOPES

PRECISIONS = ("auto", "no", "bf16", "fp16")


def objective_names() -> tuple[str, ...]:
    """``--objective``'s choices: the registry's names (``unmask.training.registry.OBJECTIVES``)."""
    from .registry import OBJECTIVES

    return tuple(OBJECTIVES)


def int_list(text: str) -> list[int]:
    """``"2,4"`` -> ``[2, 4]`` (``--draft-block-sizes``).

    Raises:
        ValueError: an item is not an integer.
    """
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"expected comma-separated integers such as 2,4, got {text!r}") from None


@dataclass
class TrainConfig:
    """Settings of one run: the ``unmask train`` options, each declared once with its flag's metadata
(``unmask.engine.options.option``; ``unmask options train`` lists them).

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

    # each field's option() metadata is its `unmask train` flag (unmask.cli.flags); cli=False: the Python API's only
    model: str = option(help="a2d checkpoint directory (`unmask convert` output)", required=True, env=False)
    data: str = option(help="JSONL: `messages` chats or `prompt`/`completion` (distill-data)", required=True,
                       env=False)
    out: str = option(help="output directory (checkpoint-<step>/, latest, metrics.csv, loss.png)", required=True,
                      env=False)
    objective: str = option(
        "block", "mdlm: one t per sequence (bidirectional); block: every block in one forward (default); draft: train "
                 "the model as the drafter of verifier-routed speculative decoding (needs --verifier); trajectory: "
                 "d3LLM's pseudo-trajectory distillation (masks follow recorded reveal orders); vfm: the VFM trial (a "
                 "prompt-conditioned noise adapter for one-step decoding; --trainable mask_lora, an experiment: "
                 "docs/methods.md)", choices=lambda: objective_names(), env=False)
    trainable: str = option("full", "mask_lora: the mask-row adapter (LoRA only mask rows see; "
                                    "--lora-r/--lora-alpha/--lora-targets)", choices=SCOPES, env=False)
    block_size: int | None = option(
        None, "training block size, 1..--seq-len (default: the checkpoint's; --objective draft: >= 2, the block its "
              "checkpoints draft at, default the largest --draft-block-sizes on a block-1 checkpoint)", env=False)
    complementary: bool = option(False, "also train the complementary mask of each block", action="store_true",
                                 env=False)
    batch_size: int = option(8, "examples per micro-batch per process", env=False)
    grad_accum: int = option(1, env=False)
    seq_len: int = option(256, "maximum tokens per example (longer ones truncated)", env=False)
    max_steps: int = option(100, env=False)
    max_minutes: float = option(0.0, "stop (and save) after this many minutes", env=False)
    eval_every: int = option(0, env=False)
    eval_data: str | None = option(None, "held-out JSONL for evaluation", env=False)
    eval_t_points: int = option(5, "mask rates t of the evaluation loss", cli=False, env=False)
    save_every: int = option(0, "checkpoint every N steps (always at the end)", env=False)
    keep_last: int = option(0, "keep only the N newest checkpoints (0 = all; each holds the model and optimizer "
                               "state)", env=False)
    seed: int = option(0, env=False)
    resume: bool = option(False, "continue from OUT/latest", action="store_true", env=False)
    lr: float = option(5e-5, env=False)
    lr_schedule: str = option(
        "cosine", "cosine/linear decay over --max-steps, constant after warmup, or cosine_time: a cosine over the "
                  "--max-minutes wall-clock budget", choices=SCHEDULES, env=False)
    warmup: int = option(0, "warmup steps", env=False)
    minutes_before: float = option(0.0, "budget minutes spent by earlier processes of the run", cli=False, env=False)
    weight_decay: float = option(0.0, env=False)
    max_grad_norm: float = option(1.0, "0 = no clipping", env=False)
    gradient_checkpointing: bool = option(False, action="store_true", env=False)
    teacher: str | None = option(None, "AR parent (HF dir or GGUF) for --teacher-kl, run in-process", env=False)
    teacher_kl: float = option(0.0, "weight W of KL(parent || model) at masked tokens", env=False)
    no_ce: bool = option(False, "KL term only (needs --teacher-kl)", action="store_true", env=False)
    certainty: float = option(
        0.0, "weight C of the certainty-forcing term (dParallel): entropy of correctly predicted masked tokens, so "
             "confidence-threshold decoding reveals more tokens per step (0 = off)", env=False)
    certainty_temperature: float = option(0.5, "softmax temperature of that entropy", env=False)
    lora_r: int = option(16, env=False)
    lora_alpha: float = option(32.0, env=False)
    lora_targets: list[str] | None = option(
        None, "comma-separated module names (default: q_proj,k_proj,v_proj,o_proj; mask_lora: every projection)",
        parse=lambda text: [t.strip() for t in text.split(",") if t.strip()] if text else None, env=False)
    init_adapter: str | None = option(
        None, "--trainable mask_lora: start the mask-row adapter from this adapter checkpoint (same rank, alpha, "
              "targets, parent); --objective vfm keeps it frozen", metavar="DIR", env=False)
    eps: float = option(1e-3, "lower bound of the mask rate t", cli=False, env=False)
    mixed_precision: str = option("auto", choices=PRECISIONS, env=False)
    progress: bool = option(True, flag="--no-progress", action="store_false", env=False)
    halt_after: int | None = option(None, "stop after that many steps without a final save (tests)", cli=False,
                                    env=False)
    verifier: str | None = option(
        None, "--objective draft: the a2d checkpoint whose causal path verifies the drafts (the untrained conversion "
              "of the AR parent); the saved checkpoints name it as their verifier", env=False)
    draft_groups: int = option(32, "--objective draft: draft groups (of --block-size masks) per example per step",
                               env=False)
    #: --objective draft: block sizes its draft groups cycle through, one per step (None = --block-size only)
    draft_block_sizes: list[int] | None = option(
        None, "--objective draft: block sizes the draft groups cycle through, one per step (e.g. 2,4: drafting at "
              "block 4 and plain diffusion at block 2 from one adapter; each in 2..--seq-len; default --block-size). "
              "Given alone on a block-1 checkpoint it implies --block-size: the saved checkpoints draft at the "
              "largest of them by default", metavar="K,K,...", parse=lambda text: int_list(text), env=False)
    fsdp: bool = option(
        False, "shard weights, gradients and optimizer state across the processes of a torchrun / accelerate launch "
               "job (FSDP2; --trainable full; docs/scale.md)", action="store_true", env=False)
    # Repr-Align (unmask.training.experimental.align, docs/design.md#the-seeds-methods); 0 = off
    align_weight: float = option(
        0.0, "Repr-Align (Open-dLLM): + W * (1 - cos(student, AR teacher hidden states)) at masked tokens; 0 = off; "
             "Open-dLLM uses 10", metavar="W", env=False)
    align_layers: str = option("all", "all | comma-separated 1-based decoder layers", env=False)
    align_exp: float = option(0.0, "layer weights proportional to exp(G * layer / n_layers) (0 = uniform)",
                              metavar="G", env=False)
    align_confidence: bool = option(False, "confidence-weighted CE per token: exp(-CE).detach() * CE (Open-dLLM's "
                                           "path term)", action="store_true", env=False)
    align_teacher: str | None = option(None, "the frozen AR teacher (default: --teacher, else --model run causally)",
                                       env=False)
    align_anchors: str | None = option(
        None, "read the teacher's states from this anchor cache (built there first when absent) instead of running "
              "the teacher live (the default)", metavar="DIR", env=False)
    align_anchor_budget_mb: float = option(2048.0, "refuse to build an anchor cache larger than this", env=False)
    # pseudo-trajectory distillation (--objective trajectory, unmask.training.objectives.trajectory)
    trajectories: str | None = option(
        None, "--objective trajectory: the trajectory file (default DATA.trajectory.jsonl; recorded there first "
              "where missing, resumable)", metavar="JSONL", env=False)
    trajectory_mode: str = option(
        "engine", "engine: the model's own threshold decoding (default); entropy: ground truth revealed "
                  "lowest-entropy-first in --trajectory-steps steps", choices=("engine", "entropy"), env=False)
    trajectory_threshold: float = option(0.9, "engine mode's threshold", env=False)
    trajectory_steps: int = option(8, "entropy mode's steps per answer", env=False)
    trajectory_model: str | None = option(None, "the recording model (default --model)", env=False)
    max_block_size: int | None = option(
        None, "--objective trajectory: the training block size doubles up to this (default 2x; at most --seq-len)",
        env=False)
    # the VFM trial (--objective vfm, unmask.training.experimental.vfm): answer positions, KL weight and its warm-up
    # fraction, the adapter's width, the share of fully masked rows
    vfm_gen_len: int = option(32, "--objective vfm: answer positions G", env=False)
    vfm_beta: float = option(1e-3, "--objective vfm: final KL weight beta", env=False)
    vfm_beta_warmup: float = option(0.5, "--objective vfm: beta rises linearly from 0 over this fraction of the run",
                                    env=False)
    vfm_width: int = option(256, "--objective vfm: the noise adapter's inner width", env=False)
    vfm_full: float = option(0.5, "--objective vfm: share of rows with every answer position masked (the one-step "
                                  "case)", env=False)

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
        """Each number within its range."""
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
        """Options that need another one."""
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
