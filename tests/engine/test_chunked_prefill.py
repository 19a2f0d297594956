"""Chunked prefill (docs/design.md#decoding, "Chunked prefill"; ``Request.prefill_inputs``): a long prompt is
forwarded in chunks of at most ``prefill_chunk`` row-equivalents (a row at position p costs ``1 + p / P0``) before
its first denoising step. It gives the same tokens, NFE and lane KV as the whole prompt at once, in every strategy
and attention; other requests keep stepping meanwhile; its KV is shared through the prefix cache as it is computed.
Found by a break-it run: other streams stalled 11-15 s while a 6000-token prompt was prefilled in one step; then
that a chunk of 256 rows cost 0.46 s at the start of such a prompt and 1.74 s at its end (hence the cost bound).

The tiny model's P0 is 288 (:data:`P0_TINY`), so the expectations below follow the rule written out here
(:func:`_chunk_sizes`, exact fractions), not the engine's own arithmetic."""
from __future__ import annotations

import dataclasses
from fractions import Fraction

import pytest
import torch

import tiny
from unmask.engine import LLM, SamplingParams
from unmask.engine.denoiser import Denoiser
from unmask.engine.engine import Engine
from unmask.engine.prefill_cost import PrefillBudget, attention_crossover_keys

#: P0 of ``tiny.loaded()`` (H 64, I 128, L 2, Hq 4, Hkv 2, D 16): linear FLOPs per row 2 * 2 * (64*64 + 2*64*32 +
#: 64*64 + 3*64*128) = 147,456 over attention FLOPs per key 4 * 4 * 16 * 2 = 512
P0_TINY = 288


def _ids(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, 300, (n,), generator=g).tolist()


def _cost(start: int, end: int, keys=P0_TINY) -> Fraction:
    """Row-equivalents of the prompt positions ``[start, end)``: the sum of ``1 + p / P0``."""
    return sum((1 + Fraction(p, keys) for p in range(start, end)), Fraction(0))


def _chunk_sizes(prompt_len: int, budget: int, start: int = 0, keys=P0_TINY) -> list[int]:
    """The rows of each chunk a prefix-causal lane's prompt goes in, from ``start``: while its pending rows ``[c,
    prompt_len)`` cost more than ``budget``, the most rows from ``c`` (before the last prompt position, which the
    first step forwards) costing at most ``budget``, at least one."""
    sizes, c, limit = [], start, prompt_len - 1
    while c < limit and _cost(c, prompt_len, keys) > budget:
        n = 1
        while c + n < limit and _cost(c, c + n + 1, keys) <= budget:
            n += 1
        sizes.append(n)
        c += n
    return sizes




def _first_step(model, prompt, params, chunk):
    """Step one request until its first event: (the event's request state, prefill-only forwards before it)."""
    engine = Engine(model, prefill_chunk=chunk, enable_prefix_caching=False)
    engine.add_request(prompt, params, "r")
    forwards = 0
    while not engine.step():
        forwards += 1
    return engine.scheduler.running[0] if engine.scheduler.running else None, forwards


@pytest.mark.parametrize("model_name, kw", tiny.CACHE_CASES, ids=tiny.case_ids(tiny.CACHE_CASES))
def test_the_same_tokens_nfe_and_kv_as_the_whole_prompt_at_once(model_name, kw):
    model = tiny.CACHE_LAYOUTS[model_name]()
    prompt = _ids(101)
    params = SamplingParams(max_tokens=12, ignore_eos=True, **kw)
    whole = LLM(model, prefill_chunk=0).generate([prompt], params)[0].outputs[0]
    for chunk in (7, 16, 64):
        got = LLM(model, prefill_chunk=chunk).generate([prompt], params)[0].outputs[0]
        assert got.token_ids == whole.token_ids, chunk
        assert got.nfe == whole.nfe  # a prompt chunk is no denoising forward
    ref, none = _first_step(model, prompt, params, 0)
    seq, forwards = _first_step(model, prompt, params, 16)
    assert none == 0 and forwards >= 100 // 16 - 1  # the prompt went in chunks before the first step
    for lane_ref, lane in zip(ref.lanes, seq.lanes):  # the KV after the first step: within float rounding
        a, b = lane_ref.cache, lane.cache
        assert a.length == b.length
        for x, y in zip(a.keys + a.values, b.keys + b.values):
            assert float((x[..., :a.length, :] - y[..., :b.length, :]).abs().max()) < 1e-4


