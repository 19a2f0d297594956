"""The paged KV pool (engine/kv_pool.py, docs/design.md#decoding "KV cache", #prefix-reuse, #admission-and-limits):
the tokens of the cache before it, blocks read in place, prefixes shared by reference, admission by free blocks, the
GPU budget from ``torch.cuda.mem_get_info``."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import decoding_paths as dp
import tiny
from device_tags import fake_cuda
from kv_pool_golden import CASES, run_cases
from unmask.engine import SamplingParams
from unmask.engine.engine import Engine
from unmask.engine.kv_budget import gpu_blocks, pool_blocks, token_blocks
from unmask.engine.kv_cache import LaneCache
from unmask.engine.kv_pool import KVPool, PoolFull
from unmask.engine.lane_attention import _merged_runs, _score_runs, lane_attend, use_lanes
from unmask.engine.limits import ParamError
from unmask.engine.model import load_model
from unmask.engine.options import EngineConfig

GOLDEN = Path(__file__).parent / "golden" / "kv_pool_paths.json"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return dp.write_checkpoints(tmp_path_factory.mktemp("kv_pool_paths"))


def _ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, 300, (n,), generator=g).tolist()


def _drain(engine: Engine) -> dict:
    outs: dict = {}
    while engine.has_unfinished():
        for ev in engine.step():
            if ev.finished:
                outs[ev.request_id] = ev.output
    return outs


def test_every_path_gives_the_tokens_of_the_cache_before_the_pool(checkpoints):
    """Plain, threshold, multi-block, CFG, speculative (greedy and sampled), prefix reuse, block-causal, sub-blocks
    and the dual cache, float32 native (lane attention), int8 (row-invariant attention) and fp16 (the fused
    decoder's padded attention), 3 requests in one batch: the tokens recorded under commit 9267790's contiguous
    per-lane buffers (tests/engine/kv_pool_golden.py)."""
    want = json.loads(GOLDEN.read_text())
    assert set(want) == {f"{n}/{w}" for n, w in CASES}
    assert run_cases(checkpoints) == want


def test_blocks_come_in_runs_with_reference_counts_and_eviction():
    pool = KVPool(block_tokens=4, capacity_blocks=8)
    a = pool.allocate(3)
    b = pool.allocate(2)
    assert a == [0, 1, 2] and b == [3, 4] and pool.free_blocks == 3 and pool.total_blocks == 8
    pool.decref([a[1]])  # a hole of one block: a run of two is found after it
    assert pool.allocate(2) == [5, 6] and pool.refcount(1) == 0
    assert pool.allocate(2) == [1, 7]  # no run of two left: the lowest free ids
    pool.incref([b[0]])  # shared: two holders
    pool.decref([b[0]])
    assert pool.refcount(b[0]) == 1 and b[0] not in pool._free
    other = KVPool(capacity_blocks=1)
    other.decref(other.allocate(1))
    with pytest.raises(ValueError, match="is free: nothing to share"):
        other.incref([0])
    with pytest.raises(ValueError, match="released more often"):
        other.decref([0])
    evicted = []

    def evict(n):  # the prefix store's role: free what it alone holds
        evicted.append(n)
        pool.decref([0])

    pool.evict = evict
    assert pool.allocate(1) == [0] and evicted == [1]
    pool.evict = None
    with pytest.raises(PoolFull, match="1 blocks wanted, 0 free of 8"):
        pool.allocate(1)
    grow = KVPool(block_tokens=4)  # unbounded: a new slab as large as everything so far, nothing moved
    first = grow.allocate(3)
    lane = LaneCache(pool=grow)
    lane.table.extend(first)
    lane.write(0, 0, torch.ones(2, 12, 8), torch.ones(2, 12, 8))
    before = grow.storage(grow.slab_of(0), 0)[0]
    grow.allocate(5)
    assert grow.total_blocks == 8 and grow.storage(grow.slab_of(0), 0)[0] is before


def test_runs_split_where_storage_does_and_segments_are_views():
    pool = KVPool(block_tokens=4, capacity_blocks=6)  # bounded: no new slab, the holes are taken
    hold = pool.allocate(6)
    pool.decref([hold[1], hold[3], hold[4]])  # free: 1, 3, 4
    lane = LaneCache(pool=pool)
    lane.reserve(12)  # one run of 3 is not free: 1, 3, 4
    assert lane.table == [1, 3, 4]
    k = torch.arange(2 * 10 * 8, dtype=torch.float32).view(2, 10, 8)
    lane.append([k], [k + 1], torch.arange(10), torch.zeros(10, dtype=torch.long))
    segs = lane.segments(0, 10)
    assert [s[0].shape[1] for s in segs] == [4, 6]  # block 1, then blocks 3-4
    storage = pool.storage(pool.slab_of(1), 0)[0]
    assert all(s[0].untyped_storage().data_ptr() == storage.untyped_storage().data_ptr() for s in segs)
    assert torch.equal(torch.cat([s[0] for s in segs], 1), k) and pool.gathered_bytes == 0
    assert torch.equal(lane.keys[0], k) and pool.gathered_bytes == 2 * k.numel() * 4  # a gather, counted


@pytest.mark.parametrize("gqa", [1, 3])
@pytest.mark.parametrize("masked", [False, True])
def test_attention_over_pieces_equals_one_sdpa_call_over_the_joined_keys(gqa, masked):
    """Lane attention over a lane's runs (a shared prefix's blocks, then its own): one fused call per run merged by
    log-sum-exp (the CPU's way) and the scores of every run side by side with one softmax (elsewhere) equal SDPA over
    the joined keys (float32 rounding); one run is that SDPA call itself."""
    g = torch.Generator().manual_seed(gqa)
    Hkv, q, D = 2, 5, 16
    query = torch.randn(Hkv * gqa, q, D, generator=g)
    pieces = [(torch.randn(Hkv, m, D, generator=g), torch.randn(Hkv, m, D, generator=g)) for m in (16, 32, 5)]
    keys, values = torch.cat([p[0] for p in pieces], 1), torch.cat([p[1] for p in pieces], 1)
    mask = None
    if masked:
        mask = torch.rand(1, 1, q, keys.shape[1], generator=g) > 0.3
        mask[..., 0] = True
    want = F.scaled_dot_product_attention(query[None], keys[None], values[None], attn_mask=mask, scale=0.25,
                                          enable_gqa=gqa > 1)[0].transpose(0, 1)
    for way in (lane_attend, _merged_runs, _score_runs):  # the CPU's way, and the scores' (off the CPU)
        got = way(query, pieces, mask, 0.25)
        assert got.shape == (q, Hkv * gqa, D) and torch.allclose(got, want, atol=2e-6, rtol=1e-5), way
    one = lane_attend(query, [(keys, values)], mask, 0.25)
    assert torch.equal(one, want)


CHAT = [dict(block_size=1), dict(block_size=4), dict(block_size=4, speculative=True), dict(block_size=4, cfg_scale=1.0),
        dict(block_size=4, multi_block=0.5)]


@pytest.mark.parametrize("kw", CHAT, ids=lambda kw: "-".join(f"{k}{v}" for k, v in kw.items()))
def test_a_chat_reusing_shared_blocks_gets_the_fresh_tokens_reading_them_in_place(kw):
    """Prefix reuse under lane attention (as load_model installs it): the next turn's cond lane starts with the
    store's blocks (two runs: the shared prefix, its own), attention reads them in place (nothing gathered) and the
    tokens equal a fresh prefill's."""
    model = tiny.loaded()
    use_lanes(model)
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0, **kw)
    outs = {}
    for reuse in (False, True):
        engine = Engine(model, enable_prefix_caching=reuse, max_batch_size=4)
        prompt, got, runs = _ids(37, 0), [], []
        for t in range(3):
            engine.add_request(prompt, params, f"t{t}")
            engine.step()
            lane = engine.scheduler.running[0].lanes[0].cache
            runs.append(len(lane.segments(0, lane.length)))
            out = _drain(engine)[f"t{t}"]
            got.append(out.token_ids)
            prompt = prompt + out.token_ids + _ids(11, 100 + t)
        outs[reuse] = got
        pool = engine.scheduler.kv_pool
        assert pool.gathered_bytes == 0
        if reuse:
            assert runs[0] == 1 and all(r >= 2 for r in runs[1:]), runs
    assert outs[True] == outs[False]


