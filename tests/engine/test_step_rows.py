"""Cost-based fairness (issue 41; engine/scheduler.py, docs/design.md#admission-and-limits): a request is weighed by
the rows it puts into every step (block_size x n x lanes). One past ``max_step_rows`` is a 400 naming
``block_size`` and the limit; admitted heavy requests share steps so that a light request never waits behind more
than one heavy step; the tokens are those of the request alone."""
from __future__ import annotations

import pytest

from tiny import loaded
from unmask.engine import ParamError, SamplingParams
from unmask.engine.engine import Engine
from unmask.engine.options import EngineConfig


@pytest.fixture(scope="module")
def model():
    return loaded(attention="block_causal")


def _engine(model, rows: int | None = 32) -> Engine:
    return Engine(model, EngineConfig(max_step_rows=rows, max_batch_size=8, enable_prefix_caching=False))


HEAVY = dict(max_tokens=32, block_size=16, sub_block_size=16, temperature=0.0, ignore_eos=True)
LIGHT = dict(max_tokens=4, block_size=4, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("kw,n", [(dict(HEAVY, block_size=32, sub_block_size=32), 2), (HEAVY, 3),
                                  (dict(HEAVY, cfg_scale=1.5, block_size=32, sub_block_size=32), 1)])
def test_a_request_past_the_rows_limit_is_refused_naming_block_size_and_the_limit(model, kw, n):
    eng = _engine(model)
    with pytest.raises(ParamError) as err:
        eng.add_request([5, 6, 7], SamplingParams.from_flat(**kw), "big", n=n)
    assert err.value.field == "block_size" and "limit is 32 rows" in str(err.value), err.value
    eng.add_request([5, 6, 7], SamplingParams.from_flat(**HEAVY), "ok", n=2)  # 16 x 2 = 32: at the limit


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
