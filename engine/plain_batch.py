"""Plain denoising of many sequences as one table (docs/design.md#decoding, "The plain table step"; issue 42).

The common request - plain block-wise unmasking without a KV cache (``cache="none"``, the default on bidirectional
models) or with Fast-dLLM's ``prefix`` cache, one lane, no grammar, no per-row sampling extras - needs nothing per
sequence between its reveals but a few counters. :func:`table_step` runs one denoising step of many such sequences
over ``[B, ...]`` tables instead of per-sequence objects: the canvases stacked once, the masked window positions
found by one NumPy pass, the forward's inputs and mask built once per batch geometry (kept while the rows' blocks
stay), one LM-head gather, the draws, scores and reveal rule over every row at once (the sampler's and the reveal
rule's own functions), one device-to-host copy, the canvas and log-probability writes as array writes. What stays
per sequence is what the host must know: its counters, the stop rules when its revealed prefix grew, and its
:class:`StepEvent`.

The tokens, log-probabilities, events and their order equal the general path's
(``Sequence.lane_inputs`` -> ``Denoiser._forward`` -> ``batch_step.reveal_batch``; tested) on every device and dtype,
since every value goes through the same operations on the same rows.
"""
from __future__ import annotations

import numpy as np
import torch

from . import lane_masks
from .kv_cache import BatchKV
from .noise import GUMBEL, row_keys_of
from .outputs import StepEvent, revealed_token
from .reveal_rule import reveal_count, select_segments
from .sampler import Candidates, forbid, gumbel_argmax, log_normalizer, sampling_temperature
from .sequence import Sequence, chunk_metadata
from .transfer import to_device

__all__ = ["PlainTable", "TableGeometry", "all_table_ready", "forward_rows", "table_ready", "table_step"]

_MEMO_SIZE = 2  # batch geometries kept (a block's steps reuse one; each holds a [B, 1, Q, Q] mask)


def table_ready(seq, vocab_size: int) -> bool:
    """Whether ``seq`` may step through :func:`table_step`: a plain :class:`~unmask.engine.sequence.Sequence`
    (not a subclass) with one lane and no grammar, without a KV cache (and no cached keys) or with Fast-dLLM's
    ``prefix`` cache on a model without the logit shift, and without ``top_logprobs``, ``min_tokens``,
    ``logit_bias``, penalties, top-k/top-p filters or a remasking order other than ``low_confidence``."""
    if type(seq) is not Sequence or len(seq.lanes) != 1 or seq.grammar is not None:
        return False
    mode = seq.cache_mode
    if not (mode == "none" and not seq.lanes[0].cache.length or mode == "prefix" and not seq.dllm.logit_shift):
        return False
    ok = getattr(seq, "_table_params_ok", None)
    if ok is None:
        p = seq.params
        k = p.top_k or 0
        ok = seq._table_params_ok = (not p.top_logprobs and not p.min_tokens and seq.logit_bias is None
                                     and p.presence_penalty == 0 and p.frequency_penalty == 0
                                     and p.repetition_penalty == 1.0 and not (0 < k < vocab_size) and p.top_p >= 1.0
                                     and (p.remasking or "low_confidence") == "low_confidence")
        seq._table_temperature = sampling_temperature(p)  # the plan's, fixed for the request
    return ok


def all_table_ready(denoiser, seqs: list, vocab_size: int) -> bool:
    """:func:`table_ready` of every sequence; at once when the denoiser's table :meth:`~PlainTable.holds` them
    (its members were ready when it was built, and nothing a table step does changes that)."""
    table = denoiser.table
    return (table is not None and table.holds(seqs)) or all(table_ready(seq, vocab_size) for seq in seqs)


