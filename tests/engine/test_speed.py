"""Speed-path rules (issue 6): the fast paths compute what the slow ones did, and the KV-cache budget holds."""
from __future__ import annotations

import os

import pytest
import torch

from step_together import step_together
from tiny import loaded
from unmask.engine import LLM, SamplingParams
from unmask.engine.plan import resolve_params
from unmask.engine.detokenize import decode, stream_safe, whole_chars
from unmask.engine.kv_cache import BatchKV, LaneCache
from unmask.engine.kv_pool import KVPool
from unmask.engine.noise import Draws
from unmask.engine.sampler import log_normalizer, sample_candidates
from unmask.engine.scheduler import CacheFull, Scheduler

PROMPTS = ["Hello world", "The quick brown fox jumps over the lazy dog. One two", "Paris"]


@pytest.fixture(scope="module")
def llm():
    return LLM(loaded(attention="prefix_causal"))


# ---------------------------------------------------------------- sampler fast path
def test_log_normalizer_matches_float64_log_softmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 5000, generator=g) * 6
    logits[:, 17] = float("-inf")  # forbidden ids
    logits[3, :4990] = float("-inf")  # a row with few finite entries (top-k)
    ref = torch.log_softmax(logits.double(), dim=-1)
    got = logits.double() - log_normalizer(logits)[:, None]
    finite = torch.isfinite(ref)
    assert torch.equal(finite, torch.isfinite(got))
    assert (ref[finite] - got[finite]).abs().max() < 1e-6
    assert (ref.exp() - got.exp()).abs().max() < 1e-7


