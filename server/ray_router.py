"""Ray Serve's side of prefix-aware routing (docs/design.md#scale-out): a ``RequestRouter`` whose choice is
:class:`~unmask.server.prefix_routing.PrefixAffinity`'s, over the chunk keys the ingress sends with each request
(the ``route_keys`` keyword of ``EngineReplica.generate``).

Load is each replica's ongoing requests as Ray's router knows them (its queue-length cache, refreshed by probing a
replica whose entry is missing or stale). The chosen replica is Ray's first rank, the others follow least loaded
first: a chosen replica that is full (``max_ongoing_requests``) is passed over by Ray's own loop. One router per
handle: each ingress replica learns from what it sent (several ingress replicas each keep their own table).
"""
from __future__ import annotations

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from .prefix_routing import DEFAULT_IMBALANCE, DEFAULT_LOAD_WEIGHT, DEFAULT_MAX_KEYS, PrefixAffinity

__all__ = ["PrefixAwareRouter", "RoundRobinRouter"]


class PrefixAwareRouter(RequestRouter):
    """Ray Serve request router of the engine replicas (``request_router_kwargs``: ``imbalance``, ``load_weight``,
    ``slots`` (the engine's batch size), ``max_keys``)."""

    def initialize_state(self, imbalance: int = DEFAULT_IMBALANCE, load_weight: float = DEFAULT_LOAD_WEIGHT,
                         slots: int = 0, max_keys: int = DEFAULT_MAX_KEYS, **_):
        self.affinity = PrefixAffinity(imbalance, max_keys, load_weight, slots)

    async def _loads(self, replicas: list[RunningReplica]) -> dict[RunningReplica, int]:
        """Ongoing requests per replica: the cached queue length, else a probe's; a replica that does not answer
        counts as full."""
        cache = self.replica_queue_len_cache
        load = {r: cache.get(r.replica_id) for r in replicas}
        missing = [r for r, n in load.items() if n is None]
        if missing:
            for r, n in await self._probe_queue_lens(missing, 0):
                load[r] = n if n is not None else r.max_ongoing_requests
        return load

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        load = await self._loads(candidate_replicas)
        keys = (pending_request.kwargs.get("route_keys") if pending_request is not None else None) or []
        by_id = {r.replica_id: r for r in candidate_replicas}
        chosen = by_id[self.affinity.choose(keys, {r.replica_id: n for r, n in load.items()})]
        self.affinity.record(keys, chosen.replica_id)
        rest = sorted((r for r in candidate_replicas if r is not chosen), key=lambda r: load[r])
        return [[chosen]] + [[r] for r in rest]

    def on_replica_actor_died(self, replica_id: ReplicaID):
        self.affinity.forget(replica_id)
        super().on_replica_actor_died(replica_id)

    def update_replicas(self, replicas: list[RunningReplica]):
        gone = set(self.curr_replicas) - {r.replica_id for r in replicas}
        for replica_id in gone:  # scaled down: its prefixes left with it
            self.affinity.forget(replica_id)
        return super().update_replicas(replicas)


class RoundRobinRouter(RequestRouter):
    """The replicas in turn (what nginx in front of replicas does; the baseline of benchmarks/bench_ray_routing.py),
    the next ones as fallbacks when the chosen one is full."""

    def initialize_state(self, **_):
        self._turn = 0

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        if not ordered:
            return []
        i = self._turn % len(ordered)
        self._turn += 1
        return [[r] for r in ordered[i:] + ordered[:i]]