def forward_rows(seq: Sequence) -> tuple[int, int, tuple[int, int] | None, bool]:
    """What a table step of ``seq`` forwards (``Sequence.lane_inputs`` for its cache mode): canvas rows
    ``[lo, hi)``, the positions committed to its cache after it (``(c, a)`` = ``c..a-1``, or None) and whether the
    lane's cache is refilled (replaced) by it. Cache ``none``: ``[0, L)`` on a bidirectional model, ``[0, e)``
    otherwise; ``prefix``: a block's first step the whole canvas, committing ``[0, a)``; later steps ``[a, L)``."""
    a, e = seq.blocks[seq.block_idx]
    if seq.cache_mode == "none":
        return 0, seq.length if seq.dllm.attention == "bidirectional" else e, None, False
    if seq.step_in_block == 0:
        return 0, seq.length, (0, a), True
    return a, seq.length, None, False


class TableGeometry:
    """One batch geometry's forward inputs other than the tokens, built once and kept while the rows' blocks stay:
    ``[B, Q]`` positions, groups, group starts, committed, valid, prompt rows (or None) on the device; ``valid_host``
    and ``cols`` (each row's canvas columns, ``[B, Q]`` host) to slice the tokens from the table; the forward's mask
    when no row attends to cached keys (else None: built per step from the lanes); ``[B]`` first rows, widths, whether
    each row is one attention group, and its commit (``(chunk indices, positions, groups)`` or None)."""

    __slots__ = ("pos", "grp", "start", "committed", "valid", "valid_host", "cols", "prompt", "mask", "los", "widths",
                 "one_group", "metas", "commits")


def _geometry(denoiser, keys: tuple, lanes: list, prompt_lens: list[int]) -> TableGeometry:
    """:class:`TableGeometry` of rows whose ``keys`` are ``(block metadata key, lo, hi, commit, replace, prompt
    forwarded)`` (the metadata of ``unmask.engine.sequence.chunk_metadata``), padded as
    ``Denoiser._inputs_on_device`` pads them."""
    pad = torch.nn.utils.rnn.pad_sequence
    metas = [chunk_metadata(key, lo, hi, commit) for key, lo, hi, commit, _, _ in keys]
    los = [k[1] for k in keys]
    widths = [hi - lo for _, lo, hi, _, _, _ in keys]
    B, Q = len(keys), max(widths)
    model = denoiser.model
    longs = torch.stack([pad([m[0] for m in metas], batch_first=True),
                         pad([m[1] for m in metas], batch_first=True, padding_value=-2),
                         pad([m[2] for m in metas], batch_first=True)])
    committed = pad([m[3] for m in metas], batch_first=True)
    valid = torch.arange(Q) < torch.tensor(widths)[:, None]
    prompt = torch.zeros(B, Q, dtype=torch.bool)
    if model.tiles_prompt_rows:  # the committed prompt rows forwarded without their cached keys (_inputs_on_device)
        forwarded = torch.tensor([k[5] for k in keys])[:, None]
        prompt = committed & (longs[0] < torch.tensor(prompt_lens)[:, None]) & forwarded
    on = to_device(torch.cat([longs, torch.stack([committed, valid, prompt]).long()]), denoiser.device)
    g = TableGeometry()
    g.pos, g.grp, g.start = on[0], on[1], on[2]
    g.committed, g.valid, g.valid_host = on[3].bool(), on[4].bool(), valid.numpy()
    g.cols = np.asarray(los)[:, None] + np.arange(Q)[None, :]
    g.prompt = on[5].bool() if bool(prompt.any()) else None
    g.los, g.widths, g.metas = los, widths, metas
    g.one_group = [bool(m[5]) for m in metas]
    g.commits = [(m[4], m[0][m[4]], m[1][m[4]]) if m[4].numel() else None for m in metas]
    g.mask = None
    if all(lo == 0 for lo in los):  # no row attends to cached keys: the mask is a function of the geometry
        kv = BatchKV(lanes, denoiser.device)  # the refilled lanes were reset: no cached keys
        if model.lane_attention:
            kv.lane_mode, kv.rows, kv.sees_all = True, widths, g.one_group
        g.mask = lane_masks.forward_mask(kv, g.pos, g.grp, g.start, g.committed, g.valid)
    return g


