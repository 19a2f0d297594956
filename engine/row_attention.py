"""Row-invariant attention: a row's attention output that does not depend on the other rows of the forward
(docs/design.md section 10, "Row-invariant attention").

CPU ``scaled_dot_product_attention`` is not bit-invariant in the number of query rows of a call or in the keys a
row cannot see (key padding of batch mates, a chunk's later rows): its flash kernel splits queries and keys into
blocks whose sizes depend on the call's shapes, and vectorised sums end their lanes at the call's length. The
differences are ~1e-7, which float32 layers keep far below a logit's decision; but a low-bit layer rounds its
input to bfloat16 (``engine/lowbit.py``), which turns such a last-bit difference into a 2^-9 one: answers then
depended on batch mates and speculative decoding stopped being the block-1 decoding it verifies.

Here every row's keys are its own lane's (``[cached | chunk]``, no padding) and rows are grouped by what they see:

* a row that sees exactly the first ``m`` keys of its lane (a committed or causal row: the prompt, a block-1
  step, a speculative step's verified tokens; also a plain-diffusion block whose rows all see the prefix and the
  whole block) is computed in one unmasked call with the other rows of its lane that see the same ``m`` keys, over
  ``keys[:m]``. A block-1 step is one such call of one row; the same token's row in a speculative step, in a prompt
  or next to other lanes is the same call with the same operands, so it gets the same bits;
* the remaining rows of a lane (a speculative step's fallback groups, which skip the draft group) take one masked
  call over the lane's own keys; their composition depends on the lane's own chunk only.

The grouping is computed once per forward (:func:`lane_plans`, from the boolean mask) and reused by every layer
(:func:`row_invariant_attention`). A forward costs one call per (lane, group) per layer instead of one: a prompt of
``P`` tokens is ``P`` one-row calls. The fused decoder uses it for the low-bit weight formats only.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class LanePlan:
    """The attention calls of one lane (batch row ``b``) of a forward.

    Attributes:
        b: the batch row. keys: the lane's key columns of the forward's ``[C + Q]`` keys (``slice`` when they are
            contiguous, else ``[K_b]`` int64): its ``n_b`` cached keys, then its ``Q_b`` chunk rows.
        groups: ``(rows, m)``: query rows (``slice`` or ``[n]`` int64) that see exactly the lane's first ``m`` keys.
        other: query rows (``[n]`` int64) that see another set, or None; other_mask: their ``[1, 1, n, K_b]`` mask.
    """

    b: int
    keys: slice | torch.Tensor
    groups: list[tuple[slice | torch.Tensor, int]]
    other: torch.Tensor | None
    other_mask: torch.Tensor | None


def lane_plans(mask: torch.Tensor, cached: int) -> list[LanePlan]:
    """The per-lane calls for a boolean mask ``[B, 1, Q, C + Q]`` (True = may attend; ``cached`` = C, the padded
    cached width; each lane's cached keys are its first ``n_b`` columns, its chunk rows the first ``Q_b`` rows, as
    ``engine/denoiser.py`` lays them out). A padded query row (it sees only itself) is left out: its output is 0."""
    B, _, Q, _ = mask.shape
    C = int(cached)
    plans = []
    for b in range(B):
        vis = mask[b, 0]
        n_b = int(vis[:, :C].any(0).sum()) if C else 0
        sees_more = vis.sum(-1) > 1
        sees_more[0] = True  # row 0 is always a real row (a lane has at least one)
        q_b = int(sees_more.nonzero().max()) + 1
        keys = (slice(0, C + q_b) if n_b == C else
                torch.cat([torch.arange(n_b, device=vis.device), torch.arange(C, C + q_b, device=vis.device)]))
        lane = vis[:q_b][:, keys]
        K = lane.shape[-1]
        m = lane.sum(-1)
        is_prefix = (lane == (torch.arange(K, device=vis.device)[None, :] < m[:, None])).all(-1)
        groups = []
        for size in sorted(set(m[is_prefix].tolist())):
            rows = (is_prefix & (m == size)).nonzero().flatten()
            start = int(rows[0])
            contiguous = int(rows[-1]) - start + 1 == rows.numel()
            groups.append((slice(start, start + rows.numel()) if contiguous else rows, int(size)))
        other = (~is_prefix).nonzero().flatten()
        plans.append(LanePlan(b, keys, groups, other if other.numel() else None,
                              lane[other][None, None] if other.numel() else None))
    return plans


def row_invariant_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plans: list[LanePlan],
                            scale: float, gqa: bool) -> torch.Tensor:
    """``scaled_dot_product_attention`` of ``q`` ``[B, Hq, Q, D]`` over ``k``/``v`` ``[B, Hkv, C + Q, D]`` by the
    calls of ``plans`` (:func:`lane_plans`); returns ``[B, Hq, Q, D]`` (padded rows 0)."""
    sdpa = F.scaled_dot_product_attention
    o = torch.zeros_like(q)
    for p in plans:
        b = slice(p.b, p.b + 1)
        kb, vb = k[b][:, :, p.keys], v[b][:, :, p.keys]
        qb, ob = q[b], o[b]
        for rows, m in p.groups:
            ob[:, :, rows] = sdpa(qb[:, :, rows], kb[:, :, :m], vb[:, :, :m], scale=scale, enable_gqa=gqa)
        if p.other is not None:
            ob[:, :, p.other] = sdpa(qb[:, :, p.other], kb, vb, attn_mask=p.other_mask, scale=scale,
                                     enable_gqa=gqa)
    return o
