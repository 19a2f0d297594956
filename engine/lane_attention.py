"""Attention over each lane's own keys, without copying caches (docs/design.md#decoding, "KV cache"): the
transformers attention function of the engine's models (``unmask_lanes``, registered here).

transformers' attention reads the keys its cache's ``update`` returns; a batched cache must return one ``[B, H, C +
Q, D]`` tensor, so every lane's cached keys were copied into a padded tensor on every layer of every step (for an
8B model, 16 lanes of 2k tokens: ~16 GiB per step). Inside :func:`lanes` the engine's
:class:`~unmask.engine.kv_cache.BatchKV` instead writes each lane's new keys after its cached ones in the lane's own
blocks of the paged KV pool (``engine/kv_pool.py``) and returns only the new keys; this function then attends per
lane over views of those blocks: its ``n_b`` cached keys and its ``Q_b`` chunk rows, one SDPA call when they are one
run of storage, the runs read in place and merged otherwise (:func:`lane_attend`). Lanes alike (same cached length,
chunk rows and mask state) whose runs are evenly spaced in one slab of the pool attend in one SDPA call over a strided
view of that slab (:func:`_groups`), bit for bit each lane's own call where the kernel allows it
(:func:`_batch_invariant_sdpa`). Bytes moved per step: the new rows' keys. The fused fp16 decoder calls
:func:`attend_lanes` the same way.

Per lane: grouped-query attention without repeating K/V (``enable_gqa``); no mask at all when every row of the
lane sees every key (:attr:`BatchKV.sees_all`, decided on the host: a decoding step of the exact cache whose rows are
one group), else the lane's slice of the engine's boolean mask. Outside :func:`lanes` (training, a bare forward)
it is transformers' SDPA attention, unchanged.
"""
from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from .transfer import to_device

__all__ = ["NAME", "attend_lanes", "lane_attend", "lanes", "register", "use_lanes"]

NAME = "unmask_lanes"
#: the CPU's fused SDPA kernel returning the log-sum-exp (a private op: without it half precision joins the pieces)
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_current: contextvars.ContextVar = contextvars.ContextVar("unmask_lane_cache", default=None)


@contextlib.contextmanager
def lanes(cache) -> Iterator[None]:
    """Inside: the attention of the engine's models reads each lane's keys from ``cache`` (a
    :class:`~unmask.engine.kv_cache.BatchKV` in lane mode)."""
    token = _current.set(cache)
    try:
        yield
    finally:
        _current.reset(token)


