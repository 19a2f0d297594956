"""KV caches: per-lane storage of committed keys/values and the batched view one forward uses.

A *lane* is one canvas variant of one request (the conditional canvas, plus the unconditional one under CFG).
Each lane keeps the keys and values of the tokens it has committed in blocks of the paged KV pool
(``engine/kv_pool.py``: a block table per lane), together with the position/group metadata the shared mask builder
needs (``unmask.engine.attention``).

Cache policies (``SamplingParams.cache``, docs/design.md#decoding and #decisions):

* ``none``: nothing cached; every step forwards the canvas (up to the active block's end for causal families).
* exact (``auto`` on ``prefix_causal`` / ``block_causal`` models): committed tokens are forwarded once - the
  just-committed block in the same forward as the next step - and their KV appended; each step forwards only
  the active block. Output identical to ``none`` (the committed tokens' attention never sees later tokens).
* ``prefix`` (bidirectional models, Fast-dLLM): at the first step of every block the whole canvas is forwarded
  and the KV of the positions before the block is kept; later steps forward the block and everything after it.
* ``dual`` (bidirectional models, Fast-dLLM dual cache): as ``prefix`` but the positions after the block are
  cached too, so later steps forward only the block. Approximate: quality change measured in ``benchmarks/``.
"""
from __future__ import annotations

import weakref

import numpy as np
import torch

from .kv_pool import KVPool, PoolFull
from .transfer import to_device


