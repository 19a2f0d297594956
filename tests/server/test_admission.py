"""Atomic admission (docs/design.md#admission-and-limits): a request's prompts x ``n`` sequences are admitted or refused
together against the queue's capacity, and a refused request holds no room afterwards (found by the breaker:
6 simultaneous near-cap requests got 4 x 429 although the queue had room for them one after another)."""
from __future__ import annotations

import threading

import pytest
from fastapi.testclient import TestClient

from tiny import loaded
from unmask.engine import SamplingParams
from unmask.engine.async_engine import AsyncEngine, QueueFull
from unmask.server.app import build_app


@pytest.fixture(scope="module")
def model():
    return loaded(block_size=4)


def _gated(model, max_queue):
    """An engine whose thread blocks in its first step until ``gate`` is set: nothing it was given leaves the
    queue, and no abort is applied, while the test submits."""
    eng = AsyncEngine(model, max_batch_size=1, max_queue=max_queue)
    gate, orig = threading.Event(), eng.engine.step
    entered = threading.Event()

    def step():
        entered.set()
        gate.wait(30)
        return orig()

    eng.engine.step = step
    return eng, gate, entered


def test_a_refused_multi_prompt_request_holds_no_queue_room(model):
    """Queue of 4 with 1 sequence waiting: a 2 prompts x n=2 request (4) does not fit and is a 429 with
    Retry-After; a 1 x n=2 request right after it fits (1 + 2 <= 4). Prompt by prompt, the refused request's first
    prompt stayed queued until the engine thread applied its abort, and the second request was a 429 too."""
    eng, gate, entered = _gated(model, max_queue=4)
    try:
        import asyncio

        async def first():
            return eng.submit([5, 6], SamplingParams(max_tokens=4, temperature=0), "x")
        asyncio.run(first())
        assert entered.wait(10)  # the engine thread holds "x" in its waiting queue and is stuck in a step
        app = build_app(eng, "m", shutdown_engine=False, max_seqs_per_request=4)
        with TestClient(app) as client:
            body = {"model": "m", "max_tokens": 4, "temperature": 0, "n": 2}
            r = client.post("/v1/completions", json={**body, "prompt": ["a", "b"]})
            assert r.status_code == 429 and r.headers["Retry-After"], r.text
            assert eng._queued_seqs == 1
            threading.Timer(1.0, gate.set).start()   # the engine resumes once the next request is admitted
            r = client.post("/v1/completions", json={**body, "prompt": "a"})
            assert r.status_code == 200, r.text
            assert len(r.json()["choices"]) == 2
    finally:
        gate.set()
        eng.shutdown()


def test_submit_many_admits_all_prompts_or_none(model):
    """The engine API: a call whose sequences overflow the queue raises QueueFull and registers nothing; one that
    fits registers every prompt."""
    import asyncio

    eng, gate, entered = _gated(model, max_queue=5)
    p = SamplingParams(max_tokens=4, temperature=0)

    async def scenario():
        eng.submit([5, 6], p, "x")
        with pytest.raises(QueueFull):
            eng.submit_many([[5], [6], [7]], p, ["a-0", "a-1", "a-2"], n=2)
        assert eng._queued_seqs == 1 and set(eng._requests) == {"x"}
        streams = eng.submit_many([[5], [6]], p, ["b-0", "b-1"], n=2)
        assert eng._queued_seqs == 5 and [s.request_id for s in streams] == ["b-0", "b-1"]
        gate.set()
        for s in streams:
            async for _ in s:
                pass
        return [len(s.outputs) for s in streams]

    try:
        assert asyncio.run(scenario()) == [2, 2]
    finally:
        gate.set()
        eng.shutdown()


@pytest.mark.parametrize("max_queue, per_request, option", [(2, 64, "--max-queue"), (8, 2, "--max-seqs-per-request")])
def test_the_per_request_limit_names_the_option_that_set_it(model, max_queue, per_request, option):
    """A request over prompts x n gets a 400 naming the option that set the limit: the queue's size when it is the
    smaller bound (found by a new user: `--max-queue 1` and n=2 blamed --max-seqs-per-request, left at 64)."""
    eng = AsyncEngine(model, max_batch_size=1, max_queue=max_queue)
    try:
        app = build_app(eng, "m", shutdown_engine=False, max_seqs_per_request=per_request)
        with TestClient(app) as client:
            r = client.post("/v1/completions", json={"model": "m", "prompt": "a", "max_tokens": 2, "n": 3})
            assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
            msg = r.json()["error"]["message"]
            assert f"limit of 2 sequences per request ({option})" in msg, msg
            r = client.post("/v1/completions", json={"model": "m", "prompt": "a", "max_tokens": 2, "n": 2})
            assert r.status_code == 200, r.text
    finally:
        eng.shutdown()