def _cached_geometry(denoiser, keys: tuple, lanes: list, prompt_lens: list[int]) -> TableGeometry:
    """:func:`_geometry`, kept in ``denoiser.table_memo`` (the last :data:`_MEMO_SIZE` geometries)."""
    memo = denoiser.table_memo
    key = (keys, tuple(prompt_lens))
    g = memo.pop(key, None)
    if g is None:
        g = _geometry(denoiser, keys, lanes, prompt_lens)
        while len(memo) >= _MEMO_SIZE:
            memo.pop(next(iter(memo)))
    memo[key] = g
    return g


class PlainTable:
    """The canvases and log-probabilities of the sequences stepping as one table: ``canvas`` ``[B, L]`` int64 and
    ``logprobs`` ``[B, G]`` float32 host tensors (``L``, ``G``: the longest canvas and generation region), whose row
    ``b`` each sequence's ``canvas`` / ``logprobs`` are views of from then on (so every reader and writer of a
    sequence's state sees the table). A new member list gets new tables; a sequence that left gets copies of its own
    rows (:meth:`release`: it keeps no old table alive, and nothing writes an old table again). The tables are normal
    tensors, made outside inference mode (the step runs in it): a caller may still write a sequence's canvas in place
    between steps, as before its first table step."""

    def __init__(self, seqs: list[Sequence]):
        self.members = list(seqs)  # held: an id() of a finished sequence may be reused by a new one
        B = len(seqs)
        L, G = max(seq.length for seq in seqs), max(seq.gen_len for seq in seqs)
        with torch.inference_mode(False):  # an inference tensor refuses in-place writes outside inference mode
            self.canvas = torch.zeros(B, L, dtype=torch.long)
            self.logprobs = torch.zeros(B, G, dtype=torch.float32)
            for b, seq in enumerate(seqs):
                self.canvas[b, :seq.length] = seq.canvas
                self.logprobs[b, :seq.gen_len] = seq.logprobs
                seq.canvas, seq.logprobs = self.canvas[b, :seq.length], self.logprobs[b, :seq.gen_len]
                seq.host_canvas()  # its NumPy views memo now of the new rows (it held the old table's views)
        self.views = [(seq.canvas, seq.logprobs) for seq in seqs]
        self.host, self.host_lp = self.canvas.numpy(), self.logprobs.numpy()
        self.prompt_lens = np.array([seq.prompt_len for seq in seqs], dtype=np.int64)

    def release(self, keep: list[Sequence] = ()) -> None:
        """Give each member not in ``keep`` whose canvas and log-probabilities are still its row's views copies of
        its own: a sequence that left (finished, aborted, paused) and that a caller still holds (a server's stream
        holds its choices until they are read) keeps its own rows alive, not the whole ``[B, L]`` tables."""
        kept = {id(seq) for seq in keep}
        with torch.inference_mode(False):  # normal tensors, as the table's
            for seq, (view, lp) in zip(self.members, self.views):
                if id(seq) not in kept:
                    if seq.canvas is view:
                        seq.canvas = view.clone()
                    if seq.logprobs is lp:
                        seq.logprobs = lp.clone()
                    seq.host_canvas()  # its NumPy views memo now of its own tensors (it held the old views)

    def holds(self, seqs: list[Sequence]) -> bool:
        """Whether the members are ``seqs``, in this order, and each one's canvas and log-probabilities are still
        its row's views."""
        return len(seqs) == len(self.members) and all(
            a is b and a.canvas is v and a.logprobs is lp for a, b, (v, lp) in zip(seqs, self.members, self.views))


def table_of(denoiser, seqs: list[Sequence]) -> PlainTable:
    """``denoiser.table`` when it :meth:`~PlainTable.holds` ``seqs``, else a new :class:`PlainTable` of them."""
    table = denoiser.table
    if table is None or not table.holds(seqs):
        if table is not None:
            table.release(seqs)  # those that left: their own rows
        table = denoiser.table = PlainTable(seqs)
    return table


