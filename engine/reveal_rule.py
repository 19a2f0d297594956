"""The reveal rule of one step (docs/design.md#decoding, step 7): which of a window's candidates are revealed.

Quota mode reveals ``ceil(m / r)`` of the highest scores (LLaDA's ``get_num_transfer_tokens``); threshold mode every
candidate whose probability reaches the threshold plus the best one (Fast-dLLM, Wu et al. 2025, arXiv:2505.22618).
:func:`select_segments` applies the rule of many windows at once on the candidates' device (no host read).
"""
from __future__ import annotations

import torch

from .sampler import NEG_INF, Candidates
from .transfer import to_device

__all__ = ["choose_rows", "reveal_count", "segment_quota", "select_reveals", "select_segments"]


def reveal_count(masked_left: int, steps_left: int) -> int:
    """Quota-mode reveal count ``k = ceil(m / r)``, recomputed every step (LLaDA ``get_num_transfer_tokens``
    gives the same counts when the block's masks divide evenly). ``steps_left <= 0`` reveals everything."""
    if masked_left <= 0:
        return 0
    if steps_left <= 1:
        return masked_left
    return -(-masked_left // steps_left)  # integer ceil: exact for any size (a float quotient can underflow)


def select_reveals(cands: Candidates, quota: int | None, threshold: float | None) -> torch.Tensor:
    """Indices (into the N candidates) to reveal this step.

    Quota mode: the ``quota`` highest scores. Threshold mode: every candidate whose probability is >= threshold,
    plus the highest score (at least one per step, Fast-dLLM). Returns a ``[k]`` int64 tensor, k >= 1 when N >= 1.
    """
    n = cands.tokens.shape[0]
    if n == 0:
        return torch.empty(0, dtype=torch.long)
    best = torch.argmax(cands.score)
    if threshold is not None:
        chosen = cands.probability >= threshold
        chosen[best] = True
        return chosen.nonzero(as_tuple=True)[0]
    k = max(1, min(int(quota or 1), n))
    return torch.topk(cands.score, k).indices


def segment_quota(lo: int, hi: int, quota: int | None, threshold: float | None) -> int:
    """How many of a segment's rows ``[lo, hi)`` its rank rule reveals: the best one under a ``threshold`` (the
    confident ones come on top), else ``quota`` clipped to ``[1, rows]``; 0 for an empty segment."""
    if hi <= lo:
        return 0
    return 1 if threshold is not None else max(1, min(int(quota or 1), hi - lo))


def choose_rows(score: torch.Tensor, probability: torch.Tensor, idx: torch.Tensor, quota: torch.Tensor,
                tau: torch.Tensor | None) -> torch.Tensor:
    """The rank rule of many segments over padded tables, on the candidates' device, static shapes, no host read.

    Args:
        score, probability: ``[N]`` the candidates' ordering scores and probabilities.
        idx: ``[S, W]`` int64, each segment's rows, padded with ``N`` (a row never chosen).
        quota: ``[S, 1]`` int64, the :func:`segment_quota` of each segment (0 for a padding segment).
        tau: ``[S, 1]`` float64 thresholds (2.0, above any probability: none), or ``None`` when no segment has one.

    Returns:
        ``[N]`` bool: per segment its ``quota`` highest scores, and every probability >= its threshold. Ties go to
        the lower row (a stable descending sort).
    """
    dev = score.device
    N = score.shape[0]
    S, W = idx.shape
    pad = torch.full((1,), NEG_INF, dtype=torch.float64, device=dev)
    ranked = torch.cat([score.to(torch.float64), pad])[idx]
    order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(W, device=dev).expand(S, W))
    chosen = rank < quota
    if tau is not None:
        chosen |= torch.cat([probability.to(torch.float64), pad])[idx] >= tau
    chosen &= idx < N
    out = torch.zeros(N + 1, dtype=torch.bool, device=dev)
    out[idx.flatten()] = chosen.flatten()
    return out[:N]


def select_segments(cands: Candidates, segments: list[tuple[int, int, int | None, float | None]]) -> torch.Tensor:
    """:func:`select_reveals` for many segments at once, on the candidates' device (no host read).

    Args:
        cands: candidates of N rows.
        segments: ``(lo, hi, quota, threshold)`` per segment of rows ``[lo, hi)`` (a request's window or active
            block), ``quota`` None under ``threshold`` and the other way round.

    Returns:
        ``[N]`` bool, the rows to reveal: per segment the ``quota`` highest scores, or every probability >=
        ``threshold`` plus the highest score (:func:`choose_rows`).
    """
    dev = cands.score.device
    N = cands.score.shape[0]
    W = max([hi - lo for lo, hi, _, _ in segments] + [0])
    if not segments or not W:
        return torch.zeros(N, dtype=torch.bool, device=dev)
    # per segment: its first row, its rows and its quota
    lo = torch.tensor([[seg[0], seg[1] - seg[0], segment_quota(*seg)] for seg in segments], dtype=torch.long)
    col = torch.arange(W)[None, :]
    idx = torch.where(col < lo[:, 1:2], lo[:, :1] + col, N)  # N: a padding row (score -inf, never chosen)
    both = to_device(torch.cat([idx, lo[:, 2:3]], 1), dev)  # one copy for the indices and quotas
    tau = None
    if any(t is not None for _, _, _, t in segments):  # quota mode alone needs no probabilities (nor their copy)
        tau = to_device(torch.tensor([[2.0 if t is None else float(t)] for _, _, _, t in segments],
                                     dtype=torch.float64), dev)
    return choose_rows(cands.score, cands.probability, both[:, :W], both[:, W:], tau)
