"""The one attention-mask builder shared by decoding and training (docs/design.md#decoding, #training and #decisions).

Every token (query or key) carries three integers and a flag:

* ``pos``   - its absolute position in the sequence (RoPE position),
* ``grp``   - its attention group: tokens of one group see each other bidirectionally,
* ``start`` - the first position of its group,
* ``committed`` - whether it is final context (prompt or a committed block) rather than a noisy block.

A query q may attend a key k iff k is valid and either they share a group, or k is committed and lies
before q's group starts:

    allowed(q, k) = valid_k and (grp_k == grp_q or (committed_k and pos_k < start_q))

This single rule gives every attention mode of docs/design.md#words:

* ``prefix_causal``: every committed token is its own group (``start = pos``), so committed context is
  strictly causal - exactly the AR parent - while the active block is one group that sees all committed context.
* ``block_causal``: each block is a group; committed blocks see earlier committed blocks.
* ``bidirectional``: one group for the whole canvas.
* training's "clean copy + noisy blocks" layout: the noisy copy of block b is a non-committed group that sees the
  committed clean tokens before the block starts, and never another noisy block.

Padding: a padded (invalid) query attends only to itself, so no row of the mask is empty (sdpa would give NaN).
"""
from __future__ import annotations

import torch

from .config import ATTENTION_MODES


def build_attention_mask(
    q_pos: torch.Tensor,
    q_grp: torch.Tensor,
    q_start: torch.Tensor,
    q_valid: torch.Tensor,
    k_pos: torch.Tensor,
    k_grp: torch.Tensor,
    k_committed: torch.Tensor,
    k_valid: torch.Tensor,
) -> torch.Tensor:
    """Boolean attention mask ``[B, 1, Q, K]`` (True = may attend) for transformers' sdpa attention.

    Args:
        q_pos, q_grp, q_start: ``[B, Q]`` int64 position, group and group start of each query.
        q_valid: ``[B, Q]`` bool, False for padding queries.
        k_pos, k_grp: ``[B, K]`` int64 position and group of each key.
        k_committed, k_valid: ``[B, K]`` bool.

    The last ``Q`` keys must be the queries themselves (the layout of a forward that appends to a KV cache, and
    of a forward without cache where ``K == Q``); padded queries attend to their own key only.

    Raises:
        ValueError: shapes do not agree or ``K < Q``.
    """
    if q_pos.shape != q_grp.shape or q_pos.shape != q_start.shape or q_pos.shape != q_valid.shape:
        raise ValueError("query tensors must share one [B, Q] shape")
    if k_pos.shape != k_grp.shape or k_pos.shape != k_committed.shape or k_pos.shape != k_valid.shape:
        raise ValueError("key tensors must share one [B, K] shape")
    B, Q = q_pos.shape
    K = k_pos.shape[1]
    if k_pos.shape[0] != B or K < Q:
        raise ValueError(f"keys [{k_pos.shape[0]}, {K}] do not fit queries [{B}, {Q}]")
    same_group = k_grp[:, None, :] == q_grp[:, :, None]
    before = k_committed[:, None, :] & (k_pos[:, None, :] < q_start[:, :, None])
    allowed = (same_group | before) & k_valid[:, None, :] & q_valid[:, :, None]
    eye = torch.eye(Q, dtype=torch.bool, device=q_pos.device)
    pad_self = eye[None] & ~q_valid[:, :, None]
    allowed[:, :, K - Q:] |= pad_self
    return allowed[:, None]


def canvas_groups(
    length: int,
    attention: str,
    committed_until: int,
    active_start: int,
    active_end: int,
    block_size: int,
    block_origin: int,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Groups for one decoding canvas of ``length`` positions.

    Args:
        length: number of positions in the canvas (prompt + generation region + suffix), ``L``.
        attention: one of ``ATTENTION_MODES``.
        committed_until: positions ``< committed_until`` are committed (prompt and finished blocks).
        active_start, active_end: the active group ``[active_start, active_end)`` (the block being denoised,
            plus, for absolute block alignment, the prompt tail that shares its block).
        block_size: block size, used for ``block_causal`` grouping of committed blocks.
        block_origin: position where block 0 starts (0 for absolute alignment, the prompt length otherwise).

    Returns:
        ``(grp, start, committed)``: int64, int64 and bool tensors of shape ``[L]``.

    Raises:
        ValueError: unknown attention mode.
    """
    if attention not in ATTENTION_MODES:
        raise ValueError(f"attention: {attention!r} is not one of {ATTENTION_MODES}")
    pos = torch.arange(length, device=device)
    committed = pos < committed_until
    if attention == "bidirectional":
        grp = torch.zeros(length, dtype=torch.long, device=device)
        start = torch.zeros(length, dtype=torch.long, device=device)
        return grp, start, committed
    if attention == "prefix_causal":
        # each committed token its own group; the active block and anything after it one group each per block
        grp = pos.clone()
        start = pos.clone()
    else:  # block_causal: blocks of block_size aligned at block_origin; the prompt before it is causal
        rel = pos - block_origin
        blk = torch.div(rel, block_size, rounding_mode="floor")
        grp = torch.where(rel >= 0, length + blk, pos)
        start = torch.where(rel >= 0, block_origin + blk * block_size, pos)
    in_active = (pos >= active_start) & (pos < active_end)
    grp = torch.where(in_active, torch.full_like(grp, 2 * length + 1), grp)
    start = torch.where(in_active, torch.full_like(start, active_start), start)
    return grp, start, committed
