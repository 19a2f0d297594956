"""Prefix reuse across requests (engine/prefix_cache.py, docs/design.md#prefix-reuse): the same tokens with and
without reuse, exact hit counts, LRU eviction inside the KV budget, live requests first, what never shares."""
from __future__ import annotations

import argparse

import pytest
import torch

import tiny
from unmask.engine import SamplingParams
from unmask.engine.checkpoint import write_checkpoint
from unmask.engine.engine import Engine
from unmask.engine.lane_attention import use_lanes
from unmask.engine.model import load_model
from unmask.engine.prefix_cache import PrefixCache, model_fingerprint

C = 16  # the chunk size (CHUNK_TOKENS)


def _ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, 300, (n,), generator=g).tolist()


def _drain(engine: Engine, check=None) -> dict:
    """Run the engine until idle; ``{request_id: [CompletionOutput per choice]}``. ``check()`` after every step."""
    outs: dict = {}
    while engine.has_unfinished():
        for ev in engine.step():
            if ev.finished:
                outs.setdefault(ev.request_id, {})[ev.index] = ev.output
        if check is not None:
            check()
    return {rid: [o[i] for i in sorted(o)] for rid, o in outs.items()}


def _run(engine: Engine, prompt: list[int], params: SamplingParams, rid: str):
    engine.add_request(prompt, params, rid)
    return _drain(engine)[rid][0]


def _chat(model, params: SamplingParams, reuse: bool, turns: int = 3):
    """A multi-turn chat on one engine: each turn's prompt is the previous prompt + its answer + a new user turn.
    Returns the outputs of every turn, the cond lane's keys/values after each turn's first step (per layer
    ``[H_kv, n, D]``: the loaded prefix + the prefill) and the engine."""
    engine = Engine(model, enable_prefix_caching=reuse)
    prompt, outs, kvs = _ids(37, 0), [], []
    for t in range(turns):
        engine.add_request(prompt, params, f"turn-{t}")
        engine.step()
        cache = engine.scheduler.running[0].lanes[0].cache
        kvs.append([t.clone() for t in cache.keys + cache.values])
        out = _drain(engine)[f"turn-{t}"][0]
        outs.append(out)
        prompt = prompt + out.token_ids + _ids(11, 100 + t)
    return outs, kvs, engine


CASES = [  # (model, params): the shared cases and two more at the front
    tiny.CACHE_CASES[0],
    ("prefix_causal", dict(block_size=4, temperature=0.0)),
    ("prefix_causal", dict(block_size=1, temperature=1.0, seed=3)),
    *tiny.CACHE_CASES[1:],
]


@pytest.mark.parametrize("model_name, kw", CASES, ids=tiny.case_ids(CASES))
def test_a_chat_gets_the_same_tokens_with_and_without_reuse(model_name, kw):
    model = tiny.CACHE_LAYOUTS[model_name]()
    params = SamplingParams(max_tokens=20, ignore_eos=True, **kw)
    fresh, fresh_kv, _ = _chat(model, params, reuse=False)
    reused, reused_kv, engine = _chat(model, params, reuse=True)
    assert [o.token_ids for o in reused] == [o.token_ids for o in fresh]
    for a, b in zip(fresh_kv, reused_kv):  # the reused prefix + prefill is the KV a fresh prefill computes
        assert len(a) == len(b) and all(x.shape == y.shape for x, y in zip(a, b))
        assert max(float((x - y).abs().max()) for x, y in zip(a, b)) < 1e-4
    assert [o.cached_tokens for o in fresh] == [0, 0, 0]
    hits = [o.cached_tokens for o in reused]
    assert hits[0] == 0 and all(h > 0 and h % engine.prefix_cache.chunk_tokens_held == 0 for h in hits[1:]), hits
    stats = engine.prefix_cache_stats()
    assert stats["hits"] == sum(hits) and stats["queries"] > stats["hits"]


def test_a_partial_prefix_hits_exactly_its_whole_shared_chunks():
    model = tiny.loaded()
    params = SamplingParams(max_tokens=8, block_size=1, temperature=0.0)
    a = _ids(50, 1)
    b = a[:37] + _ids(20, 2)  # shares 37 tokens: chunks [0, 16) and [16, 32) match, [32, 48) differs at 37
    engine = Engine(model)
    _run(engine, a, params, "a")
    got = _run(engine, b, params, "b")
    assert got.cached_tokens == 32
    assert got.token_ids == _run(Engine(model, enable_prefix_caching=False), b, params, "b").token_ids
    assert _run(engine, a, params, "a2").cached_tokens == 48  # a stored prompt: its whole chunks
    # a prompt of exactly 3 stored chunks reuses 2: its first step must forward its last position (for its output)
    assert _run(engine, a[:48], params, "a3").cached_tokens == 32


