"""A step's reveals on the host: the one device-to-host copy of a batched step (docs/design.md#devices).

The sampler's :class:`~unmask.engine.sampler.Candidates` and the chosen rows stay on the model's device until the
step is decided; :func:`to_host` packs what the host needs (each row's token, probability, log-probability, whether
it is revealed, and the ``top_logprobs`` alternatives) into one float64 tensor and copies it once. Token ids are
below 2**53, so float64 carries them exactly; float32 log-probabilities widen exactly.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampler import Candidates

__all__ = ["HostRows", "to_host"]


@dataclass
class HostRows:
    """Rows of a step's candidates on the host (Python lists, one entry per row).

    Attributes:
        tokens, probability, logprob, score: each row's candidate, its probability (float64), log-probability
            (float32 widened) and ordering score (the remasking strategy's, float64).
        chosen: whether the row is revealed this step.
        top: per row its alternatives ``((token id, logprob), ...)`` without filtered (-inf) or padding ids;
            ``None`` when no row asked for them.
        extra: per row the caller's extra value (:func:`to_host`'s ``extra``), or ``None``.
    """

    tokens: list[int]
    probability: list[float]
    logprob: list[float]
    score: list[float]
    chosen: list[bool]
    top: list[tuple[tuple[int, float], ...]] | None
    extra: list[float] | None = None

    def rows(self, lo: int, hi: int) -> "HostRows":
        """Rows ``[lo, hi)``."""
        return HostRows(self.tokens[lo:hi], self.probability[lo:hi], self.logprob[lo:hi], self.score[lo:hi],
                        self.chosen[lo:hi], None if self.top is None else self.top[lo:hi],
                        None if self.extra is None else self.extra[lo:hi])

    def picked(self, segments: list[tuple[int, int, int | None, float | None]]) -> list[int]:
        """The chosen rows in reveal order: segment by segment, a quota segment's by descending score (ties: the
        lower row), a threshold segment's ascending."""
        out = []
        for lo, hi, quota, _ in segments:
            rows = [i for i in range(lo, hi) if self.chosen[i]]
            out += sorted(rows, key=lambda i: -self.score[i]) if quota is not None else rows
        return out

    def take(self, rows: list[int]) -> "HostRows":
        """The given rows, in that order."""
        return HostRows([self.tokens[i] for i in rows], [self.probability[i] for i in rows],
                        [self.logprob[i] for i in rows], [self.score[i] for i in rows], [self.chosen[i] for i in rows],
                        None if self.top is None else [self.top[i] for i in rows],
                        None if self.extra is None else [self.extra[i] for i in rows])


def to_host(cands: Candidates, chosen: torch.Tensor | None = None, extra: torch.Tensor | None = None) -> HostRows:
    """``cands`` (``[N]`` rows, any device), ``chosen`` (``[N]`` bool, same device; ``None`` = all) and ``extra``
    (``[N]`` float, same device: a value of the caller's per row, widened to float64) as :class:`HostRows`, in one
    device-to-host copy."""
    n = int(cands.tokens.shape[0])
    dev = cands.tokens.device
    if chosen is None:
        chosen = torch.ones(n, dtype=torch.bool, device=dev)
    cols = [cands.tokens.to(torch.float64), cands.probability.to(device=dev, dtype=torch.float64),
            cands.logprob.to(device=dev, dtype=torch.float64), cands.score.to(device=dev, dtype=torch.float64),
            chosen.to(device=dev, dtype=torch.float64)]
    k = 0
    if cands.top_ids is not None:
        k = int(cands.top_ids.shape[-1])
        cols += [cands.top_ids.to(device=dev, dtype=torch.float64).reshape(n, k),
                 cands.top_logprobs.to(device=dev, dtype=torch.float64).reshape(n, k)]
    if extra is not None:
        cols.append(extra.to(device=dev, dtype=torch.float64))
    packed = torch.cat([c.reshape(n, -1) for c in cols], 1).cpu().tolist() if n else []
    top = None
    if k:
        top = [tuple((int(i), lp) for i, lp in zip(r[5:5 + k], r[5 + k:]) if i >= 0 and lp > float("-inf"))
               for r in packed]
    return HostRows([int(r[0]) for r in packed], [r[1] for r in packed], [r[2] for r in packed],
                    [r[3] for r in packed], [r[4] > 0.5 for r in packed], top,
                    None if extra is None else [r[-1] for r in packed])