def test_block_causal_chunks_end_at_block_boundaries():
    model = tiny.loaded(attention="block_causal", block_alignment="absolute", fixed_block_size=True,
                        logit_shift=False, block_size=4)
    engine = Engine(model, prefill_chunk=7, enable_prefix_caching=False)
    (seq,) = engine.add_request(_ids(50), SamplingParams(max_tokens=8, temperature=0.0), "r")
    engine.scheduler._admit()
    budget = engine.denoiser.budget
    assert _chunk_sizes(50, 7) == [6] + _chunk_sizes(50, 7, 6)  # 6 rows fit 7 row-equivalents at the start ...
    inputs = seq.prefill_inputs(budget)
    assert inputs is not None and inputs[0].chunk.tolist() == list(range(4))  # ... cut back to one whole block
    # a chunk smaller than a block takes one whole block (break-it: chunking went off, the prompt in one step)
    assert seq.prefill_inputs(dataclasses.replace(budget, chunk=3))[0].chunk.tolist() == list(range(4))


def test_other_requests_keep_stepping_during_a_long_prefill():
    model = tiny.loaded()
    engine = Engine(model, prefill_chunk=16, enable_prefix_caching=False)
    greedy = dict(temperature=0.0, ignore_eos=True, block_size=1)
    engine.add_request(_ids(5, 1), SamplingParams(max_tokens=40, **greedy), "short")
    engine.step()
    engine.add_request(_ids(200, 2), SamplingParams(max_tokens=4, **greedy), "long")
    steps_before_long = 0
    while True:
        names = [ev.request_id for ev in engine.step()]
        assert "short" in names  # the short stream steps every time
        if "long" in names:
            break
        steps_before_long += 1
    assert steps_before_long == len(_chunk_sizes(200, 16)) == 17  # its chunks, then its first step takes the rest
    alone = LLM(model, prefill_chunk=0).generate([_ids(5, 1)], SamplingParams(max_tokens=40, **greedy))
    outs = {}
    while engine.has_unfinished():
        for ev in engine.step():
            if ev.finished:
                outs[ev.request_id] = ev.output
    assert outs["short"].token_ids == alone[0].outputs[0].token_ids  # batch invariance across the chunks


def test_a_prompt_shares_its_prefix_while_it_is_being_prefilled():
    model = tiny.loaded()
    engine = Engine(model, prefill_chunk=32)
    prompt = _ids(300, 3)
    params = SamplingParams(max_tokens=4, temperature=0.0, block_size=1, ignore_eos=True)
    engine.add_request(prompt, params, "first")
    for _ in range(4):
        assert not engine.step()  # four chunks of 32 row-equivalents: 30 + 27 + 25 + 24 prompt tokens committed
    committed = sum(_chunk_sizes(300, 32)[:4])
    assert committed == 106 == engine.scheduler.running[0].lanes[0].cache.length
    (second,) = engine.add_request(prompt[:200] + _ids(20, 4), params, "second")
    engine.step()
    assert second.cached_tokens == committed // 16 * 16 == 96  # the whole prefix-cache chunks (16 tokens) stored


@pytest.mark.parametrize("bad", [-1, 1.5, True, "8"])
def test_prefill_chunk_is_validated(bad):
    with pytest.raises(ValueError, match="prefill_chunk"):
        Denoiser(tiny.loaded(), prefill_chunk=bad)


def test_the_serve_option_and_its_environment_variable(monkeypatch):
    from unmask.cli.main import build_parser
    from unmask.cli.serve import resolve_env
    from unmask.engine.limits import DEFAULT_PREFILL_CHUNK

    def parse(argv, env=None):
        with monkeypatch.context() as m:
            for k, v in (env or {}).items():
                m.setenv(k, v)
            return resolve_env(build_parser().parse_args(["serve", "m", *argv])).prefill_chunk

    assert parse([]) == DEFAULT_PREFILL_CHUNK and parse(["--prefill-chunk", "0"]) == 0
    assert parse([], {"UNMASK_PREFILL_CHUNK": "64"}) == 64
    assert parse(["--prefill-chunk", "8"], {"UNMASK_PREFILL_CHUNK": "64"}) == 8


def test_serve_refuses_a_negative_chunk(capsys):
    from unmask.cli.main import main

    assert main(["serve", "/nonexistent", "--prefill-chunk", "-1"]) == 2
    assert "--prefill-chunk: must be >= 0" in capsys.readouterr().err


