"""Lane attention's batched calls (engine/lane_attention.py, docs/design.md#decoding "KV cache"): lanes with the same
cached length, chunk rows and mask state whose blocks are evenly spaced in one slab of the KV pool attend in one SDPA
call over a strided view of the pool (no copy of a cache), bit for bit each lane's own call on a CPU in float32 and
bfloat16 (the batch-invariance contract, docs/design.md#exactness-contracts-by-device-and-dtype)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from unmask.engine import lane_attention
from unmask.engine.kv_cache import BatchKV, LaneCache
from unmask.engine.kv_pool import KVPool

LAYERS, D = 2, 8


def _lanes(pool: KVPool, cached: list[int], hints: list[int], Hkv: int, dtype, g) -> list[LaneCache]:
    """Lanes holding ``cached[i]`` random committed tokens in every layer, each reserving ``hints[i]`` positions."""
    lanes = []
    for n, hint in zip(cached, hints):
        lane = LaneCache(hint, pool)
        if n:
            keys = [torch.randn(Hkv, n, D, generator=g).to(dtype) for _ in range(LAYERS)]
            values = [torch.randn(Hkv, n, D, generator=g).to(dtype) for _ in range(LAYERS)]
            lane.append(keys, values, torch.arange(n), torch.zeros(n, dtype=torch.long))
        lanes.append(lane)
    return lanes


def _per_lane(cache: BatchKV, layer: int, query, key, value, mask, scale) -> torch.Tensor:
    """The per-lane path: one :func:`lane_attend` call per lane over its segments (the reference)."""
    B, Hq, Q, _ = query.shape
    out = query.new_zeros(B, Q, Hq, D)
    for b, q_b in enumerate(cache.rows):
        if q_b:
            segments, n_b = cache.lane_segments(b, layer, key, value)
            m = None if cache.sees_all[b] else cache.lane_mask(b, mask, n_b, q_b, cache.cached_len)
            out[b, :q_b] = lane_attention.lane_attend(query[b, :, :q_b], segments, m, scale)
    return out


def _forward(lanes, rows, sees_all, Hq, Hkv, dtype, g, monkeypatch):
    """Each layer: the chunk written after the cached keys (``BatchKV.update`` in lane mode), then ``attend_lanes``
    and the per-lane reference. Returns ``(pairs of outputs, per layer attend_lanes' SDPA calls as (key batch size,
    key storage))``."""
    B, Q = len(lanes), max(rows)
    cache = BatchKV(lanes, torch.device("cpu"))
    cache.lane_mode, cache.rows, cache.sees_all = True, rows, sees_all
    C = cache.cached_len
    mask = torch.rand(B, 1, Q, C + Q, generator=g) < 0.7
    mask[..., C:C + Q] |= torch.eye(Q, dtype=torch.bool)  # every row sees itself
    calls = []
    real = F.scaled_dot_product_attention
    monkeypatch.setattr(lane_attention.F, "scaled_dot_product_attention",
                        lambda q, k, *a, **kw: calls.append((k.shape[0], k.untyped_storage().data_ptr()))
                        or real(q, k, *a, **kw))
    outs, layer_calls = [], []
    for layer in range(LAYERS):
        query = torch.randn(B, Q, Hq, D, generator=g).to(dtype).transpose(1, 2)  # transformers' layout
        key = torch.randn(B, Q, Hkv, D, generator=g).to(dtype).transpose(1, 2)
        value = torch.randn(B, Q, Hkv, D, generator=g).to(dtype).transpose(1, 2)
        key, value = cache.update(key, value, layer)
        before = len(calls)
        got = lane_attention.attend_lanes(cache, layer, query, key, value, mask, 0.3)
        layer_calls.append(calls[before:])  # not the reference's
        outs.append((got, _per_lane(cache, layer, query, key, value, mask, 0.3)))
    return outs, layer_calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
@pytest.mark.parametrize("sees_all", [True, False], ids=["no-mask", "masked"])
def test_lanes_alike_attend_in_one_call_over_the_pool_bit_for_bit(dtype, gqa, sees_all, monkeypatch):
    """Five lanes, 12 cached keys and 6 chunk rows each, evenly spaced in one slab: one SDPA call per layer whose
    keys are the pool's own storage (a view, not a copy), each lane's rows equal to its own call bit for bit."""
    g = torch.Generator().manual_seed(1)
    Hq, Hkv = (4, 2) if gqa else (4, 4)
    pool = KVPool(block_tokens=4, capacity_blocks=64)
    lanes = _lanes(pool, [12] * 5, [24] * 5, Hkv, dtype, g)
    outs, calls = _forward(lanes, [6] * 5, [sees_all] * 5, Hq, Hkv, dtype, g, monkeypatch)
    for layer, (got, want) in enumerate(outs):
        assert torch.equal(got, want), (layer, (got - want).abs().max())
    slabs = {pool.storage(pool.slab_of(lanes[0].table[0]), layer)[0].untyped_storage().data_ptr()
             for layer in range(LAYERS)}
    assert [len(c) for c in calls] == [1] * LAYERS and {c[0] for c in calls} == {(5, s) for s in slabs}, calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
def test_mixed_lanes_group_by_length_rows_and_spacing_and_the_rest_attend_alone(dtype, monkeypatch):
    """Lanes of several cached lengths, chunk rows (padded ones), mask states and spacings, one lane reading a shared
    block (two runs) and two with nothing cached: the groups take one call each, the others their own; every row
    equals the per-lane path bit for bit and padded rows are 0."""
    g = torch.Generator().manual_seed(2)
    Hq, Hkv = 4, 2
    pool = KVPool(block_tokens=4, capacity_blocks=128)
    cached = [8, 8, 8, 12, 8, 12, 0, 8, 0, 8]
    hints = [20, 20, 20, 20, 20, 20, 20, 28, 20, 20]
    lanes = _lanes(pool, cached, hints, Hkv, dtype, g)
    shared = LaneCache(20, pool)  # a prefix block another holder keeps, then its own blocks: two runs
    shared.share(lanes[0].blocks(0, 4), torch.arange(4), torch.zeros(4, dtype=torch.long))
    lanes.append(shared)
    rows = [6, 6, 6, 6, 4, 6, 6, 6, 6, 6, 5]
    sees_all = [True, True, True, True, True, True, False, True, False, False, True]
    outs, calls = _forward(lanes, rows, sees_all, Hq, Hkv, dtype, g, monkeypatch)
    for layer, (got, want) in enumerate(outs):
        assert torch.equal(got, want), (layer, (got - want).abs().max())
        assert not got[4, 4:].any() and not got[10, 5:].any()
    # per layer, SDPA calls: lanes 0-2 (8 cached, 6 rows, evenly spaced) one, lanes 3 and 5 (12 cached) one, lanes 6
    # and 8 (nothing cached, masked) one; lanes 4 (4 rows), 7 (its wider reservation breaks 0-2's spacing) and 9
    # (masked) one each; lane 10 (two runs) its pieces without SDPA (scores side by side, or the flash op per run)
    for layer_calls in calls:
        assert sorted(c[0] for c in layer_calls) == [1, 1, 1, 2, 2, 3], layer_calls


def test_a_batch_decodes_the_tokens_of_the_per_lane_path_under_the_prefix_cache(monkeypatch):
    """End to end (tiny bidirectional model, Fast-dLLM's prefix cache, threshold decoding, 6 requests): the same
    tokens with lanes grouped as with every lane attended alone, and at least one grouped call was made."""
    import tiny
    from unmask.engine import LLM, SamplingParams

    model = tiny.loaded(attention="bidirectional", logit_shift=False, block_size=4)
    lane_attention.use_lanes(model)
    assert model.lane_attention
    g = torch.Generator().manual_seed(3)
    prompts = torch.randint(3, 300, (6, 8), generator=g).tolist()
    params = SamplingParams.from_flat(temperature=0, speculative=False, block_size=4, threshold=0.5, cache="prefix",
                                      ignore_eos=True, max_tokens=8)
    real = lane_attention._attend_group
    grouped = []
    monkeypatch.setattr(lane_attention, "_attend_group", lambda *a: grouped.append(1) or real(*a))
    batched = [o.outputs[0].token_ids for o in LLM(model, max_batch_size=6).generate(prompts, params)]
    monkeypatch.setattr(lane_attention, "_batch_invariant_sdpa", lambda query: False)
    alone = [o.outputs[0].token_ids for o in LLM(model, max_batch_size=6).generate(prompts, params)]
    assert grouped and batched == alone
