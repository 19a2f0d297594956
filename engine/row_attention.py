"""Row-invariant attention: a row's attention output that does not depend on the other rows of the forward
(docs/design.md#decisions, "Row-invariant attention").

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
  call over the lane's own keys; their composition depends on the lane's own chunk only;
* prompt rows (committed rows before the generation, flagged by the caller) need not be block-1 calls: nothing
  decodes them one at a time. They are computed in **tiles** fixed by position: tile ``t`` = the
  :data:`PROMPT_TILE` positions ``[tT, (t+1)T)``, one masked call with ``T`` query slots (the tile's rows of this
  forward in their slots, zeros elsewhere) over keys ``[0, (t+1)T)`` (zeros past the lane's keys) under the causal
  mask. Every computation of a row then has the same shapes, mask and unmasked operands, whichever chunk, cache
  start or batch it comes in: a CPU SDPA row depends only on its own query, the keys it sees and the call's shapes
  (masked keys and other query slots enter as exact zeros; tested). A prompt of ``P`` tokens costs ``P / T``
  calls instead of ``P`` (prefill ~2x faster, ``benchmarks/results/bench_long_prefill.md``). The price: a prompt
  row's bits differ from the block-1 call of the same position, so the prefix cache keeps only prompt rows' KV
  under this attention (``engine/prefix_cache.py``: an answer's KV is block-1 calls).

The grouping is computed once per forward (:func:`lane_plans`, from the boolean mask) and reused by every layer
(:func:`row_invariant_attention`). A forward costs one call per (lane, group or tile) per layer instead of one.
Each lane's keys come as its own tensor (``[cached | chunk]``: :meth:`~unmask.engine.kv_cache.BatchKV.lane_update`
writes a chunk after the lane's cached keys in its buffer, so a decoding lane attends to a view, no copy);
:func:`padded_lanes` takes them out of one right-padded ``[B, H, C + Q, D]`` tensor instead.
The fused decoder uses it for the low-bit weight formats only.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


#: positions per prompt-row tile (see the module docstring): large enough that a prompt costs few calls, small
#: enough that the masked half of a tile's diagonal and its empty slots cost little
PROMPT_TILE = 32


@dataclass
class PromptTile:
    """The rows of prompt tile ``t`` in one lane's forward: ``rows`` (``[n]`` int64 query rows of the chunk) sit
    in ``slots`` (``[n]`` int64, position - tT); ``mask`` ``[1, 1, T, (t+1)T]`` bool, the tile's causal mask."""

    t: int
    rows: torch.Tensor
    slots: torch.Tensor
    mask: torch.Tensor


@dataclass
class LanePlan:
    """The attention calls of one lane (batch row ``b``) of a forward.

    Attributes:
        b: the batch row. keys: the lane's key columns of the forward's right-padded ``[C + Q]`` keys (``slice``
            when they are contiguous, else ``[K_b]`` int64): its ``n_b`` cached keys, then its ``Q_b`` chunk rows.
        n_keys: ``n_b + Q_b``, the lane's keys in its own layout (cached keys then chunk rows).
        groups: ``(rows, m)``: query rows (``slice`` or ``[n]`` int64) that see exactly the lane's first ``m`` keys.
        other: query rows (``[n]`` int64) that see another set, or None; other_mask: their ``[1, 1, n, K_b]`` mask.
        tiles: the prompt rows' tiles (:class:`PromptTile`).
    """

    b: int
    keys: slice | torch.Tensor
    n_keys: int
    groups: list[tuple[slice | torch.Tensor, int]]
    other: torch.Tensor | None
    other_mask: torch.Tensor | None
    tiles: list[PromptTile]


