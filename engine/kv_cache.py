"""KV caches: per-lane storage of committed keys/values and the batched view one forward uses.

A *lane* is one canvas variant of one request (the conditional canvas, plus the unconditional one under CFG).
Each lane keeps, per layer, the keys and values of the tokens it has committed (``[H_kv, n, D]``), together with
the position/group metadata the shared mask builder needs (``unmask.engine.attention``).

Cache policies (``SamplingParams.cache``, DESIGN.md sections 4 and 10):

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

from dataclasses import dataclass, field

import torch


@dataclass
class LaneCache:
    """Committed KV of one lane.

    Attributes:
        keys, values: per layer ``[H_kv, n, D]`` tensors (empty list before the first commit).
        pos, grp: ``[n]`` int64 position and attention group of each cached token; committed: ``[n]`` bool.
        carry_logits: ``[V]`` float32 output of the last committed token (the logit-shifted prediction for the
            first position after it), kept because that token is not forwarded again.
    """

    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    pos: torch.Tensor | None = None
    grp: torch.Tensor | None = None
    carry_logits: torch.Tensor | None = None
    carry_position: int = -1

    @property
    def length(self) -> int:
        """Number of cached tokens."""
        return 0 if self.pos is None else int(self.pos.numel())

    def nbytes(self) -> int:
        """Bytes held by the cached keys and values."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def clear(self) -> None:
        """Drop everything (cancellation, refresh)."""
        self.keys, self.values, self.pos, self.grp = [], [], None, None
        self.carry_logits, self.carry_position = None, -1

    def append(self, keys: list[torch.Tensor], values: list[torch.Tensor], pos: torch.Tensor, grp: torch.Tensor) -> None:
        """Append ``[H_kv, m, D]`` per-layer keys/values of m newly committed tokens."""
        if not self.keys:
            self.keys, self.values = list(keys), list(values)
            self.pos, self.grp = pos.clone(), grp.clone()
            return
        self.keys = [torch.cat([a, b], dim=1) for a, b in zip(self.keys, keys)]
        self.values = [torch.cat([a, b], dim=1) for a, b in zip(self.values, values)]
        self.pos = torch.cat([self.pos, pos])
        self.grp = torch.cat([self.grp, grp])


class BatchKV:
    """Duck-typed transformers ``Cache`` for one forward over several lanes.

    ``update()`` returns the padded cached keys/values of every lane followed by the new chunk's, and keeps the
    new ones so that the caller can commit selected positions into each lane afterwards. Nothing is stored
    implicitly: a forward never changes a lane's cache by itself.

    Args:
        lanes: the lane caches, one per batch row (rows without a cache pass an empty ``LaneCache``).
        device: device of the keys.
    """

    is_compileable = False

    def __init__(self, lanes: list[LaneCache], device: torch.device):
        self.lanes = lanes
        self.device = device
        lengths = [lane.length for lane in lanes]
        self.cached_len = max(lengths, default=0)
        self._uniform = all(n == self.cached_len for n in lengths)
        self.new_keys: dict[int, torch.Tensor] = {}
        self.new_values: dict[int, torch.Tensor] = {}
        self._padded: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def key_meta(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(pos, grp, valid)`` of the cached part, each ``[B, C]`` (C = longest lane cache)."""
        B, C = len(self.lanes), self.cached_len
        pos = torch.zeros(B, C, dtype=torch.long, device=self.device)
        grp = torch.full((B, C), -1, dtype=torch.long, device=self.device)
        valid = torch.zeros(B, C, dtype=torch.bool, device=self.device)
        for b, lane in enumerate(self.lanes):
            n = lane.length
            if n:
                pos[b, :n] = lane.pos
                grp[b, :n] = lane.grp
                valid[b, :n] = True
        return pos, grp, valid

    def _padded_layer(self, layer: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, H, C, D]`` cached keys/values of one layer, right-padded with zeros to the longest lane.

        Fast paths (same values, fewer copies): a single lane is returned as a view; lanes of equal length are
        stacked (one copy instead of zero-fill + copy).
        """
        B, H, _, D = like.shape
        C = self.cached_len
        if self._uniform:
            if B == 1:
                return self.lanes[0].keys[layer][None], self.lanes[0].values[layer][None]
            return (torch.stack([lane.keys[layer] for lane in self.lanes]),
                    torch.stack([lane.values[layer] for lane in self.lanes]))
        k = like.new_zeros(B, H, C, D)
        v = like.new_zeros(B, H, C, D)
        for b, lane in enumerate(self.lanes):
            n = lane.length
            if n:
                k[b, :, :n] = lane.keys[layer]
                v[b, :, :n] = lane.values[layer]
        return k, v

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """transformers hook: ``[B, H, Q, D]`` new keys/values -> ``[B, H, C + Q, D]`` keys/values to attend."""
        self.new_keys[layer_idx] = key_states
        self.new_values[layer_idx] = value_states
        if self.cached_len == 0:
            return key_states, value_states
        k, v = self._padded_layer(layer_idx, key_states)
        return torch.cat([k, key_states], dim=2), torch.cat([v, value_states], dim=2)

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
