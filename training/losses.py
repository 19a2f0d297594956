"""Masked-diffusion training objectives built on the engine's one attention-mask builder.

Objectives (docs/design.md#training, issue 4):

* ``mdlm`` on a ``bidirectional`` checkpoint: per sequence ``t ~ U(eps, 1)``, each answer token replaced by the
  mask token with probability ``t``, one forward over the whole (bidirectional) sequence;
  ``L = sum_masked CE / t / N_answer`` (the seed's formula: ``(ce[mask] / p_mask[mask]).sum() / n_valid``, with
  ``n_valid`` the answer tokens of the micro-batch).
  On a ``prefix_causal`` / ``block_causal`` checkpoint ``mdlm`` is the block layout below with one block per
  answer turn and one ``t`` per sequence (decoding with ``block_size = gen_length``).
* ``block`` (``prefix_causal`` / ``block_causal`` checkpoints): every block of every answer in ONE forward. The
  row holds a clean copy of the sequence (committed context, attention as the engine gives committed tokens)
  followed by a noisy copy of every answer block (``t`` per block). A noisy block is a non-committed attention
  group that sees the committed clean tokens before its start and nothing else - exactly the mask the engine's
  denoiser builds when that block is the active block (``unmask.engine.attention``: ``allowed(q, k) = valid_k and
  (grp_k == grp_q or (committed_k and pos_k < start_q))``). Blocks are aligned as the engine aligns them:
  ``generation`` alignment = blocks start at each answer's first token; ``absolute`` = multiples of
  ``block_size`` from position 0. ``complementary=True`` adds a second noisy copy of each block masking exactly
  the positions the first left visible (mask rate ``1 - t``), each copy weighted by ``1/p_mask`` and the loss
  divided by the number of copies.
* Logit shift (``dllm.logit_shift``): the loss of answer position ``j`` sits at output ``j - 1``; for the first
  position of a noisy block that output is the clean copy's (the committed token before the block: the engine's
  "carry" logits), elsewhere the noisy copy's own. Without logit shift, output ``j`` of the noisy copy.
* Teacher KL (``teacher_kl = W``): adds ``W * sum_masked KL(p_parent || p_student) / t / N_answer`` where
  ``p_parent`` is the AR parent's next-token distribution for that answer token (parent output ``j - 1`` on the
  clean sequence, run in-process, or the top-k stored by distill-data, renormalised over its k ids).
  ``ce=False`` keeps only the KL term.
* Certainty forcing (``certainty = C``, ``certainty_temperature = T``; dParallel, Chen et al. 2025,
  arXiv:2509.26488, section 3): adds ``W * mean_{scored, argmax == label} H(softmax(logits / T))``, the entropy of
  the model's distribution at the masked tokens it already predicts correctly, averaged over those tokens. Driving
  those distributions to certainty while CE keeps them on the target is what lets confidence-threshold decoding
  reveal several tokens per step; wrong predictions are left to CE alone (sharpening them would entrench errors).
  The mean is per micro-batch (as in dParallel's reference trainer); with gradient accumulation the objective is the
  mean of those means.

* ``draft`` (``prefix_causal`` checkpoints with the logit shift, trained against a frozen *verifier*, e.g. the
  untrained conversion of the AR parent; ``unmask.engine.routed``): trains the model as the drafter of
  verifier-routed speculative decoding. The verifier forwards the clean sequence causally; its keys/values are the
  context. For each sampled answer position ``s``, a group of ``block_size`` mask tokens at positions
  ``s .. s+block_size-1`` sees the verifier's context before ``s`` (and itself) - exactly mask group A / a fallback
  group of ``unmask.engine.speculative`` - and its output ``s + k`` (logit shift) is scored against the answer token
  ``s + k + 1`` for ``k = 0 .. block_size - 2`` (the token at ``s`` itself comes from the verifier). ``CE`` is the
  mean over scored tokens (``1/t`` = 1); no noise level: decoding drafts from fully masked groups.

Prompt tokens are never labels; only answer positions are ever masked or scored.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from unmask.engine.attention import build_attention_mask, canvas_groups
from unmask.engine.config import DllmConfig

from .data import Batch

NOISE_OBJECTIVES = ("mdlm", "block")  # the noise draw_noise draws (the objectives: unmask.training.registry)


@dataclass
class NoisyBlock:
    """One noisy copy of one block.

    Attributes:
        row: batch row. start, end: the attention group ``[start, end)`` (canvas positions; with absolute
            alignment ``start`` may lie in the prompt). span_start: first answer position of the block's turn.
        t: mask probability this copy was drawn with (the loss weight is ``1/t``).
        masked: canvas positions replaced by the mask token (answer positions only).
        copy: 0 for the first copy, 1 for the complementary copy.
    """

    row: int
    start: int
    end: int
    span_start: int
    t: float
    masked: list[int]
    copy: int = 0


@dataclass
class Noise:
    """The noise of one micro-batch: which copies exist and what they mask.

    ``rows_t``/``rows_masked`` are used by the single-copy bidirectional ``mdlm`` layout (``[B]`` t and masked
    positions per row); ``blocks`` by the block layout. ``copies``: 1, or 2 with complementary masks.
    """

    blocks: list[NoisyBlock] = field(default_factory=list)
    rows_t: list[float] = field(default_factory=list)
    rows_masked: list[list[int]] = field(default_factory=list)
    copies: int = 1


@dataclass
class Rows:
    """The rows of one training forward.

    Attributes:
        input_ids, position_ids: ``[B, T]`` int64; attention_mask: ``[B, 1, T, K]`` bool (True = may attend).
        valid: ``[B, T]`` bool (False = padding).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor
    valid: torch.Tensor

    @property
    def n_tokens(self) -> int:
        """Tokens forwarded (valid entries of ``input_ids``), for tokens/s."""
        return int(self.valid.sum())

    def to(self, device):
        """Move every tensor field to ``device`` in place; returns self."""
        for name, value in vars(self).items():
            if isinstance(value, torch.Tensor):
                setattr(self, name, value.to(device))
        return self