@pytest.mark.parametrize("remasking", ["low_confidence", "margin", "random"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_candidates_equal_float64_softmax_reference(remasking, temperature):
    """Tokens identical, probabilities/margins within 1e-7 of LLaDA's float64 softmax."""
    logits = torch.randn(12, 3000, generator=torch.Generator().manual_seed(1)) * 4
    sp = resolve_params(SamplingParams(temperature=temperature, remasking=remasking, seed=0))
    c = sample_candidates(logits.clone(), sp, Draws(5, 0))
    p = torch.softmax(logits.double(), dim=-1)
    ref_prob = p.gather(-1, c.tokens[:, None])[:, 0]
    assert (c.probability - ref_prob).abs().max() < 1e-7
    if temperature == 0:
        assert torch.equal(c.tokens, logits.argmax(-1))
    if remasking == "margin":
        top2 = p.topk(2, dim=-1).values
        assert (c.score - (top2[:, 0] - top2[:, 1])).abs().max() < 1e-7


# ---------------------------------------------------------------- incremental text
def test_stream_text_equals_decoded_prefix_every_step(llm):
    """The incremental prefix scan gives, at every step, the stream-safe text of the revealed left-to-right
    prefix recomputed from scratch."""
    m = llm.model.dllm.mask_token_id
    sp = SamplingParams(max_tokens=12, block_size=4, steps=6, temperature=0.9, seed=2, ignore_eos=True,
                        remasking="random")
    for ev in llm.stream(PROMPTS[1], sp):
        prefix = []
        for t in ev.canvas:
            if t is None or t == m:
                break
            prefix.append(t)
        want = decode(llm.tokenizer, prefix)
        # a final text never ends in a cut multi-byte character (detokenize.whole_chars)
        assert ev.text == (whole_chars(want) if ev.finished else stream_safe(want, []))


# ---------------------------------------------------------------- KV cache view fast paths
def test_batch_kv_fast_paths_equal_padded_copy():
    def lane(n, seed):
        g = torch.Generator().manual_seed(seed)
        c = LaneCache()
        if n:
            c.append([torch.randn(2, n, 8, generator=g)], [torch.randn(2, n, 8, generator=g)],
                     torch.arange(n), torch.arange(n))
        return c

    new = torch.randn(2, 2, 3, 8)
    for lanes in ([lane(5, 0)], [lane(5, 0), lane(5, 1)], [lane(5, 0), lane(2, 1)], [lane(0, 0), lane(3, 1)]):
        kv = BatchKV(lanes, torch.device("cpu"))
        k, v = kv.update(new[: len(lanes)], new[: len(lanes)] * 2, 0)
        C = kv.cached_len
        for b, ln in enumerate(lanes):
            n = ln.length
            if n:
                assert torch.equal(k[b, :, :n], ln.keys[0]) and torch.equal(v[b, :, :n], ln.values[0])
            assert torch.equal(k[b, :, n:C], torch.zeros_like(k[b, :, n:C]))
            assert torch.equal(k[b, :, C:], new[b])


def test_lane_cache_grows_by_blocks_and_one_lane_forwards_write_only_scratch():
    """Appends in chunks (past the capacity hint, so the lane takes more blocks) hold what a concatenation would,
    and blocks already written never move; a one-lane forward's new keys land in the scratch positions and never
    become cached; clear releases the blocks (engine/kv_pool.py)."""
    g = torch.Generator().manual_seed(0)
    pool = KVPool(block_tokens=4)
    c = LaneCache(capacity_hint=4, pool=pool)
    ks, vs = [], []
    for m in (3, 1, 5, 2):
        k, v = torch.randn(2, m, 8, generator=g), torch.randn(2, m, 8, generator=g)
        ks.append(k), vs.append(v)
        table = list(c.table)
        c.append([k, k + 1], [v, v + 1], torch.arange(m), torch.zeros(m, dtype=torch.long))
        assert c.table[:len(table)] == table  # grown by blocks: nothing moved
        n = sum(x.shape[1] for x in ks)
        assert c.length == n and c.capacity >= n
        assert torch.equal(c.keys[0], torch.cat(ks, 1)) and torch.equal(c.values[1], torch.cat(vs, 1) + 1)
        # a forward of 4 new positions through the one-lane view: cached part + chunk, cache unchanged
        new = torch.randn(1, 2, 4, 8, generator=g)
        kv = BatchKV([c], torch.device("cpu"))
        k_all, v_all = kv.update(new, new * 2, 0)
        assert torch.equal(k_all[0], torch.cat([torch.cat(ks, 1), new[0]], 1))
        assert torch.equal(v_all[0, :, n:], new[0] * 2)
        assert c.length == n and torch.equal(c.keys[0], torch.cat(ks, 1))
    assert c.capacity >= 11 and c.nbytes() == len(c.table) * 2 * 2 * 4 * 2 * 8 * 4 == len(c.table) * pool.block_bytes()
    assert c.pos.tolist() == [0, 1, 2, 0, 0, 1, 2, 3, 4, 0, 1]
    # commits after a one-lane forward: the chunk's first m positions are adopted in place, anything else copied
    n0 = c.length
    chunk = torch.randn(1, 2, 3, 8, generator=g)
    kv = BatchKV([c], torch.device("cpu"))
    for layer in range(2):
        kv.update(chunk + layer, chunk * 2 + layer, layer)
    written = pool.written_bytes
    kv.commit(0, torch.tensor([0, 1]), c, torch.tensor([7, 8]), torch.tensor([1, 1]))
    assert c.length == n0 + 2 and c.pos[-2:].tolist() == [7, 8] and pool.written_bytes == written  # adopted
    assert torch.equal(c.keys[1][:, n0:], chunk[0, :, :2] + 1) and torch.equal(c.values[0][:, n0:], chunk[0, :, :2] * 2)
    kv2 = BatchKV([c], torch.device("cpu"))
    for layer in range(2):
        kv2.update(chunk + layer, chunk * 2 + layer, layer)
    kv2.commit(0, torch.tensor([2]), c, torch.tensor([9]), torch.tensor([1]))  # not a prefix: copied
    assert torch.equal(c.keys[0][:, -1], chunk[0, :, 2]) and torch.equal(c.keys[0][:, n0:n0 + 2], chunk[0, :, :2])
    kv2.commit(0, torch.tensor([0]), c, torch.tensor([10]), torch.tensor([1]))  # the lane moved on: copied
    assert c.length == n0 + 4 and torch.equal(c.keys[0][:, -1], chunk[0, :, 0])
    cap = c.capacity
    c.reset()  # a refresh: nothing cached, blocks kept
    assert c.length == 0 and c.capacity == cap and c.keys == [] and c.pos is None
    used = pool.used_blocks
    c.clear()
    assert c.length == 0 and c.capacity == 0 and c.nbytes() == 0 and c.keys == []
    assert pool.used_blocks == used - cap // 4
    # a cache built from given keys/values (the training draft objective's context)
    kv = [torch.randn(2, 5, 8, generator=g)]
    d = LaneCache.committed(kv, [kv[0] * 2], torch.arange(5), torch.arange(5))
    assert d.length == 5 and torch.equal(d.keys[0], kv[0]) and torch.equal(d.values[0], kv[0] * 2)
    with torch.no_grad():
        kv[0].zero_()
    assert not torch.equal(d.keys[0], kv[0])  # copied


def test_a_chunk_past_the_lanes_blocks_takes_more_or_copies_in_a_full_pool():
    """A one-lane forward whose chunk does not fit in the lane's blocks takes more blocks when the pool has them, and
    takes the copying path when it has none (or under autograd): the blocks are not touched then."""
    g = torch.Generator().manual_seed(2)
    pool = KVPool(block_tokens=4)
    c = LaneCache(capacity_hint=4, pool=pool)
    k = torch.randn(2, 11, 8, generator=g)
    c.append([k], [k * 2], torch.arange(11), torch.zeros(11, dtype=torch.long))
    ks = [k]
    # a chunk that does not fit takes more blocks when the pool has them ...
    cap = c.capacity
    big = torch.randn(1, 2, cap, 8, generator=g)
    k_all, _ = BatchKV([c], torch.device("cpu")).update(big, big, 0)
    assert torch.equal(k_all[0], torch.cat([torch.cat(ks, 1), big[0]], 1)) and c.capacity >= 11 + cap
    # ... and the copying path when it has none: the blocks are not touched
    pool.set_capacity(pool.total_blocks)
    while pool.free_blocks:
        pool.allocate(1)
    cap, table = c.capacity, list(c.table)
    blocks = [t.clone() for t in pool.storage(pool.slab_of(c.table[0]), 0)]
    big = torch.randn(1, 2, cap, 8, generator=g)
    k_all, _ = BatchKV([c], torch.device("cpu")).update(big, big, 0)
    assert torch.equal(k_all[0], torch.cat([torch.cat(ks, 1), big[0]], 1))
    # compared bit for bit: the scratch positions are uninitialised memory (torch.empty) and may hold NaN patterns,
    # which torch.equal never finds equal - a value comparison made this test flaky
    after = pool.storage(pool.slab_of(c.table[0]), 0)
    assert c.table == table and all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(blocks, after))
    # with autograd (the training draft objective) no in-place write into the blocks either
    grad_chunk = torch.randn(1, 2, 1, 8, requires_grad=True)
    k_all, _ = BatchKV([c], torch.device("cpu")).update(grad_chunk, grad_chunk, 0)
    k_all.sum().backward()
    assert torch.equal(grad_chunk.grad, torch.ones_like(grad_chunk)) and not after[0].requires_grad


def test_equal_length_batch_matches_alone(llm):
    """Two prompts of the same length take the stacked (equal-length) cache path; each row equals its solo run."""
    ids = llm.encode(PROMPTS[0])
    other = list(reversed(ids))
    sps = [SamplingParams(max_tokens=10, temperature=0.7, seed=s, ignore_eos=True) for s in (1, 2)]
    alone = [llm.generate([p], sp)[0].outputs[0].token_ids for p, sp in zip((ids, other), sps)]
    seqs = llm.make_sequences(ids, sps[0], "a") + llm.make_sequences(other, sps[1], "b")
    assert [s.output_ids for s in step_together(llm.denoiser, seqs, max_batch_size=4)] == alone


# ---------------------------------------------------------------- cache memory accounting
def test_over_budget_request_gets_cache_full(llm):
    sp = SamplingParams(max_tokens=40, ignore_eos=True)
    seq = llm.make_sequences(llm.encode(PROMPTS[0]), sp, "big")[0]
    sched = Scheduler(llm.denoiser, max_cached_tokens=seq.length - 1)
    with pytest.raises(CacheFull, match=f"needs {seq.length} cached tokens.*budget is {seq.length - 1}"):
        sched.add(seq)
    assert not sched.waiting and not sched.running
    # CFG doubles the reservation (two lanes)
    cfg = LLM(loaded(attention="bidirectional"))
    s2 = cfg.make_sequences(cfg.encode(PROMPTS[0]), SamplingParams(max_tokens=8, cfg_scale=1.0), "cfg")[0]
    with pytest.raises(CacheFull):
        Scheduler(cfg.denoiser, max_cached_tokens=2 * s2.length - 1).add(s2)
    Scheduler(cfg.denoiser, max_cached_tokens=2 * s2.length).add(s2)


def test_cancellation_frees_the_reservation(llm):
    """A request that does not fit next to a running one waits (FIFO); cancelling the running one frees its
    reservation and its KV, and the waiting one is admitted at the next step and decodes as if alone."""
    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    a = llm.make_sequences(llm.encode(PROMPTS[0]), sp, "a")[0]
    b = llm.make_sequences(llm.encode(PROMPTS[1]), sp, "b")[0]
    budget = max(a.length, b.length) + 1  # room for one of them, not both
    sched = Scheduler(llm.denoiser, max_batch_size=4, max_cached_tokens=budget)
    sched.add(a)
    sched.add(b)
    sched.step()
    assert sched.running == [a] and list(sched.waiting) == [b]
    assert sched.reserved_tokens() == a.length and a.cache_bytes() > 0
    sched.step()
    assert list(sched.waiting) == [b]  # still no room
    evs = sched.abort("a")
    assert [e.finish_reason for e in evs] == ["abort"]
    assert sched.reserved_tokens() == 0 and a.cache_bytes() == 0
    sched.step()
    assert sched.running == [b] and sched.reserved_tokens() == b.length
    while sched.has_work():
        sched.step()
    assert b.output_ids == llm.generate(PROMPTS[1], sp)[0].outputs[0].token_ids


# ---------------------------------------------------------------- torch.compile option
@pytest.mark.skipif(os.environ.get("UNMASK_TEST_COMPILE") != "1",
                    reason="compiling takes 30-120 s on a CPU; set UNMASK_TEST_COMPILE=1")
def test_compiled_forward_gives_the_same_tokens():
    m = loaded(attention="prefix_causal")
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    plain = LLM(m).generate(PROMPTS[0], sp)[0].outputs[0].token_ids
    compiled = LLM(m, compile=True)
    assert compiled.denoiser.compiled
    assert compiled.generate(PROMPTS[0], sp)[0].outputs[0].token_ids == plain


# ---------------------------------------------------------------- approximate caches (bidirectional)
@pytest.mark.parametrize("mode", ["prefix", "dual"])
def test_approximate_cache_refresh_step_equals_no_cache(mode):
    """The refresh step of a block forwards the whole canvas, so the first step of a request is exactly the
    no-cache step; later steps may differ (quality change measured in benchmarks/bench_bidir_cache.py)."""
    llm = LLM(loaded(attention="bidirectional"))
    sp = dict(max_tokens=8, block_size=4, temperature=0, ignore_eos=True)
    first = {m: next(iter(llm.stream(PROMPTS[1], SamplingParams(cache=m, **sp)))) for m in ("none", mode)}
    a, b = first["none"].revealed, first[mode].revealed
    assert [(r.position, r.token_id) for r in a] == [(r.position, r.token_id) for r in b]
    assert all(abs(x.confidence - y.confidence) < 1e-5 for x, y in zip(a, b))


# ---------------------------------------------------------------- block size 1 forwards one token per step
@pytest.mark.parametrize("attention", ["prefix_causal", "block_causal"])
def test_block1_forwards_one_token_per_step_like_ar(attention):
    """With logit shift and the exact cache, a block whose only masked position is its first one needs no forward
    of the block (its logits come from the committed token before it): block_size=1 forwards the prompt once and
    then exactly one token per step, as AR decoding with a KV cache does - and decodes the same tokens as
    ``cache=none``."""
    llm = LLM(loaded(attention=attention))
    sizes = []
    orig = llm.model.hidden_states

    def counting(input_ids, position_ids, attention_mask, cache=None, variant_rows=None):
        sizes.append(int(input_ids.shape[1]))
        return orig(input_ids, position_ids, attention_mask, cache=cache)

    llm.model.hidden_states = counting
    ids = llm.encode(PROMPTS[1])
    sp = dict(max_tokens=9, temperature=0, block_size=1, ignore_eos=True)
    fast = llm.generate([ids], SamplingParams(cache="auto", **sp))[0].outputs[0]
    assert sizes == [len(ids)] + [1] * 8 and fast.nfe == 9
    slow = llm.generate([ids], SamplingParams(cache="none", **sp))[0].outputs[0]
    assert fast.token_ids == slow.token_ids


def test_lane_update_gives_each_lane_its_keys_as_a_view_and_commits_adopt_them():
    """Row-invariant attention's per-lane keys (``BatchKV.lane_update``): a lane whose blocks are one run gets cached
    keys + its chunk row as a view of the pool's storage (no copy of the cache), an empty lane a view of the chunk, a
    lane without room in a full pool, with autograd or shared by two rows a copy; every one equals its cache followed
    by its chunk row, no committed key changes, and a commit of the chunk's first positions adopts the scratch keys
    of that lane only."""
    g = torch.Generator().manual_seed(1)
    pool = KVPool(block_tokens=4)

    def lane(n, hint, p=pool):
        c = LaneCache(capacity_hint=hint, pool=p)
        if n:
            k = torch.randn(2, n, 8, generator=g)
            c.append([k, k + 1], [k * 3, k * 3 + 1], torch.arange(n), torch.zeros(n, dtype=torch.long))
        return c

    full = KVPool(block_tokens=4, capacity_blocks=1)  # lanes[2]: 3 cached in its one block, no room for 3 more
    lanes = [lane(5, 16), lane(0, 0), lane(3, 4, full), lane(9, 32)]
    before = [[t.clone() for t in ln.keys] for ln in lanes]
    new = torch.randn(4, 2, 3, 8, generator=g)
    kv = BatchKV(lanes, torch.device("cpu"))
    for layer in range(2):
        per_lane = kv.lane_update(new + layer, new * 2 + layer, layer)
        for b, (ln, (k, v)) in enumerate(zip(lanes, per_lane)):
            n = ln.length
            assert k.shape == (1, 2, n + 3, 8)
            assert (not n or torch.equal(k[0, :, :n], before[b][layer])) and torch.equal(k[0, :, n:], new[b] + layer)
            assert torch.equal(v[0, :, n:], new[b] * 2 + layer)
        for b in (0, 3):  # a view of the pool's storage at the lane's first block
            slab = pool.slab_of(lanes[b].table[0])
            at = pool.storage(slab, layer)[0][:, (lanes[b].table[0] - slab.first) * 4:]
            assert per_lane[b][0].data_ptr() == at.data_ptr()
        full_k = full.storage(full.slab_of(0), layer)[0]
        assert per_lane[2][0].untyped_storage().data_ptr() != full_k.untyped_storage().data_ptr()  # no room: copied
    assert pool.gathered_bytes == 0 and [ln.length for ln in lanes] == [5, 0, 3, 9]
    assert all(torch.equal(a, b) for ln, bb in zip(lanes, before) for a, b in zip(ln.keys, bb))
    kv.commit(0, torch.tensor([0, 1]), lanes[0], torch.tensor([5, 6]), torch.tensor([0, 0]))    # adopted
    kv.commit(3, torch.tensor([1]), lanes[3], torch.tensor([9]), torch.tensor([0]))             # not a prefix
    full.set_capacity(2)
    kv.commit(2, torch.tensor([0, 1, 2]), lanes[2], torch.tensor([3, 4, 5]), torch.tensor([0, 0, 0]))
    for b, idx in ((0, [0, 1]), (3, [1]), (2, [0, 1, 2])):
        for layer in range(2):
            assert torch.equal(lanes[b].keys[layer][:, -len(idx):], new[b][:, idx] + layer)
            assert torch.equal(lanes[b].values[layer][:, -len(idx):], new[b][:, idx] * 2 + layer)
    # one lane cache in two rows: neither writes into it (the second would overwrite the first's chunk)
    shared = lane(4, 16)
    kv = BatchKV([shared, shared], torch.device("cpu"))
    written = pool.written_bytes
    per_lane = kv.lane_update(new[:2], new[:2], 0)
    for b in range(2):
        assert torch.equal(per_lane[b][0][0, :, 4:], new[b])
    assert pool.written_bytes == written
    # autograd: copies, gradients reach the chunk, the blocks are untouched
    grad_chunk = torch.randn(1, 2, 1, 8, requires_grad=True)
    solo = lane(2, 8)
    written = pool.written_bytes
    (k, _), = BatchKV([solo], torch.device("cpu")).lane_update(grad_chunk, grad_chunk, 0)
    k.sum().backward()
    assert torch.equal(grad_chunk.grad, torch.ones_like(grad_chunk)) and pool.written_bytes == written
