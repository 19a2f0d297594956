"""Continuous batching: a FIFO waiting queue and a running batch that sequences join and leave every step.

New sequences join at the next step (their prompt prefill runs in that step, or a long prompt in chunks over the
next steps (chunked prefill, ``Request.prefill_inputs``), in the same forward as the others' denoising steps or,
when padding it into their rows would waste more than a forward costs, in its own:
``unmask.engine.denoiser.plan_forwards``); finished and cancelled sequences leave at once, freeing their slot
and their KV cache. A sequence's tokens never depend on who else is in the batch (batch invariance), so joining
mid-block is exact; this is finer-grained than joining at block boundaries and gives a lower TTFT.

Fair admission (docs/design.md#admission-and-limits): a request's ``group`` (the client's whole request: every prompt
and choice of one HTTP call; by default its own id) is the unit. Free batch slots go to the waiting sequence whose group
has the fewest sequences running (ties: queue order), and a request that waits with none running takes a slot from the
request holding the most while that one holds more than its share (``max_batch_size // requests with work``, at
least 1): the taken sequence is *paused* (it keeps its canvas and KV cache and its reservation of the budget, goes
back to the front of the queue, and resumes where it stopped: a sequence's tokens never depend on when it steps).
So one request cannot hold every slot while another waits, and a small request's first step comes at the next
step however large the running one is.

Admission and the KV budget live here only (docs/design.md#decisions, #admission-and-limits): a request reserves its
canvas length x lanes (2 under CFG) cached tokens, and joins when the KV pool (``engine/kv_pool.py``) has its blocks
free (or held only by the prefix store), taking them at once; one that can never fit the budget is a client error (:class:`ParamError`,
field ``max_tokens``), one that fits the budget but not what is left of it waits; a full queue is
:class:`QueueFull` (HTTP 429). :meth:`Scheduler.fit_max_tokens` lowers a default ``max_tokens`` to fit, from the
canvas layout alone (``unmask.engine.layout``), without building the request.

Prefix reuse (docs/design.md#prefix-reuse, ``unmask.engine.prefix_cache``): a sequence joining the batch for the first
time gets the longest stored prefix of its prompt as the first blocks of its cache (shared, no copy); after every step the complete chunks of
each stepped sequence's committed KV are stored. The store is bounded by what the budget leaves after the running
and paused reservations (re-bounded at every admission and step), so kept prefixes are evicted first and never
make a live sequence wait.
"""
from __future__ import annotations

import collections
import time

from collections.abc import Callable, Iterable

from .denoiser import Denoiser
from .kv_budget import pool_blocks
from .kv_pool import KVPool
from .limits import ParamError
from .outputs import StepEvent
from .options import EngineConfig
from .prefix_cache import PrefixCache
from .request import Request
from .step_cost import SEQUENCE_ROWS, step_cost, step_rows

_DEFAULTS = EngineConfig()  # the engine options' one set of defaults
#: seconds a reading of the available memory answers admissions needing at most half of it (Scheduler.check_memory)
FREE_MEMORY_REUSE_S = 1.0


def least_served(waiting: Iterable[Request], held: collections.Counter) -> Request:
    """The first waiting sequence whose group holds the fewest running sequences (``held``: group -> count), as
    ``min(waiting, key=...)`` picks it; the scan stops at the first group holding none (no count is lower)."""
    best, fewest = None, 0
    for seq in waiting:
        n = held[seq.group]
        if best is None or n < fewest:
            best, fewest = seq, n
            if not n:
                break
    return best


class MemoryReading:
    """The last reading of the machine's available memory, ``(time.monotonic(), bytes)`` (None before the first),
    kept for :meth:`Scheduler.check_memory`'s reuse rule. The engines of one caller share one (``LLM`` builds an
    engine per call: a call right after another reuses its reading under the same rule as a burst of admissions)."""

    def __init__(self) -> None:
        self.value: tuple[float, int] | None = None


class QueueFull(RuntimeError):
    """The waiting queue holds ``max_queue`` sequences (HTTP 429)."""


class CacheFull(RuntimeError):
    """Admitting the sequence would exceed the KV-cache token budget (HTTP 503)."""


