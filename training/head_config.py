"""Options of ``unmask train-head`` (kept free of heavy imports: the CLI builds its parser from them)."""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class HeadTrainConfig:
    """Options of ``unmask train-head`` (CLI flags of the same names).

    Attributes:
        verifier: a2d checkpoint (prefix-causal, logit shift) whose hidden states the head reads.
        data: JSONL training chats (``unmask distill-data`` output recommended: the verifier's own answers).
        out: output checkpoint directory (created; resumed when it holds a run of the same verifier and data).
        minutes: wall-clock training budget (counted across resumes; feature extraction not counted).
        max_steps: optimizer-step cap (0 = budget only).
        batch_size: examples per step. seq_len: tokens per example (truncated on the right).
        lr, warmup, weight_decay: AdamW; linear warmup then a cosine over the budget.
        window: context rows per head forward. max_drafts: drafts per step the head is trained for (block - 1).
        groups: draft blocks per example per step. draft_vocab_size: ``K``. num_layers: head decoder layers.
        save_every: steps between saves (and at the end). seed: sampling of anchors and masks.
        feature_batch: documents per verifier forward during feature extraction.
        targets: ``answer`` = the data's answer tokens; ``all`` = the verifier's own greedy next token after every
            position, prompts included (self-distillation: on greedy answers the two coincide; prompts add data).
        val_docs: documents held out of training (a seeded draw; at most a fifth of the data) and scored at every
            save (``OUT/head_train/val.csv``): the training accuracies are in-sample, these are not. 0 = none.
    """

    verifier: str
    data: str
    out: str
    minutes: float = 30.0
    max_steps: int = 0
    batch_size: int = 16
    seq_len: int = 192
    lr: float = 5e-4
    warmup: int = 20
    weight_decay: float = 0.0
    window: int = 16
    max_drafts: int = 3
    groups: int = 16
    draft_vocab_size: int = 8192
    num_layers: int = 1
    save_every: int = 100
    seed: int = 0
    feature_batch: int = 16
    val_docs: int = 64
    targets: str = "answer"

    def validate(self) -> None:
        """Raise :class:`~unmask.training.trainer.TrainError` naming the ``--option`` when a value is out of
        range."""
        from .trainer import TrainError

        positive = ("batch_size", "window", "max_drafts", "groups", "draft_vocab_size", "num_layers", "save_every",
                    "feature_batch")
        for name in positive:
            if int(getattr(self, name)) < 1:
                raise TrainError(f"--{name.replace('_', '-')}: must be at least 1, got {getattr(self, name)}")
        if self.max_drafts > 31:
            raise TrainError(f"--max-drafts: at most 31 (speculative blocks hold at most 32 tokens), got "
                             f"{self.max_drafts}")
        if self.num_layers != 1:
            raise TrainError(f"--num-layers: only 1 is supported (the head keeps the last --window context pairs, "
                             f"which a deeper head would see differently than in training), got {self.num_layers}")
        if self.targets not in ("answer", "all"):
            raise TrainError(f"--targets: must be answer or all, got {self.targets!r}")
        if self.val_docs < 0:
            raise TrainError(f"--val-docs: must not be negative, got {self.val_docs}")
        if self.seq_len < 4:
            raise TrainError(f"--seq-len: must be at least 4, got {self.seq_len}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise TrainError(f"--lr: must be a positive number, got {self.lr}")
        if self.minutes <= 0 and self.max_steps <= 0:
            raise TrainError("--minutes / --max-steps: give a time budget or a step cap")
        if self.max_steps < 0 or self.warmup < 0:
            raise TrainError("--max-steps / --warmup: must not be negative")
