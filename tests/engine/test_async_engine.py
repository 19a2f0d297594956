"""AsyncEngine: one engine thread, asyncio consumers; batch-invariant results, aborts, admission errors."""
from __future__ import annotations

import asyncio
import time

import pytest

from tiny import loaded
from unmask.engine.async_engine import AsyncEngine, CacheFull, EngineClosed, EngineError, QueueFull
from unmask.engine.llm import LLM
from unmask.engine.params import ParamError, SamplingParams


@pytest.fixture(scope="module")
def model():
    return loaded(block_size=4)


def run(coro):
    return asyncio.run(coro)


async def collect(stream):
    events = [ev async for ev in stream]
    return events


def test_concurrent_requests_equal_llm_generate_alone(model):
    prompts = ["The quick brown fox", "Diffusion language models", "One two three", "Grüße aus"]
    params = [SamplingParams(max_tokens=8, temperature=0.0, seed=1),
              SamplingParams(max_tokens=7, temperature=0.9, seed=7, block_size=3),
              SamplingParams(max_tokens=12, temperature=1.0, seed=3, steps=6, remasking="margin"),
              SamplingParams(max_tokens=8, temperature=0.7, seed=11, threshold=0.5, logprobs=True)]
    llm = LLM(model, max_batch_size=1)
    alone = []
    for p, sp in zip(prompts, params):
        out = llm.generate(p, sp, n=2)[0]
        alone.append([(o.token_ids, o.text, o.finish_reason, o.nfe, o.steps, o.logprobs) for o in out.outputs])

    async def main():
        engine = AsyncEngine(model, max_batch_size=8)
        try:
            streams = [engine.submit(llm.encode(p), sp, f"r{i}", n=2) for i, (p, sp) in enumerate(zip(prompts, params))]
            all_events = await asyncio.gather(*(collect(s) for s in streams))
            return streams, all_events, engine.stats()
        finally:
            engine.shutdown()

    streams, all_events, stats = run(main())
    assert stats["running"] == 0 and stats["waiting"] == 0
    for stream, events, want in zip(streams, all_events, alone):
        got = []
        for i, out in enumerate(stream.outputs):
            lp = out.logprobs
            got.append((out.token_ids, out.text, out.finish_reason, out.nfe, out.steps, lp))
            if lp is not None:  # batched float32 arithmetic: equal tokens, log-probabilities equal to 1e-4
                assert lp == pytest.approx(want[i][5], abs=1e-4)
                got[-1] = got[-1][:5] + (want[i][5],)
            mine = [ev for ev in events if stream.index_of(ev) == i]
            assert mine[-1].finished and not any(ev.finished for ev in mine[:-1])
            assert mine[-1].text == out.text and mine[-1].output is out
            texts = [ev.text for ev in mine]
            assert all(b.startswith(a) for a, b in zip(texts, texts[1:])), "stream text must only grow"
            steps = [ev.step for ev in mine if ev.revealed]  # a step may reveal only the hidden tail of the last
            assert steps == sorted(set(steps)) and steps[0] == 0  # block (max_tokens not a block multiple)
        assert got == want
        assert stream.finished and stream.queue_time is not None


def test_abort_frees_slot_and_stops_spending_steps(model):
    async def main():
        engine = AsyncEngine(model, max_batch_size=1, max_queue=4)
        try:
            long = engine.submit([5, 6, 7], SamplingParams(max_tokens=400, temperature=0, seed=0, ignore_eos=True),
                                 "long")
            seen = 0
            async for ev in long:
                seen += 1
                if seen == 3:
                    break
            assert engine.num_running == 1
            nfe_at_abort = engine.nfe
            long.abort()
            rest = [ev async for ev in long]
            assert rest[-1].finished and rest[-1].finish_reason == "abort"
            nfe_after = engine.nfe
            assert nfe_after - nfe_at_abort <= 1 + len(rest)  # steps already queued to us + the one in flight
            await asyncio.sleep(0.2)
            # at most the step that was in flight when the abort arrived
            assert engine.nfe == nfe_after
            assert engine.num_running == 0 and not engine.scheduler.running and not engine.scheduler.waiting
            assert long._choices[0].cache_bytes() == 0
            # the freed slot serves the next request (max_batch_size=1)
            short = engine.submit([5, 6, 7], SamplingParams(max_tokens=6, temperature=0, seed=0), "short")
            evs = await asyncio.wait_for(collect(short), 30)
            assert evs[-1].finished and evs[-1].finish_reason in ("stop", "length")
            engine.abort("short")  # after finishing: a no-op
            engine.abort("never-submitted")
            return seen
        finally:
            engine.shutdown()

    assert run(main()) == 3


