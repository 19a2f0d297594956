"""Representation alignment to the AR parent (Open-dLLM's Repr-Align; docs/design.md#the-seeds-methods,
docs/methods.md): an experiment that measured no gain, kept apart from the main loop (its hook-up to the diffusion
objectives: ``unmask.training.experimental.repr_align``).

``unmask train --align-weight W --align-layers all|L1,L2,...`` adds to the masked-diffusion loss

    W * sum_l w_l * mean_masked (1 - cos(h_student^l, h_teacher^l))

where ``h^l`` is the output of decoder layer l (1-based; ``all`` = every layer), the student's state is read at the
row whose output predicts a masked token (``Layout.src_row/src_col``: with the logit shift the output j-1 for the
token at j) and the teacher's at the same place of the clean sequence run causally (position ``label_pos - 1``
with the shift, else ``label_pos``), i.e. the state that predicts that token in the AR parent. The teacher is
frozen and runs without gradients: live (:class:`LiveTeacher`, the default) or read from a precomputed anchor
cache (``unmask.training.experimental.anchors``). Layer weights ``w_l`` are uniform or, with ``--align-exp G``,
proportional to ``exp(G * l / n_layers)`` (later layers weigh more; the seed fork's option), normalised to sum 1.

``--align-confidence``: the cross-entropy becomes Open-dLLM's confidence-weighted path term
``exp(-CE).detach() * CE`` per token (tokens the student already predicts well weigh more), see
:func:`confidence_weighted`.

Shapes: states ``[N, H]`` float32 for the N scored tokens. Errors: :class:`AlignError` naming the option.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["AlignError", "parse_layers", "layer_weights", "alignment_loss", "confidence_weighted", "LiveTeacher",
           "teacher_positions"]

DEFAULT_ALIGN_WEIGHT = 10.0  # Open-dLLM's weight


class AlignError(ValueError):
    """A bad alignment setting (the message names the option)."""


def parse_layers(spec: str, n_layers: int) -> list[int]:
    """``"all"`` -> ``[1..n_layers]``; ``"2,5"`` -> ``[2, 5]`` (1-based decoder layers, ascending, unique).

    Raises:
        AlignError: (``--align-layers``) not ``all`` or a list of integers in ``[1, n_layers]``.
    """
    spec = (spec or "").strip()
    if spec == "all":
        return list(range(1, n_layers + 1))
    try:
        layers = sorted({int(x) for x in spec.split(",") if x.strip()})
    except ValueError:
        raise AlignError(f"--align-layers: {spec!r} is not `all` or a comma-separated list of layer numbers") from None
    if not layers or layers[0] < 1 or layers[-1] > n_layers:
        raise AlignError(f"--align-layers: {spec!r}: layers are numbered 1..{n_layers} for this model")
    return layers


def layer_weights(layers: list[int], n_layers: int, exp_gamma: float = 0.0) -> torch.Tensor:
    """``[len(layers)]`` float32 weights summing to 1: uniform (``exp_gamma = 0``) or ``exp(gamma * l / n)``."""
    if not math.isfinite(exp_gamma):
        raise AlignError(f"--align-exp: must be finite, got {exp_gamma}")
    w = torch.tensor([math.exp(exp_gamma * (l / n_layers)) for l in layers], dtype=torch.float32)
    return w / w.sum()


def alignment_loss(student: list[torch.Tensor], teacher: list[torch.Tensor], weights: torch.Tensor) -> torch.Tensor:
    """``sum_l weights[l] * mean_n (1 - cos(student[l][n], teacher[l][n]))``, a float32 scalar with the student's
    gradient (the teacher is detached). ``student[l]``/``teacher[l]``: ``[N, H]``; N = 0 gives a connected 0.

    Raises:
        ValueError: the lists or shapes disagree.
    """
    if len(student) != len(teacher) or len(student) != int(weights.numel()):
        raise ValueError(f"alignment: {len(student)} student layers, {len(teacher)} teacher layers, "
                         f"{weights.numel()} weights")
    total = student[0].new_zeros((), dtype=torch.float32) if student else torch.zeros(())
    for w, s, t in zip(weights.tolist(), student, teacher):
        if s.shape != t.shape:
            raise ValueError(f"alignment: student states {tuple(s.shape)} vs teacher {tuple(t.shape)}")
        if s.shape[0] == 0:
            total = total + s.float().sum() * 0.0
            continue
        cos = F.cosine_similarity(s.float(), t.detach().float().to(s.device), dim=-1, eps=1e-8)
        total = total + w * (1.0 - cos).mean()
    return total


def confidence_weighted(ce_tok: torch.Tensor) -> torch.Tensor:
    """Open-dLLM's confidence-weighted path term per token: ``exp(-CE).detach() * CE`` (``[N]`` float32)."""
    return torch.exp(-ce_tok.detach()) * ce_tok


def teacher_positions(label_pos: torch.Tensor, logit_shift: bool) -> torch.Tensor:
    """Positions of the clean sequence whose teacher state predicts each scored token: ``label_pos - 1`` with the
    logit shift (the AR parent predicts token j at output j-1), else ``label_pos``."""
    return label_pos - 1 if logit_shift else label_pos


class LiveTeacher:
    """The frozen AR parent run causally on the clean micro-batch (no gradient) for its hidden states.

    Args:
        path: the parent (HF directory, GGUF, or an a2d checkpoint - run causally it is its parent).
        device: where it runs. layers: 1-based decoder layers to return.

    Raises:
        AlignError: (``--align-teacher``) the parent cannot be loaded.
    """

    def __init__(self, path: str, device, layers: list[int], model=None):
        if model is None:
            from ..common import load_parent

            try:
                model, _ = load_parent(path, device=device)
            except Exception as exc:  # one line naming the option
                raise AlignError(f"--align-teacher {path}: {exc}") from exc
        self.model = model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.layers = list(layers)
        self.path = path

    @property
    def n_layers(self) -> int:
        return int(self.model.config.num_hidden_layers)

    @torch.no_grad()
    def all_states(self, input_ids: torch.Tensor, valid: torch.Tensor) -> list[torch.Tensor]:
        """``[B, L, H]`` float32 per chosen layer for a right-padded ``[B, L]`` batch (causal attention)."""
        dev = self.model.device
        out = self.model.get_decoder()(input_ids=input_ids.to(dev), attention_mask=valid.long().to(dev),
                                       output_hidden_states=True, use_cache=False)
        return [out.hidden_states[l].float() for l in self.layers]

    def states(self, batch, label_row: torch.Tensor, label_pos: torch.Tensor, logit_shift: bool
               ) -> list[torch.Tensor]:
        """``[N, H]`` per layer: the teacher's states that predict the scored tokens (:func:`teacher_positions`)."""
        hs = self.all_states(batch.input_ids, batch.valid)
        rows = label_row.to(hs[0].device)
        cols = teacher_positions(label_pos, logit_shift).clamp_min(0).to(hs[0].device)
        return [h[rows, cols] for h in hs]
