"""Prefix reuse across requests: committed KV of earlier requests kept in fixed-size chunks, least recently used
evicted first, and shared with a new request's lane when its token ids start the same way
(docs/design.md#prefix-reuse; the idea of vLLM's automatic prefix caching: hash chains over fixed-size token blocks).

Why it is exact: on ``prefix_causal`` and ``block_causal`` models a committed token's keys/values depend only on the
tokens before it (and, block-causally, on its own block), never on the canvas after it (docs/design.md#decoding).
So the committed KV of positions ``[0, m)`` of one request is the KV a fresh prefill of the same ``m`` token ids
would compute, provided everything else that enters it is equal too. The key of a chunk is
``sha256(parent key, its token ids)``, the root key ``sha256(model fingerprint, attention, the committed rows'
weights, the block grouping)``:

* model fingerprint (:func:`model_fingerprint`): the checkpoint's files (path, names, sizes, mtimes), the weight
  format, dtype, device and the attached adapter: another checkpoint never matches;
* the committed rows' weights: with a verifier (``engine/routed.py``) a speculative request's committed rows run
  the verifier's weights and a plain one's the drafter's, so the two never share; a mask-row adapter runs only on
  non-committed rows (docs/design.md#mask-row-adapter), so it does not split the key;
* positions: chains start at position 0, so chunk i always holds positions ``[i C, (i + 1) C)``;
* block grouping: ``block_causal`` with blocks aligned at 0 groups committed tokens by absolute block of the
  *request's* block size (a request may pick another than the model's; a prompt token sees its whole block, so its
  KV differs with the block size), so chunks are whole blocks of it (C rounded up to a multiple of it) and it is in
  the key; with blocks aligned at the generation only the prompt (causal) part of a request is kept.

Never shared: bidirectional models (their prompt KV depends on the canvas), requests without the exact cache
(``cache: none``, Fast-dLLM's approximate caches), the unconditional CFG lane (its prompt is mask tokens).
A new request reuses at most ``min(prompt, first block start) - 1`` positions (its first step needs the output of
the last prompt position).

Memory: a chunk is a whole number of the KV pool's blocks (``engine/kv_pool.py``), held by reference: storing
takes a reference to the lane's own blocks and loading puts the store's blocks at the start of the new lane's block
table (no copy; under row-invariant attention a copy into the lane's own blocks, once, so that its keys stay one
tensor). A shared block holds committed positions only. :attr:`PrefixCache.limit` bounds the tokens held; the
scheduler sets it to what the KV budget leaves after the running and paused sequences' reservations, and the pool
evicts the store's least recently used chunks when an allocation runs short, so kept prefixes are evicted before a
live request ever waits for room.
"""
from __future__ import annotations

import collections
import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .kv_cache import LaneCache
from .kv_pool import BLOCK_TOKENS

__all__ = ["PrefixCache", "model_fingerprint", "route_keys", "CHUNK_TOKENS", "DEFAULT_PREFIX_CACHE_TOKENS"]

#: chunk size in tokens: the matching granularity (vLLM's default block size is 16 too)
CHUNK_TOKENS = 16
#: tokens kept when the engine has no KV budget (``max_cached_tokens=None``): 4096 tokens of SmolLM2-135M's
#: float32 KV are 189 MB (30 layers x 2 x 3 KV heads x 64 x 4 bytes = 46 KB a token)
DEFAULT_PREFIX_CACHE_TOKENS = 4096
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".json", ".gguf", ".pt")


def _chain_key(parent: bytes, ids_int64: bytes) -> bytes:
    """The key of one chunk: ``sha256(parent key, the chunk's token ids as little-endian int64)``."""
    return hashlib.sha256(parent + ids_int64).digest()


def _salt_part(salt: str) -> str:
    """The salt's part of a root key (the tenant's and the request's ``cache_salt``)."""
    return "|salt=" + hashlib.sha256(salt.encode("utf-8", "surrogatepass")).hexdigest()


