"""Cost-based fairness (issue 41; engine/scheduler.py, engine/step_cost.py, docs/design.md#admission-and-limits): a
request is weighed by what it costs every step, in row-equivalents: its rows (block_size x n x lanes; a
self-speculative step's drafts, mask group and fallback groups) plus ``SEQUENCE_ROWS`` per sequence and lane, over
all of its prompts. One past ``max_step_rows`` is a 400 naming ``block_size`` and the limit; admitted heavy requests
share steps so that a light request never waits behind more than one heavy step; the tokens are those of the request
alone."""
from __future__ import annotations

import pytest

from tiny import loaded
from unmask.engine import ParamError, SamplingParams
from unmask.engine.engine import Engine
from unmask.engine.options import EngineConfig
from unmask.engine.step_cost import SEQUENCE_ROWS, step_rows


@pytest.fixture(scope="module")
def model():
    return loaded(attention="block_causal")


HEAVY = dict(max_tokens=32, block_size=16, sub_block_size=16, temperature=0.0, ignore_eos=True)
LIGHT = dict(max_tokens=4, block_size=4, temperature=0.0, ignore_eos=True)
LIMIT = 2 * (16 + SEQUENCE_ROWS)  # HEAVY with n 2: at the limit


def _engine(model, rows: int | None = LIMIT) -> Engine:
    return Engine(model, EngineConfig(max_step_rows=rows, max_batch_size=8, enable_prefix_caching=False))


@pytest.mark.parametrize("kw,n", [(dict(HEAVY, block_size=32, sub_block_size=32), 2), (HEAVY, 3),
                                  (dict(HEAVY, cfg_scale=1.5, block_size=32, sub_block_size=32), 1)])
def test_a_request_past_the_rows_limit_is_refused_naming_block_size_and_the_limit(model, kw, n):
    eng = _engine(model)
    with pytest.raises(ParamError) as err:
        eng.add_request([5, 6, 7], SamplingParams.from_flat(**kw), "big", n=n)
    assert err.value.field == "block_size" and f"limit is {LIMIT} per request" in str(err.value), err.value
    eng.add_request([5, 6, 7], SamplingParams.from_flat(**HEAVY), "ok", n=2)  # 2 x (16 + SEQUENCE_ROWS): the limit


def test_the_cost_counts_every_prompt_of_a_request():
    """Two prompts of n 2 each cost twice one prompt's: refused, though each prompt alone is at the limit (the
    check counted per prompt)."""
    import asyncio

    from unmask.engine.async_engine import AsyncEngine

    eng = AsyncEngine(loaded(attention="block_causal"), EngineConfig(max_step_rows=LIMIT, enable_prefix_caching=False))
    loop = asyncio.new_event_loop()
    try:
        params = SamplingParams.from_flat(**HEAVY)
        with pytest.raises(ParamError) as err:
            eng.submit_many([[5, 6, 7], [8, 9]], params, ["a-0", "a-1"], n=2, loop=loop, group="a")
        assert err.value.field == "block_size" and f"costs every step {2 * LIMIT} " in str(err.value), err.value
        assert eng.num_waiting == 0  # nothing of it queued
        eng.submit_many([[5, 6, 7]], params, ["b-0"], n=2, loop=loop, group="b")  # one prompt: at the limit
    finally:
        eng.shutdown()
        loop.close()


def test_a_speculative_step_is_counted_by_the_rows_it_forwards():
    """A self-speculative step forwards the final token, the drafts, mask group A and a fallback group per branch:
    ``step_rows`` bounds them and is reached (it counted the draft block alone: 8 rows instead of 40)."""
    model = loaded(attention="prefix_causal", block_size=8)
    eng = Engine(model, EngineConfig(max_step_rows=None, enable_prefix_caching=False))
    (seq,) = eng.add_request([5, 6, 7, 8], SamplingParams.from_flat(max_tokens=64, block_size=8, speculative=True,
                                                                    temperature=0.0, ignore_eos=True), "s")
    bound, most = step_rows(seq), 0
    assert bound == 8 * (2 + 3)  # the default 3 branches
    while not seq.finished:
        if seq.nfe:  # decoding steps (the first forwards the prompt: chunked prefill's budget)
            most = max(most, sum(int(inp.chunk.numel()) for inp in seq.lane_inputs()))
        eng.step()
    assert bound - 8 <= most <= bound, (most, bound)


def _run(eng: Engine) -> dict[str, list[int]]:
    """Step to the end; ``{request or (request, choice): [the step of each of its events]}`` and the final token
    ids."""
    seen, ids, k = {}, {}, 0
    while eng.scheduler.has_work():
        k += 1
        for ev in eng.step():
            seen.setdefault(ev.request_id, []).append(k)
            seen.setdefault((ev.request_id, ev.index), []).append(k)
            if ev.finished:
                ids[ev.request_id, ev.index] = list(ev.output.token_ids)
    return seen, ids


def test_a_light_request_waits_behind_at_most_one_heavy_step_and_its_tokens_do_not_change(model):
    eng = _engine(model)
    eng.add_request([5, 6, 7], SamplingParams.from_flat(**HEAVY), "heavy", n=2)  # 32 rows: the whole budget
    eng.step()
    eng.add_request([8, 9], SamplingParams.from_flat(**LIGHT), "light")
    seen, ids = _run(eng)
    assert seen["light"][0] <= 2, seen  # its first step comes at once or after one heavy step
    light = seen["light", 0]
    assert all(b - a <= 2 for a, b in zip(light, light[1:])), light  # never more than one step without it
    for i in (0, 1):  # each heavy choice waits at most one step at a time: the budget is shared, not starved
        steps = seen["heavy", i]
        assert all(b - a <= 2 for a, b in zip(steps, steps[1:])), (i, steps)
    assert len(seen["heavy"]) > len(set(seen["heavy"])) or max(seen["heavy"]) > len(seen["heavy", 0])
    # whole requests share steps: the light request's steps carry no part of the heavy one (light + heavy exceed
    # the limit), so they cost what the light request costs (one of the heavy choices beside it before)
    assert not set(light) & (set(seen["heavy", 0]) | set(seen["heavy", 1])), (light, seen["heavy", 0])
    alone = _engine(model, rows=None)
    alone.add_request([5, 6, 7], SamplingParams.from_flat(**HEAVY), "heavy", n=2)
    alone.add_request([8, 9], SamplingParams.from_flat(**LIGHT), "light")
    assert _run(alone)[1] == ids  # batch and step order never change the tokens


def test_a_request_whose_memory_estimate_exceeds_what_is_available_is_refused_saying_why(model, monkeypatch):
    import collections

    import psutil

    eng = _engine(model)
    kv, logits = eng.scheduler.estimate_bytes(eng.make_request([5, 6, 7], SamplingParams.from_flat(**HEAVY), "x", 2))
    assert kv > 0 and logits > 0
    mem = collections.namedtuple("mem", "available")
    monkeypatch.setattr(psutil, "virtual_memory", lambda: mem(kv + logits - 1))
    with pytest.raises(ParamError) as err:
        eng.add_request([5, 6, 7], SamplingParams.from_flat(**HEAVY), "big", n=2)
    assert err.value.field == "max_tokens" and "MiB available" in str(err.value) and "KV cache" in str(err.value)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: mem(kv + logits))
    eng.add_request([5, 6, 7], SamplingParams.from_flat(**HEAVY), "ok", n=2)