class Scheduler:
    """Owns the running batch. Not thread-safe: one thread (the engine thread) calls it.

    Args:
        denoiser: runs the steps.
        max_batch_size: most sequences in one step.
        max_queue: most sequences waiting (beyond it :meth:`add` raises :class:`QueueFull`).
        max_cached_tokens: budget of canvas tokens held by running sequences (each sequence reserves its whole
            canvas length, an upper bound on its cache); ``None`` = unlimited. A sequence longer than the whole
            budget is refused with :class:`CacheFull`.
        prefix_cache: the store of reusable prefixes (``None``: no reuse); bounded here by the free budget.
        memory_reading: the available memory last read, shared with other engines of the same caller (default: this
            scheduler's own).
    """

    def __init__(self, denoiser: Denoiser, max_batch_size: int = _DEFAULTS.max_batch_size,
                 max_queue: int = _DEFAULTS.max_queue, max_cached_tokens: int | None = None, prefix_cache: PrefixCache | None = None,
                 max_step_rows: int | None = _DEFAULTS.max_step_rows,
                 gpu_memory_utilization: float = _DEFAULTS.gpu_memory_utilization,
                 memory_reading: MemoryReading | None = None):
        if max_batch_size < 1:
            raise ValueError("max_batch_size: must be >= 1")
        self.denoiser = denoiser
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        self.max_cached_tokens = max_cached_tokens
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.paused: set[Request] = set()  # waiting sequences that already ran (they keep their KV cache)
        self.preemptions = 0  # sequences paused for a starved request so far
        self.prefix_cache = prefix_cache
        self.max_step_rows = max_step_rows  # row-equivalents; None: no bound (docs/design.md#admission-and-limits)
        # bytes per cached token (K and V of every layer) and per logits row: the memory estimate; None = unchecked
        # the lanes' KV blocks: the prefix store's pool (a store outlives engines: LLM's, tests'), else the
        # denoiser's (kept on it), else a new one
        self.kv_pool: KVPool = (getattr(prefix_cache, "pool", None) or getattr(denoiser, "kv_pool", None)
                                or KVPool())
        denoiser.kv_pool = self.kv_pool
        if prefix_cache is not None:
            prefix_cache.attach(self.kv_pool)
        self.gpu_memory_utilization = gpu_memory_utilization
        self.kv_bytes_per_token = None  # sizes the pool (the setter)
        self.logit_row_bytes: int | None = None
        self._last_step: dict[Request, int] = {}  # the step each running sequence last ran in
        self._steps = 0
        self.memory_reading = memory_reading or MemoryReading()  # the available memory last read (check_memory)

    @staticmethod
    def need(seq: Request) -> int:
        """Cached tokens a choice reserves: canvas length x lanes (2 under CFG)."""
        return seq.length * len(seq.lanes)

    @property
    def kv_bytes_per_token(self) -> int | None:
        """Bytes per cached token (K and V of every layer; None = unknown): the memory estimate, and on a GPU the
        pool's size in blocks (setting it sizes the pool: :meth:`size_pool`)."""
        return self._kv_bytes_per_token

    @kv_bytes_per_token.setter
    def kv_bytes_per_token(self, value: int | None) -> None:
        self._kv_bytes_per_token = value
        self.size_pool()

    def need_blocks(self, seq: Request) -> int:
        """KV blocks a choice reserves: its canvas length in whole blocks, per lane."""
        return -(-seq.length // self.kv_pool.block_tokens) * len(seq.lanes)

    def size_pool(self) -> None:
        """Bound the KV pool (``engine/kv_budget.py``): the token budget in blocks on a CPU; on a GPU (the
        denoiser's device) also what ``torch.cuda.mem_get_info`` leaves under :attr:`gpu_memory_utilization`."""
        self.kv_pool.set_capacity(pool_blocks(self.denoiser.device, self.max_cached_tokens, self.kv_pool.block_tokens,
                                              self._kv_bytes_per_token, 2 * self.max_batch_size,
                                              self.gpu_memory_utilization))

    def check_rows(self, reqs: list[Request]) -> None:
        """Raise :class:`ParamError` when one request's choices - every prompt's, ``reqs`` being all of them - would
        cost a step more than ``max_step_rows`` (``--max-step-rows``) row-equivalents: their rows plus the
        per-sequence term (``unmask.engine.step_cost``). It names ``block_size``, or ``n`` on a model whose block
        size a request cannot choose (``DllmConfig.fixed_block_size``: DiffusionGemma's canvas, SDAR's block), where
        one sequence is always admitted (it then steps alone: nothing the client sends could make it cheaper)."""
        if self.max_step_rows is None or not reqs:
            return
        cost = sum(step_cost(s) for s in reqs)
        if cost <= self.max_step_rows:
            return
        seq, rows = reqs[0], sum(step_rows(s) for s in reqs)
        fixed = seq.dllm.fixed_block_size and not seq.plan.speculative
        if fixed and len(reqs) == 1:
            return
        lanes = sum(len(s.lanes) for s in reqs)
        shape = (f"draft block {seq.plan.draft_block} x {2 + seq.plan.branches} groups (self-speculative)"
                 if seq.plan.speculative else f"block_size {seq.block_size}")
        per_lane = f" + {lanes} x {SEQUENCE_ROWS} per sequence and lane" if SEQUENCE_ROWS else ""
        fix = (f"lower n or send fewer prompts (the checkpoint fixes block_size at {seq.block_size}; one "
               f"sequence is always admitted)" if fixed else "lower block_size or n")
        raise ParamError("n" if fixed else "block_size",
                         f"{shape} x {len(reqs)} sequence(s) x {len(seq.lanes)} lane(s)"
                         f"{' (cfg_scale)' if len(seq.lanes) == 2 else ''} costs every step {cost} row-equivalents "
                         f"({rows} rows{per_lane}); the server's limit is {self.max_step_rows} per request "
                         f"(--max-step-rows): {fix}")

    def estimate_bytes(self, reqs: list[Request]) -> tuple[int, int]:
        """``(KV bytes, logits bytes)`` the request's choices hold at most: each choice's reserved cache
        (:meth:`need` tokens) and three float32 ``[rows, vocab]`` buffers per step (logits, probabilities, a
        sort); (0, 0) when the model's sizes are unknown."""
        if not self.kv_bytes_per_token or not self.logit_row_bytes:
            return 0, 0
        return (sum(self.need(s) for s in reqs) * self.kv_bytes_per_token,
                3 * sum(step_rows(s) for s in reqs) * self.logit_row_bytes)

    def check_memory(self, reqs: list[Request]) -> None:
        """Raise :class:`ParamError` (``max_tokens``) when the estimate (:meth:`estimate_bytes`) exceeds the
        memory the machine has available now: the request could only fail or swap midway. The available memory is
        read again unless the estimate is at most half of a reading less than ``FREE_MEMORY_REUSE_S`` old (a burst
        of admissions, e.g. ``generate`` with many prompts, reads it once; the reading is :attr:`memory_reading`,
        which ``LLM``'s engines share, so back-to-back calls read it once too)."""
        kv, logits = self.estimate_bytes(reqs)
        if not kv + logits:
            return
        seen, now = self.memory_reading.value, time.monotonic()
        if seen is not None and now - seen[0] < FREE_MEMORY_REUSE_S and 2 * (kv + logits) <= seen[1]:
            return  # at most half of what was available a moment ago: no new reading (a burst of admissions)
        import psutil

        free = psutil.virtual_memory().available
        self.memory_reading.value = (now, free)
        if kv + logits > free:
            raise ParamError("max_tokens", f"this request needs ~{(kv + logits) >> 20} MiB (KV cache {kv >> 20} MiB "
                                           f"for {sum(self.need(s) for s in reqs)} tokens, logits {logits >> 20} "
                                           f"MiB) and the server has {free >> 20} MiB available: lower max_tokens, "
                                           "n or block_size")

    def check_fits(self, reqs: list[Request]) -> None:
        """Raise :class:`ParamError` (``max_tokens``) when the request alone exceeds the KV budget: retrying could
        never help, so it is a client error, not :class:`CacheFull`; (``block_size``) beyond the rows per step
        (:meth:`check_rows`)."""
        self.check_rows(reqs)
        self.check_memory(reqs)
        cap = self.kv_pool.capacity_blocks
        if reqs and cap is not None and self.need_blocks(reqs[0]) > cap:
            seq = reqs[0]
            raise ParamError("max_tokens", f"prompt ({seq.prompt_len} tokens) + max_tokens ({seq.max_tokens}) needs "
                                           f"{self.need_blocks(seq)} KV blocks of {self.kv_pool.block_tokens} tokens "
                                           f"({len(seq.lanes)} lane(s)); the server's KV pool holds {cap}, so this "
                                           "request can never run")
        budget = self.max_cached_tokens
        if budget is None or not reqs or self.need(reqs[0]) <= budget:
            return
        seq = reqs[0]
        raise ParamError("max_tokens", f"prompt ({seq.prompt_len} tokens) + max_tokens ({seq.max_tokens}) needs "
                                       f"{self.need(seq)} cached tokens ({len(seq.lanes)} lane(s), generation region "
                                       f"rounded up to whole blocks); the server's KV budget (--max-cached-tokens) "
                                       f"is {budget}, so this request can never run")

    def check_queue(self, n: int, queued: int) -> None:
        """Raise :class:`QueueFull` when ``n`` more choices would overflow the queue holding ``queued``."""
        if queued + n > self.max_queue:
            raise QueueFull(f"waiting queue is full ({queued} of {self.max_queue} sequences waiting)")

    def check_admission(self, reqs: list[Request], queued: int) -> None:
        """:meth:`check_fits`, then :meth:`check_queue`."""
        self.check_fits(reqs)
        self.check_queue(len(reqs), queued)

    def enqueue(self, reqs: list[Request]) -> None:
        """Queue choices already admitted (:meth:`check_admission`)."""
        self.waiting.extend(reqs)

    def fit_max_tokens(self, prompt_len: int, max_tokens: int, need: Callable[[int], int], max_context: int,
                       lanes: int = 1) -> int:
        """The largest ``max_tokens`` (at most the given one) whose canvas fits the model's context, the KV budget
        and the KV pool's blocks (:meth:`check_fits`' two bounds: a GPU's pool is sized from its free memory, with
        or without a token budget): all grow with ``max_tokens`` (the canvas is rounded up to whole blocks), so
        bisect.

        Args:
            need: ``m -> cached tokens`` of the request with ``max_tokens = m`` (canvas length x ``lanes``); raises
                ParamError (``max_tokens``) when that canvas exceeds the context.
            lanes: the request's lanes (2 under CFG): its blocks are the canvas's per lane.

        Raises:
            ParamError: (``prompt``) no generation fits.
        """
        budget, cap, T = self.max_cached_tokens, self.kv_pool.capacity_blocks, self.kv_pool.block_tokens
        last: ParamError | None = None

        def fits(m: int) -> bool:
            nonlocal last
            try:
                n = need(m)
            except ParamError as exc:
                if exc.field != "max_tokens":
                    raise
                last = exc
                return False
            return (budget is None or n <= budget) and (cap is None or -(-n // lanes // T) * lanes <= cap)

        hi = min(max_tokens, max_context - prompt_len)
        best = hi if hi >= 1 and fits(hi) else None
        if best is None and hi > 1:
            lo = 0  # invariant: fits(lo) or lo == 0; not fits(hi)
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if fits(mid):
                    lo = best = mid
                else:
                    hi = mid
        if best is not None:
            return best
        if (budget is not None or cap is not None) and last is None:
            held = (f"KV budget (--max-cached-tokens) of {budget} cached tokens" if budget is not None else
                    f"KV pool of {cap} blocks of {T} tokens")
            raise ParamError("prompt", f"the prompt has {prompt_len} tokens; with the server's {held} no generation "
                                       "fits")
        raise ParamError("prompt", f"the prompt has {prompt_len} tokens; the model's context of {max_context} "
                                   f"tokens leaves no room to generate" + (f" ({last.reason})" if last else ""))

    def add(self, seq: Request) -> None:
        """Queue one choice (direct use, e.g. tests). Raises QueueFull / CacheFull."""
        if self.max_cached_tokens is not None and seq.length * len(seq.lanes) > self.max_cached_tokens:
            raise CacheFull(f"request needs {seq.length * len(seq.lanes)} cached tokens; the engine's KV budget "
                            f"is {self.max_cached_tokens}")
        if len(self.waiting) >= self.max_queue:
            raise QueueFull(f"waiting queue is full ({self.max_queue} requests)")
        self.waiting.append(seq)

    def reserved_tokens(self) -> int:
        """Canvas tokens reserved by running and paused sequences: canvas length x lanes (2 under CFG), summed."""
        return sum(self.need(s) for s in self.running) + sum(self.need(s) for s in self.paused)

    def kv_usage(self) -> tuple[int, int]:
        """``(reserved, prefix)`` cached tokens: what the running and paused sequences reserve (canvas length x lanes)
        and what the prefix store holds. Safe to read from another thread (the metrics' scrape): the batch is
        copied first (a copy of a list or set is one step under the GIL)."""
        running, paused = list(self.running), list(self.paused)
        reserved = sum(self.need(s) for s in running) + sum(self.need(s) for s in paused)
        return reserved, self.prefix_cache.tokens if self.prefix_cache is not None else 0

    def abort(self, request_id: str) -> list[StepEvent]:
        """Cancel every sequence of ``request_id`` (waiting or running); returns their final events."""
        events = []
        for seq in [s for s in self.waiting if s.request_id == request_id]:
            self.waiting.remove(seq)
            self.paused.discard(seq)
            events.append(seq.abort())
        for seq in [s for s in self.running if s.request_id == request_id]:
            self.running.remove(seq)
            self._last_step.pop(seq, None)
            events.append(seq.abort())
        return events

    def has_work(self) -> bool:
        """True while any sequence is waiting or running."""
        return bool(self.waiting or self.running)

    def _fits(self, seq: Request, reserved: int) -> bool:
        """Whether ``seq`` may join with ``reserved`` tokens held: a paused sequence holds its reservation already;
        an empty batch takes any sequence that fits the budget alone (checked at submit)."""
        if seq in self.paused:
            return True
        if self.running and self.max_cached_tokens is not None and reserved + self.need(seq) > self.max_cached_tokens:
            return False
        return self.need_blocks(seq) <= self.free_blocks()

    def free_blocks(self) -> int:
        """KV blocks a joining sequence can take: the pool's free ones and those only the prefix store holds."""
        store = self.prefix_cache.evictable_blocks() if self.prefix_cache is not None and \
            self.prefix_cache.pool is self.kv_pool else 0
        return self.kv_pool.free_blocks + store if self.kv_pool.capacity_blocks is not None else 1 << 62

    @staticmethod
    def _counts(seqs: Iterable[Request]) -> collections.Counter:
        return collections.Counter(s.group for s in seqs)

    def _join(self, seq: Request) -> None:
        self.waiting.remove(seq)
        resumed = seq in self.paused
        self.paused.discard(seq)
        self.running.append(seq)
        if resumed:
            return
        for lane in seq.lanes:
            lane.cache.bind(self.kv_pool)
        if self.prefix_cache is not None:
            self.prefix_cache.load(seq)  # a no-op for a request that never shares
        for lane in seq.lanes:  # the whole canvas now (after the shared prefix): a running sequence never waits
            lane.cache.reserve(seq.length)

    def _grow_pool_for_burst(self) -> None:
        """An unbounded KV pool grows by one slab for the choices that may join now (the first free slots' worth of
        the waiting ones), so that choices admitted together hold evenly spaced runs of one slab (one attention call
        per layer for alike lanes, ``engine/lane_attention.py``) instead of one slab each as the pool doubles. A
        bounded pool has its room in one slab already."""
        slots = self.max_batch_size - len(self.running)
        if self.kv_pool.capacity_blocks is not None or slots < 2 or len(self.waiting) < 2:
            return
        first = [s for _, s in zip(range(slots), self.waiting) if s not in self.paused]
        self.kv_pool.ensure_free(sum(self.need_blocks(s) for s in first))

    def _bound_prefix_cache(self) -> None:
        """Bound the prefix store by what the budget leaves after the unfinished running and paused sequences'
        reservations (evicting at once); without a budget by the store's own ``max_tokens``."""
        if self.prefix_cache is None:
            return
        if self.max_cached_tokens is None:
            self.prefix_cache.set_limit(None)
            return
        held = sum(self.need(s) for s in self.running if not s.finished) + sum(self.need(s) for s in self.paused)
        self.prefix_cache.set_limit(self.max_cached_tokens - held)

    def _admit(self) -> None:
        """Fill the free slots fairly, then let starved requests take a slot from the largest holder (see the
        module docstring). The fill keeps its counts (sequences per group, reserved tokens) up to date as it joins
        instead of recounting the batch per slot (issue 42: a batch of B filled in O(B), not O(B^2))."""
        self._grow_pool_for_burst()
        if self._fill():
            self._share_with_starved()

    def _fill(self) -> bool:
        """Join the least-served waiting choices while slots are free (:meth:`_admit`'s first part); False when it
        stopped at a choice the budget cannot take."""
        held: collections.Counter | None = None
        reserved: int | None = None
        while self.waiting and len(self.running) < self.max_batch_size:
            if held is None:
                held = self._counts(self.running)
            seq = least_served(self.waiting, held)
            if reserved is None and self.running and self.max_cached_tokens is not None:
                reserved = self.reserved_tokens()  # read by _fits only then
            if not self._fits(seq, reserved or 0):
                return False
            if reserved is not None and seq not in self.paused:  # a paused sequence's reservation already counts
                reserved += self.need(seq)
            self._join(seq)
            held[seq.group] += 1
        return True

    def _share_with_starved(self) -> None:
        """A waiting request with no running choice takes a slot from the largest holder above its fair share
        (:meth:`_admit`'s second part; the holder's choice paused, resumed later)."""
        while self.waiting:
            held = self._counts(self.running)
            starved = next((s for s in self.waiting if held[s.group] == 0), None)
            if starved is None or not held:
                return
            share = max(1, self.max_batch_size // len(held | self._counts(self.waiting)))
            holder, count = held.most_common(1)[0]
            if count <= share or not self._fits(starved, self.reserved_tokens()):
                return
            victim = next((s for s in reversed(self.running) if s.group == holder and not s.finished), None)
            if victim is None:
                return
            self.running.remove(victim)
            self.waiting.appendleft(victim)
            self.paused.add(victim)
            self.preemptions += 1
            self._join(starved)

    def _within_rows(self, active: list[Request]) -> list[Request]:
        """The sequences of this step: all of ``active`` when their cost (``unmask.engine.step_cost``: rows plus the
        per-sequence term) fits ``max_step_rows`` (the usual case, the batch unchanged); else whole requests
        (``group``), the longest-waiting first (the step its longest-waiting sequence last ran in), as many as fit,
        at least one sequence. A light request therefore never waits behind more than one heavy step and never
        shares its step with part of a heavy one (a light request's step beside three of four heavy sequences cost
        almost a heavy step); a sequence left out runs in the next (its tokens do not depend on when it steps)."""
        self._steps += 1
        if self.max_step_rows is not None and sum(step_cost(s) for s in active) > self.max_step_rows:
            groups: dict = {}
            for seq in active:  # queue order within a group and among ties
                groups.setdefault(seq.group, []).append(seq)
            order = sorted(groups.values(), key=lambda g: min(self._last_step.get(s, -1) for s in g))
            chosen, cost = [], 0
            for group in order:
                c = sum(step_cost(s) for s in group)
                if cost + c <= self.max_step_rows:
                    chosen += group
                    cost += c
            if not chosen:  # one request past the limit (a limit lowered since it was admitted): part of it
                for seq in sorted(order[0], key=lambda s: self._last_step.get(s, -1)):
                    if not chosen or cost + step_cost(seq) <= self.max_step_rows:
                        chosen.append(seq)
                        cost += step_cost(seq)
            active = [s for s in active if s in chosen]
        for seq in active:
            self._last_step[seq] = self._steps
        return active

    def step(self) -> list[StepEvent]:
        """Admit waiting sequences, run one step for the batch, drop finished ones. Returns the step's events."""
        self._admit()
        self._bound_prefix_cache()
        done_before = [s.final_event() for s in self.running if s.finished]  # e.g. nothing left to decode
        active = self._within_rows([s for s in self.running if not s.finished])
        if self.prefix_cache is not None:  # a sequence whose prefill waited may find what another stored meanwhile
            for seq in active:
                if not seq.nfe:
                    self.prefix_cache.load(seq)
        events = done_before + self.denoiser.step(active)
        if self.prefix_cache is not None:
            self._bound_prefix_cache()  # finished sequences' reservations are free now
            for seq in active:
                self.prefix_cache.register(seq)
        for seq in [s for s in self.running if s.finished]:
            seq.release()
            self.running.remove(seq)
            self._last_step.pop(seq, None)
        return events