@dataclass
class ForwardRows(Rows):
    """The fields every diffusion and draft forward has (:class:`Layout`, :class:`DraftLayout`): the rows forwarded
    (:class:`Rows`) and the outputs scored.

    Attributes:
        src_row, src_col: ``[N]`` int64 output (row, column) whose logits predict each scored token.
        labels: ``[N]`` int64 the clean token ids they predict.
    """

    src_row: torch.Tensor
    src_col: torch.Tensor
    labels: torch.Tensor


@dataclass
class Layout(ForwardRows):
    """Inputs of one training forward and where its losses are read.

    Attributes:
        input_ids, position_ids: ``[B, T]`` int64. attention_mask: ``[B, 1, T, T]`` bool (True = may attend).
        valid: ``[B, T]`` bool (False = padding).
        src_row, src_col: ``[N]`` int64 output (row, column) whose logits predict each scored token.
        labels: ``[N]`` int64 clean token ids. label_row, label_pos: ``[N]`` (row, canvas position) of each scored
            token (to look up teacher distributions). inv_t: ``[N]`` float32 ``1/t`` weights.
        norm: the divisor ``N_answer * copies`` (answer tokens of the micro-batch).
        block_offsets: ``[(row, start, end, offset)]`` where each forwarded noisy copy sits along the T axis.
    """

    label_row: torch.Tensor
    label_pos: torch.Tensor
    inv_t: torch.Tensor
    norm: float
    block_offsets: list[tuple[int, int, int, int]] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------- blocks and groups