class LaneCache:
    """Committed KV of one lane: a block table into a :class:`~unmask.engine.kv_pool.KVPool`.

    Position ``p`` of the lane lives in block ``table[p // T]`` at slot ``p % T`` (T = the pool's block size); the
    first :attr:`length` positions are committed. Appending writes after them into the lane's blocks (taking more
    blocks when the table is full: nothing already written moves), and a forward (:class:`BatchKV`) whose chunk fits
    in the blocks after the committed part writes its new keys/values there and attends to views of the blocks
    (:meth:`segments`: one per run of consecutive storage), so neither a step nor a commit copies the cache. The
    positions after :attr:`length` are scratch: nothing reads them as cached, and a forward never changes
    :attr:`length`, the committed values or the table.

    Blocks shared with the prefix store (:mod:`unmask.engine.prefix_cache`, :meth:`share`) hold committed positions
    only, which nothing writes again; a write into a block another holder references copies its committed part
    into a block of the lane's own first (copy on write: only after :meth:`reset`, which no sharing lane calls).

    Args:
        capacity_hint: tokens to reserve at the first append (a sequence passes its canvas length: committed tokens
            never exceed it, and cached + forwarded positions fit in it except in speculative steps with branches
            near the canvas end, which take more blocks).
        pool: the pool to take blocks from (the denoiser's; None: bound later by :meth:`bind`, or a pool of the
            lane's own at the first write).

    Attributes:
        table: the block ids, in position order (one reference each, released by :meth:`clear` or when the lane is
            garbage-collected).
        pos, grp: ``[n]`` int64 position and attention group of each cached token.
        carry_slot / carry_position: the row of the denoiser's :class:`CarryPool` holding the output of the last
            committed token (the logit-shifted prediction for the first position after it, kept because that token
            is not forwarded again) and that token's position (-1: none).
    """

    def __init__(self, capacity_hint: int = 0, pool: KVPool | None = None):
        self.capacity_hint = int(capacity_hint)
        self.pool: KVPool | None = None
        self.table: list[int] = []
        self.layers = 0  # layers written so far
        self._n = 0
        self._meta: torch.Tensor | None = None  # [2, capacity] int64 on the host: positions, groups (doubling)
        self.carry_slot = -1
        self.carry_position = -1
        self._runs: tuple[int, list] | None = None  # (end, runs) of the last :meth:`_runs_to`
        self._release: weakref.finalize | None = None
        #: bumped whenever the cached tokens' metadata changes (a commit, a reset): a key for what is computed from it
        self.meta_version = 0
        self.sees_memo: tuple | None = None  # the denoiser's ``sees_every_key`` answer, keyed by meta_version
        if pool is not None:
            self.bind(pool)

    def bind(self, pool: KVPool) -> None:
        """Take blocks from ``pool`` from now on (a no-op when bound to it already).

        Raises:
            ValueError: the lane holds blocks of another pool.
        """
        if self.pool is pool:
            return
        if self.table:
            raise ValueError("LaneCache: holds blocks of another pool")
        if self._release is not None:  # bound before (to a pool of its own), holding nothing
            self._release.detach()
        self.pool = pool
        self._release = weakref.finalize(self, pool.decref, self.table)  # the same list: its blocks when collected

    @property
    def length(self) -> int:
        """Number of cached tokens."""
        return self._n

    @property
    def pos(self) -> torch.Tensor | None:
        """``[n]`` int64 positions of the cached tokens (a view; None when nothing is cached)."""
        return self._meta[0, :self._n] if self._n else None

    @property
    def grp(self) -> torch.Tensor | None:
        """``[n]`` int64 attention groups of the cached tokens (a view; None when nothing is cached)."""
        return self._meta[1, :self._n] if self._n else None

    @property
    def capacity(self) -> int:
        """Positions the lane's blocks hold (0 before the first reservation)."""
        return len(self.table) * self.pool.block_tokens if self.pool is not None else 0

    @property
    def keys(self) -> list[torch.Tensor]:
        """Per layer ``[H_kv, n, D]`` committed keys (views when the table is one run, else gathered copies)."""
        return [self.key_value(i)[0] for i in range(self.layers)] if self._n else []

    @property
    def values(self) -> list[torch.Tensor]:
        return [self.key_value(i)[1] for i in range(self.layers)] if self._n else []

    def reserve(self, tokens: int, required: bool = True) -> bool:
        """Hold blocks for positions ``[0, tokens)`` (taking the missing ones). Returns whether it does; with
        ``required`` a full pool raises :class:`~unmask.engine.kv_pool.PoolFull` instead."""
        if self.pool is None:
            self.bind(KVPool())
        T = self.pool.block_tokens
        missing = -(-int(tokens) // T) - len(self.table)
        if missing <= 0:
            return True
        try:
            self.table.extend(self.pool.allocate(missing))
        except PoolFull:
            if required:
                raise
            return False
        self._runs = None
        return True

    def _runs_to(self, end: int) -> list:
        if self._runs is None or self._runs[0] != end:
            self._runs = (end, self.pool.runs(self.table, end))
        return self._runs[1]

    def segments(self, layer: int, end: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``[H_kv, m_i, D]`` key and value views covering positions ``[0, end)`` in order, one per run of
        consecutive storage (one when the table is one run)."""
        if end <= 0:
            return []
        out = []
        for slab, s, e in self._runs_to(end):
            k, v = self.pool.storage(slab, layer)
            out.append((k[:, s:e], v[:, s:e]))
        return out

    def key_value(self, layer: int, extra: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """``[H_kv, n + extra, D]`` keys/values of one layer: the cached part and ``extra`` scratch positions
        (``n + extra`` must not exceed :attr:`capacity`). A view when they are one run of storage, else one copy
        (counted in the pool's ``gathered_bytes``)."""
        segs = self.segments(layer, self._n + extra)
        if len(segs) == 1:
            return segs[0]
        k, v = torch.cat([s[0] for s in segs], 1), torch.cat([s[1] for s in segs], 1)
        self.pool.gathered_bytes += 2 * k.numel() * k.element_size()
        return k, v

    def write(self, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write ``[H_kv, m, D]`` keys/values at positions ``[start, start + m)`` (inside :attr:`capacity`, at or
        after :attr:`length`)."""
        m = int(keys.shape[1])
        T = self.pool.block_tokens
        self._own(start // T, -(-(start + m) // T))
        at = 0  # the position of the run's first slot
        for slab, s, e in self._runs_to(start + m):
            lo, hi = max(start, at), at + e - s
            if hi > lo:
                k, v = self.pool.storage(slab, layer, keys)
                k[:, s + lo - at:s + hi - at] = keys[:, lo - start:hi - start]
                v[:, s + lo - at:s + hi - at] = values[:, lo - start:hi - start]
            at = hi
        self.layers = max(self.layers, layer + 1)
        self.pool.written_bytes += 2 * keys.numel() * keys.element_size()

    def _own(self, first: int, last: int) -> None:
        """Copy on write: table entries ``[first, last)`` held by another too get a block of the lane's own,
        holding the same committed positions."""
        pool = self.pool
        for i in range(first, min(last, len(self.table))):
            b = self.table[i]
            if pool.refcount(b) > 1:
                new = pool.allocate(1)[0]
                T = pool.block_tokens
                keep = max(0, min(T, self._n - i * T))
                if keep:
                    src, dst = pool.slab_of(b), pool.slab_of(new)
                    so, do = (b - src.first) * T, (new - dst.first) * T
                    for layer in range(self.layers):
                        ks, vs = pool.storage(src, layer)
                        kd, vd = pool.storage(dst, layer, ks)
                        kd[:, do:do + keep] = ks[:, so:so + keep]
                        vd[:, do:do + keep] = vs[:, so:so + keep]
                self.table[i] = new
                pool.decref([b])
                self._runs = None

    def nbytes(self) -> int:
        """Bytes of the blocks the lane holds (its table: a sequence's lane holds its canvas length once it has
        committed anything, the amount the scheduler's ``max_cached_tokens`` budget reserves)."""
        return len(self.table) * self.pool.block_bytes() if self.pool is not None else 0

    def clear(self) -> None:
        """Drop everything and release the blocks (cancellation, end of a request)."""
        if self.pool is not None and self.table:
            self.pool.decref(self.table)
        self.table.clear()
        self._runs = None
        self.reset()

    def reset(self) -> None:
        """Forget the cached tokens but keep the blocks (a prefix/dual cache refresh refills them at once)."""
        self._n = 0
        self.carry_position = -1
        self.meta_version += 1

    @classmethod
    def committed(cls, keys: list[torch.Tensor], values: list[torch.Tensor], pos: torch.Tensor,
                  grp: torch.Tensor) -> "LaneCache":
        """A cache holding exactly the given per-layer ``[H_kv, n, D]`` keys/values (copied) and ``[n]`` metadata."""
        lane = cls(int(pos.numel()))
        lane.append(keys, values, pos, grp)
        return lane

    def append(self, keys: list[torch.Tensor], values: list[torch.Tensor], pos: torch.Tensor, grp: torch.Tensor) -> None:
        """Append ``[H_kv, m, D]`` per-layer keys/values of m newly committed tokens."""
        m = int(keys[0].shape[1]) if keys else 0
        if not m:
            return
        self.reserve(max(self._n + m, self.capacity_hint if not self.table else 0))
        for layer, (k, v) in enumerate(zip(keys, values)):
            self.write(layer, self._n, k, v)
        self.adopt_scratch(m, pos, grp)

    def share(self, blocks: list[int], pos: torch.Tensor, grp: torch.Tensor) -> None:
        """Make ``blocks`` (full blocks of committed keys/values another holder keeps, e.g. the prefix store) the
        lane's next positions, taking a reference to each: no copy. The lane's length must be a whole number of
        blocks; blocks it reserved there already are released.

        Raises:
            ValueError: the lane's length is not a whole number of blocks.
        """
        if self.pool is None:
            raise ValueError("LaneCache.share: the lane has no pool")
        T = self.pool.block_tokens
        if self._n % T:
            raise ValueError(f"LaneCache.share: length {self._n} is not a whole number of {T}-token blocks")
        first = self._n // T
        self.pool.incref(blocks)
        replaced = self.table[first:first + len(blocks)]
        self.table[first:first + len(blocks)] = blocks
        if replaced:
            self.pool.decref(replaced)
        self._runs = None
        self.adopt_scratch(len(blocks) * T, pos, grp)

    def blocks(self, start: int, end: int) -> list[int]:
        """The table's blocks of positions ``[start, end)`` (whole blocks)."""
        T = self.pool.block_tokens
        return self.table[start // T:-(-end // T)]

    def adopt_scratch(self, m: int, pos: torch.Tensor, grp: torch.Tensor) -> None:
        """Commit the first ``m`` scratch positions, whose keys/values a forward already wrote after the cached part
        (:meth:`BatchKV.commit`), with their ``[m]`` positions and groups."""
        if self._n + m > self.capacity:
            raise ValueError(f"LaneCache: {m} scratch positions after {self._n} exceed the capacity {self.capacity}")
        n = self._n
        if self._meta is None or self._meta.shape[1] < n + m:  # doubling: a commit costs its own rows, amortized
            grown = torch.empty(2, max(n + m, 2 * (self._meta.shape[1] if self._meta is not None else 0), 16),
                                dtype=torch.long)
            if n:
                grown[:, :n] = self._meta[:, :n]
            self._meta = grown
        self._meta[0, n:n + m] = pos
        self._meta[1, n:n + m] = grp
        self._n = n + m
        self.meta_version += 1


class CarryPool:
    """The carried logits of every lane on the model's device: one ``[capacity, V]`` tensor, a slot per lane
    (:attr:`LaneCache.carry_slot`), so a step reads and writes every lane's carry with one indexed op each instead
    of a tensor per lane. A slot is taken at a lane's first carry and freed when the lane is garbage-collected;
    the tensor doubles when full."""

    def __init__(self):
        self.rows: torch.Tensor | None = None
        self._free: list[int] = []
        self._used = 0

    def slot(self, lane: LaneCache) -> int:
        """``lane``'s slot (taken now if it has none)."""
        if lane.carry_slot < 0:
            lane.carry_slot = self._free.pop() if self._free else self._take()
            weakref.finalize(lane, self._free.append, lane.carry_slot)
        return lane.carry_slot

    def _take(self) -> int:
        self._used += 1
        return self._used - 1

    def write(self, slots: list[int], values: torch.Tensor) -> None:
        """Store ``[k, V]`` ``values`` in ``slots``."""
        need = max(slots) + 1
        if self.rows is None or self.rows.shape[0] < need or self.rows.shape[1] != values.shape[1] \
                or self.rows.dtype != values.dtype or self.rows.device != values.device:
            cap = max(need, 2 * (self.rows.shape[0] if self.rows is not None else 4))
            grown = values.new_empty(cap, values.shape[1])
            if self.rows is not None and self.rows.shape[1:] == values.shape[1:] and self.rows.dtype == values.dtype \
                    and self.rows.device == values.device:
                grown[: self.rows.shape[0]] = self.rows
            self.rows = grown
        self.rows[to_device(torch.tensor(slots, dtype=torch.long), values.device)] = values


class _ScratchPlan:
    """One lane-mode forward's scratch writes (:meth:`BatchKV._scratch_plan`): the batch rows written, their lanes,
    per slab ``(pool, slab, [M] destination slots, [M] source rows)`` and the layers written so far (one set shared
    by every written row's ``BatchKV._scratch`` entry)."""

    __slots__ = ("rows", "lanes", "slabs", "layers")

    def __init__(self):
        self.rows: set[int] = set()
        self.lanes: list[LaneCache] = []
        self.slabs: list[tuple] = []
        self.layers: set[int] = set()


class BatchKV:
    """Duck-typed transformers ``Cache`` for one forward over several lanes.

    ``update()`` returns the padded cached keys/values of every lane followed by the new chunk's (lane mode: the
    chunk's alone, each lane's rows written into its blocks after its cached ones), and keeps the new ones so that
    the caller can commit selected positions into each lane afterwards. Nothing is committed implicitly: a forward
    may write a chunk into a lane's scratch positions, never into its cached part, its length or its table.

    Args:
        lanes: the lane caches, one per batch row (rows without a cache pass an empty ``LaneCache``).
        device: device of the keys.
    """

    is_compileable = False

    def __init__(self, lanes: list[LaneCache], device: torch.device):
        self.lanes = lanes
        self.device = device
        self.cached_len = max((lane.length for lane in lanes), default=0)
        # batch row -> (the lane's length then, layers) for rows whose chunk a forward wrote after the lane's cached keys
        self._scratch: dict[int, tuple[int, set[int]]] = {}
        seen: set[int] = set()
        self._shared = {id(lane) for lane in lanes if id(lane) in seen or seen.add(id(lane))}  # in two rows
        self.new_keys: dict[int, torch.Tensor] = {}
        self.new_values: dict[int, torch.Tensor] = {}
        # lane mode (engine/lane_attention.py): update() returns the new keys only and the attention reads each
        # lane's keys from its blocks; rows[b] = batch row b's real chunk rows, sees_all[b] = every one of them sees
        # every key of its lane (no mask needed)
        self.lane_mode = False
        self.rows: list[int] = []
        self.sees_all: list[bool] = []
        self._written: dict[int, set[int]] = {}  # layer -> rows whose chunk went into their lane's scratch positions
        self._plan: _ScratchPlan | None = None  # lane mode: the forward's scratch writes (:meth:`_scratch_plan`)
        self._masks: dict[int, torch.Tensor] = {}
        self.lane_groups = None  # engine/lane_attention.py's grouping of the rows, made at the forward's first layer

    def key_meta(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(pos, grp, valid)`` of the cached part, each ``[B, C]`` (C = longest lane cache) on the keys' device,
        assembled on the host (the lanes' metadata is host state) and copied once."""
        B, C = len(self.lanes), self.cached_len
        meta = torch.zeros(3, B, C, dtype=torch.long)
        meta[1].fill_(-1)
        for b, lane in enumerate(self.lanes):
            n = lane.length
            if n:
                meta[0, b, :n] = lane.pos
                meta[1, b, :n] = lane.grp
                meta[2, b, :n] = 1
        meta = to_device(meta, self.device)
        return meta[0], meta[1], meta[2].bool()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """transformers hook: ``[B, H, Q, D]`` new keys/values -> ``[B, H, C + Q, D]`` keys/values to attend, lane
        caches right-padded with zeros to the longest (C) and the new chunk after them.

        One lane with room for the chunk in its blocks (and no autograd: the training ``draft`` objective forwards
        with gradients): the new keys go into its scratch positions and a view is returned (no copy of the cache
        when the lane is one run of storage, else one gathered copy). Otherwise one copy of each lane's cache and of
        the chunk into a fresh tensor.
        """
        self.new_keys[layer_idx] = key_states
        self.new_values[layer_idx] = value_states
        if self.lane_mode:  # each lane's chunk after its cached keys, in its own blocks where they have room
            self._written[layer_idx] = self._write_planned(key_states, value_states, layer_idx)
            return key_states, value_states
        if self.cached_len == 0:
            return key_states, value_states
        B, H, Q, D = key_states.shape
        C = self.cached_len
        if B == 1 and self._to_scratch(0, key_states, value_states, layer_idx):
            k, v = self.lanes[0].key_value(layer_idx, extra=Q)
            return k[None], v[None]
        k = key_states.new_empty(B, H, C + Q, D)
        v = value_states.new_empty(B, H, C + Q, D)
        for b, lane in enumerate(self.lanes):
            n = lane.length
            if n:
                lk, lv = lane.key_value(layer_idx)
                k[b, :, :n] = lk
                v[b, :, :n] = lv
            if n < C:
                k[b, :, n:C] = 0
                v[b, :, n:C] = 0
        k[:, :, C:] = key_states
        v[:, :, C:] = value_states
        return k, v

    def lane_update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int
                    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """As :meth:`update`, but each lane's keys/values on their own: ``[1, H, n_b + Q, D]`` for batch row ``b``, its
        ``n_b`` cached keys then the whole chunk row ``b`` (the layout of ``engine/row_attention.py``).

        A lane with room for the chunk gets it written into its scratch positions and a view of its blocks is
        returned (a decoding lane in one run of storage costs no copy of its cache; :meth:`commit` then adopts the
        written keys); a lane with nothing cached gets a view of the chunk; otherwise (no room, autograd, a lane
        cache shared by two rows, a lane in several runs) one copy of that lane's cache and chunk."""
        self.new_keys[layer_idx] = key_states
        self.new_values[layer_idx] = value_states
        out = []
        for b, lane in enumerate(self.lanes):
            kb, vb = key_states[b:b + 1], value_states[b:b + 1]
            n = lane.length
            if n and self._to_scratch(b, key_states, value_states, layer_idx):
                k, v = lane.key_value(layer_idx, extra=key_states.shape[2])
                kb, vb = k[None], v[None]
            elif n:
                lk, lv = lane.key_value(layer_idx)
                kb, vb = torch.cat([lk[None], kb], 2), torch.cat([lv[None], vb], 2)
            out.append((kb, vb))
        return out

    def lane_run(self, b: int, layer_idx: int) -> tuple | None:
        """Lane mode: ``(pool, slab, first slot)`` when batch row ``b``'s keys in layer ``layer_idx`` - its ``n_b``
        cached keys and ``rows[b]`` chunk rows, written after them - are slots ``[first, first + n_b + rows[b])`` of
        one slab of the pool (what :meth:`lane_segments` returns as one view), else None (nothing cached, the chunk
        not written there, several runs). The same in every layer of a forward (one :class:`_ScratchPlan`)."""
        lane = self.lanes[b]
        n = lane.length
        if not n or b not in self._written.get(layer_idx, ()):
            return None
        runs = lane._runs_to(n + self.rows[b])
        if len(runs) != 1:
            return None
        return lane.pool, runs[0][0], runs[0][1]

    def lane_segments(self, b: int, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor
                      ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], int]:
        """Lane mode: batch row ``b``'s keys and values as ``[H, m_i, D]`` pieces in key order (its ``n_b`` cached
        keys, then its ``rows[b]`` chunk rows) and ``n_b``. Views of the lane's blocks, one per run of storage, when
        the chunk was written after the cached keys; else the cached runs' views followed by the chunk's own rows
        (no room, autograd, a lane shared by two rows). Never a copy of the cache."""
        lane, q = self.lanes[b], self.rows[b]
        n = lane.length
        if b in self._written.get(layer_idx, ()):
            return lane.segments(layer_idx, n + q), n
        return [*lane.segments(layer_idx, n), (key_states[b, :, :q], value_states[b, :, :q])], n

    def lane_mask(self, b: int, mask: torch.Tensor, n: int, q: int, C: int) -> torch.Tensor:
        """Lane mode: ``[1, 1, q, n + q]`` bool, batch row ``b``'s slice of the forward's ``[B, 1, Q, C + Q]`` mask
        (its ``n`` cached keys and ``q`` chunk keys; built once per forward)."""
        got = self._masks.get(b)
        if got is None:
            rows = mask[b:b + 1, :, :q]
            got = self._masks[b] = torch.cat([rows[..., :n], rows[..., C:C + q]], -1)
        return got

    def _to_scratch(self, b: int, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
                    rows: int | None = None) -> bool:
        """Write batch row ``b``'s chunk (its first ``rows`` rows, default all Q: ``[H, rows, D]``) after its lane's
        cached keys, in the lane's blocks (taking more when the table is full and the pool has them), if no gradient
        flows (the training ``draft`` objective forwards with gradients) and no other row uses the lane. Returns
        whether it did."""
        lane = self.lanes[b]
        n, q = lane.length, key_states.shape[2] if rows is None else rows
        if (key_states.requires_grad or value_states.requires_grad or id(lane) in self._shared
                or (n + q > lane.capacity and not lane.reserve(n + q, required=False))):
            return False
        lane.write(layer_idx, n, key_states[b, :, :q], value_states[b, :, :q])
        written = self._scratch.get(b)
        if written is None:  # first layer of this forward (no set built per layer and lane)
            self._scratch[b] = written = (n, set())
        written[1].add(layer_idx)
        return True

    def _scratch_plan(self, key_states: torch.Tensor, value_states: torch.Tensor) -> _ScratchPlan:
        """Lane mode, once per forward: which batch rows' chunks go after their lane's cached keys (a lane with
        cached keys where :meth:`_to_scratch` would write: no gradient, not shared, room in its blocks, taken now
        when the pool has them; its blocks owned, copy on write) and, per slab, the ``[M]`` destination slots and
        ``[M]`` source rows (``b * Q + i``) of every layer's writes, on the keys' device."""
        B, _, Q, _ = key_states.shape
        plan = _ScratchPlan()
        if key_states.requires_grad or value_states.requires_grad:
            return plan
        per_slab: dict[int, tuple] = {}
        for b, lane in enumerate(self.lanes):
            n, q = lane.length, self.rows[b]
            if not n or id(lane) in self._shared or (n + q > lane.capacity
                                                              and not lane.reserve(n + q, required=False)):
                continue
            T = lane.pool.block_tokens
            lane._own(n // T, -(-(n + q) // T))
            _add_slots(per_slab, lane, n, n + q, np.arange(b * Q, b * Q + q))
            plan.rows.add(b)
            plan.lanes.append(lane)
            self._scratch[b] = (n, plan.layers)
        dev = key_states.device
        for pool, slab, dst, src in per_slab.values():
            idx = to_device(torch.from_numpy(np.stack([np.concatenate(dst), np.concatenate(src)])), dev)
            plan.slabs.append((pool, slab, idx[0], idx[1]))
        return plan

    def _write_planned(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int) -> set[int]:
        """Lane mode: write one layer's chunks after their lanes' cached keys as :meth:`_scratch_plan` says (one
        gather and one indexed copy per slab for keys and values, not two slice copies per lane); returns the batch
        rows written."""
        plan = self._plan
        if plan is None:
            plan = self._plan = self._scratch_plan(key_states, value_states)
        if not plan.rows:
            return plan.rows
        B, H, Q, D = key_states.shape
        flat_k = key_states.transpose(0, 1).reshape(H, B * Q, D)  # [H, B Q, D] (a copy only when not contiguous so)
        flat_v = value_states.transpose(0, 1).reshape(H, B * Q, D)
        for pool, slab, dst, src in plan.slabs:
            k, v = pool.storage(slab, layer_idx, key_states[0])
            k.index_copy_(1, dst, flat_k.index_select(1, src))
            v.index_copy_(1, dst, flat_v.index_select(1, src))
            pool.written_bytes += 2 * int(src.shape[0]) * H * D * key_states.element_size()
        for lane in plan.lanes:
            if lane.layers <= layer_idx:
                lane.layers = layer_idx + 1
        plan.layers.add(layer_idx)
        return plan.rows

    def commit(self, row: int, idx: torch.Tensor, lane: LaneCache, pos: torch.Tensor, grp: torch.Tensor) -> None:
        """Append to ``lane`` the new keys/values of batch row ``row`` at chunk indices ``idx`` (``[m]`` int64) with
        their ``[m]`` positions and groups.

        When this forward wrote the chunk into that lane's scratch positions (cache unchanged since) and ``idx``
        is the chunk's first m positions - the usual commit: the causal tokens the forward starts with - the values
        are already in place and only the length moves; otherwise they are copied in.
        """
        if self._adopts(row, idx, lane):
            lane.adopt_scratch(int(idx.numel()), pos, grp)
            return
        keys, values = self.new_kv(row, idx)
        lane.append(keys, values, pos, grp)

    def commit_all(self, commits: list[tuple[int, torch.Tensor, LaneCache, torch.Tensor, torch.Tensor]]) -> None:
        """:meth:`commit` of each ``(row, idx, lane, pos, grp)``, in order: those whose keys/values must be copied
        in, into lanes that appear once, with one gather and one indexed copy per slab per layer for all of them
        (the lane's blocks reserved and owned first, as :meth:`LaneCache.append` does), the rest one by one."""
        lanes = [c[2] for c in commits]
        seen: set[int] = set()
        twice = {id(lane) for lane in lanes if id(lane) in seen or seen.add(id(lane))}
        copies = []
        for row, idx, lane, pos, grp in commits:
            m = int(idx.numel())
            if not m:
                continue
            if self._adopts(row, idx, lane):
                lane.adopt_scratch(m, pos, grp)
            elif id(lane) in twice or not self.new_keys or idx.device.type != "cpu":
                keys, values = self.new_kv(row, idx)
                lane.append(keys, values, pos, grp)
            else:
                copies.append((row, idx, lane, pos, grp))
        if copies:
            self._copy_in(copies)

    def _adopts(self, row: int, idx: torch.Tensor, lane: LaneCache) -> bool:
        """Whether :meth:`commit` only adopts scratch positions (this forward wrote the chunk after the lane's
        cached keys in every layer and ``idx`` is its first m rows)."""
        m = int(idx.numel())
        written = self._scratch.get(row)
        return (written is not None and lane is self.lanes[row] and lane.length == written[0] and m > 0
                and len(written[1]) == lane.layers
                and torch.equal(idx, torch.arange(m, device=idx.device, dtype=idx.dtype)))

    def _copy_in(self, commits: list) -> None:
        """Append each ``(row, idx, lane, pos, grp)``'s new keys/values (host ``idx``; distinct lanes) to its lane:
        per slab one ``[M]`` destination-slot and source-row index, per layer one gather and one indexed copy."""
        layers = sorted(self.new_keys)
        first = self.new_keys[layers[0]]
        B, H, Q, D = first.shape
        per_slab: dict[int, tuple] = {}
        for row, idx, lane, _, _ in commits:
            n, m = lane.length, int(idx.numel())
            lane.reserve(max(n + m, lane.capacity_hint if not lane.table else 0))
            T = lane.pool.block_tokens
            lane._own(n // T, -(-(n + m) // T))
            src = idx.numpy() + row * Q
            _add_slots(per_slab, lane, n, n + m, src)
        dev = first.device
        slabs = []
        for pool, slab, dst, src in per_slab.values():
            idx = to_device(torch.from_numpy(np.stack([np.concatenate(dst), np.concatenate(src)])), dev)
            slabs.append((pool, slab, idx[0], idx[1]))
        for layer in layers:
            keys, values = self.new_keys[layer], self.new_values[layer]
            flat_k = keys.transpose(0, 1).reshape(H, B * Q, D)
            flat_v = values.transpose(0, 1).reshape(H, B * Q, D)
            for pool, slab, dst, src in slabs:
                k, v = pool.storage(slab, layer, keys[0])
                k.index_copy_(1, dst, flat_k.index_select(1, src))
                v.index_copy_(1, dst, flat_v.index_select(1, src))
                pool.written_bytes += 2 * int(src.shape[0]) * H * D * keys.element_size()
        for _, idx, lane, pos, grp in commits:
            lane.layers = max(lane.layers, len(layers))
            lane.adopt_scratch(int(idx.numel()), pos, grp)

    def new_kv(self, row: int, idx: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per-layer ``[H, m, D]`` keys/values of batch row ``row`` at chunk indices ``idx`` (length m)."""
        layers = sorted(self.new_keys)
        keys = [self.new_keys[i][row][:, idx].contiguous() for i in layers]
        values = [self.new_values[i][row][:, idx].contiguous() for i in layers]
        return keys, values

    # transformers calls these on some code paths; an external cache reports its own size
    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Cached length C (longest lane cache, in tokens), the same for every layer."""
        return self.cached_len

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` for transformers' mask builders: ``(C + query_length, 0)``."""
        return self.cached_len + query_length, 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        """Offset of the new chunk's queries in the key axis: the cached length C."""
        return self.cached_len


def _add_slots(per_slab: dict, lane, n: int, end: int, sources: np.ndarray) -> None:
    """Add the lane's pool slots of positions ``[n, end)`` to ``per_slab`` (per slab id: ``(pool, slab, slot index
    arrays, source row arrays)``), ``sources[i]`` being the source row of position ``n + i``."""
    at = 0  # the position of the run's first slot
    for slab, s, e in lane._runs_to(end):
        lo, hi = max(n, at), at + e - s
        if hi > lo:
            got = per_slab.get(id(slab))
            if got is None:
                got = per_slab[id(slab)] = (lane.pool, slab, [], [])
            got[2].append(np.arange(s + lo - at, s + hi - at))
            got[3].append(sources[lo - n:hi - n])
        at = hi
