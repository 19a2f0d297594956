"""The host work outside the denoising step (issue 42, ``benchmarks/bench_outside_step.py``) keeps its answers: the
stop rules' decode through a fast tokenizer's backend gives the tokenizer's text, and the admission fill that keeps
its counts as it joins admits exactly what recounting the batch per slot admitted."""
from __future__ import annotations

import dataclasses
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import tiny  # noqa: E402

from unmask.engine import SamplingParams  # noqa: E402
from unmask.engine.detokenize import _decodes_by_backend, decode  # noqa: E402
from unmask.engine.engine import Engine  # noqa: E402
from unmask.engine.limits import ParamError  # noqa: E402
from unmask.engine.scheduler import Scheduler  # noqa: E402


@pytest.fixture(scope="module")
def model():
    return tiny.loaded(attention="prefix_causal", block_size=4)


def _reference(tok, ids):
    return tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def test_decode_through_the_backend_is_the_tokenizers_text(model):
    """Random id lists, special ids (mask, EOS, padding) and byte pieces among them: the same text as
    ``tokenizer.decode`` (special tokens skipped, no clean-up), on the backend path."""
    tok = model.tokenizer
    assert _decodes_by_backend(tok)
    special = list(tok.all_special_ids) + [model.dllm.mask_token_id]
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.choice(special) if rng.random() < 0.2 else rng.randrange(len(tok))
               for _ in range(rng.randrange(1, 24))]
        assert decode(tok, ids) == _reference(tok, ids), ids
    assert decode(tok, []) == ""


def test_a_tokenizer_with_its_own_decode_is_asked_itself(model):
    """A subclass or an instance that replaces ``decode`` gets the call (the backend shortcut would skip it), and
    ids that are not a list go through ``decode`` too."""
    tok = model.tokenizer

    class Shouting(type(tok)):
        def decode(self, ids, **kw):
            return super().decode(ids, **kw).upper()

    sub = Shouting(tokenizer_object=tok.backend_tokenizer)
    assert not _decodes_by_backend(sub)
    assert decode(sub, [40, 41, 42]) == _reference(tok, [40, 41, 42]).upper()
    calls = []
    inst = type(tok)(tokenizer_object=tok.backend_tokenizer)
    inst.decode = lambda ids, **kw: calls.append(list(ids)) or "x"
    assert decode(inst, [40, 41]) == "x" and calls == [[40, 41]]
    assert decode(tok, (40, 41)) == _reference(tok, [40, 41])


def _recounting_admit(self: Scheduler) -> None:
    """``Scheduler._admit`` as it was written before issue 42's host work (the batch's counts and reservations
    recounted for every slot): the oracle of the incremental fill."""
    while self.waiting and len(self.running) < self.max_batch_size:
        held = self._counts(self.running)
        seq = min(self.waiting, key=lambda s: held[s.group])
        if not self._fits(seq, self.reserved_tokens()):
            return
        self._join(seq)
    self._share_with_starved()  # the second part, unchanged


def _scenario(model, seed: int) -> list:
    """Requests of random groups, sizes and arrival under a token budget; between admissions some running choices
    finish and leave (as after a step). Returns what the scheduler held after every admission."""
    rng = random.Random(seed)
    eng = Engine(model, max_batch_size=rng.choice([2, 3, 5]), max_cached_tokens=rng.choice([None, 40, 64, 96]),
                 enable_prefix_caching=False)
    sched = eng.scheduler
    history = []
    for wave in range(10):
        for k in range(rng.randrange(0, 4)):
            p = SamplingParams(max_tokens=rng.choice([4, 8, 12]), temperature=0)
            try:
                eng.add_request([5, 6 + k], p, f"r{wave}-{k}", n=rng.choice([1, 1, 2, 3]),
                                group=f"g{rng.randrange(4)}")
            except ParamError as exc:  # a request alone past the budget: refused the same on both sides
                history.append(exc.field)
        for seq in [s for s in sched.running if rng.random() < 0.4]:
            seq.finished = True
            seq.release()
            sched.running.remove(seq)
        sched._admit()
        history.append(([(s.request_id, s.index) for s in sched.running],
                        [(s.request_id, s.index) for s in sched.waiting],
                        sorted((s.request_id, s.index) for s in sched.paused), sched.preemptions))
    return history


@pytest.mark.parametrize("seed", range(12))
def test_the_incremental_fill_admits_what_recounting_admitted(model, seed, monkeypatch):
    """The fill keeps its per-group counts and reserved tokens as it joins (a batch filled in O(B), not O(B^2));
    across random groups, budgets, paused choices and departures it admits the same choices in the same order."""
    incremental = _scenario(model, seed)
    monkeypatch.setattr(Scheduler, "_admit", _recounting_admit)
    recounting = _scenario(model, seed)
    assert incremental == recounting
    assert any(isinstance(h, tuple) and h[0] for h in incremental)