def test_a_chunk_matches_only_after_the_same_prefix_at_the_same_positions():
    model = tiny.loaded()
    params = SamplingParams(max_tokens=4, block_size=1, temperature=0.0)
    x, y, z = _ids(16, 13), _ids(16, 14), _ids(16, 15)
    engine = Engine(model)
    _run(engine, x + y + z + _ids(8, 16), params, "a")
    got = _run(engine, x + z + y + _ids(8, 17), params, "b")  # z and y are stored, but after other tokens
    assert got.cached_tokens == 16


def test_lru_eviction_inside_a_small_budget_keeps_the_recently_used_prefix():
    model = tiny.loaded()
    budget = 160  # each request reserves 48 + 4 = 52 tokens: 108 tokens (6 chunks) left for the store while one runs
    engine = Engine(model, max_cached_tokens=budget)
    store = engine.prefix_cache
    params = SamplingParams(max_tokens=4, block_size=4, temperature=0.0)
    x, y, z = _ids(48, 10), _ids(48, 11), _ids(48, 12)

    def within_budget():
        assert store.tokens + engine.scheduler.reserved_tokens() <= budget

    def run(prompt, rid):
        engine.add_request(prompt, params, rid)
        return _drain(engine, within_budget)[rid][0].cached_tokens

    assert run(x, "x") == 0 and run(y, "y") == 0 and store.tokens == 96  # both stored (3 chunks each)
    assert run(x, "x2") == 32  # x is the most recently used now
    assert run(z, "z") == 0 and store.evicted == 3  # room for z: y's chunks went, not x's
    assert run(x, "x3") == 32
    assert run(y, "y2") == 0


def test_the_store_holds_its_tokens_kv_and_nothing_more():
    """Each stored chunk holds exactly its blocks of the KV pool (a reference each, never the rest of the lane that
    computed them), so once the requests end the pool's used blocks are the store's and its memory is its tokens x
    the model's KV bytes per token: what bounds a server's RSS (docs/history.md, "The server's RSS plateaus")."""
    model = tiny.loaded()
    engine = Engine(model)
    store = engine.prefix_cache
    for i in range(3):
        _run(engine, _ids(70, 40 + i), SamplingParams(max_tokens=20, block_size=4, temperature=0.0), f"r{i}")
    assert not engine.scheduler.running and store.tokens >= 3 * 64
    cfg = model.model.config
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
    pool = engine.scheduler.kv_pool
    blocks = [b for chunk in store._chunks.values() for b in chunk.blocks]
    assert len(set(blocks)) == len(blocks) and all(pool.refcount(b) == 1 for b in blocks)  # the store's alone
    assert pool.used_blocks == len(blocks) and len(blocks) * pool.block_tokens == store.tokens
    assert len(blocks) * pool.block_bytes() == store.tokens * per_token
    store.clear()
    assert pool.used_blocks == 0 and pool.free_blocks == pool.total_blocks


def test_a_reused_prefix_is_the_stores_blocks_not_a_copy():
    """Prefix reuse shares blocks (docs/design.md#prefix-reuse): the second request's cond lane starts with the very
    blocks the first stored (refcount 2 while it runs: the store's and the lane's), its keys there are views of the
    same storage, its own blocks follow; nothing of the prefix was copied (the pool's gathered bytes stay 0 and the
    bytes written are the forwarded rows' only; attention reads the blocks in place: engine/lane_attention.py)."""
    model = tiny.loaded()
    use_lanes(model)  # as load_model installs it
    assert model.lane_attention
    engine = Engine(model)
    store, pool = engine.prefix_cache, engine.scheduler.kv_pool
    prompt = _ids(40, 7)
    params = SamplingParams(max_tokens=8, block_size=4, temperature=0.0, ignore_eos=True)
    _run(engine, prompt, params, "first")
    written = pool.written_bytes
    engine.add_request(prompt + _ids(5, 8), params, "second")
    engine.step()
    lane = engine.scheduler.running[0].lanes[0].cache
    chain = engine.scheduler.running[0].prefix_chain
    shared = [b for h in chain for b in store._chunks[h].blocks]
    assert len(shared) == 2 and lane.table[:2] == shared and all(pool.refcount(b) == 2 for b in shared)
    assert all(pool.refcount(b) == 1 for b in lane.table[2:])
    (k0, _), (k1, _) = lane.segments(0, lane.length)[:2]  # the shared run, then the lane's own
    slab = pool.slab_of(shared[0])
    assert k0.untyped_storage().data_ptr() == pool.storage(slab, 0)[0].untyped_storage().data_ptr()
    assert k0.shape[1] == 32 and k0.data_ptr() == pool.storage(slab, 0)[0][:, (shared[0] - slab.first) * 16:].data_ptr()
    assert pool.gathered_bytes == 0
    per_token = pool.block_bytes() // pool.block_tokens
    assert k1.data_ptr() != k0.data_ptr() + k0.shape[1] * k0.stride(1) * k0.element_size()  # not one run: two views
    # the step wrote its forwarded rows only: the 13 prompt rows after the prefix and the 4 of the active block
    assert pool.written_bytes - written == (lane.length - 32 + 4) * per_token
    out = _drain(engine)["second"][0]
    assert out.cached_tokens == 32 and all(pool.refcount(b) == 1 for b in shared)  # the lane released its references
    fresh = Engine(model, enable_prefix_caching=False)
    assert out.token_ids == _run(fresh, prompt + _ids(5, 8), params, "x").token_ids


