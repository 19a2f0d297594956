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
            engine.add_request(prompt, params, rid, n=n)
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


def _requests(seed: int, count: int) -> list[tuple]:
    """``count`` requests of random kinds, most starting with one 40-token system prompt, some aborted."""
    rng = random.Random(seed)
    system, out = _ids(40, 0), []
    for i in range(count):
        kw = dict(dict(temperature=0.0), **rng.choice(KINDS))
        prompt = system + _ids(rng.randint(1, 30), 10 + i) if rng.random() < 0.8 else _ids(rng.randint(5, 50), 50 + i)
        params = SamplingParams(max_tokens=rng.choice([8, 12, 20]), ignore_eos=True, **kw)
        out.append((prompt, params, f"r{i}", rng.choice([1, 1, 2]), rng.choice([None, None, None, 1, 3, 6])))
    return out


def _shared_prefix_storm(model, seed: int, count: int, budget: int | None, **engine_kw) -> None:
    reqs = _requests(seed, count)
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
