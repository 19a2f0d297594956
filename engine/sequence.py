"""One generation in flight: its canvas, blocks, step budget, lanes and the reveal/finish rules.

Layout of the canvas (DESIGN.md section 4): ``prompt (P) | generation region (G masks) | suffix (S)``, with G =
``max_tokens`` rounded up to whole blocks (for absolute alignment: up to the next multiple of ``block_size`` from
position 0, so that the prompt's last partial block is completed first), the last block cut short where the
model's context ends. Positions past ``max_tokens`` are decoded but never returned.
"""
from __future__ import annotations

import operator
import time
from dataclasses import dataclass, field

import torch

from .attention import canvas_groups
from .config import DllmConfig
from .detokenize import decode, find_stop, stream_safe
from .kv_cache import LaneCache
from .outputs import CompletionOutput, Revealed, StepEvent
from .plan import DecodingPlan
from .params import ParamError, SamplingParams
from .sampler import Candidates, reveal_count, select_reveals


def split_steps(total_steps: int, num_blocks: int) -> list[int]:
    """LLaDA's step budget split over blocks: as even as possible, remainder to the earliest blocks, at least one
    step per block (no divisibility requirement). ``split_steps(10, 4) == [3, 3, 2, 2]``."""
    if num_blocks <= 0:
        return []
    total_steps = max(total_steps, num_blocks)
    base, rem = divmod(total_steps, num_blocks)
    return [base + (1 if i < rem else 0) for i in range(num_blocks)]


@dataclass
class LaneInput:
    """What one lane forwards in one step.

    ``chunk`` = canvas positions forwarded (``[Q]`` int64; ascending, except that self-speculative fallback groups
    repeat draft positions); ``grp``/``start``/``committed`` their attention metadata; ``needed`` = chunk indices
    whose outputs are read (or -1 = use the lane's carry logits); ``commit`` = chunk indices whose KV is appended
    to the lane cache after the forward (``None``: decided after it, by self-speculative verification);
    ``replace_cache`` = drop the old cache first (Fast-dLLM refresh); ``carry_index`` = chunk index of the last
    committed token, whose output becomes the carry; ``feature_rows`` = chunk indices whose last hidden states
    the sequence reads after the forward (``[n]`` int64; a draft head's context), ``None`` = none.
    """

    tokens: torch.Tensor
    chunk: torch.Tensor
    grp: torch.Tensor
    start: torch.Tensor
    committed: torch.Tensor
    needed: torch.Tensor
    commit: torch.Tensor | None
    replace_cache: bool = False
    carry_index: int = -1
    feature_rows: torch.Tensor | None = None


@dataclass
class Lane:
    """A canvas variant of a sequence: ``cond`` (the canvas) or ``uncond`` (prompt masked, for CFG)."""

    kind: str
    cache: LaneCache = field(default_factory=LaneCache)


def _check_token_ids(name: str, ids, vocab_size: int) -> None:
    """Raise :class:`ParamError` naming ``name`` when an id is not in ``[0, vocab_size)`` (an id outside it would
    fail an index in the middle of a batched step and take the other requests of the batch down with it)."""
    for t in ids:
        try:
            ok = not isinstance(t, bool) and 0 <= operator.index(t) < vocab_size
        except TypeError:
            raise ParamError(name, f"token ids must be integers, got {t!r}") from None
        if not ok:
            raise ParamError(name, f"token id {t!r} is outside the vocabulary [0, {vocab_size})")