def test_a_cfg_request_with_a_prefix_cache_hit_still_prefills_in_chunks():
    """A prefix-cache hit fills only the cond lane; the uncond lane (prompt masked) must still go in chunks, each
    lane from its own cache length (break-it: it went in one step, an 18.7 s stall for a 3000-token prompt)."""
    model = tiny.loaded()
    prompt = _ids(200, 5)
    llm = LLM(model, prefill_chunk=16)
    llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0))  # stores the prompt's chunks
    cfg = SamplingParams(max_tokens=8, temperature=0.0, cfg_scale=1.0, ignore_eos=True)
    engine = Engine(model, prefill_chunk=16, prefix_cache=llm.prefix_cache)
    (seq,) = engine.add_request(prompt, cfg, "cfg")
    widths = []
    while True:
        engine.scheduler._admit()
        inputs = seq.prefill_inputs(engine.denoiser.budget)
        if inputs is None:
            break
        widths.append(sorted((inp.lane, int(inp.chunk[0]), int(inp.chunk.numel())) for inp in inputs))
        assert not engine.step()
    assert seq.cached_tokens == 192 and [w[:2] for w in widths[0]] == [(0, 192), (1, 0)]  # each from its own length
    # the two lanes share a chunk (break-it: each took a whole one, two chunks' work in one step): each lane takes
    # the most rows that fit its half while both have rows left, the whole budget once one lane is done
    for w in widths:
        share = Fraction(16, len(w))
        for _, c, n in w:
            assert _cost(c, c + n) <= share or n == 1
            assert c + n == 199 or _cost(c, c + n + 1) > share  # the most that fit
    uncond = [(c, n) for w in widths for lane, c, n in w if lane == 1]
    assert len(uncond) > 5 and all(c == sum(n for _, n in uncond[:i]) for i, (c, _) in enumerate(uncond))
    assert _cost(sum(n for _, n in uncond), 200) <= 16  # in many chunks, until its first step's rows fit
    out = {}
    while engine.has_unfinished():
        for ev in engine.step():
            if ev.finished:
                out[ev.request_id] = ev.output.token_ids
    fresh = LLM(model, prefill_chunk=0, enable_prefix_caching=False).generate([prompt], cfg)[0].outputs[0]
    assert out["cfg"] == fresh.token_ids


def _engine_with_a_stream(seed: int, max_tokens: int, rid: str) -> Engine:
    """An engine (tiny model, chunks of 16, no prefix cache) whose greedy block-1 stream ``rid`` (a 5-token
    prompt) has taken its first step."""
    engine = Engine(tiny.loaded(), prefill_chunk=16, enable_prefix_caching=False)
    engine.add_request(_ids(5, seed), SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                                     block_size=1), rid)
    engine.step()
    return engine


def test_a_step_carries_one_chunk_of_prompt_rows_first_come_first_served():
    """Several long prompts at once: a step carries at most prefill_chunk prompt rows (break-it: six 2000-token
    prompts prefilling side by side held a stream up 4.9 s per step). The first to join prefills first; each keeps
    its own chunks, so every answer is the one it gets alone."""
    engine = _engine_with_a_stream(9, 60, "short")
    model = engine.model
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, block_size=1)
    a = engine.add_request(_ids(100, 10), greedy, "a")[0]
    b = engine.add_request(_ids(90, 11), greedy, "b")[0]
    history, outs = [], {}
    while not (a.nfe and b.nfe):
        before = (a.lanes[0].cache.length, b.lanes[0].cache.length)
        events = engine.step()
        outs.update({ev.request_id: ev.output.token_ids for ev in events if ev.finished})
        assert "short" in [ev.request_id for ev in events]
        after = (a.lanes[0].cache.length, b.lanes[0].cache.length)
        history.append((after[0] > before[0] and not a.nfe, after[1] > before[1] and not b.nfe))
    assert not any(x and y for x, y in history)  # never both chunks in one step
    first_b = next(i for i, (_, y) in enumerate(history) if y)
    assert all(not x for x, _ in history[first_b:])  # b's chunks begin once a is done with its own
    while engine.has_unfinished():
        for ev in engine.step():
            if ev.finished:
                outs[ev.request_id] = ev.output.token_ids
    alone = LLM(model, prefill_chunk=16, enable_prefix_caching=False)
    assert outs["a"] == alone.generate([_ids(100, 10)], greedy)[0].outputs[0].token_ids
    assert outs["b"] == alone.generate([_ids(90, 11)], greedy)[0].outputs[0].token_ids