def test_a_fragmented_pool_gives_the_same_tokens():
    """Lanes whose tables are many runs (every other block held by someone else) decode the tokens of lanes in one
    run, reading the blocks in place."""
    model = tiny.loaded()
    use_lanes(model)
    params = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0, block_size=4)
    prompts = [_ids(30, 1), _ids(45, 2)]
    plain = Engine(model, enable_prefix_caching=False, max_batch_size=4)
    for i, p in enumerate(prompts):
        plain.add_request(p, params, f"r{i}")
    want = {k: v.token_ids for k, v in _drain(plain).items()}
    engine = Engine(model, enable_prefix_caching=False, max_batch_size=4)
    pool = engine.scheduler.kv_pool
    held = pool.allocate(40)
    pool.set_capacity(pool.total_blocks)  # bounded: the holes are taken, no new slab
    pool.decref(held[::2])  # 20 single free blocks between held ones
    for i, p in enumerate(prompts):
        engine.add_request(p, params, f"r{i}")
    engine.step()
    assert all(len(s.lanes[0].cache.segments(0, s.lanes[0].cache.length)) > 1 for s in engine.scheduler.running)
    got = {k: v.token_ids for k, v in _drain(engine).items()}
    assert got == want and pool.gathered_bytes == 0


def test_admission_waits_for_free_blocks_and_refuses_what_never_fits():
    """The scheduler admits by the pool's free blocks (plus what only the prefix store holds): a request whose blocks
    are not free waits in the queue, runs once they are; one larger than the pool is a 400 naming max_tokens."""
    model = tiny.loaded()
    engine = Engine(model, enable_prefix_caching=False, max_batch_size=4)
    sched, pool = engine.scheduler, engine.scheduler.kv_pool
    pool.set_capacity(6)
    params = SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.0, block_size=4)
    engine.add_request(_ids(40, 3), params, "a")  # 60 canvas tokens: 4 blocks
    engine.add_request(_ids(40, 4), params, "b")
    engine.step()
    assert [s.request_id for s in sched.running] == ["a"] and [s.request_id for s in sched.waiting] == ["b"]
    assert pool.used_blocks == 4 and sched.free_blocks() == 2 < sched.need_blocks(sched.waiting[0])
    outs = _drain(engine)
    assert set(outs) == {"a", "b"} and pool.used_blocks == 0
    with pytest.raises(ParamError, match="needs 8 KV blocks of 16 tokens.*holds 6") as e:
        engine.add_request(_ids(100, 5), params, "c")
    assert e.value.field == "max_tokens"


