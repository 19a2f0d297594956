"""Block refinement: LLaDA2.x's decoding rule, with LLaDA2.1's token editing as an option
(docs/design.md#decoding, "Block refinement"; the rule of diffusers' ``LLaDA2Pipeline`` with
``BlockRefinementScheduler``, diffusers 0.42).

Per block (blocks of ``block_size`` aligned to position 0, block-causal attention, the prompt's last partial block
decoded with its prompt positions fixed), with ``S`` steps per block (the request's ``steps`` split over the
blocks; unset: ``block_size``) and the commit schedule ``q_0..q_{S-1}`` = ``block_size`` spread evenly over the S
steps (``block_size // S`` each, the remainder to the first steps):

* every step forwards the block and samples a candidate for each of its generated positions (argmax at temperature
  0, else from the request's generator) with its confidence (its probability under the distribution it was drawn
  from: the softmax of the filtered logits, at the request's temperature when it samples);
* **commit**: among the block's masks, every candidate whose confidence is above ``threshold`` when there are at
  least ``q_t`` of them, else the ``q_t`` most confident (``t`` = the mask-steps taken, capped at S - 1);
* **editing** (``editing_threshold`` tau_e > 0, LLaDA2.1): every generated position of the block that held a token
  at the step's start takes its candidate when that differs and its confidence is above tau_e, in the same step;
* the block ends when a step that started with masks has taken S mask-steps, when a step that started without masks
  edited nothing (without editing: when it has no masks), or after ``max_post_steps`` + 1 steps without masks;
* the choice ends (``stop``) when a step's commits or edits hold an EOS id while every generated position before
  the first EOS holds a token; its tokens run to that EOS.

Tokens are final only when their block ends (or the choice finishes): with editing, the active block's tokens are
provisional, so the stop rules and the stream's text see only the finished blocks (:attr:`final_end`), and the
denoising events say where the provisional region starts (``StepEvent.final``). Earlier blocks never change, so
their KV is cached exactly as in plain block-causal decoding.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from .outputs import StepEvent
from .request import LaneInput
from .reveals import HostRows, to_host
from .sampler import RowGroup, draw_groups, filter_groups, prepare_groups, score_groups
from .sequence import Sequence, guided_rows
from .transfer import to_device

__all__ = ["RefinementSequence", "commit_schedule", "refine_batch"]


def commit_schedule(block_size: int, steps: int) -> list[int]:
    """``block_size`` commits spread over ``steps`` steps: ``block_size // steps`` each, the remainder one each to
    the first steps (``BlockRefinementScheduler.get_num_transfer_tokens``)."""
    base, rem = divmod(block_size, steps)
    return [base + (1 if i < rem else 0) for i in range(steps)]


class RefinementSequence(Sequence):
    """A choice decoded by block refinement (the module docstring). Same arguments as
    :class:`~unmask.engine.request.Request`; the plan carries ``editing_threshold`` and ``max_post_steps``.

    Attributes:
        mask_steps / post_steps: steps of the active block that started with / without masks.
        edits: tokens replaced by editing so far (all blocks).
    """

    def __init__(self, *args, **kwargs):
        self.mask_steps = self.post_steps = self.edits = 0
        super().__init__(*args, **kwargs)

    @property
    def editing(self) -> float | None:
        """The token-editing threshold, None when editing is off."""
        return self.plan.editing_threshold

    # ------------------------------------------------------------------ the block's rows
    def _block_positions(self) -> torch.Tensor:
        """The active block's generated positions (the rows whose candidates a step reads)."""
        a, e = self.active
        return torch.arange(max(a, self.prompt_len), e, device=self.device)

    def _steps_per_block(self) -> int:
        """S: the request's steps for this block, else ``block_size`` (the pipeline's one commit per step)."""
        if self.params.steps is None:
            return self.block_size
        return max(1, self.window_steps[self.win_idx])

    @property
    def final_end(self) -> int:
        """Canvas position where the provisional region starts: the active block's start while editing can still
        change it, else the whole canvas (revealed tokens are final)."""
        if self.editing and not self.finished and self.block_idx < len(self.blocks):
            return max(self.active[0], self.prompt_len)
        return self.length

    # ------------------------------------------------------------------ one step: inputs
    def lane_inputs(self) -> list[LaneInput]:
        """The active block (after the cached prefix), with every generated position's logits read."""
        a, e = self.active
        grp, start, committed = self._groups(a, e)
        out_pos = self._block_positions()
        inputs = []
        for lane in self.lanes:
            if self.cache_mode == "none":
                lo, commit_pos = 0, torch.empty(0, dtype=torch.long, device=self.device)
            else:
                lo = lane.cache.length
                commit_pos = torch.arange(lo, a, device=self.device)
            inputs.append(self._lane_input(lane, lo, e, a, out_pos, commit_pos, (grp, start, committed)))
        self._inputs = inputs
        return inputs

    # ------------------------------------------------------------------ one step: commits and edits
    def consume(self, logits: list[torch.Tensor], forbidden_ids: torch.Tensor
                ) -> tuple[StepEvent, list[torch.Tensor | None]]:
        """Sample every generated position of the block, commit and edit by the module docstring's rule: this
        sequence alone through :func:`refine_batch`."""
        spans, n = [], 0
        for t in logits:
            spans.append((n, n + int(t.shape[0])))
            n += int(t.shape[0])
        every = logits[0] if len(logits) == 1 else torch.cat(logits)
        return refine_batch([self], [spans], every, forbidden_ids)[0], [inp.commit for inp in self._inputs]

    def apply(self, positions: torch.Tensor, rows: HostRows) -> StepEvent:
        """Commit and edit from the step's candidates on the host (``rows``: one per block position, ``extra`` =
        the confidence), advance the block counters, check EOS and the stop rules."""
        candidates = torch.tensor(rows.tokens, dtype=torch.long)
        confidence = torch.tensor(rows.extra, dtype=torch.float32)  # float32 compares as the scheduler does
        current = self.canvas[positions]
        masked = current == self.dllm.mask_token_id
        had_masks = bool(masked.any())
        commit = self._commits(masked, confidence) if had_masks else torch.zeros_like(masked)
        edit = torch.zeros_like(masked)
        if self.editing:
            edit = ~masked & (candidates != current) & (confidence > self.editing)
        picked = (commit | edit).nonzero(as_tuple=True)[0]
        tokens = candidates[picked]
        self.edits += int(edit.sum())
        revealed = self.record(positions[picked].tolist(), rows.take(picked.tolist()))
        block, step = self.block_idx, self.step
        self.step += 1
        self.step_in_block += 1
        self.step_in_window += 1
        if had_masks:
            self.mask_steps += 1
        else:
            self.post_steps += 1
        if self._eos_finish(tokens) is not None:
            self._finish_at_eos()
        elif not self._block_continues(had_masks, bool(edit.any())):
            self._end_block()
        else:
            self._check_finished()
        return self.event(block, step, revealed)

    def _commits(self, masked: torch.Tensor, confidence: torch.Tensor) -> torch.Tensor:
        """``[n]`` bool: the masks committed this step (module docstring's commit rule)."""
        schedule = commit_schedule(self.block_size, self._steps_per_block())
        quota = schedule[min(self.mask_steps, len(schedule) - 1)]
        conf = confidence.masked_fill(~masked, float("-inf"))
        high = conf > (self.threshold if self.threshold is not None else float("inf"))
        if int(high.sum()) >= quota:
            return high
        out = torch.zeros_like(masked)
        k = min(quota, int(masked.sum()))
        if k:
            out[torch.topk(conf, k).indices] = True
        return out

    # ------------------------------------------------------------------ the end of a block, of the choice
    def _block_continues(self, had_masks: bool, edited: bool) -> bool:
        """``BlockRefinementScheduler.check_block_should_continue`` for one choice (a block with no masks left and
        no editing ends at once instead of taking the pipeline's one more, idle, forward)."""
        masks_left = bool((self.canvas[self._block_positions()] == self.dllm.mask_token_id).any())
        if had_masks:
            if self.mask_steps >= self._steps_per_block():
                return False
            return masks_left or bool(self.editing)
        if not self.editing or not edited:
            return False
        return self.post_steps <= self.plan.max_post_steps

    def _eos_finish(self, tokens: torch.Tensor) -> int | None:
        """The first EOS's generated position when this step's commits or edits hold an EOS id and every generated
        position before the first EOS holds a token (``check_eos_finished``), else None."""
        if not self.eos_ids or not any(int(t) in self.eos_ids for t in tokens.tolist()):
            return None
        gen = self.canvas[self.prompt_len: self.prompt_len + self.gen_len].tolist()
        first = next((i for i, t in enumerate(gen) if t in self.eos_ids), None)
        if first is None or self.dllm.mask_token_id in gen[:first]:
            return None
        return first

    def _finish_at_eos(self) -> None:
        """End the choice: its tokens are final up to the first EOS (the stop rules then see it)."""
        self._close_block_counters()
        self.block_idx = len(self.blocks)
        self.win_idx = len(self.windows)
        self._check_finished()

    def _close_block_counters(self) -> None:
        self.blocks_done_steps.append(self.step_in_block)
        self.mask_steps = self.post_steps = 0
        self.step_in_block = self.step_in_window = 0

    def _end_block(self) -> None:
        """The active block is done (its tokens final): move to the next one."""
        self._close_block_counters()
        self.win_idx += 1
        self.block_idx = self.windows[self.win_idx][0] if self.win_idx < len(self.windows) else len(self.blocks)
        self._check_finished()

    def _skip_empty_blocks(self) -> None:
        """Blocks end by the refinement rule (:meth:`_end_block`), not when their masks run out; only the stop rules
        apply here."""
        self._check_finished()

    def stop_scan_end(self) -> int:
        """The stop rules see the final region only: the revealed prefix before :attr:`final_end`."""
        return min(self.final_end, self.prompt_len + self.max_tokens)

    def event(self, block: int, step: int, revealed) -> StepEvent:
        """:meth:`Request.event` plus where the provisional region starts (``StepEvent.final``, generated
        positions; None once nothing is provisional)."""
        ev = super().event(block, step, revealed)
        final = self.final_end - self.prompt_len
        if not self.editing or self.finished or final >= self.max_tokens:
            return ev
        return replace(ev, final=max(0, final))