def test_first_steps_prompt_rows_count_against_the_step_budget_shortest_first():
    """Prompts that fit one chunk each used to go all into one step (their first steps were not counted: break-it,
    8 prompts of 255 tokens made a 5.98 s step). First steps count too, shortest pending prompt first, so a short
    request does not wait behind a long prefill either; every answer is the one it gets alone."""
    model = tiny.loaded()
    greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, block_size=1)
    engine = Engine(model, prefill_chunk=16, enable_prefix_caching=False)
    prompts = {f"p{i}": _ids(15, 20 + i) for i in range(5)}
    prompts["long"] = _ids(120, 30)
    engine.add_request(prompts["long"], greedy, "long")
    engine.step()  # the long prompt's first chunk
    for rid, ids in prompts.items():
        if rid != "long":
            engine.add_request(ids, greedy, rid)
    counted, outs = [], {}
    real = engine.denoiser._forward

    def counting(rows):
        counted.append(sum(int((inp.committed & (inp.chunk < seq.prompt_len)).sum()) for seq, _, inp in rows))
        return real(rows)

    engine.denoiser._forward = counting
    while engine.has_unfinished():
        start = len(counted)
        for ev in engine.step():
            if ev.finished:
                outs[ev.request_id] = ev.output.token_ids
        assert sum(counted[start:]) <= 16, counted[start:]  # one step: at most one chunk's worth of prompt rows
    alone = LLM(model, prefill_chunk=0, enable_prefix_caching=False)
    for rid, ids in prompts.items():
        assert outs[rid] == alone.generate([ids], greedy)[0].outputs[0].token_ids, rid


def test_choices_that_prefill_one_after_another_share_the_prompt():
    """n=2 (or the same prompt sent twice at once): the second choice's prefill waits for the first's, then loads
    what the first stored instead of computing it again (break-it: both reported cached_tokens 0)."""
    model = tiny.loaded()
    engine = Engine(model, prefill_chunk=16)
    prompt = _ids(200, 40)
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, block_size=1)
    engine.add_request(prompt, greedy, "r", n=2)
    outs = {}
    while engine.has_unfinished():
        for ev in engine.step():
            if ev.finished:
                outs[ev.index] = ev.output
    assert outs[0].cached_tokens == 0 and outs[1].cached_tokens == 192
    assert outs[0].token_ids == outs[1].token_ids
    assert engine.prefix_cache_stats()["queries"] == 2 * 200  # each choice looked up once, however long it waited


def test_p0_comes_from_the_models_config():
    """P0 = 2 * N_linear / (4 * Hq * D * L) (engine/prefill_cost.py): the key count at which one row's attention
    costs what its linear layers cost."""
    from transformers import LlamaConfig, Qwen2Config

    assert attention_crossover_keys(tiny.loaded().model.config) == P0_TINY
    smollm2 = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                          num_key_value_heads=3)  # SmolLM2-135M: N_linear = 30 * 3,538,944 = 106,168,320
    assert attention_crossover_keys(smollm2) == 2 * 106_168_320 / (4 * 9 * 64 * 30) == 3072
    qwen = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2)  # head_dim = hidden_size / heads when the config has none
    assert attention_crossover_keys(qwen) == P0_TINY
    with pytest.raises(ValueError, match="intermediate_size"):
        attention_crossover_keys(LlamaConfig(intermediate_size=0))
    rows = PrefillBudget(16)  # keys = inf: every row costs 1, the bound on rows of before
    assert [rows.end(c, 100) for c in (0, 50, 90, 99)] == [16, 66, 100, 100]
    # whole prompt tiles (row-invariant attention): an end rounded down to a multiple of 32 when one lies past the
    # start; SmolLM2-135M's default chunk: 246 rows fit at the start, 224 taken, then 86 near position 6000
    tiles = PrefillBudget(256, 3072, align=32)
    assert [tiles.end(c, 10_000) - c for c in (0, 224, 5984)] == [224, 224, 64]
    assert tiles.end(5984, 5999) == 5999 and PrefillBudget(7, P0_TINY, 32).end(10, 20) == 16  # no multiple of 32
    assert _chunk_sizes(10_000, 256, keys=3072)[0] == 246 and _cost(5984, 5984 + 86, 3072) <= 256


def test_chunks_shrink_with_position_as_the_rule_says():
    """A 480-token prompt in chunks of 16 row-equivalents: 15 rows at its start, 6 at its end, each chunk the most
    rows that fit (one more would not); the answer is the unchunked one."""
    model = tiny.loaded()
    prompt = _ids(480, 50)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, block_size=2)
    engine = Engine(model, prefill_chunk=16, enable_prefix_caching=False)
    (seq,) = engine.add_request(prompt, params, "long")
    sizes, out = [], None
    while out is None:
        before = seq.lanes[0].cache.length
        events = engine.step()
        if not seq.nfe:
            sizes.append(seq.lanes[0].cache.length - before)
        out = next((ev.output for ev in events if ev.finished), out)
    expected = _chunk_sizes(480, 16)
    assert sizes == expected and expected[0] == 15 and expected[-1] == 6  # 1 + 470 / 288 = 2.6 per row at the end
    c = 0
    for n in sizes:
        assert _cost(c, c + n) <= 16 < _cost(c, c + n + 1)
        c += n
    assert _cost(c, 480) <= 16  # the first step's own prompt rows fit too
    whole = LLM(model, prefill_chunk=0, enable_prefix_caching=False).generate([prompt], params)[0].outputs[0]
    assert out.token_ids == whole.token_ids and out.nfe == whole.nfe