def route_keys(token_ids, salt: str | None = None, chunk_tokens: int = CHUNK_TOKENS) -> list[str]:
    """The chain of keys of the complete ``chunk_tokens``-token chunks of ``token_ids`` (16 hex digits each), rooted
    in ``salt`` alone: what a router across replicas of one model matches prompts on (docs/design.md#scale-out).
    The chain rule and the salt are :class:`PrefixCache`'s, the root is not (every replica serves the same model, so
    the fingerprint adds nothing): two prompts share key ``i`` exactly when they share chunks ``0..i`` and the salt,
    i.e. when a replica that served one can load those chunks for the other."""
    root = hashlib.sha256(("route" + (_salt_part(salt) if salt is not None else "")).encode()).digest()
    ids = np.asarray(list(token_ids), dtype="<i8")
    keys, parent = [], root
    for i in range(len(ids) // chunk_tokens):
        parent = _chain_key(parent, ids[i * chunk_tokens:(i + 1) * chunk_tokens].tobytes())
        keys.append(parent.hex()[:16])
    return keys


def model_fingerprint(model) -> str:
    """A hex digest naming what a committed token's keys/values are computed by: the checkpoint's weight and
    config files (relative name, size, mtime in ns, under ``model.path`` recursively, hidden cache files such as
    ``.unmask-content-hash.json`` left out; an in-memory model, whose path is not a directory, is named by ``id`` of
    its module), the weight format, dtype, device, attention mode, the attached mask-row adapter
    (``model.adapter``) and the row variant's kind. The files are read once per loaded model (kept on it): files
    touched after the load do not change the weights in memory."""
    if getattr(model, "_prefix_files", None) is None:
        model._prefix_files = _checkpoint_files(model)
    ident, files = model._prefix_files
    desc = {"model": ident, "files": files, "weights": model.weight_format,
            "packed_layers": getattr(model, "packed_layers", None), "dtype": str(model.dtype),
            "device": str(model.device), "attention": model.dllm.attention,
            "adapter": model.adapter, "row_variant": type(model.row_variant).__name__ if model.row_variant else None}
    return hashlib.sha256(json.dumps(desc, sort_keys=True, default=str).encode()).hexdigest()


def _checkpoint_files(model) -> tuple[str, list]:
    """``(identity, [[relative name, size, mtime_ns], ...])`` of ``model``'s checkpoint directory (see
    :func:`model_fingerprint`)."""
    files: list = []
    root = Path(str(model.path))
    if root.is_dir():
        for dirpath, _, names in sorted(os.walk(root)):
            for name in sorted(names):
                if name.endswith(_WEIGHT_SUFFIXES) and not name.startswith("."):
                    p = Path(dirpath) / name
                    st = p.stat()
                    files.append([str(p.relative_to(root)), st.st_size, st.st_mtime_ns])
        ident = str(root.resolve())
    else:
        ident = f"{model.path}@{id(model.model)}"
    return ident, files


@dataclass
class _Chunk:
    blocks: list[int]  # the KV pool's blocks of C consecutive committed positions (one reference each)
    grp: torch.Tensor  # [C] int64 attention groups as committed

    @property
    def tokens(self) -> int:
        return int(self.grp.numel())


class PrefixCache:
    """The LRU store of committed-KV chunks of one model (not thread-safe: the engine thread alone calls it).

    Args:
        model: the :class:`~unmask.engine.model.LoadedModel` whose KV is stored (its fingerprint roots every key).
        chunk_tokens: matching granularity C in tokens (>= 1).
        max_tokens: most tokens held when no budget applies (:attr:`limit` starts there).

    Counters (tokens; vLLM's ``prefix_cache_queries`` / ``prefix_cache_hits``): ``queries`` = prompt tokens of
    the requests looked up, ``hits`` = tokens loaded from the store.

    Raises:
        ValueError: ``chunk_tokens`` < 1 or ``max_tokens`` < 0.
    """

    def __init__(self, model, chunk_tokens: int = CHUNK_TOKENS, max_tokens: int = DEFAULT_PREFIX_CACHE_TOKENS):
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens: must be >= 1, got {chunk_tokens}")
        if max_tokens < 0:
            raise ValueError(f"max_tokens: must be >= 0, got {max_tokens}")
        self.model = model
        self.fingerprint = model_fingerprint(model)
        self.chunk_tokens = int(chunk_tokens)
        self.max_tokens = int(max_tokens)
        self.limit = self.max_tokens  # tokens the store may hold now (the scheduler lowers it to the free budget)
        self._chunks: collections.OrderedDict[bytes, _Chunk] = collections.OrderedDict()  # least recent first
        self._held = 0  # tokens of the chunks held
        self.queries = self.hits = 0
        self.evicted = 0  # chunks evicted so far
        self.pool = None  # the KV pool whose blocks the chunks are (the first registered lane's)

    # ------------------------------------------------------------------ keys
    @property
    def tokens(self) -> int:
        """Tokens held."""
        return self._held

    @property
    def chunk_tokens_held(self) -> int:
        """Tokens of one stored chunk of a request at the model's block size (:meth:`chunk_tokens_of`)."""
        return self._chunk_tokens(lambda: int(self.model.dllm.block_size))

    def chunk_tokens_of(self, seq) -> int:
        """Tokens of one of ``seq``'s chunks: C and the pool's block rounded up to whole blocks of the request's
        block size on an absolute block-causal model (its committed tokens are grouped by them)."""
        return self._chunk_tokens(lambda: int(seq.block_size))

    def _chunk_tokens(self, block_size) -> int:
        """``block_size``: a callable, read only on an absolute block-causal model."""
        d = self.model.dllm
        if d.attention == "block_causal" and d.block_alignment == "absolute":
            return math.lcm(self.chunk_tokens, block_size(), BLOCK_TOKENS)
        return math.lcm(self.chunk_tokens, BLOCK_TOKENS)

    def _root(self, seq) -> bytes | None:
        """The root key of ``seq``'s chains, or None when the request never shares (see the module docstring)."""
        d = self.model.dllm
        if d.attention == "bidirectional" or seq.cache_mode != "exact":
            return None
        rv = self.model.row_variant
        variant = rv is not None and getattr(rv, "rows", None) != "uncommitted" and seq.committed_rows_variant
        # absolute blocks: the request's block size groups its committed tokens (a request may pick its own); from
        # the generation only the (causal) prompt part is stored
        size = seq.block_size if d.block_alignment == "absolute" else d.block_size
        grouping = f"{d.block_alignment}/{size}" if d.attention == "block_causal" else "causal"
        desc = f"{self.fingerprint}|{d.attention}|{grouping}|variant={variant}|C={self.chunk_tokens_of(seq)}"
        if seq.cache_salt is not None:  # a tenant's (and cache_salt's) own chains: never matched by another salt
            desc += _salt_part(seq.cache_salt)
        return hashlib.sha256(desc.encode()).digest()

    @staticmethod
    def _child(parent: bytes, tokens: torch.Tensor) -> bytes:
        return _chain_key(parent, tokens.to("cpu", torch.int64).numpy().tobytes())

    def _storable(self, seq) -> int:
        """Committed positions of ``seq``'s cond lane whose KV a later request would compute the same way."""
        n = seq.lanes[0].cache.length
        d = self.model.dllm
        if d.attention == "block_causal" and seq.origin > 0:  # blocks from the generation: the prompt part only
            n = min(n, seq.origin)
        if self.model.tiles_prompt_rows:  # prompt tiles: an answer's KV (block-1 calls) differs in the last bits
            n = min(n, seq.blocks[0][0])
        return n

    # ------------------------------------------------------------------ the two hooks
    @torch.inference_mode()  # as a step (a lane loaded between steps takes or copies blocks here)
    def load(self, seq) -> int:
        """Copy the longest stored prefix of ``seq``'s prompt into its cond lane, or extend what the lane holds
        (a request that has not run a step, whose lane ends where its chain of chunks does: a prefill waiting a
        step may find chunks another sequence stored meanwhile). Returns the tokens loaded (0 for a request that
        never shares)."""
        lane = seq.lanes[0].cache  # the cond lane (a CFG request's uncond lane is never shared)
        C = self.chunk_tokens_of(seq)
        have = len(seq.prefix_chain)
        if seq.nfe or lane.length != have * C:  # the cheap checks first: called before every step of a prefill
            return 0
        root = self._root(seq)
        if root is None:
            return 0
        if not seq.prefix_queried:  # looked up again while its prefill waits: counted once
            self.queries += seq.prompt_len
            seq.prefix_queried = True
        chain, found = [], []
        parent = seq.prefix_chain[-1] if have else root
        for i in range(have, max(0, seq.prefill_limit()) // C):  # the first step's own rows stay
            h = self._child(parent, seq.canvas[i * C:(i + 1) * C])
            chunk = self._chunks.get(h)
            if chunk is None:
                break
            chain.append(h)
            found.append(chunk)
            parent = h
        if not found:
            return 0
        for h in reversed(chain):  # most recent: the root end, so that eviction takes a chain's tail first
            self._chunks.move_to_end(h)
        blocks = [b for c in found for b in c.blocks]
        m = len(found) * C
        pos, grp = torch.arange(have * C, have * C + m), torch.cat([c.grp for c in found])  # host metadata
        if self.copy_on_load:  # row-invariant attention wants each lane's keys in one run: copied once, here
            keys, values = self._read(blocks, m)
            lane.append(keys, values, pos, grp)
        else:
            lane.share(blocks, pos, grp)  # the store's blocks themselves: no copy
        seq.prefix_chain = seq.prefix_chain + chain
        seq.cached_tokens += m
        self.hits += m
        return m

    def register(self, seq) -> int:
        """Store the complete chunks of ``seq``'s committed KV that became complete since the last call, while
        :attr:`limit` leaves room (evicting least recently used chunks of other chains first). A chunk whose parent
        is not stored is skipped (it could never be matched), and a chunk evicted later is not stored again from
        this sequence (no churn between sequences competing for a small store). Returns the chunks added. (Called
        for every sequence after every step: what has nothing to store returns before any tensor work.)"""
        root = self._root(seq)
        if root is None:
            return 0
        C = self.chunk_tokens_of(seq)
        n_chunks = self._storable(seq) // C
        if len(seq.prefix_chain) >= n_chunks:
            return 0
        with torch.inference_mode():
            return self._register(seq, root, C, n_chunks)

    def _register(self, seq, root, C: int, n_chunks: int) -> int:
        """:meth:`register` past its early returns (``root``: the chain's root; ``C``: tokens per chunk;
        ``n_chunks``: the complete chunks storable now)."""
        chain = seq.prefix_chain
        lane = seq.lanes[0].cache
        protect = set(chain)
        added = 0
        for i in range(len(chain), n_chunks):
            h = self._child(chain[-1] if chain else root, seq.canvas[i * C:(i + 1) * C])
            chain.append(h)
            protect.add(h)
            if h in self._chunks or (i and chain[i - 1] not in self._chunks) or not self._make_room(C, protect):
                continue
            blocks = lane.blocks(i * C, (i + 1) * C)
            self.attach(lane.pool)
            self.pool.incref(blocks)  # the lane's own blocks, shared: no copy
            self._chunks[h] = _Chunk(blocks, lane.grp[i * C:(i + 1) * C].clone())
            self._held += C
            added += 1
        for h in reversed(chain):  # most recent: the root end, so that eviction takes a chain's tail first
            if h in self._chunks:
                self._chunks.move_to_end(h)
        return added

    # ------------------------------------------------------------------ blocks
    @property
    def copy_on_load(self) -> bool:
        """Whether a load copies the stored blocks into the lane's own instead of sharing them: under row-invariant
        attention (``engine/row_attention.py``, the low-bit formats) a lane's keys must be one tensor, which a
        shared prefix's blocks next to the lane's own are not (one copy at load, not one per step)."""
        return bool(getattr(self.model.decoder_forward, "row_invariant", False))

    def attach(self, pool) -> None:
        """Hold blocks of ``pool`` (the first time: it may evict this store's chunks when it runs short).

        Raises:
            ValueError: the store holds blocks of another pool.
        """
        if self.pool is None:
            self.pool = pool
            pool.evict = self.evict_blocks
        elif pool is not self.pool:
            raise ValueError("PrefixCache: the store holds blocks of another KV pool")

    def _drop(self, key: bytes) -> None:
        """Evict one chunk, releasing its blocks (freed unless a lane still holds them)."""
        chunk = self._chunks.pop(key)
        self.pool.decref(chunk.blocks)
        self._held -= chunk.tokens
        self.evicted += 1

    def _sole(self, chunk: _Chunk) -> bool:
        return all(self.pool.refcount(b) == 1 for b in chunk.blocks)

    def evictable_blocks(self) -> int:
        """Blocks held by the store alone: what evicting every chunk would free."""
        return sum(len(c.blocks) for c in self._chunks.values() if self._sole(c))

    def evict_blocks(self, n: int) -> None:
        """Evict least recently used chunks held by the store alone until ``n`` blocks are freed or none is left
        (the pool's :attr:`~unmask.engine.kv_pool.KVPool.evict`: a live request's blocks before cached prefixes)."""
        freed = 0
        for key in [k for k, c in self._chunks.items() if self._sole(c)]:
            if freed >= n:
                return
            freed += len(self._chunks[key].blocks)
            self._drop(key)

    def _read(self, blocks: list[int], m: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per layer ``[H_kv, m, D]`` copies of the keys/values in ``blocks``."""
        tmp = LaneCache(pool=self.pool)
        tmp.share(blocks, torch.arange(m), torch.zeros(m, dtype=torch.long))
        tmp.layers = self.pool.layers_of(blocks[0])
        keys, values = [k.clone() for k in tmp.keys], [v.clone() for v in tmp.values]
        tmp.clear()
        return keys, values

    # ------------------------------------------------------------------ memory
    def _make_room(self, tokens: int, protect: set) -> bool:
        """Evict least recently used chunks not in ``protect`` until ``tokens`` more fit under :attr:`limit`;
        False when they cannot."""
        while self._held + tokens > self.limit:
            victim = next((h for h in self._chunks if h not in protect), None)
            if victim is None:
                return False
            self._drop(victim)
        return True

    def evict_to(self, limit: int) -> None:
        """Evict least recently used chunks until at most ``limit`` tokens are held."""
        while self._chunks and self._held > max(0, limit):
            self._drop(next(iter(self._chunks)))

    def set_limit(self, free_tokens: int | None) -> None:
        """Bound the store by ``free_tokens`` (what the KV budget leaves; ``None`` = no budget: :attr:`max_tokens`)
        and evict down to it at once."""
        self.limit = self.max_tokens if free_tokens is None else max(0, int(free_tokens))
        self.evict_to(self.limit)

    def clear(self) -> None:
        """Drop every chunk."""
        while self._chunks:
            self._drop(next(iter(self._chunks)))

    def stats(self) -> dict:
        """``{"queries", "hits", "tokens", "evicted"}``: the counters (tokens), tokens held, chunks evicted."""
        return {"queries": self.queries, "hits": self.hits, "tokens": self.tokens, "evicted": self.evicted}
