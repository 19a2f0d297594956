"""Row-invariant attention (engine/row_attention.py): a row's output is the same bits whatever else the forward
holds - the one-row call of a block-1 step, the same row among a chunk's causal and mask rows, next to batch mates
with other cache lengths (key padding). Plain SDPA fails these (its blocks and vector tails follow the call's
shapes), which is what made int4/int8 answers depend on batch mates and speculative decoding differ from block 1."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from unmask.engine.attention import build_attention_mask
from unmask.engine.row_attention import lane_plans, padded_lanes, row_invariant_attention

HQ, HKV, D = 6, 2, 16


def _speculative_lane(n_cached: int, causal: int, group: int, branch: bool):
    """A lane's chunk after ``n_cached`` committed keys: ``causal`` committed rows, a draft group of ``group`` mask
    rows after them and (``branch``) a fallback group of mask rows that sees only the cached keys (not the causal
    rows): lists ``(pos, grp, start, committed)``."""
    P = n_cached + causal
    pos = list(range(n_cached, P)) + list(range(P, P + group))
    grp = list(range(n_cached, P)) + [1 << 40] * group
    start = list(range(n_cached, P)) + [P] * group
    if branch:
        pos += list(range(n_cached, n_cached + group))
        grp += [1 << 41] * group
        start += [n_cached] * group
    committed = [True] * causal + [False] * (len(pos) - causal)
    return pos, grp, start, committed


def _mask(lanes):
    """``[B, 1, Q, C + Q]`` mask for lanes given as (cached part, chunk part) of :func:`_speculative_lane`'s lists,
    right-padded as the denoiser pads them; returns (mask, C)."""
    C = max(n for n, _ in lanes)
    Q = max(len(ch[0]) for _, ch in lanes)
    B = len(lanes)
    q = {k: torch.zeros(B, Q, dtype=torch.long) for k in ("pos", "grp", "start")}
    qv, qc = torch.zeros(B, Q, dtype=torch.bool), torch.zeros(B, Q, dtype=torch.bool)
    kp, kg = torch.zeros(B, C, dtype=torch.long), torch.full((B, C), -1, dtype=torch.long)
    kv = torch.zeros(B, C, dtype=torch.bool)
    for b, (n, (pos, grp, start, committed)) in enumerate(lanes):
        L = len(pos)
        q["pos"][b, :L], q["grp"][b, :L], q["start"][b, :L] = torch.tensor(pos), torch.tensor(grp), torch.tensor(start)
        qv[b, :L], qc[b, :L] = True, torch.tensor(committed)
        kp[b, :n], kg[b, :n], kv[b, :n] = torch.arange(n), torch.arange(n), True
    mask = build_attention_mask(q_pos=q["pos"], q_grp=q["grp"], q_start=q["start"], q_valid=qv,
                                k_pos=torch.cat([kp, q["pos"]], 1), k_grp=torch.cat([kg, q["grp"]], 1),
                                k_committed=torch.cat([kv, qc], 1), k_valid=torch.cat([kv, qv], 1))
    return mask, C


def _padded(keys_by_lane, chunk_by_lane, C, Q):
    """Keys ``[B, H, C + Q, D]`` laid out as BatchKV.update does: each lane's cache, zeros, then its chunk."""
    B = len(keys_by_lane)
    out = torch.zeros(B, keys_by_lane[0].shape[0], C + Q, D)
    for b, (kc, ch) in enumerate(zip(keys_by_lane, chunk_by_lane)):
        out[b, :, :kc.shape[1]] = kc
        out[b, :, C:C + ch.shape[1]] = ch
    return out


