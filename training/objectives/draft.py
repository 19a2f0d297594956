"""The ``draft`` objective (docs/design.md#training): trains the model as the drafter of verifier-routed speculative
decoding (``unmask.engine.routed``). A frozen verifier (``--verifier``, or the parent itself under ``--trainable
mask_lora``) forwards the clean sequence causally; fully masked groups of ``block_size`` at sampled answer positions
draft against its keys/values (``unmask.training.losses.build_draft_layout``); CE is the mean over scored tokens.
"""
from __future__ import annotations

from pathlib import Path

import torch

from unmask.engine.config import CheckpointError

from ..common import TrainError
from ..forwards import DraftForward
from ..losses import accepted_draft_length, build_draft_layout, diffusion_loss
from ..mask_adapter import MaskDraftForward
from ..scopes import load_source
from .base import Objective


def load_verifier(path: str, device, dllm) -> torch.nn.Module:
    """The frozen verifier of the ``draft`` objective: an a2d checkpoint with the model's attention, logit shift,
    mask id and vocabulary (full precision, eval mode, no gradients).

    Raises:
        TrainError: not loadable, or differs from the model in one of those (names ``--verifier``).
    """
    try:
        model, _, vdllm = load_source(path, device=device)
    except (CheckpointError, OSError, ValueError) as exc:
        raise TrainError(f"--verifier {path}: {exc}") from exc
    if (vdllm.attention, vdllm.logit_shift, vdllm.mask_token_id) != (dllm.attention, dllm.logit_shift,
                                                                     dllm.mask_token_id):
        raise TrainError(f"--verifier {path}: attention/logit_shift/mask_token_id {vdllm.attention}/"
                         f"{vdllm.logit_shift}/{vdllm.mask_token_id} differ from the model's {dllm.attention}/"
                         f"{dllm.logit_shift}/{dllm.mask_token_id}")
    if vdllm.verifier:
        raise TrainError(f"--verifier {path}: names a verifier itself ({vdllm.verifier}); chains are not supported")
    if (vdllm.eos_token_ids, vdllm.pad_token_id, vdllm.suppress_token_ids) != (
            dllm.eos_token_ids, dllm.pad_token_id, dllm.suppress_token_ids):
        raise TrainError(f"--verifier {path}: eos/pad/suppressed token ids differ from the model's")
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def _resolved(path):
    return str(Path(path).expanduser().resolve()) if path else path


class Draft(Objective):
    """``draft``: the drafter of verifier-routed speculative decoding (see the module docstring)."""

    name = "draft"
    mask_lora = True
    fsdp_refusal = "the draft objective runs a second (verifier) model; not supported"
    owns = ("verifier", "draft_block_sizes")
    verifier: torch.nn.Module | None = None

    @classmethod
    def check(cls, cfg) -> None:
        if not cfg.verifier and cfg.trainable != "mask_lora":
            raise TrainError("--objective draft: needs --verifier DIR (the checkpoint whose causal path verifies "
                             "the drafts, e.g. the untrained conversion of the AR parent)")
        if cfg.teacher_kl > 0 or cfg.complementary or cfg.certainty > 0:
            raise TrainError("--objective draft: --teacher-kl, --complementary and --certainty do not apply")
        if cfg.draft_groups < 1:
            raise TrainError(f"--draft-groups: must be >= 1, got {cfg.draft_groups}")
        if cfg.block_size is not None and cfg.block_size < 2:
            raise TrainError(f"--block-size: the draft objective drafts groups of >= 2 masks and its checkpoints "
                             f"draft at --block-size by default, got {cfg.block_size}; give K >= 2, or leave it "
                             f"out with --draft-block-sizes (a block-1 checkpoint then drafts at the largest)")
        sizes = cfg.draft_block_sizes
        if sizes is not None and (not sizes or any(not 2 <= int(b) <= cfg.seq_len for b in sizes)):
            raise TrainError(f"--draft-block-sizes: each must be in 2..--seq-len ({cfg.seq_len}; a group of one "
                             f"mask drafts nothing), got {sizes}")
        if cfg.gradient_checkpointing:
            raise TrainError("--objective draft: --gradient-checkpointing is not supported (the checkpointed "
                             "layers drop the verifier's keys/values)")

    def resume_keys(self) -> list[str]:
        # (runs saved before the draft objective existed have neither key)
        return [] if self.cfg.trainable == "mask_lora" else ["draft_groups", "verifier"]

    def comparable(self, key: str, value):
        return _resolved(value) if key == "verifier" else value

    def block_size(self, dllm) -> int | None:
        cfg = self.cfg
        if cfg.block_size is None and cfg.draft_block_sizes and dllm.block_size < 2:
            # --draft-block-sizes alone on a block-1 checkpoint (e.g. a conversion at block 1): the checkpoints
            # this run writes draft at the largest of them by default (`record ship --block-size` changes it later)
            return max(int(b) for b in cfg.draft_block_sizes)
        return cfg.block_size

    def configure(self, run) -> None:
        """The checkpoint drafts (prefix-causal with the logit shift, block >= 2); the verifier is loaded and
        checked, and the saved checkpoints name it and draft at this block size."""
        cfg, dllm = self.cfg, run.tm.dllm
        if dllm.attention != "prefix_causal" or not dllm.logit_shift:
            raise TrainError("--objective draft: needs a prefix_causal checkpoint with the logit shift")
        if run.block_size < 2:
            raise TrainError(f"--block-size: the draft objective drafts groups of >= 2 masks; this checkpoint's "
                             f"block size is {run.block_size}: give --block-size K >= 2 or --draft-block-sizes")
        if cfg.trainable == "mask_lora":  # the parent verifies (training/mask_adapter.py)
            dllm.block_size = run.block_size
            return
        self.verifier = load_verifier(cfg.verifier, run.acc.device, dllm)
        from unmask.engine.routed import architecture_mismatch

        base = run.tm.base
        diff = architecture_mismatch(self.verifier.config, base.config)
        if diff or self.verifier.get_output_embeddings().weight.shape != base.get_output_embeddings().weight.shape:
            raise TrainError(f"--verifier {cfg.verifier}: another architecture than --model "
                             f"({diff or 'LM head shape'})")
        # the saved checkpoints decode with this verifier (unmask.engine.routed) and at this draft block
        dllm.verifier = _resolved(cfg.verifier)
        dllm.block_size = run.block_size

    def forward_module(self, run) -> torch.nn.Module:
        return MaskDraftForward(run.tm) if self.verifier is None else DraftForward(run.tm, self.verifier)

    def loss(self, run, module, batch, generator, fixed_t=None):
        sizes = self.cfg.draft_block_sizes or [run.block_size]
        # a mixture of draft block sizes: step s drafts groups of sizes[s % len(sizes)] (one size per step)
        lay = build_draft_layout(batch, run.tm.dllm, int(sizes[run.step % len(sizes)]), generator,
                                 self.cfg.draft_groups).to(run.acc.device)
        with run.acc.autocast():
            logits = module(lay.context_ids, lay.context_mask, lay.input_ids, lay.position_ids, lay.attention_mask,
                            lay.src_row, lay.src_col)
        parts = diffusion_loss(logits, lay)
        parts.accepted = accepted_draft_length(logits.detach(), lay)
        return parts, lay

    def eval_grid(self) -> list:
        return [None]  # drafts start fully masked: no noise level
