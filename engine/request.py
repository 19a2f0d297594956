"""One choice of a request in flight: its state, and the protocol its decoding strategy implements.

State (:class:`Request`), all on the host (docs/design.md#devices): the canvas (``[L]`` int64, CPU, layout in
``unmask.engine.layout``; the forward's inputs are copied to the model's device by the denoiser), the
per-position log-probabilities (``[G]`` float32), the lanes (``cond``, and ``uncond`` under CFG, each with its KV
cache, whose keys and values live on the model's device), the seed of its counter-based draws
(``unmask.engine.noise``), the block/window/step counters, timing, and the finish state
(``unmask.engine.stopping``). The engine thread alone writes it; other
threads read only :meth:`Request.num_output_tokens` and the output objects.

Strategy protocol (:class:`DecodingStrategy`): the denoiser calls exactly these and never looks at the type:

* ``lane_inputs()`` -> one :class:`LaneInput` per lane: the rows to forward;
* ``prefill_inputs(budget)`` / ``pending_prompt_rows()`` / ``pending_prompt_cost(budget)`` -> a prompt chunk
  instead of a step (chunked prefill, :class:`Request`'s for every strategy) / the prompt rows its first step
  still has to forward, in rows / in row-equivalents (:class:`~unmask.engine.prefill_cost.PrefillBudget`);
* ``variant_rows(inp)`` -> ``[Q]`` bool of the chunk rows that run the model's row variant, or ``None``;
* ``consume(logits, forbidden_ids)`` -> ``(StepEvent, commits)``: take the ``[N, V]`` logits of each
  lane's needed rows, reveal tokens, and say which chunk indices of each lane are committed to its KV cache.

Plain denoising (``unmask.engine.sequence.Sequence``) and self-speculative decoding
(``unmask.engine.speculative.SpeculativeSequence``) are the two implementations.

Errors: :class:`~unmask.engine.limits.ParamError` naming the field (a token id outside the vocabulary, a canvas
longer than the context...).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from .attention import canvas_groups
from .config import DllmConfig
from .kv_cache import LaneCache
from .layout import build_layout
from .limits import ParamError, check_block_use
from .noise import Draws
from .outputs import CompletionOutput, Revealed, StepEvent, filled, revealed_token
from .plan import DecodingPlan
from .prefill_cost import PrefillBudget
from .reveals import HostRows
from .stopping import StopChecker
from .text_ids import check_no_mask, check_sampleable, check_token_ids, suffix_ids


@dataclass
class LaneInput:
    """What one lane forwards in one step.

    ``chunk`` = canvas positions forwarded (``[Q]`` int64; ascending, except that self-speculative fallback groups
    repeat draft positions); ``grp``/``start``/``committed`` their attention metadata; ``needed`` = chunk indices
    whose outputs are read (or -1 = use the lane's carry logits); ``commit`` = chunk indices whose KV is appended
    to the lane cache after the forward (``None``: decided by the strategy's ``consume``);
    ``replace_cache`` = drop the old cache first (Fast-dLLM refresh); ``carry_index`` = chunk index of the last
    committed token, whose output becomes the carry; ``lane`` = the lane it feeds (``None``: its position in the
    list; set by prompt chunks that leave a lane out); ``one_group`` = whether every chunk row is in one attention
    group (``None``: not known, the denoiser looks).
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
    lane: int | None = None
    one_group: bool | None = None


@dataclass
class Lane:
    """A canvas variant of a sequence: ``cond`` (the canvas) or ``uncond`` (prompt masked, for CFG)."""

    kind: str
    cache: LaneCache = field(default_factory=LaneCache)


class DecodingStrategy(Protocol):
    """What the denoiser calls on every request (see the module docstring)."""

    lanes: list[Lane]
    nfe: int

    def lane_inputs(self) -> list[LaneInput]: ...

    def prefill_inputs(self, budget: PrefillBudget) -> list[LaneInput] | None: ...

    def pending_prompt_rows(self) -> int: ...

    def pending_prompt_cost(self, budget: PrefillBudget) -> float: ...

    def variant_rows(self, inp: LaneInput) -> torch.Tensor | None: ...

    def consume(self, logits: list[torch.Tensor], forbidden_ids: torch.Tensor
                ) -> tuple[StepEvent, list[torch.Tensor | None]]: ...


def bias_tensors(logit_bias: dict[int, float] | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``logit_bias`` as ``([K] int64 ids, [K] float32 biases)`` for :func:`~unmask.engine.sampler.add_bias`;
    ``None`` when empty."""
    if not logit_bias:
        return None
    ids = sorted(logit_bias)
    return (torch.tensor(ids, dtype=torch.long),
            torch.tensor([float(logit_bias[i]) for i in ids], dtype=torch.float32))


def check_request_ids(prompt_ids: list[int], params, dllm: DllmConfig, vocab_size: int | None) -> None:
    """Every token id a request carries (prompt, suffix ids, constraints, ``stop_token_ids``, ``logit_bias`` keys)
    is below ``vocab_size`` (None = not checked), none is the mask token, and no option targets an id the model
    never samples (it would be accepted and do nothing; docs/design.md#admission-and-limits).

    Raises:
        ParamError: naming the field (``prompt`` also when it is empty).
    """
    if not prompt_ids:
        raise ParamError("prompt", "must contain at least one token")
    if vocab_size is not None:
        check_token_ids("prompt", prompt_ids, vocab_size)
        check_no_mask("prompt", prompt_ids if type(prompt_ids) is list else list(prompt_ids), dllm.mask_token_id)
        check_token_ids("stop_token_ids", params.stop_token_ids, vocab_size)
        if params.constraints:
            check_token_ids("constraints", list(params.constraints.values()), vocab_size)
        if isinstance(params.suffix, list):
            check_token_ids("suffix", params.suffix, vocab_size)
            check_no_mask("suffix", list(params.suffix), dllm.mask_token_id)
        if params.logit_bias:
            check_token_ids("logit_bias", list(params.logit_bias), vocab_size)
    if params.logit_bias:
        check_sampleable("logit_bias", sorted(params.logit_bias), dllm, "a bias on it has no effect", key=True)
    check_sampleable("stop_token_ids", params.stop_token_ids, dllm, "it can never stop a choice")


class Request:
    """State of one choice (the strategy-independent part; see the module docstring).

    Args:
        request_id: the request's id (the same for every choice). index: the choice.
        prompt_ids: prompt token ids (already templated).
        plan: the resolved :class:`~unmask.engine.plan.DecodingPlan`, from
            :func:`unmask.engine.engine.plan_request` (the engine's draft policy and the model's device type).
        dllm: the model's diffusion settings. tokenizer: for suffix tokenisation, stop strings and text.
        max_context: the model's context length in tokens.
        vocab_size: rows of the model's LM head; every token id the request carries (prompt, suffix ids,
            constraints, ``stop_token_ids``) must be below it. ``None`` = not checked.

    Raises:
        ParamError: a parameter that this model cannot honour (names the field).
        TypeError: ``plan`` is not a :class:`~unmask.engine.plan.DecodingPlan` (a :class:`SamplingParams` is
            resolved once, by ``plan_request``: resolving it here would miss the engine's options and device).
    """

    #: whether the strategy runs its committed (causal) rows on the model's row variant (a verifier): their KV
    #: then differs from a plain request's, so the prefix cache keys them apart (docs/design.md#prefix-reuse)
    committed_rows_variant = False
    #: the prefix cache's salt (docs/design.md#prefix-reuse): requests share stored KV only with requests of the
    #: same salt (the server's tenant plus the request's ``cache_salt``); None: the unsalted store
    cache_salt: str | None = None
    #: the consumer reads only the choice's final event (``LLM.generate``, as vLLM's ``FINAL_ONLY`` outputs): a plain
    #: step that does not finish it emits no :class:`StepEvent` (set before its first step)
    final_only = False

    def __init__(self, request_id: str, prompt_ids: list[int], plan: DecodingPlan,
                 dllm: DllmConfig, tokenizer, max_context: int, device: torch.device | str = "cpu",
                 vocab_size: int | None = None, index: int = 0):
        if not isinstance(plan, DecodingPlan):
            raise TypeError(f"plan: a resolved DecodingPlan (unmask.engine.engine.plan_request), got "
                            f"{type(plan).__name__}")
        params = plan.params
        check_request_ids(prompt_ids, params, dllm, vocab_size)
        self.request_id, self.index, self.plan, self.params = request_id, index, plan, params
        # the unit of fair admission (docs/design.md#admission-and-limits): the client's whole request
        self.group = request_id
        # the request's state is host state (CPU tensors); the model's device holds only its KV and logits
        self.dllm, self.tokenizer = dllm, tokenizer
        self.device, self.model_device = torch.device("cpu"), torch.device(device)
        self.prompt_ids = list(prompt_ids)
        # docs/design.md#admission-and-limits
        check_block_use(params.block_size, params.max_tokens, plan.model_block_size)
        P = self.prompt_len = len(prompt_ids)
        mask_id = dllm.mask_token_id
        suffix = suffix_ids(params, tokenizer, mask_id)
        fixed = frozenset(int(p) for p, t in params.constraints.items() if int(t) != mask_id)
        lay = self.layout = build_layout(P, params.max_tokens, len(suffix), plan.block_size, plan.window_size,
                                         dllm.block_alignment == "absolute", max_context, params.steps, fixed)
        self.block_size, self.window_size, self.origin = plan.block_size, plan.window_size, lay.origin
        self.max_tokens, self.suffix_len, self.gen_len, self.length = (params.max_tokens, lay.suffix_len,
                                                                       lay.gen_len, lay.length)
        self.blocks, self.windows, self.window_steps = list(lay.blocks), list(lay.windows), list(lay.window_steps)
        # one tensor from one list (prompt | masks | suffix): a request's host tensors cost a few allocations each
        canvas = torch.tensor(self.prompt_ids + [mask_id] * self.gen_len + suffix, dtype=torch.long)
        for pos, tok in params.constraints.items():
            canvas[P + int(pos)] = int(tok)
        self.canvas = canvas.to(self.device)
        self.logprobs = torch.zeros(self.gen_len, dtype=torch.float32)
        k = params.top_logprobs if params.logprobs else 0  # the alternatives recorded per position (-1: none)
        self.top_ids = torch.full((self.gen_len, k), -1, dtype=torch.long) if k else None
        self.top_lps = torch.full((self.gen_len, k), float("-inf"), dtype=torch.float32) if k else None
        self.threshold = plan.threshold
        self.cache_mode = plan.cache
        L = lay.length
        self.lanes = [Lane("cond", LaneCache(L))] + ([Lane("uncond", LaneCache(L))] if plan.lanes == 2 else [])
        eos = [] if params.ignore_eos else list(dllm.eos_token_ids)
        self.eos_ids = set(eos) | set(params.stop_token_ids)
        self.min_tokens_ids = torch.tensor(sorted(set(dllm.eos_token_ids) | set(params.stop_token_ids)),
                                           dtype=torch.long)
        self.stopper = StopChecker(tokenizer, params.stop, params.min_tokens, self.eos_ids, self.max_tokens)
        self.logit_bias = bias_tensors(params.logit_bias)
        # the grammar state of the revealed prefix (docs/design.md#constrained-decoding), compiled (cached) here,
        # off the step
        self.grammar = None
        if params.constraint is not None:
            from .constraints import compile_constraint

            self.grammar = compile_constraint(params.constraint, tokenizer, vocab_size or len(tokenizer),
                                              self.min_tokens_ids.tolist())

        self.win_idx = self.block_idx = self.step_in_block = self.step_in_window = 0
        self.step = self.nfe = 0
        self.finished, self.finish_reason = False, None  # finish_reason: stop | length | abort once finished
        self.output_ids: list[int] = []
        self.text = ""
        self.created = time.time()
        self.first_token_time: float | None = None  # wall times (time.time())
        self.finish_time: float | None = None
        self.blocks_done_steps: list[int] = []
        self.prefix_chain: list[bytes] = []  # chunk keys of the committed KV (engine/prefix_cache.py)
        self.cached_tokens = 0  # prompt positions loaded from the prefix cache
        self.prefix_queried = False  # counted in the prefix cache's queries
        self.proposed_drafts = 0  # draft tokens verified / accepted (self-speculative decoding; 0 otherwise)
        self.accepted_drafts = 0
        self._masked_memo: tuple | None = None  # (window start, its tokens' bytes) -> its masked positions
        self._views: tuple | None = None  # (canvas, logprobs, their NumPy views): _host_views
        self._skip_empty_blocks()

    # ------------------------------------------------------------------ blocks and windows
    def _window_masked(self) -> torch.Tensor:
        """Canvas positions of the current decoding window that are still masked (the positions predicted and
        revealed this step; ``[N]`` int64, host, ascending)."""
        return self._masked_window()[0]

    def _masked_window(self) -> tuple[torch.Tensor, np.ndarray]:
        """:meth:`_window_masked` and the same positions as a NumPy array (sharing memory), computed once per
        state of the window's tokens (a step asks several times; a reveal, or any other write, changes the tokens
        and so the answer)."""
        _, s, e = self.windows[self.win_idx]
        window = self.host_canvas()[s:e]
        key = (s, window.tobytes())
        memo = self._masked_memo
        if memo is None or memo[0] != key:
            at = np.flatnonzero(window == self.dllm.mask_token_id) + s
            memo = self._masked_memo = (key, torch.from_numpy(at), at)
        return memo[1], memo[2]

    def host_canvas(self) -> np.ndarray:
        """The canvas's memory as a NumPy array (``[L]`` int64; writes go to the canvas)."""
        return self._host_views()[0]

    def _host_views(self) -> tuple[np.ndarray, np.ndarray]:
        """NumPy views of the canvas and the log-probabilities (kept while those tensors stay)."""
        memo = self._views
        if memo is None or memo[0] is not self.canvas or memo[1] is not self.logprobs:
            memo = self._views = (self.canvas, self.logprobs, (self.canvas.numpy(), self.logprobs.numpy()))
        return memo[2]

    def _skip_empty_blocks(self) -> None:
        """Advance past windows without masks; entering a new block resets its step counter."""
        canvas, mask = self.host_canvas(), self.dllm.mask_token_id
        while self.win_idx < len(self.windows):
            _, s, e = self.windows[self.win_idx]
            if (canvas[s:e] == mask).any():  # the window still has masks (no positions list needed)
                break
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

    def prefill_limit(self) -> int:
        """Most canvas positions whose KV may be in a lane's cache before the first step: that step must forward
        the last prompt position (its output gives the first block's first logits; the prefix cache and chunked
        prefill both stop here)."""
        return min(self.prompt_len, self.active[0]) - 1

    def pending_prompt_rows(self) -> int:
        """Committed prompt rows (all lanes) still to forward before the first step under the exact cache; 0 once
        stepped or without the exact cache (the chunked-prefill budget, ``Denoiser.step``)."""
        return sum(e - c for c, e in self._pending_ranges())

    def pending_prompt_cost(self, budget: PrefillBudget) -> float:
        """:meth:`pending_prompt_rows` in ``budget``'s row-equivalents (a row's cost grows with its position)."""
        return sum(budget.cost(c, e) for c, e in self._pending_ranges())

    def _pending_ranges(self) -> list[tuple[int, int]]:
        """Per lane with rows pending, the prompt positions ``[cache length, end)`` its first step would forward."""
        if self.nfe or self.cache_mode != "exact" or self.dllm.attention == "bidirectional":
            return []
        end = min(self.prompt_len, self.active[0])
        return [(lane.cache.length, end) for lane in self.lanes if lane.cache.length < end]

    def prefill_inputs(self, budget: PrefillBudget) -> list[LaneInput] | None:
        """Chunked prefill (docs/design.md#decoding, "Chunked prefill"): before its first step, a sequence whose
        lanes' pending prompt rows cost more than ``budget.chunk`` row-equivalents (a row at position p costs
        ``1 + p / budget.keys``) forwards in each lane the next rows up to :meth:`prefill_limit` that fit its share
        of it (the budget split evenly between the lanes with rows left; at least one row; cut back to a group
        boundary, e.g. a block-causal prompt block; a group costing more, whole), committing their KV, instead of
        a step; their bounds depend on the lane's cache length alone. ``None``:
        the step may run (every lane's rest fits, ``budget.chunk`` is 0, nothing pending). Each lane advances from
        its own cache length (a CFG cond lane may hold a cached prefix, its uncond lane, prompt masked, none); a
        lane with nothing left sits the chunk out (``LaneInput.lane`` names the others)."""
        pending = self._pending_ranges() if budget.chunk > 0 else []
        if sum(budget.cost(c, e) for c, e in pending) <= budget.chunk:
            return None
        limit = self.prefill_limit()
        shares = max(1, sum(ln.cache.length < limit for ln in self.lanes))  # a CFG request's two lanes: half each
        budget = PrefillBudget(budget.chunk / shares, budget.keys, budget.align)
        a, e = self.active
        grp, start, committed = canvas_groups(self.length, self.dllm.attention, a, a, e, self.block_size,
                                              self.origin, device=self.device)
        none = torch.empty(0, dtype=torch.long, device=self.device)
        out = []
        for i, lane in enumerate(self.lanes):  # a CFG cond lane may start further on (a prefix-cache hit)
            c = lane.cache.length
            if c >= limit:
                continue
            end = budget.end(c, limit)
            while end > c and int(grp[end - 1]) == int(grp[end]):  # never split a group ...
                end -= 1
            if end == c:  # ... and take a group that alone costs more than the budget whole
                end = c + 1
                while end < limit and int(grp[end - 1]) == int(grp[end]):
                    end += 1
                if int(grp[end - 1]) == int(grp[end]):  # no group ends before the limit
                    continue
            rows = torch.arange(c, end, device=self.device)
            tokens = self.canvas[c:end]
            if lane.kind == "uncond":
                tokens = torch.full_like(tokens, self.dllm.mask_token_id)  # the prompt masked (c < prompt_len)
            out.append(LaneInput(tokens=tokens, chunk=rows, grp=grp[c:end], start=start[c:end],
                                 committed=committed[c:end], needed=none, commit=rows - c, lane=i))
        return out or None

    @property
    def active(self) -> tuple[int, int]:
        """The active group ``[start, end)`` (the current block; with absolute alignment it may start inside
        the prompt)."""
        return self.blocks[self.block_idx]

    def context_ids(self) -> torch.Tensor:
        """Prompt + revealed generated ids (for penalties)."""
        region = self.canvas[: self.prompt_len + self.gen_len]
        return region[region != self.dllm.mask_token_id]

    def canvas_view(self) -> list[int | None]:
        """The first ``max_tokens`` generated positions: token id or ``None`` where masked."""
        region = self.host_canvas()[self.prompt_len: self.prompt_len + self.max_tokens].tolist()
        m = self.dllm.mask_token_id
        return [None if t == m else t for t in region]

    # ------------------------------------------------------------------ finish
    def _check_finished(self) -> None:
        """Apply the stop rules (``unmask.engine.stopping``) to the newly revealed left-to-right prefix (none when the
        position after it is still masked: ``StopChecker.update`` then returns at once unless a check is due)."""
        if self.finished:
            return
        stopper = self.stopper
        lo, hi = self.stop_watch(), self.stop_scan_end()
        at_end = self.block_idx >= len(self.blocks)
        canvas, mask = self.host_canvas(), self.dllm.mask_token_id
        if lo < hi and canvas[lo] == mask:
            new = []  # the prefix did not grow (most steps): no scan of the rest
        else:
            rest = canvas[lo:hi].tolist()
            new = rest[: rest.index(mask)] if mask in rest else rest  # the revealed run before the first mask
        shown = stopper.stream_text
        done = stopper.update(new, at_end)
        if done is not None:
            self._finish(*done)
        elif len(stopper.stream_text) > len(shown) and self.first_token_time is None:
            self.first_token_time = time.time()

    def stop_watch(self) -> int:
        """The canvas position after the revealed prefix: while it is masked (and the last block is not done), a
        :meth:`_check_finished` after the stop rules' first run changes nothing (``StopChecker.update``)."""
        return self.prompt_len + len(self.stopper.prefix)

    def stop_scan_end(self) -> int:
        """The canvas position where the stop rules' scan of the revealed prefix ends: ``max_tokens`` generated
        positions (a strategy whose tokens may still change ends it before them)."""
        return self.prompt_len + self.max_tokens

    def _finish(self, reason: str, ids: list[int], text: str) -> None:
        self.output_ids = list(ids)  # before `finished`: another thread reading num_output_tokens sees both
        self.finished = True
        self.finish_reason = reason
        self.text = text
        if len(text) > len(self.stopper.stream_text) and self.first_token_time is None and text:
            self.first_token_time = time.time()
        self.stopper.stream_text = text
        self.finish_time = time.time()

    @property
    def stream_text(self) -> str:
        """The stream-safe text so far."""
        return self.stopper.stream_text

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far: ``len(output_ids)`` once finished, else the revealed left-to-right prefix (what a
        stream has shown; an abort keeps exactly these). Safe to read from another thread: CPython ``len`` of a
        list the engine thread appends to is atomic."""
        return len(self.output_ids) if self.finished else len(self.stopper.prefix)

    # ------------------------------------------------------------------ outputs
    def draws(self, positions: list[int] | torch.Tensor) -> Draws:
        """The counter-based draws of this step for rows predicting canvas ``positions`` (``unmask.engine.noise``:
        a function of the choice's seed, :attr:`step` and the position, so alone = in any batch)."""
        return Draws(self.plan.seed, self.step, positions)

    def record(self, positions: list[int], rows: HostRows) -> list[Revealed]:
        """Write the tokens of ``rows`` (:class:`~unmask.engine.reveals.HostRows`) revealed at canvas
        ``positions`` into the canvas, record their log-probabilities (and alternatives), and return their
        :class:`Revealed` (positions past ``max_tokens``, decoded only to fill a block, left out)."""
        if not positions:
            return []
        rel = [p - self.prompt_len for p in positions]
        canvas, logprobs = self._host_views()  # host tensors: written through their memory
        for p, r, t, lp in zip(positions, rel, rows.tokens, rows.logprob):
            canvas[p] = t
            logprobs[r] = lp  # rounded to float32 as a float32 tensor write rounds it
        k = self.params.top_logprobs
        tops = [tuple(t[:k]) for t in rows.top] if rows.top is not None and k else [()] * len(rel)
        if self.top_ids is not None:
            rel_t = torch.tensor(rel, dtype=torch.long)
            kk = self.top_ids.shape[-1]
            self.top_ids[rel_t] = torch.tensor([[i for i, _ in t[:kk]] + [-1] * (kk - len(t[:kk])) for t in tops],
                                               dtype=torch.long).reshape(len(rel), kk)
            self.top_lps[rel_t] = torch.tensor([[lp for _, lp in t[:kk]] + [float("-inf")] * (kk - len(t[:kk]))
                                                for t in tops], dtype=torch.float32).reshape(len(rel), kk)
        return [revealed_token(p, t, c, lp, top) for p, t, c, lp, top in
                zip(rel, rows.tokens, rows.probability, rows.logprob, tops) if p < self.max_tokens]

    def _top_logprobs(self, n: int) -> list[list[tuple[int, float]]] | None:
        """The recorded alternatives of the first ``n`` positions (None unless asked for)."""
        if self.top_ids is None:
            return None
        return [[(i, lp) for i, lp in zip(ids, lps) if i >= 0 and lp > float("-inf")]
                for ids, lps in zip(self.top_ids[:n].tolist(), self.top_lps[:n].tolist())]

    def event(self, block: int, step: int, revealed: list[Revealed], canvas: list[int | None] | None = None
              ) -> StepEvent:
        """The :class:`StepEvent` of the state now (``output`` set once finished; ``canvas``: :meth:`canvas_view`
        when the caller has it)."""
        return filled(StepEvent, request_id=self.request_id, index=self.index, block=block, step=step, nfe=self.nfe,
                      revealed=revealed, canvas=self.canvas_view() if canvas is None else canvas, text=self.stream_text,
                      finished=self.finished,
                      finish_reason=self.finish_reason, num_tokens=self.num_output_tokens,
                      drafts_proposed=self.proposed_drafts, drafts_accepted=self.accepted_drafts,
                      output=self.completion() if self.finished else None, cached_tokens=self.cached_tokens)

    def completion(self) -> CompletionOutput:
        """The choice's :class:`CompletionOutput` (final once finished; partial after an abort)."""
        ids = list(self.output_ids)
        lp = self.logprobs[: len(ids)].tolist() if self.params.logprobs else None
        return CompletionOutput(
            index=self.index, text=self.text, token_ids=ids, finish_reason=self.finish_reason, logprobs=lp,
            steps=self.step, nfe=self.nfe, ended_by_eos=bool(ids) and ids[-1] in self.eos_ids,
            steps_per_block=list(self.blocks_done_steps), drafts_proposed=self.proposed_drafts,
            drafts_accepted=self.accepted_drafts, speculative=self.plan.speculative,
            draft_block=self.plan.draft_block, first_token_time=self.first_token_time, finish_time=self.finish_time,
            cached_tokens=self.cached_tokens, top_logprobs=self._top_logprobs(len(ids)))

    def final_event(self) -> StepEvent:
        """The last event of a choice that finished without a further step."""
        return self.event(self.block_idx, self.step, [])

    def abort(self) -> StepEvent:
        """Cancel: mark finished with ``abort`` and free the lane caches. ``output_ids`` / ``text`` keep what was
        generated so far: the revealed left-to-right prefix (what a stream has shown), as vLLM returns the partial
        output of an aborted request (usage and the request log count it)."""
        self.output_ids = list(self.stopper.prefix)  # before `finished` (see num_output_tokens)
        self.finished = True
        self.finish_reason = "abort"
        self.text = self.stream_text
        self.finish_time = time.time()
        self.release()
        return self.event(self.block_idx, self.step, [])

    def release(self) -> None:
        """Free cached KV (called when the choice leaves the batch)."""
        for lane in self.lanes:
            lane.cache.clear()

    def cache_bytes(self) -> int:
        """Bytes of KV held by this choice's lanes."""
        return sum(lane.cache.nbytes() for lane in self.lanes)