class Sequence:
    """State of one generation.

    Args:
        request_id: id used in events.
        prompt_ids: prompt token ids (already templated).
        params: resolved parameters (``with_defaults`` applied: temperature and seed set).
        dllm: the model's diffusion settings.
        tokenizer: for suffix tokenisation, stop strings and text.
        max_context: the model's context length in tokens.
        vocab_size: rows of the model's LM head; every token id the request carries (prompt, suffix ids,
            constraints, ``stop_token_ids``) must be below it. ``None`` = not checked.

    Raises:
        ParamError: a parameter that this model cannot honour (block size of a block-causal family, infilling on a
            causal model, canvas longer than the context, a constraint outside the region...).
    """

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams, dllm: DllmConfig,
                 tokenizer, max_context: int, device: torch.device | str = "cpu", vocab_size: int | None = None,
                 index: int = 0):
        if not prompt_ids:
            raise ParamError("prompt", "must contain at least one token")
        if vocab_size is not None:
            _check_token_ids("prompt", prompt_ids, vocab_size)
            _check_token_ids("stop_token_ids", params.stop_token_ids, vocab_size)
            _check_token_ids("constraints", list(params.constraints.values()), vocab_size)
            if isinstance(params.suffix, list):
                _check_token_ids("suffix", params.suffix, vocab_size)
        self.request_id = request_id
        self.index = index
        self.params = params
        self.dllm = dllm
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.prompt_ids = list(prompt_ids)
        P = self.prompt_len = len(prompt_ids)

        bs = params.block_size or dllm.block_size
        if dllm.fixed_block_size and params.block_size not in (None, dllm.block_size):
            raise ParamError("block_size", f"this {dllm.family} model decodes with its trained block size "
                                           f"{dllm.block_size} only, got {params.block_size}")
        self.block_size = bs
        causal = dllm.attention != "bidirectional"
        suffix_ids: list[int] = []
        if params.suffix is not None and params.suffix != "" and params.suffix != []:
            if causal:
                raise ParamError("suffix", f"infilling needs a bidirectional model; this model's attention is "
                                           f"{dllm.attention}")
            suffix_ids = (list(params.suffix) if isinstance(params.suffix, list)
                          else tokenizer.encode(params.suffix, add_special_tokens=False))
        if params.constraints and causal:
            raise ParamError("constraints", f"fixed-position constraints need a bidirectional model; this model's "
                                            f"attention is {dllm.attention}")

        self.origin = 0 if dllm.block_alignment == "absolute" else P
        self.max_tokens = params.max_tokens
        self.suffix_len = len(suffix_ids)
        room = max_context - self.suffix_len   # canvas positions available before the suffix
        plus_suffix = f" + suffix ({self.suffix_len})" if self.suffix_len else ""
        if P >= room:
            raise ParamError("prompt", f"the prompt ({P} tokens{plus_suffix}) leaves no room to generate in the "
                                       f"model's context of {max_context} tokens")
        if P + params.max_tokens > room:
            raise ParamError("max_tokens", f"prompt ({P} tokens) + max_tokens ({params.max_tokens}){plus_suffix} = "
                                           f"{P + params.max_tokens + self.suffix_len} exceeds the model's context of "
                                           f"{max_context} tokens; at most {room - P} new tokens fit")
        # whole blocks, except that the last block is cut short at the context edge (a request that fits in the
        # context is never refused because of the rounding)
        gen_end = min(self.origin - (-(P + params.max_tokens - self.origin) // bs) * bs, room)  # integer ceil
        self.gen_len = gen_end - P
        L = self.length = P + self.gen_len + self.suffix_len
        mask_id = dllm.mask_token_id
        canvas = torch.full((L,), mask_id, dtype=torch.long)
        canvas[:P] = torch.tensor(prompt_ids, dtype=torch.long)
        if suffix_ids:
            canvas[P + self.gen_len:] = torch.tensor(suffix_ids, dtype=torch.long)
        for pos, tok in params.constraints.items():
            canvas[P + int(pos)] = int(tok)
        self.canvas = canvas.to(self.device)
        self.logprobs = torch.zeros(self.gen_len, dtype=torch.float32)

        first_block_start = self.origin + ((P - self.origin) // bs) * bs
        self.blocks = [(s, min(s + bs, gen_end)) for s in range(first_block_start, gen_end, bs)]
        self.threshold = params.threshold
        # default steps = one per masked canvas position, window by window: max_tokens when it fills whole blocks
        # (DESIGN.md section 10), else max_tokens rounded up to the block; with ``max_tokens`` split evenly the
        # budget would be shared with the hidden positions of the last block (and a partial first block under
        # absolute alignment, or uneven sub-block windows, would get an even share), so some steps would reveal
        # more than one token
        # decoding windows: a block is revealed window by window (Fast-dLLM v2's sub-blocks; a window is the whole
        # block elsewhere); the step budget is split over the windows that hold generation positions
        self.window_size = min(params.sub_block_size or dllm.sub_block_size or bs, bs)
        self.windows: list[tuple[int, int, int]] = []  # (block index, start, end), generation positions only
        for b, (s, e) in enumerate(self.blocks):
            for ws in range(s, e, self.window_size):
                lo, hi = max(ws, P), min(ws + self.window_size, e)
                if lo < hi:
                    self.windows.append((b, lo, hi))
        if params.steps is None:  # one step per masked position of each window (its own count, not an even split)
            self.window_steps = [max(1, int((self.canvas[lo:hi] == mask_id).sum())) for _, lo, hi in self.windows]
        else:
            self.window_steps = split_steps(params.steps, len(self.windows))

        self.cache_mode = self._resolve_cache(params.cache)
        self.lanes = [Lane("cond", LaneCache(L))] + ([Lane("uncond", LaneCache(L))] if params.cfg_scale > 0 else [])
        self.generator = torch.Generator(device="cpu").manual_seed(int(params.seed or 0))
        eos = [] if params.ignore_eos else list(dllm.eos_token_ids)
        self.eos_ids = set(eos) | set(params.stop_token_ids)
        self.min_tokens_ids = torch.tensor(sorted(set(dllm.eos_token_ids) | set(params.stop_token_ids)),
                                           dtype=torch.long)

        self.win_idx = 0
        self.block_idx = 0
        self.step_in_block = 0
        self.step_in_window = 0
        self.step = 0
        self.nfe = 0
        self.finished = False
        self.finish_reason: str | None = None
        self.output_ids: list[int] = []
        self.text = ""
        self.stream_text = ""
        self.created = time.time()
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.blocks_done_steps: list[int] = []
        self.proposed_drafts = 0  # draft tokens verified / accepted (self-speculative decoding; 0 otherwise)
        self.accepted_drafts = 0
        self._prefix: list[int] = []  # revealed left-to-right prefix of the generated region (see _check_finished)
        self._checked = False
        self._skip_empty_blocks()

    # ------------------------------------------------------------------ setup helpers
    def _resolve_cache(self, mode: str) -> str:
        causal = self.dllm.attention != "bidirectional"
        if mode == "auto":
            return "exact" if causal else "none"
        if mode == "none":
            return "none"
        if causal:  # prefix/dual on a causal model: the exact cache is already a prefix cache
            return "exact"
        return mode  # prefix | dual on a bidirectional model (approximate, opt-in)

    def _window_masked(self) -> torch.Tensor:
        """Canvas positions of the current decoding window that are still masked (the positions predicted and
        revealed this step)."""
        _, s, e = self.windows[self.win_idx]
        pos = torch.arange(s, e, device=self.device)
        return pos[self.canvas[s:e] == self.dllm.mask_token_id]

    def _skip_empty_blocks(self) -> None:
        """Advance past windows without masks; entering a new block resets its step counter."""
        while self.win_idx < len(self.windows) and self._window_masked().numel() == 0:
            self.win_idx += 1
            self.step_in_window = 0
            block = self.windows[self.win_idx][0] if self.win_idx < len(self.windows) else len(self.blocks)
            if block != self.block_idx:
                if self.step_in_block:
                    self.blocks_done_steps.append(self.step_in_block)
                self.block_idx = block
                self.step_in_block = 0
        self._check_finished()

    def goto_block(self, b: int) -> None:
        """Make block ``b`` (its first decoding window) the active one, e.g. to replay a canvas whose earlier
        blocks were filled by the caller (the training-mask equality tests do this)."""
        self.win_idx = next(i for i, w in enumerate(self.windows) if w[0] == b)
        self.block_idx = b
        self.step_in_block = self.step_in_window = 0

    @property
    def active(self) -> tuple[int, int]:
        """The active group ``[start, end)`` (the current block; with absolute alignment it may start inside
        the prompt)."""
        return self.blocks[self.block_idx]

    # ------------------------------------------------------------------ one step: inputs
    def lane_inputs(self) -> list[LaneInput]:
        """What each lane forwards in the next step (see :class:`LaneInput`)."""
        a, e = self.active
        L = self.length
        masked = self._window_masked()
        grp, start, committed = canvas_groups(L, self.dllm.attention, a, a, e, self.block_size, self.origin,
                                              device=self.device)
        out_pos = masked - 1 if self.dllm.logit_shift else masked
        mode = self.cache_mode
        causal = self.dllm.attention != "bidirectional"
        inputs = []
        for lane in self.lanes:
            tokens = self.canvas
            if lane.kind == "uncond":
                tokens = self.canvas.clone()
                tokens[: self.prompt_len] = self.dllm.mask_token_id
            c = lane.cache.length
            replace = False
            if mode == "none":
                lo, hi = 0, (e if causal else L)
                commit_pos = torch.empty(0, dtype=torch.long, device=self.device)
            elif mode == "exact":
                lo, hi = c, e
                if self.dllm.logit_shift and c < a and masked.numel() == 1 and int(masked[0]) == a:
                    # only the block's first position is masked: its logits come from position a - 1 (committed,
                    # and committed tokens never attend to the active block), so the block need not be
                    # forwarded - block_size=1 then forwards one token per step, exactly like AR decoding
                    hi = a
                commit_pos = torch.arange(c, a, device=self.device)
            elif self.step_in_block == 0:  # prefix / dual refresh: full forward, cache around the block
                lo, hi, replace = 0, L, True
                commit_pos = torch.arange(0, a, device=self.device)
                if mode == "dual":
                    commit_pos = torch.cat([commit_pos, torch.arange(e, L, device=self.device)])
            else:
                lo = a
                hi = L if mode == "prefix" else e
                commit_pos = torch.empty(0, dtype=torch.long, device=self.device)
            chunk = torch.arange(lo, hi, device=self.device)
            needed = torch.where(out_pos >= lo, out_pos - lo, torch.full_like(out_pos, -1))
            if bool((needed < 0).any()) and lane.cache.carry_position != int(a - 1):
                raise RuntimeError(f"{self.request_id}: missing carry logits for position {a - 1}")  # pragma: no cover
            carry_index = (a - 1 - lo) if (self.dllm.logit_shift and lo <= a - 1 < hi and mode != "none") else -1
            inputs.append(LaneInput(tokens=tokens[lo:hi], chunk=chunk, grp=grp[lo:hi], start=start[lo:hi],
                                    committed=committed[lo:hi], needed=needed, commit=commit_pos - lo,
                                    replace_cache=replace, carry_index=carry_index))
        return inputs

    # ------------------------------------------------------------------ one step: reveal
    def masked_positions(self) -> torch.Tensor:
        """Canvas positions being predicted this step (the masked positions of the active block)."""
        return self._window_masked()

    def context_ids(self) -> torch.Tensor:
        """Prompt + revealed generated ids (for penalties)."""
        region = self.canvas[: self.prompt_len + self.gen_len]
        return region[region != self.dllm.mask_token_id]

    def min_tokens_rows(self, masked: torch.Tensor) -> torch.Tensor | None:
        """``[N]`` bool: masked positions where EOS/stop ids are forbidden by ``min_tokens``."""
        if not self.params.min_tokens:
            return None
        return (masked - self.prompt_len) < self.params.min_tokens

    def apply(self, cands: Candidates, masked: torch.Tensor) -> StepEvent:
        """Reveal the chosen candidates, advance the block/step counters, check EOS/stop/length.

        Args:
            cands: candidates for ``masked`` (``[N]`` canvas positions, the active block's masks).
        Returns:
            the step's :class:`StepEvent`.
        """
        steps_left = self.window_steps[self.win_idx] - self.step_in_window
        quota = None if self.threshold is not None else reveal_count(int(masked.numel()), steps_left)
        chosen = select_reveals(cands, quota, self.threshold)
        positions = masked[chosen]
        tokens = cands.tokens[chosen]
        self.canvas[positions] = tokens.to(self.canvas.device)
        rel = (positions - self.prompt_len).cpu()
        self.logprobs[rel] = cands.logprob[chosen].cpu()
        # positions past max_tokens (the rounding up to whole blocks) are decoded but never shown
        revealed = [Revealed(int(p), int(t), float(c), float(lp)) for p, t, c, lp in
                    zip(rel.tolist(), tokens.tolist(), cands.probability[chosen].tolist(),
                        cands.logprob[chosen].tolist()) if p < self.max_tokens]
        block = self.block_idx
        step = self.step
        self.step += 1
        self.step_in_block += 1
        self.step_in_window += 1
        self._skip_empty_blocks()
        return self.event(block, step, revealed)

    def event(self, block: int, step: int, revealed: list[Revealed]) -> StepEvent:
        """The :class:`StepEvent` of the state now (``output`` set once finished)."""
        return StepEvent(request_id=self.request_id, index=self.index, block=block, step=step, nfe=self.nfe,
                         revealed=revealed, canvas=self.canvas_view(), text=self.stream_text, finished=self.finished,
                         finish_reason=self.finish_reason, num_tokens=self.num_output_tokens,
                         drafts_proposed=self.proposed_drafts, drafts_accepted=self.accepted_drafts,
                         output=self.completion() if self.finished else None)

    @property
    def plan(self) -> DecodingPlan:
        """The resolved decoding plan (read-only)."""
        p = self.params
        speculative = bool(p.speculative)
        return DecodingPlan(speculative=speculative, block_size=self.block_size,
                            draft_block=self.block_size if speculative else None,
                            temperature=float(p.temperature or 0.0), threshold=p.threshold, seed=int(p.seed or 0),
                            top_k=p.top_k, top_p=p.top_p, steps=p.steps, remasking=p.remasking, cache=self.cache_mode,
                            cfg_scale=p.cfg_scale)

    def completion(self) -> CompletionOutput:
        """The choice's :class:`CompletionOutput` (final once finished; partial after an abort)."""
        ids = list(self.output_ids)
        lp = self.logprobs[: len(ids)].tolist() if self.params.logprobs else None
        speculative = bool(self.params.speculative)
        return CompletionOutput(
            index=self.index, text=self.text, token_ids=ids, finish_reason=self.finish_reason, logprobs=lp,
            steps=self.step, nfe=self.nfe, ended_by_eos=bool(ids) and ids[-1] in self.eos_ids,
            steps_per_block=list(self.blocks_done_steps), drafts_proposed=self.proposed_drafts,
            drafts_accepted=self.accepted_drafts, speculative=speculative,
            draft_block=self.block_size if speculative else None, first_token_time=self.first_token_time,
            finish_time=self.finish_time)

    def canvas_view(self) -> list[int | None]:
        """The first ``max_tokens`` generated positions: token id or ``None`` where masked."""
        region = self.canvas[self.prompt_len: self.prompt_len + self.max_tokens].tolist()
        m = self.dllm.mask_token_id
        return [None if t == m else t for t in region]

    def _check_finished(self) -> None:
        """EOS (every earlier position revealed), stop strings on the revealed prefix, ``max_tokens``."""
        if self.finished:
            return
        # the revealed left-to-right prefix only grows: scan from where the last call stopped, and skip the
        # re-decode when it did not grow (most steps of a block that is not decoded left to right)
        prefix = self._prefix
        start = self.prompt_len + len(prefix)
        rest = self.canvas[start: self.prompt_len + self.max_tokens]
        masks = (rest == self.dllm.mask_token_id).nonzero()
        n_new = int(masks[0, 0]) if masks.numel() else int(rest.numel())
        if n_new == 0 and self._checked and self.block_idx < len(self.blocks):
            return
        self._checked = True
        eos_hit = False
        for t in rest[:n_new].tolist():
            prefix.append(t)
            if t in self.eos_ids:
                eos_hit = True
                break
        complete = eos_hit or len(prefix) == self.max_tokens or self.block_idx >= len(self.blocks)
        text_ids = prefix[:-1] if eos_hit else prefix
        text = decode(self.tokenizer, text_ids)
        stops = self.params.stop
        # min_tokens (vLLM): no stop string counts before the output has min_tokens tokens
        min_tok = self.params.min_tokens
        after = len(decode(self.tokenizer, text_ids[:min_tok])) if min_tok and stops else 0
        checkable = bool(stops) and len(text_ids) >= min_tok
        idx, which = find_stop(text, stops, after) if checkable else (-1, None)
        if idx >= 0:
            # fewest tokens whose text contains the stop string
            n = len(text_ids)
            for k in range(max(1, min_tok), len(text_ids) + 1):
                if find_stop(decode(self.tokenizer, text_ids[:k]), [which], after)[0] >= 0:
                    n = k
                    break
            self._finish("stop", text_ids[:n], text[:idx])
            return
        if complete:
            self._finish("stop" if eos_hit else "length", prefix, text)
            return
        safe = stream_safe(text, stops)
        if len(safe) > len(self.stream_text) and safe.startswith(self.stream_text):
            self.stream_text = safe
            if self.first_token_time is None:
                self.first_token_time = time.time()

    def _finish(self, reason: str, ids: list[int], text: str) -> None:
        self.output_ids = list(ids)  # before `finished`: another thread reading num_output_tokens sees both
        self.finished = True
        self.finish_reason = reason
        self.text = text
        if len(text) > len(self.stream_text):
            if self.first_token_time is None and text:
                self.first_token_time = time.time()
        self.stream_text = text
        self.finish_time = time.time()

    def final_event(self) -> StepEvent:
        """The last event of a sequence that finished without a further step."""
        return self.event(self.block_idx, self.step, [])

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far: ``len(output_ids)`` once finished, else the revealed left-to-right prefix (what a
        stream has shown; an abort keeps exactly these). Safe to read from another thread: CPython ``len`` of a
        list the engine thread appends to is atomic."""
        return len(self.output_ids) if self.finished else len(self._prefix)

    def abort(self) -> StepEvent:
        """Cancel: mark finished with ``abort`` and free the lane caches. ``output_ids`` / ``text`` keep what was
        generated so far: the revealed left-to-right prefix (what a stream has shown), as vLLM returns the partial
        output of an aborted request (usage and the request log count it)."""
        self.output_ids = list(self._prefix)  # before `finished` (see num_output_tokens)
        self.finished = True
        self.finish_reason = "abort"
        self.text = self.stream_text
        self.finish_time = time.time()
        for lane in self.lanes:
            lane.cache.clear()
        return self.event(self.block_idx, self.step, [])

    def release(self) -> None:
        """Free cached KV (called when the sequence leaves the batch)."""
        for lane in self.lanes:
            lane.cache.clear()

    def cache_bytes(self) -> int:
        """Bytes of KV held by this sequence's lanes."""
        return sum(lane.cache.nbytes() for lane in self.lanes)