def table_step(denoiser, seqs: list[Sequence], groups: list[list[int]]) -> list[StepEvent]:
    """One denoising step of ``seqs`` (each :func:`table_ready`, none finished), one forward per group of
    indices (``unmask.engine.denoiser.plan_forwards``); returns their :class:`StepEvent` s in order (none for a
    ``final_only`` sequence's unfinished step)."""
    table = table_of(denoiser, seqs)
    n = len(seqs)
    windows = np.empty((n, 2), dtype=np.int64)  # per row: the window [start, end)
    keys = []
    for b, seq in enumerate(seqs):
        a, e = seq.blocks[seq.block_idx]
        _, s, we = seq.windows[seq.win_idx]
        windows[b] = (s, we)
        lo, hi, commit, replace = forward_rows(seq)
        keys.append(((seq.length, seq.dllm.attention, a, e, seq.block_size, seq.origin), lo, hi, commit, replace,
                     replace or seq.lanes[0].cache.length < seq.prompt_len))
    mask_id = seqs[0].dllm.mask_token_id
    cols = np.arange(table.host.shape[1])
    masked = (table.host == mask_id) & (cols >= windows[:, :1]) & (cols < windows[:, 1:])
    rows, at = np.nonzero(masked)  # each row's masked window positions, ascending
    counts = np.bincount(rows, minlength=n)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    logits, commits = [], []
    for group in groups:
        out, todo = _forward(denoiser, table, [seqs[b] for b in group], group, [keys[b] for b in group], rows, at,
                             counts, starts)
        logits.append(out)
        commits.append(todo)
        for b in group:  # counted once its forward ran, as the general path counts (a failed forward counts none)
            seqs[b].nfe += 1
    order = [b for group in groups for b in group]
    if order != list(range(n)):  # the groups' logits back in row order
        perm = np.concatenate([np.arange(starts[b], starts[b] + counts[b]) for b in order])
        inverse = np.empty_like(perm)
        inverse[perm] = np.arange(len(perm))
        logits = [torch.cat(logits)[to_device(torch.from_numpy(inverse), denoiser.device)]]
    segments, packed = _decide(denoiser, seqs, logits[0] if len(logits) == 1 else torch.cat(logits), rows, at,
                               counts)
    for kv, todo in commits:  # one batched copy per forward (BatchKV.commit_all), as the general path commits
        if todo:
            kv.commit_all(todo)
    events = _apply(table, seqs, packed, rows, at, counts, segments)
    if any(seq.finished for seq in seqs):
        table.release()  # every member its own rows (the next step copies the others into a new table)
        denoiser.table = None  # the next step's members differ: hold no finished sequence until then
    return events


def _forward(denoiser, table: PlainTable, seqs: list[Sequence], group: list[int], keys: list, rows: np.ndarray,
             at: np.ndarray, counts: np.ndarray, starts: np.ndarray) -> tuple[torch.Tensor, tuple]:
    """The forward of the table rows ``group`` (``seqs``: theirs; ``keys``: their geometry keys): the logits of
    their masked window positions, row after row (``[n, V]``), and ``(BatchKV, commits)`` for
    ``BatchKV.commit_all``."""
    dev = denoiser.device
    lanes = [seq.lanes[0].cache for seq in seqs]
    for lane, key in zip(lanes, keys):
        if key[4]:
            lane.reset()  # refilled by this forward: keep the buffers
    geo = _cached_geometry(denoiser, tuple(keys), lanes, table.prompt_lens[group].tolist())
    idx = np.asarray(group)
    host = table.host
    tokens = np.where(geo.valid_host, host[idx[:, None], np.minimum(geo.cols, host.shape[1] - 1)], 0)  # 0-padded
    kv = BatchKV(lanes, dev)
    mask = geo.mask
    if denoiser.model.lane_attention:
        kv.lane_mode, kv.rows = True, geo.widths
        kv.sees_all = geo.one_group if mask is not None else [
            lane_masks.sees_every_key(_Rows(m[1], m[2], m[5]), lane) for m, lane in zip(geo.metas, lanes)]
    if mask is None:
        mask = lane_masks.forward_mask(kv, geo.pos, geo.grp, geo.start, geo.committed, geo.valid)
    extra = {"prompt_rows": geo.prompt} if geo.prompt is not None else {}
    hidden = denoiser.model.hidden_states(to_device(torch.from_numpy(tokens), dev), geo.pos, mask, cache=kv, **extra)
    denoiser.forwards += 1
    if len(group) == len(counts):  # every row: the masked positions as they are
        r, c = rows, at
    else:
        sel = np.concatenate([np.arange(starts[b], starts[b] + counts[b]) for b in group])
        r, c = np.searchsorted(idx, rows[sel]), at[sel]
    shift = 1 if seqs[0].dllm.logit_shift else 0
    gather = to_device(torch.from_numpy(np.stack([r, c - shift - np.asarray(geo.los)[r]])), dev)
    todo = [(b, *commit[:1], lane, *commit[1:]) for b, (commit, lane) in enumerate(zip(geo.commits, lanes))
            if commit is not None]
    return denoiser.model.logits(hidden[gather[0], gather[1]]), (kv, todo)


