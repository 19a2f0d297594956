"""Which replica a request goes to: the one most likely to hold its prompt's prefix, within a load bound
(docs/design.md#scale-out). No Ray here: :mod:`unmask.server.ray_router` calls it from Ray Serve's router.

A prompt is named by its chain of chunk keys (``unmask.engine.route_keys``: the prefix cache's 16-token chunks and
salt), so key ``i`` is shared by two prompts exactly when a replica that ran one can load chunks ``0..i`` for the
other. The table remembers which keys were sent to which replica (the last ``max_keys`` per replica, least
recently sent forgotten first: a replica's prefix store is bounded too) and nothing else; it is what this router
sent, not what the replicas hold (a replica may have evicted a chunk, or died: :meth:`forget`).

The rule (:meth:`PrefixAffinity.choose`):

1. the replicas whose load is at most the least loaded one's + ``imbalance`` are eligible (load: requests in
   flight to the replica, as the caller counts them);
2. among them the highest score wins: the run of the prompt's leading keys the replica holds (chunks it need not
   prefill) minus ``load_weight`` chunks per request the new one would wait behind there, i.e. beyond the
   replica's ``slots`` (its batch: requests in a batch with room run at once; llm-d's scheduler likewise weighs a
   prefix score against the queue, ``num_requests_waiting``). Without the load term a prefix every chat shares (a
   system prompt) would pull every new chat to the replica that saw it first; with it, new chats fill one
   replica's batch and then go where they need not wait, while a chat's later turns (most of their prompt held)
   stay unless staying means waiting behind ``held chunks / load_weight`` requests;
3. ties (and prompts nobody holds) go to the least loaded, then to the one chosen least recently (new
   conversations and short prompts take the replicas in turn).
"""
from __future__ import annotations

import collections
from collections.abc import Hashable, Iterable, Mapping, Sequence

__all__ = ["PrefixAffinity", "DEFAULT_IMBALANCE", "DEFAULT_LOAD_WEIGHT", "DEFAULT_MAX_KEYS"]

#: requests in flight by which an eligible replica may exceed the least loaded one
DEFAULT_IMBALANCE = 4
#: chunks of held prefix one request waited behind is worth (it waits for a whole request's steps; a held chunk
#: saves 16 prompt rows of one forward); chosen by benchmarks/bench_ray_routing.py (docs/design.md#scale-out)
DEFAULT_LOAD_WEIGHT = 8.0
#: keys remembered per replica: 65,536 chunks of 16 tokens = 1M tokens, above a CPU replica's prefix store
DEFAULT_MAX_KEYS = 65536


class PrefixAffinity:
    """The routing table and rule (not thread-safe: one router's event loop calls it).

    Args:
        imbalance: most requests in flight an eligible replica may have beyond the least loaded (>= 0).
        load_weight: chunks of held prefix one request waited behind is worth (>= 0; 0: the longest match alone).
        slots: requests a replica runs at once (its batch; >= 0): a new request waits behind those in flight
            beyond them (0: behind every request in flight).
        max_keys: keys remembered per replica (>= 1).

    Raises:
        ValueError: ``imbalance``, ``load_weight`` or ``slots`` < 0, ``max_keys`` < 1 (names the argument).
    """

    def __init__(self, imbalance: int = DEFAULT_IMBALANCE, max_keys: int = DEFAULT_MAX_KEYS,
                 load_weight: float = DEFAULT_LOAD_WEIGHT, slots: int = 0):
        if imbalance < 0:
            raise ValueError(f"imbalance: must be >= 0, got {imbalance}")
        if slots < 0:
            raise ValueError(f"slots: must be >= 0, got {slots}")
        self.slots = int(slots)
        if not load_weight >= 0:  # NaN too
            raise ValueError(f"load_weight: must be >= 0, got {load_weight}")
        if max_keys < 1:
            raise ValueError(f"max_keys: must be >= 1, got {max_keys}")
        self.imbalance, self.max_keys, self.load_weight = int(imbalance), int(max_keys), float(load_weight)
        self._holders: dict[str, set] = {}  # key -> replicas it was sent to
        self._held: dict[Hashable, collections.OrderedDict] = {}  # replica -> its keys, least recently sent first
        self._chosen: dict[Hashable, int] = {}  # replica -> the turn it was last chosen at
        self._turn = 0

    def held(self, replica: Hashable) -> int:
        """Keys remembered for ``replica``."""
        return len(self._held.get(replica, ()))

    def match(self, keys: Sequence[str], replicas: Iterable[Hashable]) -> dict:
        """``replica -> number of leading keys of `keys` it holds`` for each of ``replicas``."""
        depth = {r: 0 for r in replicas}
        alive = set(depth)
        for k in keys:
            alive &= self._holders.get(k, set())
            if not alive:
                break
            for r in alive:
                depth[r] += 1
        return depth

    def choose(self, keys: Sequence[str], load: Mapping[Hashable, int]) -> Hashable:
        """The replica for a prompt with chain ``keys`` among ``load``'s replicas (``replica -> requests in
        flight``; the module docstring has the rule).

        Raises:
            ValueError: no replica given.
        """
        if not load:
            raise ValueError("load: no replica to choose from")
        floor = min(load.values())
        eligible = [r for r, n in load.items() if n <= floor + self.imbalance]
        depth = self.match(keys, eligible)
        w = self.load_weight
        return min(eligible, key=lambda r: (w * self.waits(load[r]) - depth[r], load[r], self._chosen.get(r, -1),
                                            str(r)))

    def waits(self, in_flight: int) -> int:
        """Requests a new one would wait behind on a replica with ``in_flight`` requests (beyond ``slots``)."""
        return max(0, in_flight + 1 - self.slots) if self.slots else in_flight

    def record(self, keys: Sequence[str], replica: Hashable) -> None:
        """Remember that ``keys`` were sent to ``replica`` (most recent) and that it was chosen now, forgetting its
        least recently sent keys beyond ``max_keys``."""
        self._turn += 1
        self._chosen[replica] = self._turn
        held = self._held.setdefault(replica, collections.OrderedDict())
        for k in keys:
            held[k] = None
            held.move_to_end(k)
            self._holders.setdefault(k, set()).add(replica)
        while len(held) > self.max_keys:
            old, _ = held.popitem(last=False)
            self._drop(old, replica)

    def forget(self, replica: Hashable) -> None:
        """Drop every key of ``replica`` (it died or left)."""
        self._chosen.pop(replica, None)
        for k in self._held.pop(replica, {}):
            self._drop(k, replica)

    def _drop(self, key: str, replica: Hashable) -> None:
        holders = self._holders.get(key)
        if holders is not None:
            holders.discard(replica)
            if not holders:
                del self._holders[key]
