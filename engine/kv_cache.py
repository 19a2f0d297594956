"""KV caches: per-lane storage of committed keys/values and the batched view one forward uses.

A *lane* is one canvas variant of one request (the conditional canvas, plus the unconditional one under CFG).
Each lane keeps, per layer, the keys and values of the tokens it has committed (``[H_kv, n, D]``), together with
the position/group metadata the shared mask builder needs (``unmask.engine.attention``).

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

import torch

from .transfer import to_device


class LaneCache:
    """Committed KV of one lane, in per-layer buffers that grow in place.

    Each layer's keys and values live in a ``[H_kv, capacity, D]`` buffer of which the first :attr:`length`
    positions are committed; appending writes after them (no re-copy of what is cached), and a one-lane forward
    (:class:`BatchKV`) whose chunk fits in the free tail writes its new keys/values there and attends to a view of
    the buffer, so the per-layer ``cat`` of cached + new keys disappears. The free tail is scratch: nothing reads it
    as cached, and a forward never changes :attr:`length`, the committed values or the capacity.

    Args:
        capacity_hint: tokens to allocate at the first append (a sequence passes its canvas length: committed
            tokens never exceed it, and cached + forwarded positions fit in it except in speculative steps with
            branches near the canvas end, which then take the copying path); appends beyond it double the buffers.

    Attributes:
        keys, values: per layer ``[H_kv, n, D]`` views of the committed part (empty list before the first commit).
        pos, grp: ``[n]`` int64 position and attention group of each cached token.
        carry_slot / carry_position: the row of the denoiser's :class:`CarryPool` holding the output of the last
            committed token (the logit-shifted prediction for the first position after it, kept because that token
            is not forwarded again) and that token's position (-1: none).
    """

    def __init__(self, capacity_hint: int = 0):
        self.capacity_hint = int(capacity_hint)
        self._k: list[torch.Tensor] = []
        self._v: list[torch.Tensor] = []
        self._n = 0
        self.pos: torch.Tensor | None = None
        self.grp: torch.Tensor | None = None
        self.carry_slot = -1
        self.carry_position = -1

    @property
    def length(self) -> int:
        """Number of cached tokens."""
        return self._n

    @property
    def capacity(self) -> int:
        """Tokens the buffers hold room for (0 before the first append)."""
        return int(self._k[0].shape[1]) if self._k else 0

    @property
    def keys(self) -> list[torch.Tensor]:
        return [b[:, :self._n] for b in self._k] if self._n else []

    @property
    def values(self) -> list[torch.Tensor]:
        return [b[:, :self._n] for b in self._v] if self._n else []

    def key_value(self, layer: int, extra: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """``[H_kv, n + extra, D]`` views of one layer's buffers: the cached part and ``extra`` scratch positions
        (``n + extra`` must not exceed :attr:`capacity`)."""
        end = self._n + extra
        return self._k[layer][:, :end], self._v[layer][:, :end]

    def nbytes(self) -> int:
        """Bytes allocated for keys and values (the buffers' full capacity: a sequence's lane holds its canvas
        length once it has committed anything, the amount the scheduler's ``max_cached_tokens`` budget reserves)."""
        return sum(t.numel() * t.element_size() for t in (*self._k, *self._v))

    def clear(self) -> None:
        """Drop everything and free the buffers (cancellation, end of a request)."""
        self._k, self._v = [], []
        self.reset()

    def reset(self) -> None:
        """Forget the cached tokens but keep the buffers (a prefix/dual cache refresh refills them at once)."""
        self._n, self.pos, self.grp = 0, None, None
        self.carry_position = -1

    @classmethod
    def committed(cls, keys: list[torch.Tensor], values: list[torch.Tensor], pos: torch.Tensor,
                  grp: torch.Tensor) -> "LaneCache":
        """A cache holding exactly the given per-layer ``[H_kv, n, D]`` keys/values (copied) and ``[n]`` metadata."""
        lane = cls(int(pos.numel()))
        lane.append(keys, values, pos, grp)
        return lane

    def _grow(self, tokens: int, like_k: list[torch.Tensor], like_v: list[torch.Tensor]) -> None:
        """Make room for ``tokens`` committed positions (doubling; keeps the cached part). ``like_k``/``like_v``:
        per-layer ``[H_kv, *, D]`` tensors giving shapes, dtype and device when nothing is allocated yet."""
        cap = self.capacity
        if tokens <= cap:
            return
        new_cap = max(tokens, 2 * cap, self.capacity_hint if not self._k else 0)
        ref_k = self._k or like_k
        ref_v = self._v or like_v
        k_new = [t.new_empty(t.shape[0], new_cap, t.shape[-1]) for t in ref_k]
        v_new = [t.new_empty(t.shape[0], new_cap, t.shape[-1]) for t in ref_v]
        if self._n:
            for dst, src in zip(k_new, self._k):
                dst[:, :self._n] = src[:, :self._n]
            for dst, src in zip(v_new, self._v):
                dst[:, :self._n] = src[:, :self._n]
        self._k, self._v = k_new, v_new

    def append(self, keys: list[torch.Tensor], values: list[torch.Tensor], pos: torch.Tensor, grp: torch.Tensor) -> None:
        """Append ``[H_kv, m, D]`` per-layer keys/values of m newly committed tokens."""
        m = int(keys[0].shape[1]) if keys else 0
        if not m:
            return
        self._grow(self._n + m, keys, values)
        for buf, new in zip(self._k, keys):
            buf[:, self._n:self._n + m] = new
        for buf, new in zip(self._v, values):
            buf[:, self._n:self._n + m] = new
        self.adopt_scratch(m, pos, grp)

    def adopt_scratch(self, m: int, pos: torch.Tensor, grp: torch.Tensor) -> None:
        """Commit the first ``m`` scratch positions, whose keys/values a forward already wrote after the cached part
        (:meth:`BatchKV.commit`), with their ``[m]`` positions and groups."""
        if self._n + m > self.capacity:
            raise ValueError(f"LaneCache: {m} scratch positions after {self._n} exceed the capacity {self.capacity}")
        self._n += m
        self.pos = pos.clone() if self.pos is None else torch.cat([self.pos, pos])
        self.grp = grp.clone() if self.grp is None else torch.cat([self.grp, grp])


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


class BatchKV:
    """Duck-typed transformers ``Cache`` for one forward over several lanes.

    ``update()`` returns the padded cached keys/values of every lane followed by the new chunk's, and keeps the
    new ones so that the caller can commit selected positions into each lane afterwards. Nothing is committed
    implicitly: a forward may write a one-lane chunk into the lane buffer's scratch tail, never into its cached
    part, its length or its capacity.

    Args:
        lanes: the lane caches, one per batch row (rows without a cache pass an empty ``LaneCache``).
        device: device of the keys.
    """

    is_compileable = False

    def __init__(self, lanes: list[LaneCache], device: torch.device):
        self.lanes = lanes
        self.device = device
        self.cached_len = max((lane.length for lane in lanes), default=0)
        # batch row -> (the lane's length then, layers) for rows whose chunk a forward wrote into the lane's scratch tail
        self._scratch: dict[int, tuple[int, set[int]]] = {}
        seen: set[int] = set()
        self._shared = {id(lane) for lane in lanes if id(lane) in seen or seen.add(id(lane))}  # in two rows
        self.new_keys: dict[int, torch.Tensor] = {}
        self.new_values: dict[int, torch.Tensor] = {}
        # lane mode (engine/lane_attention.py): update() returns the new keys only and the attention reads each
        # lane's keys from its buffer; rows[b] = batch row b's real chunk rows, sees_all[b] = every one of them sees
        # every key of its lane (no mask needed)
        self.lane_mode = False
        self.rows: list[int] = []
        self.sees_all: list[bool] = []
        self._written: dict[int, set[int]] = {}  # layer -> rows whose chunk went into their lane's scratch tail
        self._masks: dict[int, torch.Tensor] = {}

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

        One lane whose buffer has room for the chunk (and no autograd: the training ``draft`` objective forwards
        with gradients): the new keys go into the lane buffer's scratch tail and a view is returned (no copy of the
        cache). Otherwise one copy of each lane's cache and of the chunk into a fresh tensor.
        """
        self.new_keys[layer_idx] = key_states
        self.new_values[layer_idx] = value_states
        if self.lane_mode:  # each lane's chunk after its cached keys, in its own buffer where it fits
            self._written[layer_idx] = {b for b, lane in enumerate(self.lanes)
                                        if lane.length and self._to_scratch(b, key_states, value_states, layer_idx)}
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

        A lane whose buffer has room for the chunk gets it written into its scratch tail and a view of the buffer is
        returned (a decoding lane costs no copy of its cache; :meth:`commit` then adopts the written keys); a lane
        with nothing cached gets a view of the chunk; otherwise (no room, autograd, a lane cache shared by two rows)
        one copy of that lane's cache and chunk."""
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

    def lane_keys(self, b: int, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Lane mode: batch row ``b``'s keys and values ``[H, n_b + rows[b], D]`` (its ``n_b`` cached keys, then its
        chunk rows) and ``n_b``: a view of the lane's buffer when the chunk was written into its scratch tail, else
        one copy of that lane's cache and chunk (no room, autograd, a lane shared by two rows)."""
        lane, q = self.lanes[b], self.rows[b]
        n = lane.length
        if b in self._written.get(layer_idx, ()):
            k, v = lane.key_value(layer_idx, extra=q)
            return k, v, n
        kb, vb = key_states[b, :, :q], value_states[b, :, :q]
        if n:
            lk, lv = lane.key_value(layer_idx)
            kb, vb = torch.cat([lk, kb], 1), torch.cat([lv, vb], 1)
        return kb, vb, n

    def lane_mask(self, b: int, mask: torch.Tensor, n: int, q: int, C: int) -> torch.Tensor:
        """Lane mode: ``[1, 1, q, n + q]`` bool, batch row ``b``'s slice of the forward's ``[B, 1, Q, C + Q]`` mask
        (its ``n`` cached keys and ``q`` chunk keys; built once per forward)."""
        got = self._masks.get(b)
        if got is None:
            rows = mask[b:b + 1, :, :q]
            got = self._masks[b] = torch.cat([rows[..., :n], rows[..., C:C + q]], -1)
        return got

    def _to_scratch(self, b: int, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int) -> bool:
        """Write batch row ``b``'s chunk ``[H, Q, D]`` after its lane's cached keys if the buffer has room, no
        gradient flows (the training ``draft`` objective forwards with gradients) and no other row uses the lane.
        Returns whether it did."""
        lane = self.lanes[b]
        n, Q = lane.length, key_states.shape[2]
        if (n + Q > lane.capacity or key_states.requires_grad or value_states.requires_grad
                or id(lane) in self._shared):
            return False
        k, v = lane.key_value(layer_idx, extra=Q)
        k[:, n:] = key_states[b]
        v[:, n:] = value_states[b]
        written = self._scratch.get(b)
        if written is None:  # first layer of this forward (no set built per layer and lane)
            self._scratch[b] = written = (n, set())
        written[1].add(layer_idx)
        return True

    def commit(self, row: int, idx: torch.Tensor, lane: LaneCache, pos: torch.Tensor, grp: torch.Tensor) -> None:
        """Append to ``lane`` the new keys/values of batch row ``row`` at chunk indices ``idx`` (``[m]`` int64) with
        their ``[m]`` positions and groups.

        When this forward wrote the chunk into that lane's scratch tail (cache unchanged since) and ``idx``
        is the chunk's first m positions - the usual commit: the causal tokens the forward starts with - the values
        are already in place and only the length moves; otherwise they are copied in.
        """
        m = int(idx.numel())
        written = self._scratch.get(row)
        if (written is not None and lane is self.lanes[row] and lane.length == written[0] and m
                and len(written[1]) == len(lane._k)
                and torch.equal(idx, torch.arange(m, device=idx.device, dtype=idx.dtype))):
            lane.adopt_scratch(m, pos, grp)
            return
        keys, values = self.new_kv(row, idx)
        lane.append(keys, values, pos, grp)

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