def _tiles(rows: torch.Tensor, positions: torch.Tensor, masks: dict) -> list[PromptTile]:
    T = PROMPT_TILE
    out = []
    for t in sorted(set((positions // T).tolist())):
        sel = positions // T == t
        if t not in masks:
            masks[t] = (torch.arange((t + 1) * T, device=rows.device)[None, :]
                        <= (t * T + torch.arange(T, device=rows.device))[:, None])[None, None]
        out.append(PromptTile(t, rows[sel], positions[sel] - t * T, masks[t]))
    return out


def lane_plans(mask: torch.Tensor, cached: int, positions: torch.Tensor | None = None,
               prompt_rows: torch.Tensor | None = None, lengths: list[int] | None = None) -> list[LanePlan]:
    """The per-lane calls for a boolean mask ``[B, 1, Q, C + Q]`` (True = may attend; ``cached`` = C, the padded
    cached width; each lane's cached keys are its first ``n_b`` columns, its chunk rows the first ``Q_b`` rows, as
    ``engine/denoiser.py`` lays them out). A padded query row (it sees only itself) is left out: its output is 0.
    ``lengths``: each lane's cached keys ``n_b`` (a cache knows them); without it, the cached columns some row sees.

    ``prompt_rows`` (``[B, Q]`` bool, with ``positions`` ``[B, Q]`` int64): rows to compute in prompt tiles; one
    counts only when it sees exactly the keys of positions ``0..pos`` (its lane's keys start at position 0 and run
    in order, as the exact cache keeps them), else it is grouped as any other row."""
    B, _, Q, _ = mask.shape
    C = int(cached)
    plans = []
    tile_masks: dict = {}
    for b in range(B):
        vis = mask[b, 0]
        n_b = int(lengths[b]) if lengths is not None else (int(vis[:, :C].any(0).sum()) if C else 0)
        sees_more = vis.sum(-1) > 1
        sees_more[0] = True  # row 0 is always a real row (a lane has at least one)
        q_b = int(sees_more.nonzero().max()) + 1
        keys = (slice(0, C + q_b) if n_b == C else
                torch.cat([torch.arange(n_b, device=vis.device), torch.arange(C, C + q_b, device=vis.device)]))
        lane = vis[:q_b][:, keys]
        K = lane.shape[-1]
        m = lane.sum(-1)
        is_prefix = (lane == (torch.arange(K, device=vis.device)[None, :] < m[:, None])).all(-1)
        tiles = []
        if prompt_rows is not None:
            pos = positions[b, :q_b]
            tiled = prompt_rows[b, :q_b] & is_prefix & (m == pos + 1)
            if bool(tiled.any()):
                rows = tiled.nonzero().flatten()
                tiles = _tiles(rows, pos[rows], tile_masks)
                is_prefix = is_prefix & ~tiled
                m = torch.where(tiled, -1, m)  # neither a prefix group nor "other"
        groups = []
        for size in sorted(set(m[is_prefix].tolist())):
            rows = (is_prefix & (m == size)).nonzero().flatten()
            start = int(rows[0])
            contiguous = int(rows[-1]) - start + 1 == rows.numel()
            groups.append((slice(start, start + rows.numel()) if contiguous else rows, int(size)))
        other = (~is_prefix & (m >= 0)).nonzero().flatten()
        plans.append(LanePlan(b, keys, n_b + q_b, groups, other if other.numel() else None,
                              lane[other][None, None] if other.numel() else None, tiles))
    return plans


def padded_lanes(k: torch.Tensor, v: torch.Tensor, plans: list[LanePlan]
                 ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each lane's ``[1, Hkv, n_keys, D]`` keys/values out of right-padded ``k``/``v`` ``[B, Hkv, C + Q, D]``
    (lane ``b``'s cached keys in columns ``[0, n_b)``, its chunk from column C): views where they are contiguous,
    else gathered copies."""
    out = [(k[:0], v[:0])] * k.shape[0]
    for p in plans:
        b = slice(p.b, p.b + 1)
        out[p.b] = (k[b][:, :, p.keys], v[b][:, :, p.keys])
    return out


def row_invariant_attention(q: torch.Tensor, lane_kv: list[tuple[torch.Tensor, torch.Tensor]],
                            plans: list[LanePlan], scale: float, gqa: bool) -> torch.Tensor:
    """``scaled_dot_product_attention`` of ``q`` ``[B, Hq, Q, D]`` by the calls of ``plans`` (:func:`lane_plans`);
    ``lane_kv[b]``: lane ``b``'s keys/values ``[1, Hkv, >= n_keys, D]``, its ``n_b`` cached keys then its chunk
    rows (:meth:`~unmask.engine.kv_cache.BatchKV.lane_update`, :func:`padded_lanes`). Returns ``[B, Hq, Q, D]``
    (padded rows 0)."""
    sdpa = F.scaled_dot_product_attention
    o = torch.zeros_like(q)
    for p in plans:
        kb, vb = lane_kv[p.b]
        kb, vb = kb[:, :, :p.n_keys], vb[:, :, :p.n_keys]
        b = slice(p.b, p.b + 1)
        qb, ob = q[b], o[b]
        for rows, m in p.groups:
            ob[:, :, rows] = sdpa(qb[:, :, rows], kb[:, :, :m], vb[:, :, :m], scale=scale, enable_gqa=gqa)
        if p.other is not None:
            ob[:, :, p.other] = sdpa(qb[:, :, p.other], kb, vb, attn_mask=p.other_mask, scale=scale,
                                     enable_gqa=gqa)
        for tile in p.tiles:
            ob[:, :, tile.rows] = _tile_attention(qb, kb, vb, tile, scale, gqa)
    return o


def _tile_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tile: PromptTile, scale: float,
                    gqa: bool) -> torch.Tensor:
    """One prompt tile's call (module docstring): ``q`` ``[1, Hq, Q_b, D]``, ``k``/``v`` ``[1, Hkv, K_b, D]`` of
    one lane (keys = positions); returns ``[1, Hq, n, D]`` for ``tile.rows``."""
    T = PROMPT_TILE
    L = (tile.t + 1) * T
    qt = q.new_zeros(q.shape[0], q.shape[1], T, q.shape[3])
    qt[:, :, tile.slots] = q[:, :, tile.rows]
    if k.shape[2] >= L:
        kt, vt = k[:, :, :L], v[:, :, :L]
    else:  # keys of later positions are not there yet: exact zeros, masked for every row that is
        pad = k.new_zeros(k.shape[0], k.shape[1], L - k.shape[2], k.shape[3])
        kt, vt = torch.cat([k, pad], 2), torch.cat([v, pad], 2)
    out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=tile.mask, scale=scale, enable_gqa=gqa)
    return out[:, :, tile.slots]
