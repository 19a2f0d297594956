"""The masked-diffusion objectives ``mdlm`` and ``block`` (docs/design.md#training; the noise, layouts and loss terms
are ``unmask.training.losses``): CE over the masked answer tokens weighted by ``1/t``, plus the teacher KL
(``--teacher-kl``, the AR parent in-process or distill-data's stored top-k), certainty forcing (``--certainty``) and
an auxiliary term where one is configured (``run.aux``).
"""
from __future__ import annotations

import torch

from ..common import TrainError, load_parent
from ..data import Batch
from ..forwards import DiffusionForward
from ..losses import build_layout, diffusion_loss, draw_noise, stored_teacher
from ..mask_adapter import MaskBlockForward
from .base import Objective


class Teacher:
    """The AR parent run in-process: its next-token log-probabilities for scored answer tokens."""

    def __init__(self, path: str, device, student_vocab: int):
        self.model, _ = load_parent(path, device=device)
        v = self.model.get_output_embeddings().weight.shape[0]
        if v > student_vocab:
            raise TrainError(f"--teacher: its vocabulary ({v}) is larger than the student's ({student_vocab}); "
                             "the teacher must be the AR parent of this checkpoint")

    @torch.no_grad()
    def logprobs(self, batch: Batch, label_row: torch.Tensor, label_pos: torch.Tensor) -> torch.Tensor:
        """``[N, V_t]`` float32 log-probabilities of the parent's output at ``label_pos - 1`` (causal, clean)."""
        dev = self.model.device
        out = self.model.get_decoder()(input_ids=batch.input_ids.to(dev), attention_mask=batch.valid.long().to(dev),
                                       use_cache=False)
        hidden = out.last_hidden_state[label_row.to(dev), (label_pos - 1).to(dev)]
        return torch.log_softmax(self.model.get_output_embeddings()(hidden).float(), -1)


class Mdlm(Objective):
    """``mdlm``: one ``t`` per sequence (one forward over a bidirectional checkpoint, or the block layout with one
    block per answer turn on a causal one)."""

    name = "mdlm"
    aux = True
    teacher: Teacher | None = None

    def prepare(self, run) -> None:
        """The in-process KL teacher (``--teacher-kl`` with ``--teacher``), or a check that the data stores one."""
        cfg = self.cfg
        if cfg.teacher_kl <= 0:
            return
        if cfg.teacher:
            try:
                self.teacher = Teacher(cfg.teacher, run.acc.device,
                                       run.tm.base.get_output_embeddings().weight.shape[0])
            except TrainError:
                raise
            except Exception as exc:  # a missing or unreadable parent: one line naming the option
                raise TrainError(f"--teacher {cfg.teacher}: {exc}") from exc
        elif not run.data.teacher_top_k:
            raise TrainError("--teacher-kl: needs --teacher MODEL or distill-data lines with `teacher` top-k "
                             "distributions (unmask distill-data --top-k-dist K)")

    def forward_module(self, run) -> torch.nn.Module:
        return MaskBlockForward(run.tm) if self.cfg.trainable == "mask_lora" else DiffusionForward(run.tm)

    def noise(self, run, batch: Batch, generator: torch.Generator, fixed_t: float | None):
        """``(Noise, block size)`` of one micro-batch (``unmask.training.losses.draw_noise``)."""
        cfg = self.cfg
        return draw_noise(batch, run.tm.dllm, self.name, generator, run.block_size, cfg.eps, cfg.complementary,
                          fixed_t=fixed_t), run.block_size

    def certainty(self) -> float:
        """The certainty-forcing weight (``--certainty``)."""
        return self.cfg.certainty

    def loss(self, run, module, batch, generator, fixed_t=None):
        cfg, dllm = self.cfg, run.tm.dllm
        training = fixed_t is None
        noise, block_size = self.noise(run, batch, generator, fixed_t)
        layout = build_layout(batch, dllm, noise, block_size).to(run.acc.device)
        aux = run.aux if training else None
        with run.acc.autocast():
            logits = module(layout.input_ids, layout.position_ids, layout.attention_mask, layout.src_row,
                            layout.src_col, **({"hidden_layers": aux.layers} if aux else {}))
        if aux:
            logits, student_states = logits
        t_lp = t_ids = present = None
        if cfg.teacher_kl > 0 and training:
            if self.teacher is not None:
                t_lp = self.teacher.logprobs(batch, layout.label_row, layout.label_pos)
            else:
                st = stored_teacher(batch, layout)
                if st is not None:
                    t_lp, t_ids, present = st
        parts = diffusion_loss(logits, layout, teacher_kl=cfg.teacher_kl if training else 0.0,
                               ce=not cfg.no_ce or not training, teacher_logprobs=t_lp, teacher_ids=t_ids,
                               teacher_present=present, certainty=self.certainty() if training else 0.0,
                               certainty_temperature=cfg.certainty_temperature,
                               ce_weight=aux.ce_weight if aux else None)
        if aux:
            term = aux.loss(student_states, batch, layout, dllm.logit_shift)
            parts.loss = parts.loss + aux.weight * term
            parts.align = float(term.detach())
        return parts, layout


class Block(Mdlm):
    """``block``: every block of every answer in one forward (a clean copy, then a noisy copy per block); needs a
    ``prefix_causal`` or ``block_causal`` checkpoint."""

    name = "block"
    mask_lora = True

    def check_checkpoint(self, dllm) -> None:
        if dllm.attention == "bidirectional":
            raise TrainError("--objective block: needs a prefix_causal or block_causal checkpoint; this one is "
                             "bidirectional (use --objective mdlm)")