def test_a_live_request_never_waits_for_cached_prefixes():
    model = tiny.loaded()
    budget = 160
    engine = Engine(model, max_cached_tokens=budget)
    store = engine.prefix_cache
    for i in range(3):
        _run(engine, _ids(48, 20 + i), SamplingParams(max_tokens=4, temperature=0.0), f"fill-{i}")
    assert store.tokens >= 96  # the store holds more than the two requests below leave
    step = engine.scheduler.denoiser.step

    def checked_step(seqs):  # the store gives way before the forward that needs the room
        assert store.tokens + engine.scheduler.reserved_tokens() <= budget
        return step(seqs)

    engine.scheduler.denoiser.step = checked_step
    engine.add_request(_ids(48, 30), SamplingParams(max_tokens=40, block_size=1, temperature=0.0), "long")
    engine.step()
    engine.add_request(_ids(40, 31), SamplingParams(max_tokens=24, block_size=4, temperature=0.0), "joiner")
    events = engine.step()  # 88 + 64 reserved leave 8 tokens of 160: the store gives way, not the joiner
    assert any(ev.request_id == "joiner" for ev in events)
    assert not engine.scheduler.waiting
    assert store.tokens + engine.scheduler.reserved_tokens() <= budget


def test_bidirectional_models_never_reuse():
    model = tiny.loaded(attention="bidirectional", logit_shift=False)
    assert Engine(model).prefix_cache is None
    store = PrefixCache(model)  # even a store forced on the engine never matches nor keeps anything
    engine = Engine(model, prefix_cache=store)
    params = SamplingParams(max_tokens=8, block_size=4, temperature=0.0, cache="prefix")
    prompt = _ids(40, 3)
    first = _run(engine, prompt, params, "a")
    again = _run(engine, prompt, params, "b")
    assert again.token_ids == first.token_ids and again.cached_tokens == 0
    assert store.stats() == {"queries": 0, "hits": 0, "tokens": 0, "evicted": 0}


def test_requests_without_the_exact_cache_never_share():
    model = tiny.loaded()
    engine = Engine(model)
    params = SamplingParams(max_tokens=8, block_size=4, temperature=0.0, cache="none")
    prompt = _ids(40, 4)
    _run(engine, prompt, params, "a")
    assert _run(engine, prompt, params, "b").cached_tokens == 0 and engine.prefix_cache.tokens == 0


def test_a_verifiers_causal_rows_and_the_drafters_never_share():
    """With a verifier, a speculative request's committed rows run the verifier's weights, a plain request's the
    drafter's: their prompt KV differs, so they are keyed apart."""
    routed, _ = tiny.loaded_with_verifier()
    prompt = _ids(40, 5)
    plain = SamplingParams(max_tokens=8, block_size=4, temperature=0.0)
    spec = SamplingParams(max_tokens=8, block_size=4, temperature=0.0, speculative=True)
    engine = Engine(routed)
    _run(engine, prompt, plain, "plain")
    got = _run(engine, prompt, spec, "spec")
    assert got.cached_tokens == 0
    assert got.token_ids == _run(Engine(routed, enable_prefix_caching=False), prompt, spec, "s").token_ids
    assert _run(engine, prompt, spec, "spec2").cached_tokens == 32
    assert _run(engine, prompt, plain, "plain2").cached_tokens == 32


