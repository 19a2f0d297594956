"""Adversarial checks of the paged KV pool, prefix sharing by reference and admission by free blocks
(docs/design.md#decoding "KV cache", #prefix-reuse, #admission-and-limits): many requests sharing prefixes, aborted
mid-flight, n > 1, CFG, speculative and multi-block decoding in a bounded pool give the tokens of a fresh engine
without prefix caching and leave no block referenced; a request's block size keys its stored prefix; a default
``max_tokens`` is lowered to what the pool's blocks hold."""
from __future__ import annotations

import random

import pytest
import torch
from fastapi.testclient import TestClient

import tiny
from unmask.engine import SamplingParams
from unmask.engine.async_engine import AsyncEngine
from unmask.engine.engine import Engine
from unmask.engine.kv_cache import LaneCache
from unmask.engine.lane_attention import use_lanes
from unmask.engine.limits import ParamError
from unmask.server.app import build_app


def _ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, 300, (n,), generator=g).tolist()


def _drain(engine: Engine, arrivals=(), aborts=None) -> dict:
    """Step ``engine`` until idle, adding ``arrivals`` (``(prompt, params, id, n)``) one every other step and
    aborting ``aborts[id]`` after that many steps; returns ``{id: {choice index: output}}`` of finished choices."""
    arrivals, outs, step = list(arrivals), {}, 0
    while engine.has_unfinished() or arrivals:
        if arrivals and step % 2 == 0:
            prompt, params, rid, n = arrivals.pop(0)
            try:
                engine.add_request(prompt, params, rid, n=n)
            except ParamError as exc:  # never fits: refused at once, naming the field; the rest keep running
                outs[rid] = exc
        for ev in engine.step():
            if ev.finished:
                outs.setdefault(ev.request_id, {})[ev.output.index] = ev.output
        step += 1
        for rid, at in (aborts or {}).items():
            if at == step:
                engine.abort(rid)
    return outs


KINDS = [dict(block_size=4), dict(block_size=4, speculative=True),
         dict(block_size=4, speculative=True, temperature=1.0, seed=5), dict(block_size=4, cfg_scale=1.0),
         dict(block_size=4, multi_block=0.5), dict(block_size=1), dict(block_size=8, sub_block_size=4)]


def _requests(seed: int, count: int, kinds: list[dict] = KINDS) -> list[tuple]:
    """``count`` requests of random kinds, most starting with one 40-token system prompt, some aborted."""
    rng = random.Random(seed)
    system, out = _ids(40, 0), []
    for i in range(count):
        kw = dict(dict(temperature=0.0), **rng.choice(kinds))
        prompt = system + _ids(rng.randint(1, 30), 10 + i) if rng.random() < 0.8 else _ids(rng.randint(5, 50), 50 + i)
        params = SamplingParams(max_tokens=rng.choice([8, 12, 20]), ignore_eos=True, **kw)
        out.append((prompt, params, f"r{i}", rng.choice([1, 1, 2]), rng.choice([None, None, None, 1, 3, 6])))
    return out


def _shared_prefix_storm(model, seed: int, count: int, budget: int | None, kinds: list[dict] = KINDS,
                         **engine_kw) -> None:
    reqs = _requests(seed, count, kinds)
    engine = Engine(model, max_batch_size=4, max_cached_tokens=budget, **engine_kw)
    pool, store = engine.scheduler.kv_pool, engine.prefix_cache
    got = _drain(engine, [r[:4] for r in reqs], {r[2]: r[4] for r in reqs if r[4] is not None})
    assert store.hits > 0 and (budget is None or store.evicted > 0)
    # every lane's reference returned: only the store's remain, one each; none after it is emptied
    held = [b for c in store._chunks.values() for b in c.blocks]
    assert pool.used_blocks == len(held) and all(pool.refcount(b) == 1 for b in held)
    store.clear()
    assert pool.used_blocks == 0
    for prompt, params, rid, n, abort in reqs:
        if isinstance(got.get(rid), ParamError):  # only what the budget can never hold, naming max_tokens
            need = engine.make_request(prompt, params, rid)[0]
            assert got[rid].field == "max_tokens" and engine.scheduler.need(need) > budget
            continue
        if abort is not None:
            continue
        fresh = Engine(model, max_batch_size=4, enable_prefix_caching=False)
        fresh.add_request(prompt, params, rid, n=n)
        want = _drain(fresh)[rid]
        assert {k: o.token_ids for k, o in got[rid].items()} == {k: o.token_ids for k, o in want.items()}, rid


