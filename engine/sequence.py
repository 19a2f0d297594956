"""Plain denoising: the block-wise iterative unmasking strategy of a :class:`~unmask.engine.request.Request`
(docs/design.md#decoding, steps 1-8).

Each step forwards the active block (and what the cache mode needs around it), takes the logits of its masked
positions (after CFG: ``l = l_u + (1 + s)(l_c - l_u)``, LLaDA), draws a candidate per position
(``unmask.engine.sampler``) and reveals a quota of them (LLaDA's ``ceil(masked / steps left)``) or every one above
the threshold (Fast-dLLM), window by window. Shapes: logits ``[N, V]`` float32 for the N masked positions.
"""
from __future__ import annotations

import functools

import numpy as np
import torch

from .attention import canvas_groups
from .outputs import StepEvent
from .request import LaneInput, Request
from .reveals import HostRows, to_host
from .transfer import to_device
from .reveal_rule import reveal_count, select_segments
from .sampler import (Candidates, RowGroup, classifier_free_guidance, forced_candidates, prepare_groups,
                      sample_groups)

__all__ = ["Sequence", "block_metadata", "chunk_metadata", "guided_rows"]


def guided_rows(seqs: list, spans: list[list[tuple[int, int]]], logits: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """The conditional rows of ``seqs`` one after another, CFG applied where a sequence has two lanes (LLaDA:
    ``l = l_u + (1 + s)(l_c - l_u)``, one indexed write for all of them).

    Args:
        spans: per sequence, per lane (cond, then uncond) its rows ``(start, end)`` in ``logits`` (``[R, V]``).

    Returns:
        ``[n, V]`` rows (a view of ``logits`` when the cond rows are one run, edited in place) and each sequence's
        first row in them.
    """
    dev = logits.device
    cond_idx: list[int] = []
    cfg_rows, cfg_uncond, cfg_scale, offsets = [], [], [], []
    n = 0
    for seq, lane_spans in zip(seqs, spans):
        c0, c1 = lane_spans[0]
        k = c1 - c0
        offsets.append(n)
        cond_idx.extend(range(c0, c1))
        if len(lane_spans) == 2:
            u0, _ = lane_spans[1]
            cfg_rows.extend(range(n, n + k))
            cfg_uncond.extend(range(u0, u0 + k))
            cfg_scale.extend([1.0 + float(seq.params.cfg_scale)] * k)
        n += k
    run = not cond_idx or cond_idx == list(range(cond_idx[0], cond_idx[0] + n))
    if run and not cfg_rows:  # the usual step: a view, no index tensor to copy to the device
        first = cond_idx[0] if cond_idx else 0
        return logits[first: first + n], offsets
    idx = to_device(torch.tensor(([] if run else cond_idx) + cfg_rows + cfg_uncond, dtype=torch.long), dev)
    first = cond_idx[0] if cond_idx else 0
    cond = logits[first: first + n] if run else logits[idx[:n]]  # one run: a view
    if cfg_rows:
        m = len(cfg_rows)
        rows, uncond = idx[-2 * m: -m], logits[idx[-m:]]
        scale = to_device(torch.tensor(cfg_scale, dtype=cond.dtype), dev)[:, None]
        cond[rows] = uncond + scale * (cond[rows] - uncond)
    return cond, offsets


class SharedMasks(tuple):
    """:func:`block_metadata`'s ``(grp, start, committed)``, with the ``key`` it was built from."""

    key: tuple


@functools.lru_cache(maxsize=512)
def block_metadata(length: int, attention: str, a: int, e: int, block_size: int, origin: int) -> SharedMasks:
    """:func:`~unmask.engine.attention.canvas_groups` (host, ``[L]`` each) of a canvas of ``length`` whose
    block ``[a, e)`` is active and everything before it committed: a function of these numbers alone, so built once
    and shared by the steps of a block and every sequence of that shape (read-only)."""
    masks = SharedMasks(canvas_groups(length, attention, a, a, e, block_size, origin))
    masks.key = (length, attention, a, e, block_size, origin)
    return masks


def _slice_chunk(masks: tuple[torch.Tensor, torch.Tensor, torch.Tensor], lo: int, hi: int, commit_pos
                 ) -> tuple[torch.Tensor, ...]:
    """Rows ``lo:hi``: ``[Q]`` positions, ``masks`` sliced to them and the ``[C]`` chunk indices of
    ``commit_pos`` (a tensor of positions, ``(c, a)`` = positions ``c..a-1``, ``None`` = none)."""
    if commit_pos is None:
        commit = torch.empty(0, dtype=torch.long)
    elif isinstance(commit_pos, tuple):
        commit = torch.arange(commit_pos[0] - lo, commit_pos[1] - lo)
    else:
        commit = commit_pos - lo
    grp, start, committed = masks
    return torch.arange(lo, hi), grp[lo:hi], start[lo:hi], committed[lo:hi], commit


@functools.lru_cache(maxsize=4096)
def chunk_metadata(key: tuple, lo: int, hi: int, commit_pos: tuple[int, int] | None) -> tuple[torch.Tensor, ...]:
    """:func:`_slice_chunk` of :func:`block_metadata` ``(*key)`` and whether its rows are one attention group:
    shared like it (read-only)."""
    chunk, grp, start, committed, commit = _slice_chunk(block_metadata(*key), lo, hi, commit_pos)
    return chunk, grp, start, committed, commit, bool(grp.numel()) and bool((grp == grp[0]).all())


class Sequence(Request):
    """A choice decoded by plain denoising (the :class:`~unmask.engine.request.DecodingStrategy` protocol).

    Same arguments as :class:`~unmask.engine.request.Request`.
    """

    # ------------------------------------------------------------------ one step: inputs
    def lane_inputs(self) -> list[LaneInput]:
        """What each lane forwards in the next step (see :class:`LaneInput`)."""
        a, e = self.active
        L = self.length
        masked, at = self._masked_window()
        self._step_masked = (self.step, masked)  # the step's masked positions (read again by its reveal pass)
        masks = self._groups(a, e)
        out_pos = at - 1 if self.dllm.logit_shift else at
        mode = self.cache_mode
        causal = self.dllm.attention != "bidirectional"
        inputs = []
        for lane in self.lanes:
            c = lane.cache.length
            replace = False
            if mode == "none":
                lo, hi = 0, (e if causal else L)
                commit_pos = None
            elif mode == "exact":
                lo, hi = c, e
                if self.dllm.logit_shift and c < a and len(out_pos) == 1 and int(out_pos[0]) == a - 1:
                    # only the block's first position is masked: its logits come from position a - 1 (committed,
                    # and committed tokens never attend to the active block), so the block need not be
                    # forwarded - block_size=1 then forwards one token per step, exactly like AR decoding
                    hi = a
                commit_pos = (c, a)
            elif self.step_in_block == 0:  # prefix / dual refresh: full forward, cache around the block
                lo, hi, replace = 0, L, True
                commit_pos = (0, a)  # positions 0..a-1 (a range: the chunk metadata is shared, chunk_metadata)
                if mode == "dual":
                    commit_pos = torch.cat([torch.arange(0, a, device=self.device),
                                            torch.arange(e, L, device=self.device)])
            else:
                lo = a
                hi = L if mode == "prefix" else e
                commit_pos = None
            inputs.append(self._lane_input(lane, lo, hi, a, out_pos, commit_pos, masks, replace))
        self._inputs = inputs
        return inputs

    def _lane_input(self, lane, lo: int, hi: int, a: int, out_pos, commit_pos,
                    masks: tuple[torch.Tensor, torch.Tensor, torch.Tensor], replace: bool = False) -> LaneInput:
        """The :class:`LaneInput` of ``lane`` forwarding rows ``lo:hi`` (shared by :meth:`lane_inputs` and the
        multi-block variant): the lane's tokens (the unconditional lane's prompt masked), the rows whose logits are
        needed (``out_pos``: ``[N]`` int64 host array or tensor, ascending; -1 = the carried logits of position
        ``a - 1``), the positions to commit to the cache (``commit_pos``: a tensor of positions, ``(c, a)`` =
        positions ``c..a-1``, ``None`` = none) and the canvas's attention metadata ``masks`` = (groups, starts,
        committed) sliced to the rows (:meth:`_chunk_meta`: shared when ``masks`` are :meth:`_groups`')."""
        if isinstance(out_pos, torch.Tensor):
            out_pos = out_pos.numpy()
        tokens = self.canvas
        if lane.kind == "uncond":
            tokens = self.canvas.clone()
            tokens[: self.prompt_len] = self.dllm.mask_token_id
        if len(out_pos) and int(out_pos[0]) < lo and lane.cache.carry_position != int(a - 1):
            raise RuntimeError(f"{self.request_id}: missing carry logits for position {a - 1}")  # pragma: no cover
        needed = torch.from_numpy(np.maximum(out_pos - lo, -1))  # out_pos ascending: only its first rows precede
        carry_index = (a - 1 - lo) if (self.dllm.logit_shift and lo <= a - 1 < hi and self.cache_mode != "none") else -1
        chunk, grp, start, committed, commit, one_group = self._chunk_meta(lo, hi, masks, commit_pos)
        return LaneInput(tokens=tokens[lo:hi], chunk=chunk, grp=grp, start=start, committed=committed, needed=needed,
                         commit=commit, replace_cache=replace, carry_index=carry_index, one_group=one_group)

    def _chunk_meta(self, lo: int, hi: int, masks: tuple[torch.Tensor, torch.Tensor, torch.Tensor], commit_pos
                    ) -> tuple[torch.Tensor, ...]:
        """Rows ``lo:hi``'s positions, ``masks`` sliced to them, the chunk indices of ``commit_pos`` (see
        :meth:`_lane_input`) and whether the rows are one attention group (``None``: not looked at); shared by
        every sequence of the same canvas shape when ``masks`` are :meth:`_groups`' (:func:`chunk_metadata`)."""
        key = getattr(masks, "key", None)
        if key is not None and not isinstance(commit_pos, torch.Tensor):
            return chunk_metadata(key, lo, hi, commit_pos)
        return (*_slice_chunk(masks, lo, hi, commit_pos), None)

    def variant_rows(self, inp: LaneInput) -> torch.Tensor | None:
        """Plain denoising never runs the model's row variant."""
        return None

    def consume(self, logits: list[torch.Tensor], forbidden_ids: torch.Tensor
                ) -> tuple[StepEvent, list[torch.Tensor | None]]:
        """CFG, sampling and reveals of one step (``logits[i]``: ``[N, V]`` of lane i's needed rows); every lane
        commits what :meth:`lane_inputs` said. The batched step (``unmask.engine.batch_step``) does the same for
        many unconstrained sequences in one pass; this is the one-sequence path (grammar-constrained steps)."""
        cond = logits[0]
        if len(logits) == 2:
            cond = classifier_free_guidance(cond, logits[1], self.params.cfg_scale)
        masked = self.masked_positions()
        group = self.row_group(masked, 0)
        # constrained: a left-to-right chain under the grammar (docs/design.md#constrained-decoding)
        if self.grammar is not None:
            return self.apply_constrained(cond, masked, group, forbidden_ids), [inp.commit for inp in self._inputs]
        cands = sample_groups(cond, [group], forbidden_ids)
        return self.apply(cands, masked), [inp.commit for inp in self._inputs]

    def row_group(self, masked: torch.Tensor, lo: int) -> RowGroup:
        """This step's :class:`~unmask.engine.sampler.RowGroup` for rows ``[lo, lo + N)`` predicting the
        ``[N]`` (host) ``masked`` positions: parameters, counter-based draws keyed by those positions,
        ``min_tokens`` rows, penalties' context and ``logit_bias``."""
        p = self.params
        penalised = p.presence_penalty != 0 or p.frequency_penalty != 0 or p.repetition_penalty != 1.0
        return RowGroup(lo, lo + int(masked.numel()), p, self.draws(masked), self.min_tokens_rows(masked),
                        self.min_tokens_ids, self.context_ids() if penalised else None, self.logit_bias)

    def apply_constrained(self, logits: torch.Tensor, masked: torch.Tensor, group: RowGroup,
                          forbidden_ids: torch.Tensor) -> StepEvent:
        """One constrained step: :func:`~unmask.engine.grammar_sampling.sample_chain` over the window's masked
        positions (``[N]``, ascending; every generated position before the first is revealed), revealing the kept
        leading run."""
        from .constraints import forced_run
        from .grammar_sampling import sample_chain

        if int(masked[0]) - self.prompt_len != self.grammar.consumed:  # pragma: no cover - an invariant
            raise RuntimeError(f"{self.request_id}: constrained reveals left a gap before position {int(masked[0])}")
        steps_left = self.window_steps[self.win_idx] - self.step_in_window
        quota = None if self.threshold is not None else reveal_count(int(masked.numel()), steps_left)
        cands = sample_chain(prepare_groups(logits, [group], forbidden_ids), self.grammar, self.params,
                             group.draws, quota, self.threshold)
        k = int(cands.tokens.numel())
        nxt = int(masked[k - 1]) + 1  # every position after the chain is masked (the revealed region is a prefix)
        forced = forced_run(self.grammar, self.prompt_len + self.gen_len - nxt)
        if forced:  # forced tokens past the chain (and past the window) are final at once: probability 1
            cands = Candidates.cat([cands, forced_candidates(forced, cands)])
        positions = torch.cat([masked[:k], torch.arange(nxt, nxt + len(forced))])
        return self.reveal(positions, to_host(cands))

    def masked_positions(self) -> torch.Tensor:
        """Canvas positions being predicted this step (the masked positions of the active window; ``[N]`` int64,
        host): those :meth:`lane_inputs` found, when it ran for this step (the canvas changes only at a reveal)."""
        memo = getattr(self, "_step_masked", None)
        if memo is not None and memo[0] == self.step:
            return memo[1]
        return self._window_masked()

    def _groups(self, a: int, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:func:`~unmask.engine.attention.canvas_groups` of the canvas with ``[a, e)`` active (read-only: shared
        by every sequence of the same canvas shape and block, :func:`block_metadata`)."""
        return block_metadata(self.length, self.dllm.attention, a, e, self.block_size, self.origin)

    def min_tokens_rows(self, masked: torch.Tensor) -> torch.Tensor | None:
        """``[N]`` bool: masked positions where EOS/stop ids are forbidden by ``min_tokens``."""
        if not self.params.min_tokens:
            return None
        return (masked - self.prompt_len) < self.params.min_tokens

    def reveal_segments(self, masked: torch.Tensor) -> list[tuple[int, int, int | None, float | None]]:
        """The reveal rule of this step over its ``[N]`` masked rows: ``(lo, hi, quota, threshold)`` per segment
        (:func:`~unmask.engine.reveal_rule.select_segments`): one, the window's quota or threshold."""
        steps_left = self.window_steps[self.win_idx] - self.step_in_window
        n = int(masked.numel())
        quota = None if self.threshold is not None else reveal_count(n, steps_left)
        return [(0, n, quota, self.threshold)]

    def apply(self, cands: Candidates, masked: torch.Tensor) -> StepEvent:
        """Reveal by the quota / threshold rule (:meth:`reveal_segments`) among ``cands`` for ``masked``
        (``[N]`` canvas positions, the active window's masks) and advance (:meth:`reveal`)."""
        segments = self.reveal_segments(masked)
        return self.reveal(masked, to_host(cands, select_segments(cands, segments)), segments)

    def reveal(self, masked: torch.Tensor, rows: HostRows, segments: list | None = None) -> StepEvent:
        """Write the chosen rows of ``rows`` (the step's candidates for ``masked``, on the host; in the order of
        :meth:`~unmask.engine.reveals.HostRows.picked` for the step's ``segments``, ascending without), advance
        the block/step counters, check EOS/stop/length; returns the step's :class:`StepEvent` (None for a
        :attr:`~unmask.engine.request.Request.final_only` choice that did not finish)."""
        picked = rows.picked(segments) if segments else [i for i, c in enumerate(rows.chosen) if c]
        memo = self._masked_memo
        at = (memo[2] if memo is not None and memo[1] is masked else masked).tolist()
        revealed = self.record([at[i] for i in picked], rows.take(picked))
        block = self.block_idx
        step = self.step
        self.step += 1
        self.step_in_block += 1
        self.step_in_window += 1
        if segments and len(picked) < int(masked.numel()):  # ``masked`` is the window's: masks are left in it
            self._check_finished()
        else:
            self._skip_empty_blocks()
        if self.final_only and not self.finished:
            return None  # nobody reads it (Request.final_only)
        return self.event(block, step, revealed)
