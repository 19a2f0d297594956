"""The batched reveal pass of one denoising step (docs/design.md#decoding, steps 2-7, for many sequences at once).

Every unconstrained plain or multi-block sequence of a forward contributes its masked rows; CFG, the forbidden ids,
``min_tokens``, ``logit_bias``, penalties, top-k/top-p, the draws (counter-based, ``unmask.engine.noise``), the
scores and the reveal rule (quota or threshold per window or active block) run over all rows at once on the
model's device (``unmask.engine.sampler.sample_groups``, ``select_segments``), and the step's outcome reaches the
host in one copy (``unmask.engine.reveals.to_host``). Each sequence then applies its rows on the host
(``Sequence.reveal``): the same reveals, in the same order, as its own ``consume`` gives (tested), so a batch's
tokens are each sequence's alone (batch invariance, docs/design.md#exactness-contracts-by-device-and-dtype).
"""
from __future__ import annotations

import torch

from .outputs import StepEvent
from .reveals import to_host
from .sampler import sample_groups, select_segments
from .sequence import Sequence
from .speculative import SpeculativeSequence
from .speculative_batch import verify_batch
from .transfer import to_device

__all__ = ["batchable", "consume_batch"]


def batchable(seq) -> bool:
    """Whether ``seq`` goes through :func:`consume_batch`: a plain or multi-block sequence (its strategy keeps
    :class:`~unmask.engine.sequence.Sequence`'s ``consume``) or a speculative one, without a grammar."""
    return getattr(type(seq), "consume", None) in (Sequence.consume, SpeculativeSequence.consume) \
        and getattr(seq, "grammar", None) is None


def consume_batch(seqs: list, spans: list[list[tuple[int, int]]], logits: torch.Tensor, forbidden_ids: torch.Tensor
                  ) -> list[tuple[StepEvent, list[torch.Tensor | None]]]:
    """What ``seq.consume`` returns for each of ``seqs`` (:func:`batchable` ones), from one step's needed rows:
    the plain and multi-block sequences through one reveal pass, the speculative ones through one verification
    pass (``unmask.engine.speculative_batch``): one device-to-host copy each.

    Args:
        seqs: the sequences; ``spans[i]``: per lane of ``seqs[i]`` (cond, then uncond under CFG) its rows
            ``(start, end)`` in ``logits``.
        logits: ``[R, V]`` needed rows of the step's forwards (edited in place).
        forbidden_ids: ``[F]`` ids never generated, on the logits' device.

    Returns:
        per sequence ``(event, commits)``: its :class:`StepEvent` and per lane the chunk indices to commit.
    """
    out: list = [None] * len(seqs)
    spec = [i for i, s in enumerate(seqs) if isinstance(s, SpeculativeSequence)]
    plain = [i for i, s in enumerate(seqs) if not isinstance(s, SpeculativeSequence)]
    if plain:
        events = reveal_batch([seqs[i] for i in plain], [spans[i] for i in plain], logits, forbidden_ids)
        for i, event in zip(plain, events):
            out[i] = (event, [inp.commit for inp in seqs[i]._inputs])
    if spec:
        for i, (event, commit) in zip(spec, verify_batch([seqs[i] for i in spec], [spans[i][0] for i in spec],
                                                          logits, forbidden_ids)):
            out[i] = (event, [commit])
    return out


def reveal_batch(seqs: list, spans: list[list[tuple[int, int]]], logits: torch.Tensor, forbidden_ids: torch.Tensor
                 ) -> list[StepEvent]:
    """Reveal for ``seqs`` (``Sequence`` s without a grammar) from one forward's needed rows.

    Args:
        seqs: the sequences; ``spans[i]``: per lane of ``seqs[i]`` (cond, then uncond under CFG) its rows
            ``(start, end)`` in ``logits``.
        logits: ``[R, V]`` needed rows of the forward (edited in place).
        forbidden_ids: ``[F]`` ids never generated, on the logits' device.

    Returns:
        each sequence's :class:`StepEvent`, in order.
    """
    dev = logits.device
    cond_idx: list[int] = []
    cfg_rows, cfg_uncond, cfg_scale = [], [], []
    groups, segments, masks = [], [], []
    n = 0
    for seq, lane_spans in zip(seqs, spans):
        masked = seq.masked_positions()
        c0, c1 = lane_spans[0]
        k = c1 - c0
        cond_idx.extend(range(c0, c1))
        if len(lane_spans) == 2:  # CFG (LLaDA): l = l_u + (1 + s)(l_c - l_u)
            u0, _ = lane_spans[1]
            cfg_rows.extend(range(n, n + k))
            cfg_uncond.extend(range(u0, u0 + k))
            cfg_scale.extend([1.0 + float(seq.params.cfg_scale)] * k)
        groups.append(seq.row_group(masked, n))
        own = seq.reveal_segments(masked)
        segments.append(own)
        masks.append(masked)
        n += k
    run = cond_idx == list(range(cond_idx[0], cond_idx[0] + n))
    idx = to_device(torch.tensor(([] if run else cond_idx) + cfg_rows + cfg_uncond, dtype=torch.long), dev)
    cond = logits[cond_idx[0]: cond_idx[0] + n] if run else logits[idx[:n]]  # one run: a view
    if cfg_rows:
        m = len(cfg_rows)
        rows, uncond = idx[-2 * m: -m], logits[idx[-m:]]
        scale = to_device(torch.tensor(cfg_scale, dtype=cond.dtype), dev)[:, None]
        cond[rows] = uncond + scale * (cond[rows] - uncond)
    cands = sample_groups(cond, groups, forbidden_ids)
    flat = [(g.lo + lo, g.lo + hi, q, t) for g, own in zip(groups, segments) for lo, hi, q, t in own]
    host = to_host(cands, select_segments(cands, flat))  # the step's one device-to-host copy
    return [seq.reveal(masked, host.rows(g.lo, g.hi), own)
            for seq, g, own, masked in zip(seqs, groups, segments, masks)]