def test_an_llms_calls_share_one_reading_of_the_available_memory(model, monkeypatch):
    """``LLM`` builds an engine per call; its calls share the memory reading, so a call right after another does
    not read it again (the burst rule of ``Scheduler.check_memory``), one after the reading aged does, and another
    engine keeps its own."""
    import types

    import psutil

    from unmask.engine import LLM
    from unmask.engine import scheduler as sched

    reads, now = [], [500.0]
    monkeypatch.setattr(psutil, "virtual_memory", lambda: reads.append(1) or types.SimpleNamespace(available=1 << 40))
    monkeypatch.setattr(sched.time, "monotonic", lambda: now[0])
    llm = LLM(model, max_batch_size=2)
    p = SamplingParams(max_tokens=4, temperature=0)
    first = llm.generate([[5, 6, 7], [5, 8]], p)
    assert len(reads) == 1
    assert [o.outputs[0].token_ids for o in llm.generate([[5, 6, 7], [5, 8]], p)] == \
        [o.outputs[0].token_ids for o in first]
    assert len(reads) == 1  # the second call reused the first call's reading
    now[0] += sched.FREE_MEMORY_REUSE_S
    llm.generate([5, 6, 7], p)
    assert len(reads) == 2  # aged: read again
    Engine(model).add_request([5, 6], p, "other")
    assert len(reads) == 3  # another engine: its own reading


def test_a_call_takes_the_engine_a_finished_call_left_idle_and_never_one_in_use(model):
    """``generate`` after ``generate`` runs on the first call's idle engine (no engine built per call) and decodes
    what a fresh engine decodes; a call still running, or abandoned midway, keeps its engine to itself."""
    from unmask.engine import LLM

    llm = LLM(model, max_batch_size=2)
    p = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = [[5, 6, 7], [5, 8], [9, 9, 4]]
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, p)]
    idle = llm._idle[2]
    assert not idle.has_unfinished()
    again = [o.outputs[0].token_ids for o in llm.generate(prompts, p)]
    assert again == first and llm._idle[2] is idle
    fresh = LLM(model, max_batch_size=2)._engine(2)
    assert fresh is not idle
    running = llm.generate_iter(((q, p) for q in prompts))
    next(running)  # holds the idle engine now, with choices left
    assert 2 not in llm._idle
    other = [o.outputs[0].token_ids for o in llm.generate(prompts, p)]  # a fresh engine beside it
    assert other == first and llm._idle[2] is not idle
    running.close()  # abandoned midway: its engine, holding choices, is never handed out again
    assert all(not e.has_unfinished() for e in llm._idle.values())


def _plans(monkeypatch, llm):
    """Every plan the engines of ``llm`` build, in order."""
    seen = []
    add = Engine.add_request

    def recording(self, *args, **kwargs):
        reqs = add(self, *args, **kwargs)
        seen.extend(r.plan for r in reqs)
        return reqs

    monkeypatch.setattr(Engine, "add_request", recording)
    return seen


def _unseeded(plan):
    return dataclasses.replace(plan, seed=0, params=dataclasses.replace(plan.params, seed=0))


@pytest.mark.parametrize("kw", [dict(temperature=0), dict(temperature=0.7), dict(temperature=0.7, seed=11),
                                dict(temperature=0.7, seed=11, n=2), dict(temperature=0.7, n=3)])
def test_generate_resolves_its_shared_parameters_once_and_each_prompt_gets_what_resolving_gives(model, monkeypatch,
                                                                                              kw):
    """``generate``'s prompts share one ``SamplingParams``: it is resolved once; every request's plan equals the one
    ``plan_request`` gives it (the seed apart), a seed the request set is every prompt's, and a request that sets none
    draws its own per prompt."""
    import unmask.engine.engine as eng_mod
    from unmask.engine import LLM
    from unmask.engine.engine import plan_request

    kw = dict(kw)
    n = kw.pop("n", 1)
    llm = LLM(model, max_batch_size=4)
    p = SamplingParams(max_tokens=6, **kw)
    resolved = []
    monkeypatch.setattr(eng_mod, "plan_request", lambda *a: resolved.append(1) or plan_request(*a))
    plans = _plans(monkeypatch, llm)
    outs = llm.generate([[5, 6, 7], [5, 8], [9, 4, 4], [7]], p, n=n)
    assert len(resolved) == 1 and len(plans) == 4 * n
    fresh = plan_request(model, p, llm._idle[4].defaults)
    assert all(_unseeded(q) == _unseeded(fresh.for_choice(i % n)) for i, q in enumerate(plans))
    assert all(q.seed == q.params.seed for q in plans)
    assert [q.seed - plans[k - k % n].seed for k, q in enumerate(plans)] == [k % n for k in range(4 * n)]
    firsts = [q.seed for q in plans[::n]]
    if p.seed is not None:
        assert set(firsts) == {p.seed}
        alone = [[c.token_ids for c in llm.generate([q], p, n=n)[0].outputs] for q in ([5, 6, 7], [5, 8], [9, 4, 4],
                                                                                       [7])]
        assert alone == [[c.token_ids for c in o.outputs] for o in outs]
    else:
        assert len(set(firsts)) == 4


def test_generate_iter_resolves_each_request_its_parameters_may_change_between_them(model):
    """``generate_iter`` reads a caller's iterable, which may change a ``SamplingParams`` between two requests: each
    request is resolved as it comes."""
    from unmask.engine import LLM

    llm = LLM(model, max_batch_size=2)
    p = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)

    def requests():
        yield [5, 6, 7], p
        p.max_tokens = 3
        yield [5, 6, 7], p

    outs = dict(llm.generate_iter(requests()))
    assert [len(outs[i].outputs[0].token_ids) for i in (0, 1)] == [6, 3]