def test_a_steps_prompt_cost_stays_within_the_budget_with_several_long_prompts():
    """Three long prompts join a decoding stream at once: no step's prompt rows cost more than 16 row-equivalents,
    each prompt goes in the very chunks it gets alone (bounds from its own position, never its batch mates), and
    every answer is the unchunked one."""
    engine = _engine_with_a_stream(60, 200, "stream")
    model = engine.model
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, block_size=1)
    prompts = {"a": _ids(450, 61), "b": _ids(400, 62), "c": _ids(300, 63)}
    seqs = {rid: engine.add_request(ids, greedy, rid)[0] for rid, ids in prompts.items()}
    costs, sizes, outs = [], {rid: [] for rid in prompts}, {}
    real = engine.denoiser._forward

    def counting(rows):
        costs[-1] += sum(1 + Fraction(p, P0_TINY) for seq, _, inp in rows
                         for p in inp.chunk[inp.committed & (inp.chunk < seq.prompt_len)].tolist())
        return real(rows)

    engine.denoiser._forward = counting
    while any(not s.finished for s in seqs.values()):
        before = {rid: s.lanes[0].cache.length for rid, s in seqs.items()}
        costs.append(Fraction(0))
        events = engine.step()
        assert "stream" in [ev.request_id for ev in events]  # the stream steps every time
        for rid, s in seqs.items():
            if not s.nfe and s.lanes[0].cache.length > before[rid]:
                sizes[rid].append(s.lanes[0].cache.length - before[rid])
        outs.update({ev.request_id: ev.output.token_ids for ev in events if ev.finished})
    assert max(costs) <= 16 and max(costs) > 15  # full steps, never over
    assert sum(costs) == sum(_cost(0, len(ids)) for ids in prompts.values())  # every prompt row forwarded once
    whole = LLM(model, prefill_chunk=0, enable_prefix_caching=False)
    for rid, ids in prompts.items():
        assert sizes[rid] == _chunk_sizes(len(ids), 16), rid
        assert outs[rid] == whole.generate([ids], greedy)[0].outputs[0].token_ids, rid


def test_a_long_prompt_is_not_starved_by_a_stream_of_new_requests():
    """Break-it: first steps go before chunks, so a short request joining every step kept a long prompt's chunk
    waiting for ever (30 steps, cache length 0). After a step that left a chunk waiting, chunks go first."""
    engine = Engine(tiny.loaded(), max_batch_size=4, prefill_chunk=16, enable_prefix_caching=False)
    greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, block_size=1)
    (long,) = engine.add_request(_ids(150, 3), greedy, "long")
    k, first = 0, None
    for step in range(60):
        while len(engine.scheduler.waiting) < 2:  # the queue always holds new short requests
            engine.add_request(_ids(10, 100 + k), greedy, f"s{k}")
            k += 1
        if "long" in [ev.request_id for ev in engine.step()] and first is None:
            first = step
    # the prompt's chunks (at most every other step) and its first step came through the stream of joiners
    assert first is not None and first <= 2 * (len(_chunk_sizes(150, 16)) + 1), (first, long.lanes[0].cache.length)


def test_chunk_ends_align_to_prompt_tiles_only_when_a_tile_fits():
    """Break-it: rounding a chunk's end down to a prompt tile when fewer than a tile's rows fit split every tile
    in two chunks (28 + 4, ...): 22 chunks where 13 do. Only a chunk of at least one tile is aligned."""
    aligned = PrefillBudget(256, 3072.0, 32)
    assert aligned.end(0, 8000) == 224 and aligned.end(224, 8000) % 32 == 0  # whole tiles
    small = PrefillBudget(31, 3072.0, 32)
    ends, c = [], 0
    while c < 366:
        c = small.end(c, 366)
        ends.append(c)
    unaligned = PrefillBudget(31, 3072.0, 1)
    ref, c = [], 0
    while c < 366:
        c = unaligned.end(c, 366)
        ref.append(c)
    assert ends == ref  # under a tile's rows a chunk is not cut back