class _Rows:
    """What ``lane_masks.sees_every_key`` reads of a lane's chunk: its groups, starts and whether it is one group."""

    __slots__ = ("grp", "start", "one_group")

    def __init__(self, grp: torch.Tensor, start: torch.Tensor, one_group: bool):
        self.grp, self.start, self.one_group = grp, start, one_group


def _decide(denoiser, seqs: list[Sequence], logits: torch.Tensor, rows: np.ndarray, at: np.ndarray,
            counts: np.ndarray) -> tuple[list, np.ndarray]:
    """Candidates and the reveal rule over every row (``batch_step.reveal_batch``'s operations: forbidden ids at
    -inf, argmax or Gumbel-max per row, probability = the candidate's softmax at temperature 1, score = the
    probability, per sequence its quota or threshold) and their one device-to-host copy: ``(per sequence its
    segment (quota, threshold), [N, 4] float64 host (token, probability, log-probability, chosen))``."""
    dev = logits.device
    logits = forbid(logits.float(), denoiser.forbidden)
    tokens = torch.argmax(logits, dim=-1)
    temps = [seq._table_temperature for seq in seqs]
    if any(temps):
        t_row = np.asarray(temps, dtype=np.float64)[rows]
        sampled = np.flatnonzero(t_row)
        seeds = np.asarray([seq.plan.seed for seq in seqs], dtype=np.int64)[rows[sampled]]
        steps = np.asarray([seq.step for seq in seqs], dtype=np.int64)[rows[sampled]]
        draw_keys = row_keys_of(torch.from_numpy(seeds), torch.from_numpy(steps), GUMBEL,
                                torch.from_numpy(at[sampled]))
        both = to_device(torch.from_numpy(np.stack([sampled.astype(np.float64), t_row[sampled]])), dev)
        r = both[0].long()
        tokens[r] = gumbel_argmax(logits[r].to(torch.float64) / both[1][:, None], draw_keys)
    lse = log_normalizer(logits)
    logp = logits.gather(-1, tokens[:, None])[:, 0].to(torch.float64) - lse
    probability = logp.exp()
    flat, lo = [], 0  # per sequence its window's rows and rule, as Sequence.reveal_segments gives it
    for seq, c in zip(seqs, counts.tolist()):
        quota = None if seq.threshold is not None else reveal_count(
            c, seq.window_steps[seq.win_idx] - seq.step_in_window)
        flat.append((lo, lo + c, quota, seq.threshold))
        lo += c
    chosen = select_segments(Candidates(tokens, probability, probability, logp.float()), flat)
    packed = torch.stack([tokens.to(torch.float64), probability, logp.float().to(torch.float64),
                          chosen.to(torch.float64)], 1).cpu().numpy()  # the step's one device-to-host copy
    return [(q, t) for _, _, q, t in flat], packed