@pytest.mark.parametrize("n_cached,causal,group,branch", [(37, 3, 4, True), (5, 1, 2, False), (130, 4, 4, True)])
def test_a_causal_rows_output_is_the_one_row_calls_whatever_the_forward_holds(n_cached, causal, group, branch):
    g = torch.Generator().manual_seed(n_cached)
    lane = _speculative_lane(n_cached, causal, group, branch)
    Q = len(lane[0])
    cache_k, cache_v = torch.randn(HKV, n_cached, D, generator=g), torch.randn(HKV, n_cached, D, generator=g)
    ch_k, ch_v, ch_q = (torch.randn(HKV, Q, D, generator=g), torch.randn(HKV, Q, D, generator=g),
                        torch.randn(HQ, Q, D, generator=g))
    mask, C = _mask([(n_cached, lane)])
    k, v = _padded([cache_k], [ch_k], C, Q), _padded([cache_v], [ch_v], C, Q)
    alone = row_invariant_attention(ch_q[None], padded_lanes(k, v, plans := lane_plans(mask, C)), plans, 0.25, True)
    # the math: SDPA with the mask, up to rounding
    torch.testing.assert_close(alone, F.scaled_dot_product_attention(ch_q[None], k, v, attn_mask=mask, scale=0.25,
                                                                     enable_gqa=True), rtol=1e-5, atol=1e-6)
    # a causal row = the one-row unmasked call over exactly its keys (what its block-1 step computes)
    for r in range(causal):
        m = n_cached + r + 1
        one = F.scaled_dot_product_attention(ch_q[None, :, r:r + 1], k[:, :, :m], v[:, :, :m], scale=0.25,
                                             enable_gqa=True)
        assert torch.equal(alone[:, :, r:r + 1], one), r
    # next to batch mates with longer and shorter caches and chunks (key and query padding): every row, mask rows
    # included, gets the same bits
    other = (n_cached + 19, _speculative_lane(n_cached + 19, 2, group + 1, True))
    short = (3, _speculative_lane(3, 1, 1, False))
    for mates in ([other], [short, other]):
        specs = [(n_cached, lane)] + mates
        Qs = [len(chunk[0]) for _, chunk in specs]
        mask_b, Cb = _mask(specs)
        Qb = max(Qs)
        ks = [cache_k] + [torch.randn(HKV, n, D, generator=g) for n, _ in mates]
        vs = [cache_v] + [torch.randn(HKV, n, D, generator=g) for n, _ in mates]
        cks = [ch_k] + [torch.randn(HKV, q, D, generator=g) for q in Qs[1:]]
        cvs = [ch_v] + [torch.randn(HKV, q, D, generator=g) for q in Qs[1:]]
        qs = torch.zeros(len(specs), HQ, Qb, D)
        qs[0, :, :Q] = ch_q
        for b, q in enumerate(Qs[1:], 1):
            qs[b, :, :q] = torch.randn(HQ, q, D, generator=g)
        plans = lane_plans(mask_b, Cb)
        out = row_invariant_attention(qs, padded_lanes(_padded(ks, cks, Cb, Qb), _padded(vs, cvs, Cb, Qb), plans),
                                      plans, 0.25, True)
        assert torch.equal(out[:1, :, :Q], alone)
        assert not out[0, :, Q:].any()  # padded query rows: zeros


def test_plain_sdpa_is_not_row_invariant_here():
    """The reason for the module (if torch's SDPA became row-invariant, the per-lane calls could go): the same
    causal row through one masked call of a speculative chunk differs from its one-row call."""
    g = torch.Generator().manual_seed(3)
    lane = _speculative_lane(37, 3, 4, True)
    Q = len(lane[0])
    mask, C = _mask([(37, lane)])
    k, v = torch.randn(1, HKV, C + Q, D, generator=g), torch.randn(1, HKV, C + Q, D, generator=g)
    q = torch.randn(1, HQ, Q, D, generator=g)
    batched = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25, enable_gqa=True)
    ones = [F.scaled_dot_product_attention(q[:, :, r:r + 1], k[:, :, :37 + r + 1], v[:, :, :37 + r + 1], scale=0.25,
                                           enable_gqa=True) for r in range(3)]
    assert not all(torch.equal(batched[:, :, r:r + 1], o) for r, o in enumerate(ones))


# ---------------------------------------------------------------------------------------------- prompt tiles
def _prompt_lane(n_cached: int, rows: int):
    """A prefill chunk: ``rows`` committed causal prompt rows after ``n_cached`` cached keys (positions in order)."""
    pos = list(range(n_cached, n_cached + rows))
    return pos, list(pos), list(pos), [True] * rows