def lane_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                   **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: ``query`` ``[B, Hq, Q, D]``; ``key``/``value`` the new chunk's
    ``[B, Hkv, Q, D]`` (lane mode) or every key (otherwise); returns ``([B, Q, Hq, D], None)``."""
    cache = _current.get()
    if cache is None or not getattr(cache, "lane_mode", False):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    return attend_lanes(cache, module.layer_idx, query, key, value, attention_mask, scaling), None


def attend_lanes(cache, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, scaling: float | None) -> torch.Tensor:
    """Every lane's attention in one layer: ``query`` ``[B, Hq, Q, D]``, ``key``/``value`` the chunk's ``[B, Hkv, Q,
    D]`` (written after each lane's cached keys by ``cache.update``), ``attention_mask`` the forward's ``[B, 1, Q, C +
    Q]`` bool or None (nothing masked). Returns ``[B, Q, Hq, D]`` (padded rows 0). Used by transformers' attention
    modules (:func:`lane_attention`) and the fused fp16 decoder (``engine/fused_decoder.py``).

    Lanes of one :class:`_Group` (same cached length, chunk rows and mask state, runs evenly spaced in one slab of
    the pool, or nothing cached: :func:`_groups`, planned at the forward's first layer) take one SDPA call over a
    strided view of the slab; the others one call each (:func:`lane_attend`)."""
    B, Hq, Q, D = query.shape
    C = cache.cached_len
    if C == 0:  # no lane has cached keys (a canvas without cache, a batch of first prefills): one call for all
        return _uncached(cache, query, key, value, attention_mask, scaling)
    plan = getattr(cache, "lane_groups", None)
    if plan is None:
        plan = cache.lane_groups = _groups(cache, layer, query)
    singles = plan.singles
    outs = []
    for group in plan.groups:
        o = _attend_group(cache, group, layer, query, key, value, attention_mask, scaling)
        if o is None:  # this layer's storage is not laid out as planned: the group's lanes one by one
            singles = [*singles, *group.rows]
        elif len(plan.groups) == 1 and not singles and group.q == Q and group.rows == tuple(range(B)):
            return o  # every row, in order, no padding
        else:
            outs.append((group, o))
    out = query.new_zeros(B, Q, Hq, D)
    for group, o in outs:
        out[group.index, :group.q] = o
    for b in singles:
        q_b = cache.rows[b]
        segments, n_b = cache.lane_segments(b, layer, key, value)
        mask = None
        if not cache.sees_all[b] and attention_mask is not None:
            mask = cache.lane_mask(b, attention_mask, n_b, q_b, C)
        out[b, :q_b] = lane_attend(query[b, :, :q_b], segments, mask, scaling)
    return out


class _Group:
    """Batch rows attended in one SDPA call (:func:`_groups`), alike: ``n`` cached keys, ``q`` chunk rows, one mask
    state. ``slab`` set: row ``rows[i]``'s keys are slots ``[first + i * step, ... + n + q)`` of that slab of ``pool``
    (in every layer); else ``n == 0`` and its keys are the chunk's own rows. ``index`` selects ``rows`` of a batch
    tensor (a slice when they are evenly spaced, else a LongTensor); ``masks`` caches the group's mask."""

    __slots__ = ("rows", "index", "n", "q", "sees_all", "pool", "slab", "first", "step", "masks")

    def __init__(self, rows: list[int], n: int, q: int, sees_all: bool, device: torch.device, pool=None, slab=None,
                 slots: list[int] | None = None):
        self.rows = tuple(rows)
        self.index = _row_index(rows, device)
        self.n, self.q, self.sees_all, self.pool, self.slab = n, q, sees_all, pool, slab
        self.first, self.step = (slots[0], slots[1] - slots[0]) if slots else (0, 0)
        self.masks: tuple | None = None  # (the forward's mask, the group's [g, 1, q, n + q] slice of it)


class _LaneGroups:
    """One forward's rows (:func:`_groups`): ``groups`` (:class:`_Group`) and ``singles`` (rows attended alone)."""

    __slots__ = ("groups", "singles")

    def __init__(self, groups: list[_Group], singles: list[int]):
        self.groups, self.singles = groups, singles


def _batch_invariant_sdpa(query: torch.Tensor) -> bool:
    """Whether one SDPA call over several lanes gives each lane the bits of its own call. On a CPU: the fused flash
    kernel (float32, float64, bfloat16) computes each (batch row, head, query block) alone with the same blocking;
    float16 may switch to packed (oneDNN) GEMMs by the whole call's size, and the math path (flash disabled) runs
    batched matmuls: those keep one call per lane. Elsewhere the contracts are within a tolerance, not exact
    (docs/design.md#exactness-contracts-by-device-and-dtype), and one call is allowed."""
    if query.device.type != "cpu":
        return True
    return query.dtype in (torch.float32, torch.float64, torch.bfloat16) and torch.backends.cuda.flash_sdp_enabled()


def _groups(cache, layer: int, query: torch.Tensor) -> _LaneGroups:
    """Once per forward (the block tables and the rows written are the same in every layer): rows whose keys are one
    run of one slab of the pool (``cache.lane_run``: cached keys then the chunk written after them), bucketed by
    cached length, chunk rows, mask state and slab, then cut into runs evenly spaced in the slab
    (:func:`_even_runs`), and rows with nothing cached (their keys: the chunk's rows), bucketed by chunk rows and mask
    state; a run or bucket of two or more rows is a :class:`_Group`. The rest (a lane in several runs, a chunk not
    written into its blocks, a dtype whose SDPA is not batch invariant) are ``singles``."""
    singles: list[int] = []
    pooled: dict[tuple, list[tuple]] = {}
    chunks: dict[tuple, list[int]] = {}
    batchable = len(cache.rows) > 1 and _batch_invariant_sdpa(query)
    for b, q_b in enumerate(cache.rows):
        if not q_b:
            continue
        if not batchable:
            singles.append(b)
        elif not cache.lanes[b].length:
            chunks.setdefault((q_b, bool(cache.sees_all[b])), []).append(b)
        elif (run := cache.lane_run(b, layer)) is None:
            singles.append(b)
        else:
            pool, slab, first = run
            key = (cache.lanes[b].length, q_b, bool(cache.sees_all[b]), id(slab))
            pooled.setdefault(key, []).append((first, b, pool, slab))
    groups = []
    for (n_b, q_b, sees_all, _), members in pooled.items():
        members.sort(key=lambda m: m[0])
        for run in _even_runs(members):
            if len(run) == 1:
                singles.append(run[0][1])
            else:
                groups.append(_Group([m[1] for m in run], n_b, q_b, sees_all, query.device, run[0][2], run[0][3],
                                     [m[0] for m in run]))
    for (q_b, sees_all), rows in chunks.items():
        if len(rows) == 1:
            singles.append(rows[0])
        else:
            groups.append(_Group(rows, 0, q_b, sees_all, query.device))
    return _LaneGroups(groups, sorted(singles))


def _even_runs(members: list[tuple]) -> list[list[tuple]]:
    """``(first slot, ...)`` tuples sorted by slot, cut into runs whose slots advance by one constant step (greedy:
    a run takes the next member while its step matches the run's first)."""
    runs: list[list[tuple]] = []
    for m in members:
        run = runs[-1] if runs else None
        if run is not None and (len(run) == 1 and m[0] > run[0][0]
                                or len(run) > 1 and m[0] - run[-1][0] == run[1][0] - run[0][0]):
            run.append(m)
        else:
            runs.append([m])
    return runs


def _row_index(rows: list[int], device: torch.device) -> slice | torch.Tensor:
    """``rows`` of a batch tensor: a slice when evenly spaced and increasing (a view), else a LongTensor."""
    step = rows[1] - rows[0]
    if step > 0 and all(b - a == step for a, b in zip(rows, rows[1:])):
        return slice(rows[0], rows[-1] + 1, step)
    return to_device(torch.tensor(rows, dtype=torch.long), device)


def _attend_group(cache, group: _Group, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, scaling: float | None) -> torch.Tensor | None:
    """One SDPA call for ``group``'s rows: ``[g, q, Hq, D]``, row ``i`` bit for bit the call of its own lane
    (:func:`_batch_invariant_sdpa`). A pooled group's keys/values are one strided view of its slab's tensors of
    this layer, lane ``i`` exactly the view :meth:`BatchKV.lane_segments` gives it (no copy of a cache); a chunk
    group's the chunk's rows. None when this layer's first row is not where the plan says (the caller then attends
    the rows one by one)."""
    q, n, Hq = group.q, group.n, query.shape[1]
    if group.slab is not None:
        run = cache.lane_run(group.rows[0], layer)
        if run is None or run[1] is not group.slab or run[2] != group.first:
            return None
        ks, vs = group.pool.storage(group.slab, layer)  # [Hkv, slots, D]

        def lanes_view(t: torch.Tensor) -> torch.Tensor:
            h, at, d = t.stride()
            return t.as_strided((len(group.rows), t.shape[0], n + q, t.shape[2]), (group.step * at, h, at, d),
                                t.storage_offset() + group.first * at)

        k, v = lanes_view(ks), lanes_view(vs)
    else:  # nothing cached: the chunk's own rows
        k, v = key[group.index, :, :q], value[group.index, :, :q]
    mask = None
    if not group.sees_all and attention_mask is not None:
        memo = group.masks
        if memo is None or memo[0] is not attention_mask:
            rows = attention_mask[group.index, :, :q]
            C = cache.cached_len
            memo = group.masks = (attention_mask, torch.cat([rows[..., :n], rows[..., C:C + q]], -1))
        mask = memo[1]
    o = F.scaled_dot_product_attention(query[group.index, :, :q], k, v, attn_mask=mask, scale=scaling,
                                       enable_gqa=k.shape[1] != Hq)
    return o.transpose(1, 2)


def _uncached(cache, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, scaling: float | None) -> torch.Tensor:
    """:func:`attend_lanes` when no lane has cached keys: every lane attends over its own chunk only, so one SDPA call
    over the batch (the forward's ``[B, 1, Q, Q]`` mask keeps the lanes' padding apart; no mask when every row is real
    and sees every key) instead of one per lane. Padded rows come out 0 (a fully masked row would be NaN, and a NaN
    value row poisons the next layer's products even at weight 0)."""
    B, Hq, Q, _ = query.shape
    padded = [b for b, q_b in enumerate(cache.rows) if q_b < Q]
    mask = attention_mask
    if mask is not None and not padded and all(cache.sees_all):
        mask = None
    elif mask is None and padded:
        raise ValueError("lane attention: padded lanes need the forward's attention mask")
    o = F.scaled_dot_product_attention(query, key, value, attn_mask=None if mask is None else mask[..., :Q],
                                       scale=scaling, enable_gqa=key.shape[1] != Hq).transpose(1, 2)
    for b in padded:
        o[b, cache.rows[b]:] = 0
    return o


def lane_attend(query: torch.Tensor, segments: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor | None,
                scale: float | None) -> torch.Tensor:
    """One lane's attention: ``query`` ``[Hq, q, D]`` over keys/values given as ``[Hkv, m_i, D]`` pieces in key order
    (``Hq`` a multiple of ``Hkv``), ``mask`` None or ``[1, 1, q, sum m_i]`` bool (True = may attend). Returns ``[q, Hq,
    D]``.

    One piece (the lane's blocks are one run of storage): one SDPA call on the view, grouped-query heads without
    repeating K/V, as before the pool. Several (a shared prefix's blocks, then the lane's own), read in place, never
    a copy of the keys: in float32 the scores of every piece side by side, one softmax, each piece's values weighted
    (:func:`_score_runs`, costing the ``[Hq, q, sum m_i]`` scores SDPA's math path makes anyway); in half precision
    on a CPU, whose score matmul would round the scores to the keys' dtype, one fused SDPA call per piece (float32
    inside) merged by the pieces' log-sum-exps (:func:`_merged_runs`; faster, ``benchmarks/results/
    bench_paged_attention.md``, but in float32 its merge left a prefix-reused nf4 step 1.2e-4 from a fresh prefill,
    past the float32 cell's 1e-4); half precision off the CPU joins the pieces (a copy) for one SDPA call."""
    Hq, q, D = query.shape
    if len(segments) == 1:
        k, v = segments[0]
        o = F.scaled_dot_product_attention(query[None], k[None], v[None], attn_mask=mask, scale=scale,
                                           enable_gqa=k.shape[0] != Hq)
        return o[0].transpose(0, 1)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    if query.dtype == torch.float32:
        return _score_runs(query, segments, mask, scale)
    if query.device.type == "cpu" and _CPU_FLASH is not None:
        return _merged_runs(query, segments, mask, scale)
    # half precision off the CPU: the runs joined (a copy) and one SDPA call; a paged GPU kernel is not built
    k, v = torch.cat([s[0] for s in segments], 1), torch.cat([s[1] for s in segments], 1)
    return lane_attend(query, [(k, v)], mask, scale)


def _score_runs(query: torch.Tensor, segments: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor | None,
                scale: float) -> torch.Tensor:
    """:func:`lane_attend` over several pieces by scores: every piece's ``[Hkv, g q, m_i]`` scores side by side, one
    float32 softmax, each piece's values weighted in place. Returns ``[q, Hq, D]``."""
    Hq, q, D = query.shape
    Hkv = segments[0][0].shape[0]
    g = Hq // Hkv
    qg = query.reshape(Hkv, g * q, D)  # query head h reads kv head h // g
    # the keys and values are read in their own dtype (no converted copy of a block); scores and softmax in float32
    scores = torch.cat([torch.matmul(qg, k.transpose(1, 2)).float() for k, _ in segments], -1) * scale
    if mask is not None:
        scores.masked_fill_(~mask[0, 0].repeat(g, 1), float("-inf"))
    probs = torch.softmax(scores, -1)
    o, at = None, 0
    for _, v in segments:
        m = v.shape[1]
        part = torch.matmul(probs[..., at:at + m].to(v.dtype), v).float()
        o = part if o is None else o.add_(part)
        at += m
    return o.reshape(Hq, q, D).transpose(0, 1).to(query.dtype)


def _merged_runs(query: torch.Tensor, segments: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor | None,
                 scale: float) -> torch.Tensor:
    """:func:`lane_attend` on a CPU over several pieces: per piece, the CPU flash kernel's output and log-sum-exp
    (float32 inside, as one SDPA call over the joined keys), then ``sum_i exp(lse_i - lse) o_i`` in float32 with
    ``lse = logsumexp_i lse_i``. Grouped-query heads read their KV head without repeating it (the query heads of one
    KV head are one batch of rows). A row that sees no key of a piece gets weight 0 there. Returns ``[q, Hq, D]``."""
    Hq, q, D = query.shape
    Hkv = segments[0][0].shape[0]
    g = Hq // Hkv
    qg = query.reshape(1, Hkv, g * q, D)
    flash = _CPU_FLASH
    outs, lses, at = [], [], 0
    for k, v in segments:
        m = k.shape[1]
        bias = None
        seen = None
        if mask is not None:
            part = mask[0, 0, :, at:at + m].repeat(g, 1)  # [g q, m]
            seen = part.any(-1)  # rows that see a key of this piece
            bias = torch.zeros(part.shape, dtype=query.dtype, device=query.device).masked_fill_(~part, float("-inf"))
            bias = bias[None, None]
        o, lse = flash(qg, k[None], v[None], 0.0, False, attn_mask=bias, scale=scale)
        if seen is not None:
            lse = lse.masked_fill(~seen, float("-inf"))
            o = o.masked_fill(~seen[:, None], 0)
        outs.append(o.float())
        lses.append(lse)
        at += m
    lse = torch.stack(lses)  # [pieces, 1, Hkv, g q]
    weights = torch.exp(lse - torch.logsumexp(lse, 0, keepdim=True)).nan_to_num(0.0)
    out = sum(w[..., None] * o for w, o in zip(weights, outs))  # [1, Hkv, g q, D]
    return out.reshape(Hq, q, D).transpose(0, 1).to(query.dtype)


def use_lanes(loaded) -> None:
    """Switch ``loaded`` (a :class:`~unmask.engine.loaded.LoadedModel`) to attention over each lane's own blocks: the
    transformers forward through :func:`lane_attention` when every attention module reads
    ``config._attn_implementation`` (transformers' models do), the fused fp16 decoder through :func:`attend_lanes`;
    the engine's caches then run in lane mode. The fused low-bit decoder keeps its row-invariant attention
    (``engine/row_attention.py``: its own per-lane calls)."""
    fused = loaded.decoder_forward
    if fused is not None:
        if not getattr(fused, "row_invariant", False) and getattr(fused, "lane_attention", False):
            loaded.lane_attention = True
        return
    register()
    set_impl = getattr(loaded.model, "set_attn_implementation", None)
    try:
        if set_impl is not None:
            set_impl(NAME)
        else:  # pragma: no cover - older transformers
            loaded.model.config._attn_implementation = NAME
    except (ValueError, TypeError, AttributeError):  # a model class that refuses custom attention: keep SDPA
        return
    loaded.lane_attention = True


def register() -> None:
    """Register :func:`lane_attention` (and the SDPA mask format for it) with transformers, once."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(NAME, lane_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