def test_the_store_gives_its_blocks_to_a_joining_request():
    """Blocks only the prefix store holds count as free for admission and are evicted (least recently used) when
    a joining request takes them."""
    model = tiny.loaded()
    engine = Engine(model, max_batch_size=4)
    sched, pool, store = engine.scheduler, engine.scheduler.kv_pool, engine.prefix_cache
    pool.set_capacity(6)
    params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0, block_size=4)
    engine.add_request(_ids(48, 6), params, "a")
    _drain(engine)
    assert store.tokens == 48 and store.evictable_blocks() == 3 and pool.free_blocks == 3
    assert sched.free_blocks() == 6
    engine.add_request(_ids(80, 7), params, "b")  # 84 tokens: 6 blocks, 3 of them the store's
    engine.step()
    assert [s.request_id for s in sched.running] == ["b"] and store.evicted == 3
    # the store now holds b's prompt: b's own blocks, shared (no block of its own)
    assert store.tokens == 80 and pool.used_blocks == 6 and store.evictable_blocks() == 0
    _drain(engine)


def test_the_budget_is_tokens_on_a_cpu_and_bytes_from_mem_get_info_on_a_gpu(monkeypatch):
    assert token_blocks(100, 16, 4) == 7 + 4
    assert pool_blocks(torch.device("cpu"), None, 16, 512, 8, 0.9) is None
    assert pool_blocks(torch.device("cpu"), 160, 16, 512, 8, 0.9) == 10 + 8
    info = lambda device: (3 << 30, 10 << 30)  # noqa: E731 - 3 GiB free of 10
    assert gpu_blocks(torch.device("cuda"), 1 << 20, 0.9, mem_get_info=info) == 2048  # 3 - 1 GiB, 1 MiB blocks
    assert gpu_blocks(torch.device("cuda"), 1 << 20, 0.5, mem_get_info=info) == 0  # 5 GiB kept: nothing left
    assert gpu_blocks(torch.device("cuda"), 1 << 20, 1.0, reserve_bytes=1 << 30, mem_get_info=info) == 2048
    with pytest.raises(ValueError, match="gpu_memory_utilization: must be in"):
        gpu_blocks(torch.device("cuda"), 1, 0.0, mem_get_info=info)
    with pytest.raises(ValueError, match="gpu_memory_utilization: must be in"):
        EngineConfig(gpu_memory_utilization=1.5).validate()
    cpu = Engine(tiny.loaded(), max_cached_tokens=160, max_batch_size=4)
    assert cpu.scheduler.kv_pool.capacity_blocks == 10 + 8
    with fake_cuda(monkeypatch):
        model = tiny.loaded()
        model.model.to("cuda")
        model.device = torch.device("cuda")
        cfg = model.model.config
        per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a, **k: (21 * 16 * per_token, 110 * 16 * per_token))
        engine = Engine(model, enable_prefix_caching=False)
        assert engine.scheduler.kv_bytes_per_token == per_token
        assert engine.scheduler.kv_pool.capacity_blocks == 10  # 21 - 0.1 x 110 blocks' bytes
        assert Engine(model, gpu_memory_utilization=0.95).scheduler.kv_pool.capacity_blocks == 15  # 21 - 5.5
        engine.add_request(_ids(40, 8), SamplingParams(max_tokens=8, temperature=0.0, block_size=4), "a")
        outs = _drain(engine)
    assert len(outs["a"].token_ids) == 8


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_pieces_merge_by_log_sum_exp_as_one_call(dtype):
    """In bfloat16/float16 on a CPU the pieces' fused SDPA outputs merge by their log-sum-exps: within the dtype's
    rounding of one SDPA call over the joined keys, rows that see no key of a piece included."""
    g = torch.Generator().manual_seed(5)
    Hkv, gqa, q, D = 2, 2, 6, 16
    query = torch.randn(Hkv * gqa, q, D, generator=g).to(dtype)
    pieces = [(torch.randn(Hkv, m, D, generator=g).to(dtype), torch.randn(Hkv, m, D, generator=g).to(dtype))
              for m in (16, 20)]
    keys, values = torch.cat([p[0] for p in pieces], 1), torch.cat([p[1] for p in pieces], 1)
    mask = torch.rand(1, 1, q, 36, generator=g) > 0.4
    mask[0, 0, 0, :16] = False  # row 0 sees nothing of the first piece
    mask[0, 0, :, 20] = True
    want = F.scaled_dot_product_attention(query[None].float(), keys[None].float(), values[None].float(),
                                          attn_mask=mask, scale=0.25, enable_gqa=True)[0].transpose(0, 1)
    got = lane_attend(query, pieces, mask, 0.25)
    one = lane_attend(query, [(keys, values)], mask, 0.25)
    assert got.dtype == dtype and torch.isfinite(got).all()
    assert (got.float() - want).abs().max() <= 2 * (one.float() - want).abs().max() + 1e-3


