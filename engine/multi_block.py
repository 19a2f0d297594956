"""Multi-block decoding: several blocks denoised at once, each joining when its predecessor is far enough along
(docs/design.md#the-seeds-methods; D2F, Wang et al. 2025, arXiv:2508.09192, and d3LLM's multi-block decoding, arXiv
2601.07568: "the next block becomes active once the current one is a given fraction decoded").

Rule (``SamplingParams.multi_block = f``, f in (0, 1]):

* Block 0 is active at the start. After every step, when the *last* active block has revealed at least ``f`` of
  its generation positions, the next block becomes active (it takes part from the next step on). At most one
  block joins per step (a newly joined block has revealed nothing, and f > 0).
* Every active block with masks reveals in every step: its own quota ``ceil(masks left / its steps left)`` from its
  own step budget (``CanvasLayout.window_steps``), or in threshold mode ``{p >= tau} U {its best}``.
* Attention among the active blocks is block-causal: a later active block sees the earlier active blocks' current
  tokens (masks included), an earlier one never sees a later one. With the one mask rule
  (``unmask.engine.attention``) this is each active block its own group and the earlier active blocks flagged
  ``committed`` *in this forward's metadata only*.
* KV is committed only for the prefix of finished blocks: a block is appended to the cache in the forward after it
  and every block before it are complete, computed causally from final tokens. A later block's keys/values
  computed while an earlier block was unfinished are never kept (``tests/engine/test_multi_block.py``).
* ``f = 1.0`` is single-block decoding exactly: a block joins only when its predecessor is complete, when that one
  leaves the active set, so one block is ever active and every forward equals :class:`Sequence`'s.

Only for ``prefix_causal`` / ``block_causal`` models (a bidirectional canvas has no block order to stagger) with
whole-block windows (``unmask.engine.plan`` refuses the rest, naming ``multi_block``).
Shapes: as :mod:`unmask.engine.sequence`.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from .attention import canvas_groups
from .outputs import StepEvent
from .request import LaneInput
from .reveals import HostRows
from .reveal_rule import reveal_count
from .sequence import Sequence

__all__ = ["MultiBlockSequence"]


class MultiBlockSequence(Sequence):
    """A choice decoded with several active blocks (see the module docstring). Same arguments as
    :class:`~unmask.engine.request.Request`; the plan carries ``multi_block``.

    Attributes:
        last_active: index of the last active block (``block_idx`` is the first).
        block_steps: ``[n_blocks]`` steps each block has taken part in.
        active_history: the active blocks of every step taken (for tests and the denoising stream).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fraction = float(self.plan.multi_block)
        self.last_active = self.block_idx
        self.block_steps = [0] * len(self.blocks)
        self.active_history: list[list[int]] = []
        self._block_gen = [self._gen_range(b) for b in range(len(self.blocks))]

    # ------------------------------------------------------------------ blocks
    def _gen_range(self, b: int) -> tuple[int, int]:
        """``[lo, hi)`` generation positions of block b (its single window)."""
        _, lo, hi = self.windows[b]
        return lo, hi

    def _masked_in(self, b: int) -> torch.Tensor:
        """``[n]`` int64 (host): block b's masked generation positions, ascending."""
        lo, hi = self._block_gen[b]
        return torch.from_numpy(np.flatnonzero(self.host_canvas()[lo:hi] == self.dllm.mask_token_id) + lo)

    def _masks_left(self, b: int) -> int:
        """How many of block b's generation positions are masked."""
        lo, hi = self._block_gen[b]
        return int(np.count_nonzero(self.host_canvas()[lo:hi] == self.dllm.mask_token_id))

    def active_blocks(self) -> list[int]:
        """Indices of the blocks active in the next step."""
        if self.block_idx >= len(self.blocks):
            return []
        return list(range(self.block_idx, max(self.last_active, self.block_idx) + 1))

    def masked_positions(self) -> torch.Tensor:
        """Masked positions of every active block, in canvas order."""
        parts = [self._masked_in(b) for b in self.active_blocks()]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long, device=self.device)

    # ------------------------------------------------------------------ one step: inputs
    def lane_inputs(self) -> list[LaneInput]:
        """One active block: exactly :meth:`Sequence.lane_inputs`. Several: the rows from the first uncached
        position to the last active block's end, the active blocks block-causal (module docstring)."""
        active = self.active_blocks()
        if len(active) <= 1:
            return super().lane_inputs()
        a, e0 = self.blocks[active[0]]
        e = self.blocks[active[-1]][1]
        L = self.length
        grp, start, committed = canvas_groups(L, self.dllm.attention, a, a, e0, self.block_size, self.origin,
                                              device=self.device)
        for j, b in enumerate(active[1:], start=1):
            s_b, e_b = self.blocks[b]
            grp[s_b:e_b] = 2 * L + 1 + j
            start[s_b:e_b] = s_b
        # mask metadata only: the later active blocks see the earlier ones; nothing here is appended to the cache
        committed = committed.clone()
        committed[a:self.blocks[active[-1]][0]] = True
        masked = self.masked_positions()
        out_pos = masked.numpy() - 1 if self.dllm.logit_shift else masked.numpy()
        inputs = []
        for lane in self.lanes:
            c = lane.cache.length
            lo = 0 if self.cache_mode == "none" else c
            commit_pos = (c, a) if self.cache_mode != "none" else None
            inputs.append(self._lane_input(lane, lo, e, a, out_pos, commit_pos, (grp, start, committed)))
        self._inputs = inputs
        return inputs

    # ------------------------------------------------------------------ one step: reveals
    def reveal_segments(self, masked: torch.Tensor) -> list[tuple[int, int, int | None, float | None]]:
        """One segment per active block with masks (its rows of ``masked`` are contiguous: ascending
        positions): its own quota from its own step budget, or the threshold rule."""
        segments = []
        at = masked.numpy()
        for b in self.active_blocks():
            lo, hi = self._block_gen[b]
            r0, r1 = int(np.searchsorted(at, lo)), int(np.searchsorted(at, hi))
            if r1 == r0:
                continue
            steps_left = max(1, self.window_steps[b] - self.block_steps[b])
            quota = None if self.threshold is not None else reveal_count(r1 - r0, steps_left)
            segments.append((r0, r1, quota, self.threshold))
        return segments

    def reveal(self, masked: torch.Tensor, rows: HostRows, segments: list | None = None) -> StepEvent:
        """Reveal the chosen rows in every active block, then let the next block join and the finished ones
        leave. ``rows`` are the step's candidates for ``masked`` (:meth:`masked_positions`)."""
        active = self.active_blocks()
        self.active_history.append(active)
        at = masked.numpy()
        for b in active:
            lo, hi = self._block_gen[b]
            if int(np.searchsorted(at, hi)) > int(np.searchsorted(at, lo)):
                self.block_steps[b] += 1
        picked = rows.picked(segments) if segments else [i for i, c in enumerate(rows.chosen) if c]
        listed = at.tolist()
        revealed = self.record([listed[i] for i in picked], rows.take(picked))
        block, step = self.block_idx, self.step
        self.step += 1
        self._advance()
        return self.event(block, step, revealed)

    def _advance(self) -> None:
        """Let the next block join (module docstring), then move ``block_idx`` past the finished blocks."""
        n = len(self.blocks)
        last = self.last_active
        if last + 1 < n:
            lo, hi = self._block_gen[last]
            done = (hi - lo) - self._masks_left(last)
            if done >= math.ceil(self.fraction * (hi - lo) - 1e-9):
                self.last_active = last + 1
        while self.block_idx < n and self._masks_left(self.block_idx) == 0:
            self.blocks_done_steps.append(self.block_steps[self.block_idx])
            self.block_idx += 1
        if self.block_idx < n:
            self.win_idx = self.block_idx
            self.last_active = max(self.last_active, self.block_idx)
            self.step_in_block = self.block_steps[self.block_idx]
            self.step_in_window = self.step_in_block
        else:
            self.win_idx = len(self.windows)
        self._check_finished()