def _prefill_outputs(q_all, k_all, v_all, n_cached: int, rows: int, mates=()):
    """Row-invariant attention of prompt rows ``[n_cached, n_cached + rows)`` of one lane (queries/keys/values of
    every position given as ``[H, P, D]``), flagged as prompt rows, optionally next to other lanes ``mates``
    (``(n_cached, rows, q, k, v)``); returns the lane's ``[1, HQ, rows, D]`` output."""
    specs = [(n_cached, rows, q_all, k_all, v_all)] + list(mates)
    mask, C = _mask([(n, _prompt_lane(n, r)) for n, r, *_ in specs])
    Q = max(r for _, r, *_ in specs)
    B = len(specs)
    q = torch.zeros(B, HQ, Q, D)
    pos = torch.zeros(B, Q, dtype=torch.long)
    flag = torch.zeros(B, Q, dtype=torch.bool)
    for b, (n, r, qa, _, _) in enumerate(specs):
        q[b, :, :r] = qa[:, n:n + r]
        pos[b, :r] = torch.arange(n, n + r)
        flag[b, :r] = True
    k = _padded([ka[:, :n] for n, _, _, ka, _ in specs], [ka[:, n:n + r] for n, r, _, ka, _ in specs], C, Q)
    v = _padded([va[:, :n] for n, _, _, _, va in specs], [va[:, n:n + r] for n, r, _, _, va in specs], C, Q)
    plans = lane_plans(mask, C, pos, flag)
    assert plans[0].tiles and not plans[0].groups and plans[0].other is None  # every row went into a tile
    return row_invariant_attention(q, padded_lanes(k, v, plans), plans, 0.25, True)[:1, :, :rows]


def test_a_prompt_rows_tile_output_is_the_same_whatever_chunk_cache_start_or_batch():
    """Prompt rows are computed in tiles fixed by position (PROMPT_TILE): the same bits whether the prompt comes in
    one chunk, in chunks of 7 or 40, after a prefix loaded from the cache, or next to other lanes."""
    from unmask.engine.row_attention import PROMPT_TILE

    g = torch.Generator().manual_seed(0)
    P = 3 * PROMPT_TILE + 11
    q_all, k_all, v_all = (torch.randn(HQ, P, D, generator=g), torch.randn(HKV, P, D, generator=g),
                           torch.randn(HKV, P, D, generator=g))
    whole = _prefill_outputs(q_all, k_all, v_all, 0, P)
    ref = F.scaled_dot_product_attention(q_all[None], k_all[None], v_all[None], is_causal=True, scale=0.25,
                                         enable_gqa=True)
    torch.testing.assert_close(whole, ref, rtol=1e-5, atol=1e-6)  # the math: causal attention
    for chunk in (7, 40, PROMPT_TILE):
        parts = [_prefill_outputs(q_all, k_all, v_all, s, min(chunk, P - s)) for s in range(0, P, chunk)]
        assert torch.equal(torch.cat(parts, 2), whole), chunk
    for start in (5, PROMPT_TILE, 50):  # a prefix from the cache, then the rest
        assert torch.equal(_prefill_outputs(q_all, k_all, v_all, start, P - start), whole[:, :, start:]), start
    mate_q, mate_k, mate_v = (torch.randn(HQ, 90, D, generator=g), torch.randn(HKV, 90, D, generator=g),
                              torch.randn(HKV, 90, D, generator=g))
    for mate in ((0, 90, mate_q, mate_k, mate_v), (60, 3, mate_q, mate_k, mate_v)):
        assert torch.equal(_prefill_outputs(q_all, k_all, v_all, 0, P, [mate]), whole)


def test_a_tiles_row_ignores_the_other_slots_and_masked_keys():
    """What the tiles rely on: in one CPU SDPA call of fixed shapes and mask, a row's output depends only on its own
    query and the keys it sees (other query slots and masked keys may hold anything finite)."""
    g = torch.Generator().manual_seed(1)
    T, L = 32, 96
    mask = (torch.arange(L)[None, :] <= (64 + torch.arange(T))[:, None])[None, None]
    q, k, v = (torch.randn(1, HQ, T, D, generator=g), torch.randn(1, HKV, L, D, generator=g),
               torch.randn(1, HKV, L, D, generator=g))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25, enable_gqa=True)
    for r in (0, 7, 31):
        q2, k2, v2 = torch.zeros_like(q), k.clone(), v.clone()
        q2[:, :, r] = q[:, :, r]
        k2[:, :, 64 + r + 1:], v2[:, :, 64 + r + 1:] = 0, 0  # keys the row cannot see
        out2 = F.scaled_dot_product_attention(q2, k2, v2, attn_mask=mask, scale=0.25, enable_gqa=True)
        assert torch.equal(out2[:, :, r], out[:, :, r]), r


def test_unflagged_causal_rows_stay_one_row_calls():
    """Without the prompt flag a causal row is still its block-1 call (answers: block-1 steps)."""
    mask, C = _mask([(10, _prompt_lane(10, 5))])
    plans = lane_plans(mask, C, torch.arange(10, 15)[None], torch.zeros(1, 5, dtype=torch.bool))
    assert not plans[0].tiles and [m for _, m in plans[0].groups] == [11, 12, 13, 14, 15]