def test_a_storm_of_shared_prefixes_and_aborts_in_a_small_pool_gives_fresh_tokens_and_leaks_no_block():
    """12 requests (plain, speculative greedy and sampled, CFG, multi-block, block 1, sub-blocks; n = 1 or 2; most
    sharing a 40-token system prompt; some aborted after 1, 3 or 6 steps) joining a running batch of 4 in a pool of
    21 blocks (--max-cached-tokens 200): the store is evicted while lanes hold its blocks, requests wait for blocks,
    and each finished request's tokens equal a fresh engine's without prefix caching (float32: equal unless a
    near-tie); afterwards only the store's references are left, and none once it is emptied."""
    model = tiny.loaded()
    use_lanes(model)
    _shared_prefix_storm(model, seed=1, count=12, budget=200)


@pytest.mark.system
@pytest.mark.parametrize("seed, budget, kw", [(2, None, {}), (3, 160, {}), (5, 96, {}), (7, 200, dict(prefill_chunk=8))])
def test_more_storms(seed, budget, kw):
    """As above with other seeds, an unbounded pool, the smallest budgets the requests fit and chunked prefill."""
    model = tiny.loaded()
    use_lanes(model)
    _shared_prefix_storm(model, seed=seed, count=14, budget=budget, **kw)


@pytest.mark.system
@pytest.mark.parametrize("weights", ["int8", "int4", "fp16"])
def test_storms_on_packed_weights(weights, tmp_path):
    """The storm on the low-bit formats (row-invariant attention: the store's blocks copied into the lane once, E)
    and fp16 (the fused decoder attending per lane)."""
    from unmask.engine.checkpoint import write_checkpoint
    from unmask.engine.model import load_model

    m = tiny.loaded(block_size=4, initializer_range=0.5)
    path = write_checkpoint(tmp_path / "c", m.model, m.tokenizer, m.dllm)
    model = load_model(str(path), device="cpu", dtype="float32", weights=weights)
    _shared_prefix_storm(model, seed=7, count=12, budget=200)


@pytest.mark.system
@pytest.mark.parametrize("seed", [1, 2])
def test_storms_at_many_block_sizes_on_a_block_causal_model(seed):
    """The storm on a block-causal model aligned at 0 with requests at block sizes 2, 3, 4, 5, 8, 16: chunks of
    16-48-80 tokens, only equal block sizes share."""
    model = tiny.loaded(attention="block_causal", block_alignment="absolute", block_size=8, initializer_range=0.5)
    use_lanes(model)
    _shared_prefix_storm(model, seed=seed, count=14, budget=400, kinds=[dict(block_size=b) for b in (2, 3, 4, 5, 8, 16)])


def _generate(engine: Engine, prompt: list[int], block_size: int) -> object:
    params = SamplingParams(max_tokens=12, temperature=0.0, block_size=block_size, ignore_eos=True)
    engine.add_request(prompt, params, f"b{block_size}")
    return _drain(engine)[f"b{block_size}"][0]


@pytest.mark.parametrize("first, second", [(4, 8), (8, 4), (8, 16), (4, 4)])
def test_a_request_at_another_block_size_never_loads_a_prefix_grouped_by_the_first(first, second):
    """On a block-causal model with blocks aligned at position 0 a prompt token attends to its whole block, so its
    KV depends on the request's block size (a request may pick another than the model's). The store keyed chunks by
    the model's block size: a block-8 request's prompt was loaded by a block-4 or block-16 request, whose tokens then
    parted from a fresh prefill's at the first step. Now a chunk is keyed and sized by the request's block size:
    only equal sizes share, and every request gets the fresh tokens."""
    model = tiny.loaded(attention="block_causal", block_alignment="absolute", block_size=8, initializer_range=0.5)
    use_lanes(model)
    prompt = _ids(37, 0)
    engine = Engine(model, max_batch_size=4)
    _generate(engine, prompt, first)
    got = _generate(engine, prompt + [7, 8, 9], second)
    want = _generate(Engine(model, enable_prefix_caching=False), prompt + [7, 8, 9], second)
    assert got.token_ids == want.token_ids
    assert (got.cached_tokens > 0) == (first == second)
    held = sum(c.tokens for c in engine.prefix_cache._chunks.values())
    assert engine.prefix_cache.tokens == held and held % 16 == 0