def _apply(table: PlainTable, seqs: list[Sequence], packed: np.ndarray, rows: np.ndarray, at: np.ndarray,
           counts: np.ndarray, segments: list) -> list[StepEvent]:
    """Write the chosen rows into the table (every sequence's canvas and log-probabilities at once), then per
    sequence, in the reveal order of ``HostRows.picked`` (a quota window's by descending score, ties to the lower
    row; a threshold window's ascending), its revealed tokens, counters and stop rules (``Sequence.reveal``);
    returns the events."""
    chosen = packed[:, 3] > 0.5
    prob = packed[:, 1]
    quota_row = np.array([q is not None for q, _ in segments], dtype=bool)[rows]
    # reveal order: by row, then (quota windows) descending score, then position; a stable sort keeps ties ascending
    order = np.lexsort((np.where(quota_row, -prob, 0.0), rows))
    order = order[chosen[order]]
    if np.isnan(prob[order]).any():  # a NaN score (a broken forward): the general path's own sort, not lexsort's
        order = _picked_order(chosen, prob, rows, [q is not None for q, _ in segments])
    r, pos = rows[order], at[order]
    toks = packed[order, 0].astype(np.int64)
    rel = pos - table.prompt_lens[r]
    table.host[r, pos] = toks
    table.host_lp[r, rel] = packed[order, 2]  # float64 -> float32, rounded as a float32 tensor write rounds it
    picked = np.bincount(r, minlength=len(seqs)).tolist()
    rel_l, tok_l, prob_l, lp_l = rel.tolist(), toks.tolist(), packed[order, 1].tolist(), packed[order, 2].tolist()
    views = [None] * len(seqs) if all(seq.final_only for seq in seqs) else _canvas_views(table, seqs)
    # the stop rules can change something only where the position after the revealed prefix was revealed (or they
    # never ran): Request.stop_watch
    watch = [(seq.stop_watch(), seq.stop_scan_end(), seq.stopper.checked) for seq in seqs]
    at = np.array([w if w < end else 0 for w, end, _ in watch], dtype=np.int64)
    due = ((table.host[np.arange(len(seqs)), at] != seqs[0].dllm.mask_token_id)
           | np.array([not (checked and w < end) for w, end, checked in watch])).tolist()
    events = []
    lo = 0
    for seq, c, k, view, check in zip(seqs, counts.tolist(), picked, views, due):
        hi = lo + k
        block, step = seq.block_idx, seq.step
        seq.step += 1
        seq.step_in_block += 1
        seq.step_in_window += 1
        if k == c:
            seq._skip_empty_blocks()
        elif check:
            seq._check_finished()
        if not seq.final_only or seq.finished:  # a final-only choice's unfinished steps emit nothing
            limit = seq.max_tokens
            revealed = [revealed_token(p, t, pr, lp) for p, t, pr, lp in
                        zip(rel_l[lo:hi], tok_l[lo:hi], prob_l[lo:hi], lp_l[lo:hi]) if p < limit]
            events.append(seq.event(block, step, revealed, view))
        lo = hi
    return events


def _picked_order(chosen: np.ndarray, prob: np.ndarray, rows: np.ndarray, quota: list[bool]) -> np.ndarray:
    """The chosen rows' reveal order as ``HostRows.picked`` sorts them (Python's ``sorted`` by descending score in
    a quota window, in which a NaN compares equal to every score; ascending in a threshold window), sequence by
    sequence: ``[k]`` int64 indices into the step's rows."""
    flat = np.flatnonzero(chosen)  # by sequence, then position
    score = prob.tolist()
    out: list[int] = []
    for b, by_score in enumerate(quota):
        mine = flat[rows[flat] == b].tolist()
        out += sorted(mine, key=lambda i: -score[i]) if by_score else mine
    return np.asarray(out, dtype=np.int64)


def _canvas_views(table: PlainTable, seqs: list[Sequence]) -> list[list[int | None]]:
    """Every sequence's ``Sequence.canvas_view`` (its first ``max_tokens`` generated positions, ``None`` where
    masked) from the table at once."""
    limits = [seq.max_tokens for seq in seqs]
    cols = table.prompt_lens[:, None] + np.arange(max(limits))[None, :]
    region = table.host[np.arange(len(seqs))[:, None], np.minimum(cols, table.host.shape[1] - 1)]
    shown = region.astype(object)
    shown[region == seqs[0].dllm.mask_token_id] = None
    return [row[:m] for row, m in zip(shown.tolist(), limits)]