def refine_batch(seqs: list, spans: list[list[tuple[int, int]]], logits: torch.Tensor, forbidden_ids: torch.Tensor
                 ) -> list[StepEvent]:
    """One step of block refinement for many :class:`RefinementSequence` s: the candidates and confidences of every
    block position of all of them in one pass on the logits' device and one device-to-host copy, then each
    sequence's commits and edits on the host (:meth:`RefinementSequence.apply`).

    Args:
        spans: per sequence, per lane (cond, then uncond under CFG) its rows ``(start, end)`` in ``logits``.
        logits: ``[R, V]`` the step's needed rows (edited in place).
        forbidden_ids: ``[F]`` ids never generated.
    """
    cond, offsets = guided_rows(seqs, spans, logits)
    positions = [seq._block_positions() for seq in seqs]
    groups = [seq.row_group(pos, lo) for seq, pos, lo in zip(seqs, positions, offsets)]
    prepared = prepare_groups(cond, groups, forbidden_ids)  # steps 3-6 of sample_groups, the prepared logits kept
    filtered = filter_groups(prepared.clone(), groups)
    cands = score_groups(filtered, draw_groups(filtered, groups), groups)
    host = to_host(cands, extra=_confidence(prepared, cands.tokens, seqs, groups))  # the pass's one copy
    return [seq.apply(pos, host.rows(g.lo, g.hi)) for seq, pos, g in zip(seqs, positions, groups)]


def _confidence(prepared: torch.Tensor, tokens: torch.Tensor, seqs: list, groups: list[RowGroup]) -> torch.Tensor:
    """``[n]`` float32 probability of each row's candidate as ``BlockRefinementScheduler`` computes it: the float32
    softmax of the ``prepared`` logits (forbidden ids, bias and penalties applied), at the request's temperature and
    after top-k/top-p when it samples, unfiltered at temperature 0 (whose candidate is the argmax)."""
    sampled = [(seq, g) for seq, g in zip(seqs, groups) if seq.plan.sampling and g.n]
    if sampled:
        dev = prepared.device
        prepared = prepared.clone()
        rows = to_device(torch.cat([torch.arange(g.lo, g.hi) for _, g in sampled]), dev)
        temps = to_device(torch.cat([torch.full((g.n,), float(seq.plan.temperature)) for seq, g in sampled]), dev)
        prepared[rows] = prepared[rows] / temps.to(prepared.dtype)[:, None]
        prepared = filter_groups(prepared, [g for _, g in sampled])
    return torch.softmax(prepared, dim=-1).gather(-1, tokens[:, None].to(prepared.device))[:, 0]