def test_abort_while_waiting(model):
    async def main():
        engine = AsyncEngine(model, max_batch_size=1)
        try:
            a = engine.submit([5, 6], SamplingParams(max_tokens=200, temperature=0, seed=0, ignore_eos=True), "a")
            await a.__anext__()
            b = engine.submit([5, 6], SamplingParams(max_tokens=8, temperature=0, seed=0), "b", n=2)
            b.abort()
            evs = await asyncio.wait_for(collect(b), 30)
            assert [ev.finish_reason for ev in evs] == ["abort", "abort"]
            assert all(o.steps == 0 for o in b.outputs)
            a.abort()
            await collect(a)
            for _ in range(50):
                if engine.num_running == 0 and engine.num_waiting == 0:
                    break
                await asyncio.sleep(0.02)
            assert engine.stats()["running"] == 0 and engine.stats()["waiting"] == 0
        finally:
            engine.shutdown()

    run(main())


def test_submit_errors_are_synchronous(model):
    async def main():
        engine = AsyncEngine(model, max_batch_size=1, max_queue=1, max_cached_tokens=100)
        try:
            with pytest.raises(ParamError) as e:
                engine.submit([5] * 10, SamplingParams(max_tokens=600), "x")
            assert e.value.field == "max_tokens" and "512" in str(e.value) and "10 tokens" in str(e.value)
            with pytest.raises(ParamError) as e:
                engine.submit([], SamplingParams(max_tokens=4), "x")
            assert e.value.field == "prompt"
            with pytest.raises(ParamError) as e:
                engine.submit([5], SamplingParams(max_tokens=4), "x", n=0)
            assert e.value.field == "n"
            with pytest.raises(ParamError, match=r"needs \d+ cached tokens.*KV budget.*is 100.*never") as e:
                engine.submit([5] * 90, SamplingParams(max_tokens=20), "x")  # can never fit: a client error
            assert e.value.field == "max_tokens"
            # an unset max_tokens (the server's default) is lowered to fit the budget as well as the context
            fitted = engine.submit([5] * 90, SamplingParams(max_tokens=256, ignore_eos=True), "fit",
                                   fit_max_tokens=True)
            from unmask.engine.llm import make_sequences

            def canvas(m):  # tokens the request would reserve with max_tokens = m
                return make_sequences(model, [5] * 90, SamplingParams(max_tokens=m), "probe")[0].length
            largest = max(m for m in range(1, 11) if canvas(m) <= 100)  # the canvas is rounded up to whole blocks
            assert fitted._choices[0].length <= 100 and fitted._choices[0].max_tokens == largest
            fitted.abort()
            await collect(fitted)
            # block 32: the canvas grows in steps of 32, and the largest fit (96) is not the first one below the
            # overshoot (a subtract-the-excess search stopped at 66)
            fitted = engine.submit([5] * 3, SamplingParams(max_tokens=256, block_size=32, ignore_eos=True), "fit32",
                                   fit_max_tokens=True)
            assert fitted._choices[0].max_tokens == 96 and fitted._choices[0].length == 99
            fitted.abort()
            await collect(fitted)
            with pytest.raises(ParamError, match="KV budget") as e:
                engine.submit([5] * 101, SamplingParams(max_tokens=256), "y", fit_max_tokens=True)
            assert e.value.field == "prompt"
            a = engine.submit([5, 6], SamplingParams(max_tokens=80, temperature=0, seed=0, ignore_eos=True), "a")
            await a.__anext__()  # a is running: the queue is empty again
            b = engine.submit([5, 6], SamplingParams(max_tokens=4, temperature=0, seed=0), "b")
            with pytest.raises(QueueFull):
                engine.submit([5, 6], SamplingParams(max_tokens=4, temperature=0, seed=0), "c")
            with pytest.raises(ParamError):
                engine.submit([5, 6], SamplingParams(max_tokens=4), "b")  # duplicate id in flight
            a.abort()
            await collect(a)
            evs = await asyncio.wait_for(collect(b), 30)
            assert evs[-1].finish_reason in ("stop", "length")
        finally:
            engine.shutdown()

    run(main())