def test_another_checkpoint_never_reuses(tmp_path):
    for seed, name in ((0, "a"), (1, "b")):
        m = tiny.loaded(seed=seed)
        write_checkpoint(tmp_path / name, m.model, m.tokenizer, m.dllm)
    a, a_again, b = (load_model(str(tmp_path / n), weights="native") for n in ("a", "a", "b"))
    assert model_fingerprint(a) == model_fingerprint(a_again) != model_fingerprint(b)
    store = PrefixCache(a)
    prompt, params = _ids(40, 6), SamplingParams(max_tokens=8, temperature=0.0, block_size=1)
    _run(Engine(a, prefix_cache=store), prompt, params, "a")
    with pytest.raises(ValueError, match="prefix_cache: the store was built for another model"):
        Engine(b, prefix_cache=store)
    assert _run(Engine(b), prompt, params, "b").cached_tokens == 0
    assert _run(Engine(a_again, prefix_cache=store), prompt, params, "a2").cached_tokens == 32  # same files


def test_concurrent_requests_sharing_a_prefix():
    model = tiny.loaded()
    system = _ids(40, 7)
    params = SamplingParams(max_tokens=16, block_size=1, temperature=0.0)
    prompts = {f"r{i}": system + _ids(6, 40 + i) for i in range(3)}
    want = {rid: _run(Engine(model, enable_prefix_caching=False), p, params, rid).token_ids
            for rid, p in prompts.items()}
    engine = Engine(model, max_batch_size=8)
    engine.add_request(prompts["r0"], params, "r0")
    engine.add_request(prompts["r1"], params, "r1")  # joins in the same step: nothing stored yet
    outs: dict = {}
    for ev in engine.step():
        assert not ev.finished
    engine.add_request(prompts["r2"], params, "r2")  # r0 and r1 are still decoding: their prompt KV is stored
    outs.update(_drain(engine))
    assert {rid: o[0].token_ids for rid, o in outs.items()} == want
    assert [outs[r][0].cached_tokens for r in ("r0", "r1", "r2")] == [0, 0, 32]


def test_the_serve_switch_and_its_environment_variable(monkeypatch):
    from unmask.cli.main import build_parser
    from unmask.cli.serve import resolve_env

    def parse(argv, env=None):
        with monkeypatch.context() as m:
            for k, v in (env or {}).items():
                m.setenv(k, v)
            return resolve_env(build_parser().parse_args(["serve", *argv])).enable_prefix_caching

    assert parse([]) is True and parse(["--no-enable-prefix-caching"]) is False
    assert parse([], {"UNMASK_ENABLE_PREFIX_CACHING": "0"}) is False
    assert parse([], {"UNMASK_ENABLE_PREFIX_CACHING": "on"}) is True
    assert parse(["--enable-prefix-caching"], {"UNMASK_ENABLE_PREFIX_CACHING": "0"}) is True
    assert isinstance(argparse.BooleanOptionalAction, type)


def test_prometheus_counters_read_the_engine_at_scrape_time():
    from unmask.server.metrics import Metrics

    class FakeEngine:
        num_running = num_waiting = 0
        prefix_cache_queries, prefix_cache_hits = 120, 32

    text = Metrics("m", FakeEngine()).render()[0].decode()
    assert 'unmask:prefix_cache_queries_total{model_name="m"} 120.0' in text
    assert 'unmask:prefix_cache_hits_total{model_name="m"} 32.0' in text


@pytest.mark.parametrize("chunk", [9, 10, 11])
def test_a_waiting_cfg_prefill_extends_its_lane_from_chunks_stored_meanwhile(chunk):
    """Break-it: a CFG request's cond lane prefills at half the budget, so a request sharing its prompt stores the
    next chunks first; loading them into the waiting lane (outside a step) wrote in place into buffers made inside
    the step's inference mode and failed the whole step. Both requests get their tokens without the cache."""
    model = tiny.loaded(attention="block_causal", block_alignment="absolute", fixed_block_size=True,
                        logit_shift=False)
    prompt = _ids(400, 3)
    cfg = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0, cfg_scale=1.0)
    plain = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0)
    outs = {}
    for reuse in (False, True):
        engine = Engine(model, enable_prefix_caching=reuse, prefill_chunk=chunk)
        engine.add_request(prompt, cfg, "a")
        engine.add_request(prompt[:200], plain, "b")
        outs[reuse] = {rid: [o.token_ids for o in choices] for rid, choices in _drain(engine).items()}
    assert outs[True] == outs[False]