def answer_blocks(spans: list[tuple[int, int]], block_size: int | None, alignment: str = "generation"
                  ) -> list[tuple[int, int, int]]:
    """Blocks ``(start, end, span_start)`` covering the answer spans, as the engine lays them out.

    ``generation``: blocks start at each span's first token (docs/design.md#decisions); ``absolute``: blocks are the
    multiples of ``block_size`` from position 0 that intersect the span (the first may start in the prompt).
    The last block of a span ends at the span's end (its EOS). ``block_size=None``: one block per span.
    """
    out = []
    for s, e in spans:
        if block_size is None:
            out.append((s, e, s))
            continue
        a = s if alignment == "generation" else (s // block_size) * block_size
        while a < e:
            out.append((a, min(a + block_size, e), s))
            a += block_size
    return out


def clean_groups(length: int, spans: list[tuple[int, int]], dllm: DllmConfig, block_size: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention groups ``(grp, start)`` (``[L]`` int64) of the clean, fully committed copy of a sequence.

    ``prefix_causal``: every token its own group (strictly causal - the parent's attention). ``block_causal``:
    the answer positions grouped into blocks as decoding commits them (per answer turn for ``generation``
    alignment; from position 0 for ``absolute``, via :func:`unmask.engine.attention.canvas_groups`); other tokens
    causal. ``bidirectional``: one group.
    """
    if dllm.attention == "block_causal" and dllm.block_alignment == "absolute":
        grp, start, _ = canvas_groups(length, "block_causal", length, length, length, block_size, 0)
        return grp, start
    if dllm.attention == "bidirectional":
        return torch.zeros(length, dtype=torch.long), torch.zeros(length, dtype=torch.long)
    pos = torch.arange(length)
    grp, start = pos.clone(), pos.clone()
    if dllm.attention == "block_causal":
        nxt = length
        for s, e in spans:
            for a in range(s, e, block_size):
                b = min(a + block_size, e)
                grp[a:b] = nxt
                start[a:b] = a
                nxt += 1
    return grp, start


# ---------------------------------------------------------------------------------------------- noise
def _draw_t(generator: torch.Generator, eps: float, hi: float = 1.0) -> float:
    u = float(torch.rand((), generator=generator, dtype=torch.float64))
    return eps + (hi - eps) * u


def draw_noise(batch: Batch, dllm: DllmConfig, objective: str, generator: torch.Generator, block_size: int | None = None,
               eps: float = 1e-3, complementary: bool = False, fixed_t: float | None = None) -> Noise:
    """Draw the noise of one micro-batch from ``generator`` (CPU ``torch.Generator``; its state makes resume exact).

    Args:
        batch: the micro-batch. dllm: the checkpoint's settings (attention, alignment, block size).
        objective: ``mdlm`` | ``block``.
        block_size: training block size (default ``dllm.block_size``).
        eps: lower bound of ``t`` (``t ~ U(eps, 1)``; ``U(eps, 1 - eps)`` with complementary masks).
        complementary: add the complementary copy of each block (``block`` only).
        fixed_t: use this ``t`` everywhere (held-out evaluation on a t grid).

    Raises:
        ValueError: unknown objective; ``block`` on a bidirectional checkpoint.
    """
    if objective not in NOISE_OBJECTIVES:
        raise ValueError(f"objective: {objective!r} is not one of {NOISE_OBJECTIVES}")
    bs = block_size or dllm.block_size
    noise = Noise(copies=2 if complementary else 1)
    hi = 1.0 - eps if complementary else 1.0
    if dllm.attention == "bidirectional":
        if objective == "block":
            raise ValueError("objective: `block` needs a prefix_causal or block_causal checkpoint; this one is "
                             "bidirectional (use `mdlm`)")
        if complementary:
            raise ValueError("complementary: complementary masks need the block layout (a prefix_causal or "
                             "block_causal checkpoint)")
        for b in range(batch.input_ids.shape[0]):
            t = fixed_t if fixed_t is not None else _draw_t(generator, eps)
            pos = batch.answer[b].nonzero().flatten()
            r = torch.rand(pos.numel(), generator=generator, dtype=torch.float64)
            noise.rows_t.append(t)
            noise.rows_masked.append(pos[r < t].tolist())
        noise.copies = 1
        return noise
    for b in range(batch.input_ids.shape[0]):
        row_t = None
        if objective == "mdlm":
            row_t = fixed_t if fixed_t is not None else _draw_t(generator, eps, hi)
        blocks = answer_blocks(batch.spans[b], None if objective == "mdlm" else bs, dllm.block_alignment)
        for a, e, s in blocks:
            t = row_t if row_t is not None else (fixed_t if fixed_t is not None else _draw_t(generator, eps, hi))
            lo = max(a, s)
            pos = torch.arange(lo, e)
            r = torch.rand(pos.numel(), generator=generator, dtype=torch.float64)
            m = r < t
            noise.blocks.append(NoisyBlock(b, a, e, s, t, pos[m].tolist(), 0))
            if complementary:
                noise.blocks.append(NoisyBlock(b, a, e, s, 1.0 - t, pos[~m].tolist(), 1))
    return noise


# ---------------------------------------------------------------------------------------------- layout
class _Canvas:
    """What :func:`build_layout` collects: each row's pieces (ids, positions, groups, group starts, committed) and
    the scored outputs (row, column, label, label position, ``1/t``), then the padded tensors."""

    def __init__(self):
        self.rows: list[list[tuple]] = []
        self.scored: list[tuple[int, int, int, int, float]] = []
        self.offsets: list[tuple[int, int, int, int]] = []

    def piece(self, ids, pos, grp, start, committed) -> None:
        self.rows[-1].append((ids, pos, grp, start, committed))

    def score(self, b: int, src: int, label: int, pos: int, t: float) -> None:
        if src >= 0:  # (with the logit shift, position 0 has no output before it)
            self.scored.append((b, src, label, pos, 1.0 / t))

    def layout(self, dllm: DllmConfig, norm: float) -> Layout:
        cat = [[torch.cat([p[i] for p in row]) for i in range(5)] for row in self.rows]
        B, T = len(cat), max(int(r[0].numel()) for r in cat)
        pad = dllm.pad_token_id if dllm.pad_token_id is not None else dllm.eos_token_ids[0]
        input_ids = torch.full((B, T), pad, dtype=torch.long)
        position_ids = torch.zeros(B, T, dtype=torch.long)
        grp = torch.full((B, T), -2, dtype=torch.long)
        start = torch.zeros(B, T, dtype=torch.long)
        com = torch.zeros(B, T, dtype=torch.bool)
        valid = torch.zeros(B, T, dtype=torch.bool)
        for b, (r_ids, r_pos, r_grp, r_start, r_com) in enumerate(cat):
            n = int(r_ids.numel())
            input_ids[b, :n], position_ids[b, :n] = r_ids, r_pos
            grp[b, :n], start[b, :n], com[b, :n] = r_grp, r_start, r_com
            valid[b, :n] = True
        mask = build_attention_mask(position_ids, grp, start, valid, position_ids, grp, com, valid)
        cols = list(zip(*self.scored)) or [[]] * 5
        src_row, src_col, labels, lab_pos, inv_t = (list(c) for c in cols)

        def t64(x):
            return torch.tensor(x, dtype=torch.long)

        return Layout(input_ids=input_ids, position_ids=position_ids, attention_mask=mask, valid=valid,
                      src_row=t64(src_row), src_col=t64(src_col), labels=t64(labels), label_row=t64(src_row),
                      label_pos=t64(lab_pos), inv_t=torch.tensor(inv_t, dtype=torch.float32), norm=norm,
                      block_offsets=self.offsets)


def _bidirectional_row(canvas: _Canvas, b: int, ids: torch.Tensor, noise: Noise, mask_id: int, shift: bool) -> None:
    """One row of the single-copy ``mdlm`` layout of a bidirectional checkpoint (one group, nothing committed)."""
    n = int(ids.numel())
    noisy = ids.clone()
    masked = noise.rows_masked[b]
    if masked:
        noisy[masked] = mask_id
    canvas.piece(noisy, torch.arange(n), torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long),
                 torch.zeros(n, dtype=torch.bool))
    for p in masked:
        canvas.score(b, p - 1 if shift else p, int(ids[p]), p, noise.rows_t[b])


def _block_row(canvas: _Canvas, b: int, ids: torch.Tensor, blocks: list[NoisyBlock], grp: torch.Tensor,
               start: torch.Tensor, mask_id: int, shift: bool, skip_unmasked: bool) -> None:
    """One row of the block layout: the clean copy (``grp``/``start``: its groups), then each noisy block copy."""
    n = int(ids.numel())
    canvas.piece(ids, torch.arange(n), grp, start, torch.ones(n, dtype=torch.bool))
    off, gid = n, 3 * n + 3
    for blk in blocks:
        if skip_unmasked and not blk.masked:
            continue
        a, e = blk.start, blk.end
        noisy = ids[a:e].clone()
        if blk.masked:
            noisy[torch.tensor(blk.masked) - a] = mask_id
        canvas.piece(noisy, torch.arange(a, e), torch.full((e - a,), gid, dtype=torch.long),
                     torch.full((e - a,), a, dtype=torch.long), torch.zeros(e - a, dtype=torch.bool))
        canvas.offsets.append((b, a, e, off))
        for p in blk.masked:
            if shift:
                src = (a - 1) if p == a else off + (p - 1 - a)
            else:
                src = off + (p - a)
            canvas.score(b, src, int(ids[p]), p, blk.t)
        off += e - a
        gid += 1


def build_layout(batch: Batch, dllm: DllmConfig, noise: Noise, block_size: int | None = None,
                 skip_unmasked: bool = True) -> Layout:
    """Inputs, the shared-builder attention mask and the scoring indices for ``noise`` on ``batch``.

    See the module docstring for the layout; the mask comes from
    :func:`unmask.engine.attention.build_attention_mask` (keys = queries). ``skip_unmasked``: a noisy copy that
    masks nothing is not forwarded - it carries no label and no other position attends to it (noisy blocks see
    only committed clean tokens), so the loss is unchanged while about ``1/(block_size+1)`` of the blocks (those
    drawn with no mask under ``t ~ U(eps, 1)``) cost nothing.
    """
    bs = block_size or dllm.block_size
    shift = bool(dllm.logit_shift)
    canvas = _Canvas()
    for b in range(batch.input_ids.shape[0]):
        n = int(batch.valid[b].sum())
        ids = batch.input_ids[b, :n]
        canvas.rows.append([])
        if dllm.attention == "bidirectional":
            _bidirectional_row(canvas, b, ids, noise, dllm.mask_token_id, shift)
        else:
            grp, start = clean_groups(n, batch.spans[b], dllm, bs)
            _block_row(canvas, b, ids, [x for x in noise.blocks if x.row == b], grp, start, dllm.mask_token_id,
                       shift, skip_unmasked)
    return canvas.layout(dllm, float(max(int(batch.answer.sum()), 1) * noise.copies))


# ---------------------------------------------------------------------------------------------- losses
@dataclass
class LossParts:
    """``loss`` (the value to backpropagate, a scalar tensor) and its parts as floats, plus accuracy counts."""

    loss: torch.Tensor
    ce: float
    kl: float
    n_scored: int
    n_correct: int
    certainty: float = 0.0
    align: float = 0.0
    accepted: float | None = None  # draft: the mean accepted draft length


def kl_to_teacher(student_logits: torch.Tensor, teacher_logprobs: torch.Tensor,
                  teacher_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token ``KL(p_teacher || p_student)``, ``[N]`` float32.

    Args:
        student_logits: ``[N, V_s]`` student logits.
        teacher_logprobs: ``[N, K]`` log-probabilities of the parent: its full next-token distribution
            (``K = V_t <= V_s``, ids ``0..V_t-1``) when ``teacher_ids`` is None, else the stored top-k
            (renormalised over the k ids; ``-inf`` entries are ignored).
        teacher_ids: ``[N, K]`` int64 ids of the top-k entries, or None.
    """
    logq = F.log_softmax(student_logits.float(), dim=-1)
    t = teacher_logprobs.float()
    t = torch.where(torch.isfinite(t), t, torch.full_like(t, -1e4))  # absent entries: probability 0, never NaN
    logp = torch.log_softmax(t, dim=-1)  # renormalise (a no-op for a full distribution)
    if teacher_ids is None:
        logq = logq[:, : logp.shape[-1]]
    else:
        logq = logq.gather(1, teacher_ids)
    p = logp.exp()
    terms = torch.where(p > 0, p * (logp - logq), torch.zeros_like(p))
    return terms.sum(-1)


def certainty_term(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 0.5) -> torch.Tensor:
    """Mean entropy (nats) of ``softmax(logits / temperature)`` over the rows whose argmax equals the label.

    Args:
        logits: ``[N, V]`` logits of the scored (masked) tokens, any float dtype (computed in float32).
        labels: ``[N]`` int64 target ids.
        temperature: ``T > 0``; ``T < 1`` sharpens the distribution before the entropy (dParallel uses 0.5).

    Returns:
        A float32 scalar tensor with a gradient; ``0 * logits.sum()`` (zero, still connected to the graph) when no
        row is predicted correctly. Rule: dParallel (arXiv:2509.26488) certainty-forcing loss, the entropy of
        correctly predicted masked tokens only.

    Raises:
        ValueError: ``temperature <= 0``.
    """
    if not temperature > 0:
        raise ValueError(f"certainty_temperature: must be > 0, got {temperature}")
    correct = logits.argmax(-1) == labels
    rows = logits[correct].float()
    if rows.shape[0] == 0:
        return logits[:0].float().sum()  # exactly 0 (never NaN from an inf logit) and still in the graph
    logp = F.log_softmax(rows / temperature, dim=-1)
    return -(logp.exp() * logp).sum(-1).mean()


def diffusion_loss(logits: torch.Tensor, layout: Layout, teacher_kl: float = 0.0, ce: bool = True,
                   teacher_logprobs: torch.Tensor | None = None, teacher_ids: torch.Tensor | None = None,
                   teacher_present: torch.Tensor | None = None, certainty: float = 0.0,
                   certainty_temperature: float = 0.5, ce_weight=None) -> LossParts:
    """The masked-diffusion loss from the gathered logits of the scored tokens.

    Args:
        logits: ``[N, V]`` logits at ``(layout.src_row, layout.src_col)``.
        layout: from :func:`build_layout` (labels, ``1/t`` weights, the ``N_answer * copies`` divisor).
        teacher_kl: weight W of the KL term (0 = none). ce: include the cross-entropy term.
        teacher_logprobs, teacher_ids: ``[N, K]`` parent distributions for the scored tokens (see
            :func:`kl_to_teacher`); teacher_present: ``[N]`` bool, False where no distribution is stored.
        certainty: weight C of the certainty-forcing term (0 = none); certainty_temperature: its ``T``
            (:func:`certainty_term`).
        ce_weight: a per-token CE transform (``[N] -> [N]``) in the loss, e.g. Open-dLLM's confidence-weighted path
            term (``unmask.training.experimental.align.confidence_weighted``); the reported ``ce`` stays the plain
            one.

    Returns:
        :class:`LossParts`; ``loss = [CE] + W * KL + C * H_correct`` with CE and KL each
        ``sum_scored(term / t) / norm`` and ``H_correct`` from :func:`certainty_term`.

    Raises:
        ValueError: ``teacher_kl > 0`` without teacher distributions, neither CE nor KL enabled, a negative
            ``certainty``, or ``certainty_temperature <= 0`` with ``certainty > 0``.
    """
    if certainty < 0:
        raise ValueError(f"certainty: must be >= 0, got {certainty}")
    if not ce and teacher_kl <= 0:
        raise ValueError("no-ce: a KL weight (--teacher-kl > 0) is required when the CE term is off")
    w = layout.inv_t.to(logits.device)
    total = logits.new_zeros((), dtype=torch.float32)
    ce_val = kl_val = cert_val = 0.0
    labels = layout.labels.to(logits.device)
    if logits.shape[0]:
        ce_tok = F.cross_entropy(logits.float(), labels, reduction="none")
        ce_term = (ce_tok * w).sum() / layout.norm
        ce_val = float(ce_term.detach())
        if ce_weight is not None:
            ce_term = (ce_weight(ce_tok) * w).sum() / layout.norm
        if ce:
            total = total + ce_term
        if teacher_kl > 0:
            if teacher_logprobs is None:
                raise ValueError("teacher-kl: no teacher distributions (give --teacher or distill-data top-k)")
            kl_tok = kl_to_teacher(logits, teacher_logprobs.to(logits.device),
                                   None if teacher_ids is None else teacher_ids.to(logits.device))
            if teacher_present is not None:
                kl_tok = torch.where(teacher_present.to(logits.device), kl_tok, torch.zeros_like(kl_tok))
            kl_term = (kl_tok * w).sum() / layout.norm
            kl_val = float(kl_term.detach())
            total = total + teacher_kl * kl_term
        if certainty > 0:
            cert_term = certainty_term(logits, labels, certainty_temperature)
            cert_val = float(cert_term.detach())
            total = total + certainty * cert_term
        correct = int((logits.argmax(-1) == labels).sum())
    else:
        total = total + logits.sum() * 0.0
        correct = 0
    return LossParts(loss=total, ce=ce_val, kl=kl_val, n_scored=int(logits.shape[0]), n_correct=correct,
                     certainty=cert_val)


def stored_teacher(batch: Batch, layout: Layout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The distill-data top-k rows for the scored tokens: ``([N, K] logprobs, [N, K] ids, [N] present)``."""
    if batch.teacher_ids is None:
        return None
    r, p = layout.label_row, layout.label_pos
    return batch.teacher_logprobs[r, p], batch.teacher_ids[r, p], batch.has_teacher[r, p]


def eval_t_grid(n: int = 5) -> list[float]:
    """The fixed ``t`` grid of held-out evaluation: midpoints ``(i + 0.5) / n`` (an ELBO estimate by the midpoint
    rule over ``t``)."""
    return [(i + 0.5) / n for i in range(n)]


def finite(x: float) -> bool:
    """``math.isfinite(x)``: False for NaN and +-inf."""
    return math.isfinite(x)


# ---------------------------------------------------------------------------------------------- draft objective
@dataclass
class DraftLayout(ForwardRows):
    """Inputs of one ``draft`` forward (see the module docstring) and where its losses are read.

    Attributes:
        context_ids: ``[B, L]`` int64 clean sequences; context_mask: ``[B, 1, L, L]`` bool causal mask (the
            verifier's forward); context_valid: ``[B, L]`` bool.
        input_ids, position_ids: ``[B, R]`` int64 mask tokens of the draft groups and their positions.
        attention_mask: ``[B, 1, R, L + R]`` bool (keys: the context, then the draft rows).
        valid: ``[B, R]`` bool (False = padding).
        src_row, src_col: ``[N]`` int64 draft-row outputs scored; labels: ``[N]`` int64 answer tokens they predict.
        draft_index: ``[N]`` int64 ``k`` (0 = the first draft of its group); group: ``[N]`` int64 a group id unique
            in the micro-batch (for the accepted-length statistic).
        inv_t: ``[N]`` float32 ones; norm: ``N`` (float).
    """

    context_ids: torch.Tensor
    context_mask: torch.Tensor
    context_valid: torch.Tensor
    draft_index: torch.Tensor
    group: torch.Tensor
    inv_t: torch.Tensor
    norm: float


DRAFT_GROUP_BASE = 1 << 40  # attention-group ids of draft groups: above every position (context tokens use pos)


def build_draft_layout(batch: Batch, dllm: DllmConfig, block_size: int, generator: torch.Generator,
                       max_groups: int = 32) -> DraftLayout:
    """The ``draft`` objective's layout for ``batch``: up to ``max_groups`` draft groups per example, at answer
    positions ``s`` drawn without replacement from those with at least one label (``s + 1`` inside the answer).

    Masks come from :func:`unmask.engine.attention.build_attention_mask` (the engine's builder): the context is
    committed and causal (each token its own group), each draft group one non-committed group starting at ``s``.

    Raises:
        ValueError: ``block_size < 2`` (a group of one mask drafts nothing), ``max_groups < 1``, or a checkpoint
            without ``prefix_causal`` attention and the logit shift.
    """
    if block_size < 2:
        raise ValueError(f"block_size: the draft objective needs at least 2 (got {block_size})")
    if max_groups < 1:
        raise ValueError(f"draft_groups: must be >= 1 (got {max_groups})")
    if dllm.attention != "prefix_causal" or not dllm.logit_shift:
        raise ValueError("the draft objective needs a prefix_causal checkpoint with the logit shift")
    B, L = batch.input_ids.shape
    pos = torch.arange(L)
    ctx_pos = pos.expand(B, L)
    ctx_valid = batch.valid
    context_mask = build_attention_mask(ctx_pos, ctx_pos, ctx_pos, ctx_valid, ctx_pos, ctx_pos, ctx_valid, ctx_valid)
    per_row = []
    for b in range(B):
        starts = []
        for lo, hi in batch.spans[b]:
            starts.extend(range(lo, hi - 1))
        if len(starts) > max_groups:
            pick = torch.randperm(len(starts), generator=generator)[:max_groups].sort().values
            starts = [starts[i] for i in pick.tolist()]
        per_row.append(starts)
    R = max(1, max(len(st) for st in per_row) * block_size)
    ids = torch.full((B, R), dllm.mask_token_id, dtype=torch.long)
    q_pos = torch.zeros(B, R, dtype=torch.long)
    q_grp = torch.full((B, R), -2, dtype=torch.long)
    q_start = torch.zeros(B, R, dtype=torch.long)
    q_valid = torch.zeros(B, R, dtype=torch.bool)
    src_row, src_col, labels, k_idx, groups = [], [], [], [], []
    gid = 0
    for b, starts in enumerate(per_row):
        ends = {s: next(hi for lo, hi in batch.spans[b] if lo <= s < hi) for s in starts}
        for g, s in enumerate(starts):
            c0 = g * block_size
            q_pos[b, c0: c0 + block_size] = torch.arange(s, s + block_size)
            q_grp[b, c0: c0 + block_size] = DRAFT_GROUP_BASE + g
            q_start[b, c0: c0 + block_size] = s
            q_valid[b, c0: c0 + block_size] = True
            for k in range(block_size - 1):
                if s + k + 1 >= ends[s]:
                    break
                src_row.append(b)
                src_col.append(c0 + k)
                labels.append(int(batch.input_ids[b, s + k + 1]))
                k_idx.append(k)
                groups.append(gid)
            gid += 1
    k_committed = torch.cat([ctx_valid, torch.zeros(B, R, dtype=torch.bool)], 1)
    mask = build_attention_mask(q_pos, q_grp, q_start, q_valid,
                                torch.cat([ctx_pos, q_pos], 1), torch.cat([ctx_pos, q_grp], 1), k_committed,
                                torch.cat([ctx_valid, q_valid], 1))
    n = len(labels)
    return DraftLayout(context_ids=batch.input_ids, context_mask=context_mask, context_valid=ctx_valid,
                       input_ids=ids, position_ids=q_pos, attention_mask=mask, valid=q_valid,
                       src_row=torch.tensor(src_row, dtype=torch.long), src_col=torch.tensor(src_col, dtype=torch.long),
                       labels=torch.tensor(labels, dtype=torch.long), draft_index=torch.tensor(k_idx, dtype=torch.long),
                       group=torch.tensor(groups, dtype=torch.long), inv_t=torch.ones(n), norm=float(max(n, 1)))


def accepted_draft_length(logits: torch.Tensor, layout: DraftLayout) -> float:
    """Mean number of leading drafts of a group that equal their label (greedy drafts, all verified correct):
    the drafts a step of verifier-routed speculative decoding would accept on this data, ``0 .. block_size-1``."""
    if not layout.labels.numel():
        return 0.0
    ok = (logits.argmax(-1) == layout.labels.to(logits.device)).cpu()
    total, n_groups = 0, 0
    for g in layout.group.unique().tolist():
        sel = layout.group == g
        run = 0
        for hit in ok[sel][layout.draft_index[sel].argsort()].tolist():
            if not hit:
                break
            run += 1
        total += run
        n_groups += 1
    return total / max(n_groups, 1)
