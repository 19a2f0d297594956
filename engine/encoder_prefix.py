"""Encoder-KV reuse for encoder-decoder families (DiffusionGemma; docs/design.md#prefix-reuse, "Encoder caches").

A uniform-canvas choice (``unmask.engine.uniform_canvas``) encodes its prompt once, then each finished canvas, into
its own transformers ``DynamicCache``. The store keeps a copy of that cache after each encode, keyed by the exact
token sequence it holds (the prompt, then the prompt and the canvases so far) and the choice's cache salt (tenants
share nothing); a later choice whose prompt starts with a stored sequence starts from a copy of its cache and
encodes only the rest of its prompt (the whole prompt stored: nothing). The ``n`` choices of a request and repeated
prompts therefore encode their prompt once, and the next turn of a chat encodes only what the last turn added.

Exactness: a whole-prompt hit is the very cache a fresh encode makes (the encoder at batch 1, the same calls), so
the choice's tokens are unchanged bit for bit; a strict-prefix hit encodes the rest on top of the stored cache, as
``generate()`` encodes each canvas on top of its prompt, which differs from encoding the whole prompt at once in
the last bits (float32: within the ``prefix-reuse`` contract's tolerance,
docs/design.md#exactness-contracts-by-device-and-dtype). Bounded by ``max_entries`` snapshots, least recently used
first out.
"""
from __future__ import annotations

import copy
from collections import OrderedDict

__all__ = ["EncoderPrefixStore"]


class EncoderPrefixStore:
    """Snapshots of encoder caches by ``(salt, token ids)`` (module docstring).

    Attributes:
        queries / hits: lookups, and those that found a stored prefix. tokens: prompt tokens not encoded thanks to
            hits. evicted: snapshots dropped for room.
    """

    def __init__(self, max_entries: int = 16):
        if max_entries < 1:
            raise ValueError(f"max_entries: must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple, object] = OrderedDict()
        self.queries = self.hits = self.tokens = self.evicted = 0

    def lookup(self, ids: list[int], salt: str | None = None) -> tuple[int, object | None]:
        """``(n, cache)``: the longest stored sequence that ``ids`` starts with (``n`` tokens) and a copy of its cache
        for the caller to extend; ``(0, None)`` when none."""
        self.queries += 1
        best = None
        for key in self._entries:
            s, seq = key
            if s == salt and len(seq) <= len(ids) and (best is None or len(seq) > len(best[1])) \
                    and tuple(ids[: len(seq)]) == seq:
                best = key
        if best is None:
            return 0, None
        self._entries.move_to_end(best)
        self.hits += 1
        self.tokens += len(best[1])
        return len(best[1]), copy.deepcopy(self._entries[best])

    def store(self, ids: list[int], cache, salt: str | None = None) -> None:
        """Keep a copy of ``cache``, which holds exactly the tokens ``ids``."""
        key = (salt, tuple(ids))
        self._entries[key] = copy.deepcopy(cache)
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
            self.evicted += 1

    def stats(self) -> dict:
        """``{"queries", "hits", "tokens", "evicted"}`` (the prefix cache's keys)."""
        return {"queries": self.queries, "hits": self.hits, "tokens": self.tokens, "evicted": self.evicted}