@pytest.mark.parametrize("cfg", [0.0, 1.0])
def test_a_default_max_tokens_is_lowered_to_the_blocks_the_pool_holds(cfg):
    """A pool bounded by blocks rather than a token budget (a GPU's, sized from mem_get_info, the default there): a
    request without ``max_tokens`` got the remaining context as its default and was refused with a 400 naming
    ``max_tokens``, a field the client never set. Now the default is lowered to what the blocks hold (both lanes
    under CFG), and a prompt the pool cannot hold at all is a 400 naming ``prompt`` and the pool."""
    engine = Engine(tiny.loaded(), enable_prefix_caching=False, max_batch_size=4)
    engine.scheduler.kv_pool.set_capacity(10)
    params = SamplingParams(max_tokens=4096, temperature=0.0, block_size=4, cfg_scale=cfg)
    seq = engine.add_request(_ids(40, 1), params, "a", fit_max_tokens=True)[0]
    lanes = len(seq.lanes)
    assert engine.scheduler.need_blocks(seq) <= 10 < -(-(seq.length + 4) // 16) * lanes  # the most that fits
    out = _drain(engine)["a"][0]
    assert len(out.token_ids) >= 1 and engine.scheduler.kv_pool.used_blocks == 0
    with pytest.raises(ParamError, match="KV pool of 10 blocks") as e:
        engine.add_request(_ids(170 // lanes, 2), params, "b", fit_max_tokens=True)
    assert e.value.field == "prompt"


def test_the_server_lowers_a_default_max_tokens_to_the_pool_and_keeps_serving():
    """Over HTTP: no ``max_tokens`` with a bounded pool is a 200; an explicit one the pool can never hold is a 400
    naming ``max_tokens``; the server answers the next request."""
    engine = AsyncEngine(tiny.loaded(), max_batch_size=4)
    engine.scheduler.kv_pool.set_capacity(10)
    with TestClient(build_app(engine, "m")) as client:
        r = client.post("/v1/completions", json={"model": "m", "prompt": "x " * 30, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1
        r = client.post("/v1/completions", json={"model": "m", "prompt": "x " * 30, "max_tokens": 400})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
        r = client.post("/v1/completions", json={"model": "m", "prompt": "Hi", "max_tokens": 4})
        assert r.status_code == 200
    engine.shutdown()
    assert engine.scheduler.kv_pool.used_blocks == len([b for c in engine.engine.prefix_cache._chunks.values()
                                                          for b in c.blocks])


@pytest.mark.parametrize("kw", KINDS, ids=lambda kw: "-".join(f"{k}{v}" for k, v in kw.items()))
def test_a_request_that_exactly_fills_the_pool_decodes_the_unbounded_tokens(kw, monkeypatch):
    """A pool of exactly the blocks a request reserves (its canvas per lane), the rest held by a stored prefix the
    request does not share: the store is evicted for it, a speculative step near the canvas end finds no block for
    its branches (it attends to its cached runs and the chunk instead), and the tokens are those of an unbounded
    pool; a second request waits until the first has left, then runs in the same blocks."""
    model = tiny.loaded()
    use_lanes(model)
    params = SamplingParams(max_tokens=8, ignore_eos=True, **dict(dict(temperature=0.0), **kw))
    prompt = _ids(40, 3)  # a canvas of 48 (whole blocks): a speculative step's 20 rows at 40 pass its end
    want = _generate_with(Engine(model, enable_prefix_caching=False), prompt, params, "a")
    engine = Engine(model, max_batch_size=4)
    pool, store = engine.scheduler.kv_pool, engine.prefix_cache
    pool.set_capacity(engine.scheduler.need_blocks(engine.make_request(prompt, params, "a")[0]))
    _generate_with(engine, _ids(32, 4), SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0), "warm")
    assert store.tokens == 32 and pool.total_blocks == pool.capacity_blocks
    refused = []
    reserve = LaneCache.reserve

    def counted(lane, tokens, required=True):
        ok = reserve(lane, tokens, required)
        refused.append(not ok)
        return ok

    monkeypatch.setattr(LaneCache, "reserve", counted)
    engine.add_request(prompt, params, "a")
    engine.add_request(prompt, params, "b")
    engine.step()
    assert [s.request_id for s in engine.scheduler.running] == ["a"] and pool.free_blocks == 0
    outs = _drain(engine)
    assert outs["a"][0].token_ids == want and outs["b"][0].token_ids == want
    assert any(refused) == bool(kw.get("speculative"))  # branches past the canvas end found no block
    store.clear()
    assert pool.used_blocks == 0


def _generate_with(engine: Engine, prompt: list[int], params: SamplingParams, rid: str) -> list[int]:
    engine.add_request(prompt, params, rid)
    return _drain(engine)[rid][0].token_ids


# ------------------------------------------------------------------ mixed batches = each request alone
#: one request of each kind the batched passes serve (plain, speculative greedy/relaxed/sampled, constrained, CFG,
#: multi-block, logprobs), on the prefix-causal model
CAUSAL_MIX = [
    dict(temperature=0, block_size=4),
    dict(temperature=0, block_size=4, threshold=0.3),
    dict(temperature=0.9, seed=5, block_size=4, top_k=20, top_p=0.9),
    dict(temperature=0, block_size=4, logit_bias={5: 5.0, 6: -100.0}, min_tokens=4, logprobs=True, top_logprobs=3),
    dict(temperature=0, block_size=4, speculative=True, logprobs=True, top_logprobs=3),
    dict(temperature=0, block_size=3, speculative=True, speculative_branches=1, min_tokens=5),
    dict(temperature=0, block_size=4, speculative=True, speculative_ratio=0.3),
    dict(temperature=0.8, seed=3, block_size=4, speculative=True, logprobs=True, top_logprobs=2),
    dict(temperature=1.0, seed=4, block_size=3, speculative=True, top_k=20, top_p=0.9),
    dict(temperature=0, block_size=4, cfg_scale=1.0),
    dict(temperature=0, block_size=4, multi_block=0.5),
    dict(temperature=0, block_size=4, constraint="json", max_tokens=40),
    dict(temperature=0, block_size=4, speculative=True, constraint="json", max_tokens=40),
    dict(temperature=0, block_size=1, logprobs=True),
]
#: block refinement at two block sizes (the model's 8 and 4), greedy, sampled, editing, logprobs, penalties
LLADA2_MIX = [
    dict(temperature=0, block_size=8, threshold=0.7),
    dict(temperature=0, block_size=8, threshold=0.5, editing_threshold=0.4, logprobs=True, top_logprobs=2),
    dict(temperature=0.9, seed=4, block_size=8, top_k=30, threshold=0.6, editing_threshold=0.3),
    dict(temperature=0.7, seed=5, block_size=4, steps=6, logit_bias={9: 2.0}, min_tokens=3),
    dict(temperature=0, block_size=4, threshold=0.9, top_p=0.8),
    dict(temperature=0, block_size=8, threshold=0.6, editing_threshold=0.5, max_tokens=30),
    dict(temperature=0, block_size=8, threshold=0.95, presence_penalty=0.5, repetition_penalty=1.2),
]


def _mix_arrivals(model, reqs: list[dict]) -> list[tuple]:
    """``(prompt, params, id, 1)`` per request: a shared 3-sentence system text, then one of the paths' prompts."""
    import decoding_paths as dp
    from unmask.engine import Constraint

    out = []
    for i, kw in enumerate(reqs):
        kw = dict(kw)
        if kw.pop("constraint", None):
            kw["constraint"] = Constraint("json_schema", dp.SCHEMA)
        flat = dict({"speculative": False, "max_tokens": 12, "ignore_eos": "constraint" not in kw}, **kw)
        prompt = model.tokenizer("system prompt shared by everyone " * 3 + dp.PROMPTS[i % 3]).input_ids
        out.append((prompt, SamplingParams.from_flat(**flat), f"r{i}", 1))
    return out


def _mixed_equals_alone(model, reqs: list[dict], budget: int | None) -> None:
    arrivals = _mix_arrivals(model, reqs)
    engine = Engine(model, max_batch_size=16, max_cached_tokens=budget)
    together = _drain(engine, arrivals)  # one joining every other step, sharing the system prompt's blocks
    assert engine.prefix_cache.hits > 0
    engine.prefix_cache.clear()
    assert engine.scheduler.kv_pool.used_blocks == 0
    for prompt, params, rid, n in arrivals:
        alone = _drain(Engine(model, enable_prefix_caching=False), [(prompt, params, rid, n)])[rid][0]
        got = together[rid][0]
        assert got.token_ids == alone.token_ids, (rid, reqs[int(rid[1:])])
        if alone.logprobs is not None:
            assert got.logprobs == pytest.approx(alone.logprobs, abs=1e-4)


def test_a_mixed_refinement_batch_with_prefix_reuse_gives_each_request_its_tokens_alone():
    """LLaDA2 block refinement (the batched pass, ``refine_batch``) over requests at the model's block size and
    another, joining one every other step and sharing a system prompt through the store, in a bounded pool: each
    request's tokens (and logprobs) are its own alone without a store (MoE: within the float32 contract; the block-4
    request parted before the store keyed chunks by the request's block size)."""
    from llada2_tiny import loaded_llada2

    _mixed_equals_alone(loaded_llada2(seed=1), LLADA2_MIX, budget=300)


@pytest.mark.system
@pytest.mark.parametrize("budget", [None, 260])
def test_a_mixed_causal_batch_with_prefix_reuse_gives_each_request_its_tokens_alone(budget):
    """The same for the prefix-causal model's kinds: plain, speculative (greedy, relaxed, sampled, constrained), CFG,
    multi-block, a grammar, logprobs, batched by the speculative and reveal passes."""
    model = tiny.loaded(attention="prefix_causal", block_size=4, initializer_range=0.5)
    use_lanes(model)
    _mixed_equals_alone(model, CAUSAL_MIX, budget)


def test_the_free_list_stays_sorted_and_first_fit_across_slabs_after_out_of_order_releases():
    """The pool's free list after releases in any order (a lane's table after a shared prefix is not ascending) is
    the sorted free ids, merged once per release; a run never spans two slabs even where their ids are consecutive;
    without a run the lowest free ids are taken; an allocation takes a slice of the list."""
    from unmask.engine.kv_pool import KVPool

    pool = KVPool(block_tokens=4)
    first = pool.allocate(4)  # slab 0: ids 0-3
    second = pool.allocate(8)  # slab 1: ids 4-11 (made as large as everything so far... and the request)
    assert pool.slab_of(3) is not pool.slab_of(4)
    pool.set_capacity(pool.total_blocks)  # bounded now: no new slab, holes are taken
    pool.decref([first[3], second[1], first[2], second[0], 9, 7])  # out of order, singles and pairs
    assert pool._free == [2, 3, 4, 5, 7, 9] and all(pool.refcount(b) == 0 for b in pool._free)
    assert pool.allocate(3) == [2, 3, 4]  # 2-5 are consecutive ids but 3 | 4 is a slab edge: no run of 3 ...
    pool.decref([2, 3, 4])
    assert pool.allocate(2) == [2, 3]  # ... a run of 2 in slab 0 is
    assert pool.allocate(2) == [4, 5] and pool.allocate(2) == [7, 9] and pool.free_blocks == 0
    pool.decref(list(range(12)))
    assert pool._free == list(range(12)) and pool.used_blocks == 0


def test_a_paused_choice_keeps_its_blocks_and_returns_them_when_aborted():
    """Fair admission pauses a choice of the request holding the batch for a starved one
    (docs/design.md#admission-and-limits): the paused choice keeps its blocks (they stay referenced while it waits), an abort of its request
    while it waits returns them, and the starved request's tokens are its own alone."""
    model = tiny.loaded()
    use_lanes(model)
    params = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0, block_size=4)
    engine = Engine(model, max_batch_size=2, max_cached_tokens=400)
    pool, sched = engine.scheduler.kv_pool, engine.scheduler
    engine.add_request(_ids(40, 5), params, "big", n=2)
    engine.step()
    engine.add_request(_ids(20, 6), params, "small")
    engine.step()
    assert len(sched.paused) == 1
    paused = next(iter(sched.paused))
    held = list(paused.lanes[0].cache.table)
    assert held and all(pool.refcount(b) >= 1 for b in held)
    engine.abort("big")
    stored = {b for c in engine.prefix_cache._chunks.values() for b in c.blocks}
    assert not sched.paused and all(pool.refcount(b) == (b in stored) for b in held)
    outs = _drain(engine)
    want = _generate_with(Engine(model, enable_prefix_caching=False), _ids(20, 6), params, "small")
    assert outs["small"][0].token_ids == want
    engine.prefix_cache.clear()
    assert pool.used_blocks == 0


def test_a_failed_step_releases_every_lanes_blocks_and_the_engine_keeps_serving(monkeypatch):
    """A fault inside a step (after the forward wrote its new rows into the lanes' scratch blocks) fails the requests
    in the batch: their blocks all return to the pool (only the store's remain), and the next request runs."""
    import asyncio

    from unmask.engine.denoiser import Denoiser

    model = tiny.loaded()
    use_lanes(model)
    engine = AsyncEngine(model, max_batch_size=4, max_cached_tokens=300)
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0, block_size=4)
    real, calls = Denoiser.step, []

    def faulty(self, seqs):
        calls.append(len(seqs))
        events = real(self, seqs)
        if len(calls) == 3:
            raise RuntimeError("injected fault")
        return events

    monkeypatch.setattr(Denoiser, "step", faulty)

    async def run(prompt, rid, n=1):
        try:
            async for _ in engine.submit(prompt, params, rid, n=n):
                pass
            return "ok"
        except Exception as exc:  # noqa: BLE001 - the failed requests' error
            return type(exc).__name__

    async def main():
        first = await asyncio.gather(run(_ids(40, 7), "a", n=2), run(_ids(40, 7) + [9, 9], "b"))
        return first, await run(_ids(30, 8), "c")

    try:
        (failed, after) = asyncio.run(main())
        assert failed == ["EngineError", "EngineError"] and after == "ok"
        sched = engine.scheduler
        stored = [b for c in engine.engine.prefix_cache._chunks.values() for b in c.blocks]
        assert not sched.running and not sched.waiting and sched.kv_pool.used_blocks == len(stored)
    finally:
        engine.shutdown()


def test_a_requests_top_logprobs_among_equal_logits_do_not_depend_on_a_mates_wider_request():
    """``torch.topk``'s order among equal logits depends on k: the batched reveal pass took every row's alternatives
    from one ``topk`` at the widest ``top_logprobs`` of the batch, so a request asking for 2 beside one asking for 5
    got other ids (of equal log-probability) than alone. Now one ``topk`` per distinct k."""
    from unmask.engine.sampler import RowGroup, score_groups

    logits = torch.zeros(4, 321)
    logits[:, 7] = 1.0  # one clear best, then 320 equal logits
    tokens = torch.full((4,), 7, dtype=torch.long)
    two, five = SamplingParams(top_logprobs=2, logprobs=True), SamplingParams(top_logprobs=5, logprobs=True)
    batched = score_groups(logits, tokens, [RowGroup(0, 2, two, None), RowGroup(2, 4, five, None)])
    alone_two = score_groups(logits[:2], tokens[:2], [RowGroup(0, 2, two, None)])
    alone_five = score_groups(logits[2:], tokens[2:], [RowGroup(0, 2, five, None)])
    assert [t[:2] for t in batched.top([0, 1])] == alone_two.top([0, 1])  # what the request keeps (its first 2)
    assert batched.top([2, 3]) == alone_five.top([0, 1])
    assert [len(t) for t in batched.top([0, 1, 2, 3])] == [2, 2, 5, 5]