def test_fit_max_tokens_lowers_default_to_context(model):
    async def main():
        engine = AsyncEngine(model)
        try:
            # 507-token prompt, context 512, block 4: the 5 positions left are all used (the last block is cut
            # short at the context edge instead of max_tokens being lowered to whole blocks)
            s = engine.submit([5] * 507, SamplingParams(max_tokens=256, temperature=0, seed=0, ignore_eos=True),
                              "fit", fit_max_tokens=True)
            assert s._choices[0].max_tokens == 5
            await collect(s)
            assert len(s.outputs[0].token_ids) == 5
            with pytest.raises(ParamError) as e:
                engine.submit([5] * 512, SamplingParams(max_tokens=256), "full", fit_max_tokens=True)
            assert e.value.field == "prompt" and "512" in str(e.value)
        finally:
            engine.shutdown()

    run(main())


def test_engine_fault_fails_request_then_serves(model, monkeypatch):
    async def main():
        engine = AsyncEngine(model)
        try:
            real = engine.denoiser.step
            calls = {"n": 0}

            def broken(seqs):
                calls["n"] += 1
                if calls["n"] == 2:
                    raise RuntimeError("boom")
                return real(seqs)

            monkeypatch.setattr(engine.denoiser, "step", broken)
            s = engine.submit([5, 6], SamplingParams(max_tokens=20, temperature=0, seed=0, ignore_eos=True), "f")
            with pytest.raises(EngineError, match="boom"):
                await asyncio.wait_for(collect(s), 30)
            assert not engine.scheduler.running
            ok = engine.submit([5, 6], SamplingParams(max_tokens=4, temperature=0, seed=0), "ok")
            evs = await asyncio.wait_for(collect(ok), 30)
            assert evs[-1].finished
        finally:
            engine.shutdown()

    run(main())


def test_shutdown_closes_open_streams(model):
    async def main():
        engine = AsyncEngine(model, max_batch_size=1)
        s = engine.submit([5, 6], SamplingParams(max_tokens=400, temperature=0, seed=0, ignore_eos=True), "s")
        await s.__anext__()
        t0 = time.time()
        await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)
        assert time.time() - t0 < 10
        with pytest.raises(EngineClosed):
            await asyncio.wait_for(collect(s), 10)
        assert not engine.alive
        with pytest.raises(EngineClosed):
            engine.submit([5], SamplingParams(max_tokens=2), "late")

    run(main())


def test_stream_outputs_boundary(model):
    """The server reads only the output objects: events carry the choice index, counters and, on the finished
    event, the CompletionOutput; ``stream.outputs`` and ``stream.resolved`` hold the rest."""
    async def main():
        engine = AsyncEngine(model, max_batch_size=4)
        try:
            assert engine.tokenizer is model.tokenizer and engine.max_context == model.max_context
            assert engine.dllm is model.dllm
            stream = engine.submit(model.tokenizer("Hello there").input_ids,
                                   SamplingParams(max_tokens=6, temperature=0, logprobs=True), "out", n=2)
            return stream, await collect(stream)
        finally:
            engine.shutdown()

    stream, events = run(main())
    assert stream.n == 2 and stream.finished and all(o is not None for o in stream.outputs)
    assert {ev.request_id for ev in events} == {"out"} and {ev.index for ev in events} == {0, 1}
    assert stream.resolved.speculative is False and stream.resolved.temperature == 0.0
    for i in range(2):
        mine = [ev for ev in events if ev.index == i]
        assert [ev.output is not None for ev in mine] == [False] * (len(mine) - 1) + [True]
        out = mine[-1].output
        assert out is stream.outputs[i] and out.index == i and mine[-1].num_tokens == len(out.token_ids)
        assert len(out.logprobs) == len(out.token_ids) and out.steps == mine[-1].step + 1 or out.steps >= 1
        assert out.ended_by_eos == (out.finish_reason == "stop" and out.token_ids[-1] in model.dllm.eos_token_ids)
        assert [ev.num_tokens for ev in mine] == sorted(ev.num_tokens for ev in mine)


def test_limits_are_openai_ranges():
    from unmask.engine import limits

    assert limits.RANGES["temperature"] == limits.Range(0, 2)
    SamplingParams(temperature=2)
    with pytest.raises(ParamError, match=r"temperature: must be <= 2, got 2.5"):
        SamplingParams(temperature=2.5)
    with pytest.raises(ParamError, match="seed"):
        limits.check("seed", limits.MAX_SEED + 1)
    assert limits.MAX_STOP == 4 and "dual" in limits.CACHE_MODES and "margin" in limits.REMASKING_STRATEGIES
