"""The attention mask of a forward over lanes (docs/design.md#decoding, "Per-request host work"): whether a lane's
chunk rows see every key (then its attention needs no mask), and the forward's ``[B, 1, Q, C + Q]`` bool mask over
the lanes' cached keys and the chunk's (``unmask.engine.attention.build_attention_mask``, or made all true). Shared
by the denoiser's general path and the plain table step (``engine/plain_batch.py``)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .attention import build_attention_mask

if TYPE_CHECKING:
    from .kv_cache import BatchKV, LaneCache

__all__ = ["forward_mask", "sees_every_key"]


def sees_every_key(inp, lane: LaneCache) -> bool:
    """Whether every chunk row of ``inp`` (a ``LaneInput``, or anything with its ``grp``, ``start`` and
    ``one_group``) may attend to every cached key of ``lane`` and every chunk key (the attention rule of
    ``unmask.engine.attention`` on host metadata): the rows form one group, and each cached key is in that group or
    committed before the group starts. Then the lane's attention needs no mask."""
    grp = inp.grp
    one = inp.one_group if inp.one_group is not None else bool(grp.numel()) and bool((grp == grp[0]).all())
    if not one:
        return False
    if lane.length == 0:
        return True
    key = (lane.meta_version, int(grp[0]), int(inp.start[0]))  # the answer changes only with these (host values)
    memo = lane.sees_memo
    if memo is None or memo[0] != key:
        memo = lane.sees_memo = (key, bool(((lane.grp == grp[0]) | (lane.pos < inp.start[0])).all()))
    return memo[1]


def forward_mask(kv: BatchKV, pos: torch.Tensor, grp: torch.Tensor, start: torch.Tensor, committed: torch.Tensor,
                 valid: torch.Tensor) -> torch.Tensor:
    """The forward's ``[B, 1, Q, C + Q]`` bool mask (``unmask.engine.attention.build_attention_mask`` over the
    lanes' cached keys then the chunk's; the chunk's ``[B, Q]`` metadata on the device). In lane mode, when every
    row is real and sees every key of its lane (``kv.sees_all``, decided on the host) and every lane holds ``C``
    cached keys, that mask is all true: made as such, not built from the keys' metadata."""
    B, Q = pos.shape
    if kv.lane_mode and all(kv.sees_all) and all(q == Q for q in kv.rows) \
            and all(lane.length == kv.cached_len for lane in kv.lanes):
        return torch.ones(B, 1, Q, kv.cached_len + Q, dtype=torch.bool, device=pos.device)
    c_pos, c_grp, c_valid = kv.key_meta()
    return build_attention_mask(
        q_pos=pos, q_grp=grp, q_start=start, q_valid=valid,
        k_pos=torch.cat([c_pos, pos], 1), k_grp=torch.cat([c_grp, grp], 1),
        k_committed=torch.cat([c_valid, committed], 1), k_valid=torch.cat([c_valid, valid], 1),
    )