def test_an_unbounded_pool_keeps_tables_in_one_run_within_twice_the_blocks_in_use():
    pool = KVPool(block_tokens=4)
    held = pool.allocate(10)
    pool.decref(held[::2])  # 5 free, none adjacent, 5 in use
    assert pool.allocate(3) == [10, 11, 12] and pool.total_blocks == 13  # a slab of its own: 10 < 2 x (5 + 3)
    pool = KVPool(block_tokens=4)
    held = pool.allocate(16)
    pool.decref([b for b in held if b not in (2, 5, 8, 11, 14)])  # runs of 2 free, 5 in use
    assert pool.allocate(3) == [0, 1, 3] and pool.total_blocks == 16  # 16 >= 2 x (5 + 3): scattered, no growth


def test_a_collected_lane_returns_its_blocks_to_the_pool_it_holds_them_from():
    """A lane dropped without clear() (a cancelled request's last reference) releases its blocks when collected, to
    its current pool only (a lane that took a pool of its own before holds nothing there)."""
    import gc

    pool = KVPool(block_tokens=4)
    lane = LaneCache(capacity_hint=8)
    lane.reserve(4)  # a pool of its own
    own = lane.pool
    lane.clear()
    lane.bind(pool)
    lane.append([torch.ones(2, 6, 8)], [torch.ones(2, 6, 8)], torch.arange(6), torch.zeros(6, dtype=torch.long))
    assert pool.used_blocks == 2 and own.used_blocks == 0
    del lane
    gc.collect()
    assert pool.used_blocks == 0 and own.used_blocks == 0


