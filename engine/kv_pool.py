"""The paged KV pool: fixed-size blocks of keys/values that every lane's cache is made of (docs/design.md#decoding,
"KV cache"; the idea of vLLM's PagedAttention and SGLang's token pool, no code taken).

A *block* holds the keys and values of :data:`BLOCK_TOKENS` consecutive positions of one lane, in every layer. The
pool's storage is a list of *slabs*; a slab holds ``blocks`` consecutive block ids and, per layer, one ``[H_kv,
blocks x BLOCK_TOKENS, D]`` tensor for keys and one for values, made at the first write of that layer (so the pool
learns the model's shapes, dtype and device from the keys themselves). Block ``i`` of a slab is slots ``[i T, (i +
1) T)`` of those tensors: a lane whose block table is a run of consecutive ids in one slab reads its keys as one view,
and the allocator hands out such runs whenever the free list has one (first fit), so a lane is usually one run
(two after a shared prefix: :mod:`unmask.engine.prefix_cache`). Slabs are never reallocated: nothing is copied when
the pool grows, and every view stays valid.

Capacity: ``capacity_blocks`` (from the KV budget: tokens on a CPU, bytes on a GPU from ``torch.cuda.mem_get_info``,
``engine/kv_budget.py``) or ``None`` (grows by slabs as large as everything so far). A block carries a reference
count: a lane holds one per block of its table, the prefix store one per block of a stored chunk; a block returns
to the free list when its count reaches 0. When an allocation finds too few free blocks, the pool asks
:attr:`KVPool.evict` (the prefix store's least-recently-used eviction) for the rest before it grows or fails.

Counters for the benchmark of bytes moved per step (``benchmarks/bench_kv_bytes.py``): :attr:`KVPool.written_bytes`
(new rows' keys/values written into blocks) and :attr:`KVPool.gathered_bytes` (a lane's keys copied into one tensor:
a reader that needs them contiguous while the lane's table is not one run).
"""
from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

__all__ = ["BLOCK_TOKENS", "KVPool", "PoolFull"]

#: tokens per block (vLLM's default block size; the prefix store's chunk is a whole number of blocks)
BLOCK_TOKENS = 16


class PoolFull(RuntimeError):
    """The pool has fewer free (or evictable) blocks than an allocation needs and cannot grow."""


@dataclass
class _Slab:
    first: int  # the first block id
    blocks: int
    k: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [H_kv, blocks x T, D]
    v: dict[int, torch.Tensor] = field(default_factory=dict)


