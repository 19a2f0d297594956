"""The batched reveal pass of one denoising step (docs/design.md#decoding, steps 2-7, for many sequences at once).

Every unconstrained plain or multi-block sequence of a forward contributes its masked rows; CFG, the forbidden ids,
``min_tokens``, ``logit_bias``, penalties, top-k/top-p, the draws (counter-based, ``unmask.engine.noise``), the
scores and the reveal rule (quota or threshold per window or active block) run over all rows at once on the
model's device (``unmask.engine.sampler.sample_groups``, ``unmask.engine.reveal_rule.select_segments``), and the step's outcome reaches the
host in one copy (``unmask.engine.reveals.to_host``). Each sequence then applies its rows on the host
(``Sequence.reveal``): the same reveals, in the same order, as its own ``consume`` gives (tested), so a batch's
tokens are each sequence's alone (batch invariance, docs/design.md#exactness-contracts-by-device-and-dtype).
Speculative and block-refinement sequences go through their own batched passes in the same step
(``unmask.engine.speculative_batch.verify_batch``, ``unmask.engine.refinement.refine_batch``): one copy per kind.
"""
from __future__ import annotations

import torch

from .outputs import StepEvent
from .reveals import to_host
from .reveal_rule import select_segments
from .sampler import sample_groups
from .refinement import RefinementSequence, refine_batch
from .sequence import Sequence, guided_rows
from .speculative import SpeculativeSequence
from .speculative_batch import verify_batch
from .step_graphs import StepGraphs

__all__ = ["batchable", "consume_batch"]

#: the strategies' own ``consume`` -> the batched pass that does the same for many sequences
PASSES = {Sequence.consume: "reveal", SpeculativeSequence.consume: "verify", RefinementSequence.consume: "refine"}


def batchable(seq) -> bool:
    """Whether ``seq`` goes through :func:`consume_batch`: a plain or multi-block sequence (its strategy keeps
    :class:`~unmask.engine.sequence.Sequence`'s ``consume``), a speculative or a block-refinement one, without a
    grammar."""
    return getattr(type(seq), "consume", None) in PASSES and getattr(seq, "grammar", None) is None


def consume_batch(seqs: list, spans: list[list[tuple[int, int]]], logits: torch.Tensor, forbidden_ids: torch.Tensor,
                  graphs: StepGraphs | None = None) -> list[tuple[StepEvent, list[torch.Tensor | None]]]:
    """What ``seq.consume`` returns for each of ``seqs`` (:func:`batchable` ones), from one step's needed rows:
    the plain and multi-block sequences through one reveal pass, the speculative ones through one verification
    pass (``unmask.engine.speculative_batch``), the block-refinement ones through one refinement pass
    (``unmask.engine.refinement.refine_batch``): one device-to-host copy each.

    Args:
        seqs: the sequences; ``spans[i]``: per lane of ``seqs[i]`` (cond, then uncond under CFG) its rows
            ``(start, end)`` in ``logits``.
        logits: ``[R, V]`` needed rows of the step's forwards (edited in place).
        forbidden_ids: ``[F]`` ids never generated, on the logits' device.
        graphs: the reveal pass's static step (``--cuda-graphs``, ``unmask.engine.step_graphs``), or None; the
            verification and refinement passes stay eager (counted there).

    Returns:
        per sequence ``(event, commits)``: its :class:`StepEvent` and per lane the chunk indices to commit.
    """
    out: list = [None] * len(seqs)
    kinds: dict[str, list[int]] = {}
    for i, seq in enumerate(seqs):
        kinds.setdefault(PASSES[type(seq).consume], []).append(i)
    for kind, at in kinds.items():
        some, their = [seqs[i] for i in at], [spans[i] for i in at]
        if graphs is not None and kind != "reveal":
            graphs.note_eager(kind, len(at))
        if kind == "verify":
            for i, (event, commit) in zip(at, verify_batch(some, [s[0] for s in their], logits, forbidden_ids)):
                out[i] = (event, [commit])
            continue
        events = (reveal_batch(some, their, logits, forbidden_ids, graphs) if kind == "reveal"
                  else refine_batch(some, their, logits, forbidden_ids))
        for i, event in zip(at, events):
            out[i] = (event, [inp.commit for inp in seqs[i]._inputs])
    return out


def reveal_batch(seqs: list, spans: list[list[tuple[int, int]]], logits: torch.Tensor, forbidden_ids: torch.Tensor,
                 graphs: StepGraphs | None = None) -> list[StepEvent]:
    """Reveal for ``seqs`` (``Sequence`` s without a grammar) from one forward's needed rows.

    Args:
        seqs: the sequences; ``spans[i]``: per lane of ``seqs[i]`` (cond, then uncond under CFG) its rows
            ``(start, end)`` in ``logits``.
        logits: ``[R, V]`` needed rows of the forward (edited in place).
        forbidden_ids: ``[F]`` ids never generated, on the logits' device.
        graphs: when given, sampling and the reveal rule run through its static step (bucketed shapes, a CUDA
            graph under ``--cuda-graphs``): the same candidates and reveals.

    Returns:
        each sequence's :class:`StepEvent`, in order.
    """
    cond, offsets = guided_rows(seqs, spans, logits)
    masks = [seq.masked_positions() for seq in seqs]
    groups = [seq.row_group(masked, lo) for seq, masked, lo in zip(seqs, masks, offsets)]
    segments = [seq.reveal_segments(masked) for seq, masked in zip(seqs, masks)]
    flat = [(g.lo + lo, g.lo + hi, q, t) for g, own in zip(groups, segments) for lo, hi, q, t in own]
    if graphs is not None:
        cands, chosen = graphs.sample_and_select(cond, groups, flat, forbidden_ids)
    else:
        cands = sample_groups(cond, groups, forbidden_ids)
        chosen = select_segments(cands, flat)
    host = to_host(cands, chosen)  # the step's one device-to-host copy
    return [seq.reveal(masked, host.rows(g.lo, g.hi), own)
            for seq, g, own, masked in zip(seqs, groups, segments, masks)]