def test_a_commit_costs_its_own_rows_of_metadata_not_the_whole_lanes():
    """The cached tokens' positions and groups live in a doubling host buffer: 300 one-token commits reallocate it
    a handful of times (a concatenation per commit copied the lane's whole metadata each step)."""
    lane = LaneCache(pool=KVPool(block_tokens=4))
    buffers = set()
    for i in range(300):
        lane.append([torch.zeros(1, 1, 2)], [torch.zeros(1, 1, 2)], torch.tensor([i]), torch.tensor([i // 4]))
        buffers.add(lane.pos.untyped_storage().data_ptr())
    assert len(buffers) <= 6 and lane.pos.tolist() == list(range(300)) and lane.grp.tolist() == [i // 4 for i in range(300)]
    lane.reset()
    assert lane.pos is None and lane.grp is None


@pytest.mark.parametrize("gqa", [False, True])
def test_lanes_without_cached_keys_attend_in_one_call_as_each_alone(gqa, monkeypatch):
    """No lane has cached keys (a canvas decoded without cache, a batch of first prefills): ``attend_lanes`` makes one
    SDPA call for the batch, not one per lane; each lane's real rows equal its own call over its chunk (float32
    tolerance: CPU SDPA's bits move with the call's shape, the ≈32 contracts), its padded rows are 0, and a lane
    whose rows are all masked past its length never poisons the others with NaN."""
    from types import SimpleNamespace

    from unmask.engine import lane_attention

    g = torch.Generator().manual_seed(0)
    B, Hq, Q, D = 3, 4, 6, 8
    Hkv = 2 if gqa else Hq
    query = torch.randn(B, Hq, Q, D, generator=g)
    key, value = torch.randn(B, Hkv, Q, D, generator=g), torch.randn(B, Hkv, Q, D, generator=g)
    rows = [6, 4, 0]
    mask = torch.zeros(B, 1, Q, Q, dtype=torch.bool)
    for b, q in enumerate(rows):
        mask[b, 0, :q, :q] = torch.rand(q, q, generator=g) < 0.7
        mask[b, 0, range(q), range(q)] = True  # every real row sees itself
    cache = SimpleNamespace(cached_len=0, rows=rows, sees_all=[False] * B)
    calls = []
    real = F.scaled_dot_product_attention
    monkeypatch.setattr(lane_attention.F, "scaled_dot_product_attention",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    out = lane_attention.attend_lanes(cache, 0, query, key, value, mask, 0.3)
    assert len(calls) == 1 and out.shape == (B, Q, Hq, D) and torch.isfinite(out).all()
    for b, q in enumerate(rows):
        assert not out[b, q:].any()
        if q:
            alone = real(query[b:b + 1, :, :q], key[b:b + 1, :, :q], value[b:b + 1, :, :q],
                         attn_mask=mask[b:b + 1, :, :q, :q], scale=0.3, enable_gqa=gqa)
            torch.testing.assert_close(out[b, :q], alone[0].transpose(0, 1), rtol=1e-5, atol=1e-6)