class KVPool:
    """Blocks of KV storage with reference counts (not thread-safe: the engine thread alone uses it).

    Args:
        block_tokens: positions per block (>= 1).
        capacity_blocks: most blocks held (None: grows on demand).

    Raises:
        ValueError: ``block_tokens`` < 1 or ``capacity_blocks`` < 0.
    """

    def __init__(self, block_tokens: int = BLOCK_TOKENS, capacity_blocks: int | None = None):
        if block_tokens < 1:
            raise ValueError(f"block_tokens: must be >= 1, got {block_tokens}")
        if capacity_blocks is not None and capacity_blocks < 0:
            raise ValueError(f"capacity_blocks: must be >= 0, got {capacity_blocks}")
        self.block_tokens = int(block_tokens)
        self.capacity_blocks = capacity_blocks
        self._slabs: list[_Slab] = []
        self._firsts: list[int] = []  # slab first ids, ascending (bisect)
        self._free: list[int] = []  # free block ids, ascending
        self._refs: list[int] = []  # block id -> reference count
        self.evict: Callable[[int], None] | None = None  # frees at least n blocks if it can (the prefix store)
        self.written_bytes = 0
        self.gathered_bytes = 0

    # ------------------------------------------------------------------ accounting
    @property
    def total_blocks(self) -> int:
        """Block ids made so far."""
        return len(self._refs)

    @property
    def free_blocks(self) -> int:
        """Blocks an allocation can take without evicting: free ids plus what the capacity leaves unmade (None: no
        bound, reported as the free ids only)."""
        unmade = max(0, self.capacity_blocks - self.total_blocks) if self.capacity_blocks is not None else 0
        return len(self._free) + unmade

    @property
    def used_blocks(self) -> int:
        """Blocks with a reference."""
        return self.total_blocks - len(self._free)

    def refcount(self, block: int) -> int:
        """References to ``block`` (0: free)."""
        return self._refs[block]

    def set_capacity(self, blocks: int | None) -> None:
        """Bound the pool at ``blocks`` (None: unbounded). Blocks made already stay (a bound below them stops the
        pool from making more)."""
        if blocks is not None and blocks < 0:
            raise ValueError(f"capacity_blocks: must be >= 0, got {blocks}")
        self.capacity_blocks = blocks

    def block_bytes(self) -> int:
        """Bytes of one block over every layer's keys and values (0 before the first write)."""
        if not self._slabs or not self._slabs[0].k:
            return 0
        s = self._slabs[0]
        per_slot = sum(t.shape[0] * t.shape[2] * t.element_size() for t in (*s.k.values(), *s.v.values()))
        return per_slot * self.block_tokens

    # ------------------------------------------------------------------ blocks
    def allocate(self, n: int) -> list[int]:
        """``n`` blocks with one reference each, as one run of consecutive ids in one slab when there is one (an
        unbounded pool holding less than twice the blocks in use makes a slab of ``n`` for it rather than scatter
        them: memory stays within ~2x the peak in use).

        Raises:
            PoolFull: fewer than ``n`` blocks are free after eviction and the capacity is reached.
        """
        if n <= 0:
            return []
        self.ensure_free(n)
        at = self._run(n)
        if at is None and self.capacity_blocks is None and self.total_blocks < 2 * (self.used_blocks + n):
            self._add_slab(n)  # unbounded and not twice the blocks in use: one run of its own, not scattered blocks
            at = self._run(n)
        at = at or 0  # no run: the lowest free ids
        ids = self._free[at:at + n]
        del self._free[at:at + n]  # a slice of the sorted free list either way: one memmove, not a rebuild
        for b in ids:
            self._refs[b] = 1
        return ids

    def incref(self, blocks: list[int]) -> None:
        for b in blocks:
            if self._refs[b] <= 0:
                raise ValueError(f"block {b} is free: nothing to share")
            self._refs[b] += 1

    def decref(self, blocks: list[int]) -> None:
        """Drop one reference of each of ``blocks``; blocks left without one return to the free list (merged in
        once: an insertion per block cost O(free blocks) each, 0.23 s to release 8 lanes of 512 blocks from a
        100k-block pool)."""
        freed = []
        for b in blocks:
            self._refs[b] -= 1
            if self._refs[b] == 0:
                freed.append(b)
            elif self._refs[b] < 0:
                raise ValueError(f"block {b}: released more often than taken")
        if len(freed) == 1:
            bisect.insort(self._free, freed[0])
        elif freed:
            self._free.extend(freed)
            self._free.sort()  # two sorted runs (a lane's table may be out of order: sorted too): merged in C

    def ensure_free(self, n: int) -> None:
        """Make at least ``n`` blocks free: a new slab while the capacity allows (under a bound, all the room left
        at once: one slab), then eviction (:attr:`evict`).

        Raises:
            PoolFull: they cannot be found.
        """
        if len(self._free) >= n:
            return
        cap = self.capacity_blocks
        if cap is None:
            self._add_slab(max(n - len(self._free), self.total_blocks))
            return
        if cap > self.total_blocks:
            self._add_slab(cap - self.total_blocks)
        if len(self._free) < n and self.evict is not None:
            self.evict(n - len(self._free))
        if len(self._free) < n:
            raise PoolFull(f"KV pool: {n} blocks wanted, {len(self._free)} free of {cap} (after eviction)")

    def _add_slab(self, blocks: int) -> None:
        first = self.total_blocks
        self._slabs.append(_Slab(first, blocks))
        self._firsts.append(first)
        self._refs.extend([0] * blocks)
        self._free.extend(range(first, first + blocks))  # ids above every existing one: stays sorted

    def _run(self, n: int) -> int | None:
        """Where the first ``n`` consecutive free ids in one slab start in the free list, or None. Vectorized: a
        Python scan cost ~1 us per free block (0.1 s per join in a fragmented 100k-block pool)."""
        free = self._free
        if len(free) < n:
            return None
        if free[n - 1] - free[0] == n - 1 and self.slab_of(free[0]) is self.slab_of(free[n - 1]):
            return 0  # the usual case: the lowest free ids are a run
        ids = np.asarray(free, dtype=np.int64)
        # a run breaks where ids are not consecutive or a slab starts (ids of two slabs are never one run)
        breaks = np.flatnonzero((np.diff(ids) != 1) | np.isin(ids[1:], self._firsts))
        starts = np.concatenate(([0], breaks + 1))
        lengths = np.diff(np.concatenate((starts, [len(free)])))
        fit = np.flatnonzero(lengths >= n)
        return int(starts[fit[0]]) if fit.size else None

    def layers_of(self, block: int) -> int:
        """Layers written into ``block``'s slab."""
        return len(self.slab_of(block).k)

    def slab_of(self, block: int) -> _Slab:
        return self._slabs[bisect.bisect_right(self._firsts, block) - 1]

    # ------------------------------------------------------------------ storage
    def runs(self, table: list[int], end: int) -> list[tuple[_Slab, int, int]]:
        """The positions ``[0, end)`` of a lane with block table ``table`` as runs ``(slab, first slot, last slot +
        1)`` of consecutive storage, in position order."""
        T = self.block_tokens
        out: list[tuple[_Slab, int, int]] = []
        for i in range(-(-end // T)):
            b = table[i]
            slab = self.slab_of(b)
            s = (b - slab.first) * T
            e = s + min(T, end - i * T)
            if out and out[-1][0] is slab and out[-1][2] == s:
                out[-1] = (slab, out[-1][1], e)
            else:
                out.append((slab, s, e))
        return out

    def storage(self, slab: _Slab, layer: int, like: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``slab``'s ``[H_kv, blocks x T, D]`` key and value tensors of ``layer``, made from ``like`` (``[H_kv, *,
        D]``: shape, dtype, device) at the first write. Made outside inference mode (a normal tensor may be written
        in place in and out of it: the prefix store writes outside a step)."""
        k = slab.k.get(layer)
        if k is None:
            if like is None:
                raise KeyError(f"KV pool: layer {layer} was never written")
            with torch.inference_mode(False):
                shape = (like.shape[0], slab.blocks * self.block_tokens, like.shape[-1])
                k = slab.k[layer] = torch.empty(shape, dtype=like.dtype, device=like.device)
                slab.v[layer] = torch.empty(shape, dtype=like.dtype, device=like.device)
        return k, slab.v[layer]
