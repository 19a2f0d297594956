"""The plain table step (engine/plain_batch.py, issue 42): cache-less plain sequences stepped as one table give the
events the general path gives (tokens, log-probabilities, reveal order, canvases, text, finish), alone or beside
requests of other kinds, with requests joining, finishing and aborting at different steps; its host reads stay at
one per batch step."""
import pickle
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import decoding_paths as dp  # noqa: E402
import tiny  # noqa: E402

from unmask.engine import LLM, SamplingParams  # noqa: E402
from unmask.engine.denoiser import Denoiser  # noqa: E402
from unmask.engine.plain_batch import table_ready  # noqa: E402

#: table-ready requests of every kind the table step serves (cache "none" is set by the runner)
READY = [
    dict(temperature=0, block_size=4),
    dict(temperature=0, block_size=4, threshold=0.3, logprobs=True),
    dict(temperature=0.9, seed=5, block_size=4, steps=6),
    dict(temperature=0.7, seed=6, block_size=8, threshold=0.6, max_tokens=7),
    dict(temperature=0, block_size=8, sub_block_size=4, max_tokens=9),
    dict(temperature=0, block_size=4, stop=["a"], max_tokens=12, prompt=1),
    dict(temperature=0, block_size=4, ignore_eos=False, max_tokens=12, prompt=2),
]
#: requests that take the general path beside them
OTHERS = [
    dict(temperature=0, block_size=4, top_k=20),
    dict(temperature=0, block_size=4, logit_bias={5: 5.0}, min_tokens=3),
    dict(temperature=0, block_size=4, remasking="margin"),
    dict(temperature=0, block_size=4, logprobs=True, top_logprobs=2),
]


def _count_table_steps(monkeypatch) -> list[int]:
    """From now on, the size of every table step (``unmask.engine.plain_batch.table_step``) the denoiser runs."""
    from unmask.engine import plain_batch

    calls, real = [], plain_batch.table_step
    monkeypatch.setattr("unmask.engine.denoiser.table_step",
                        lambda d, seqs, groups: calls.append(len(seqs)) or real(d, seqs, groups))
    return calls


def _run(llm: LLM, requests: list[dict], table: bool, join_every: int = 0, abort_at: int | None = None,
         cache: str = "none") -> list:
    """Every request's events as comparable tuples (every field but wall times), decoded together by a fresh engine
    over ``llm``'s model with the table step on or off; request i joins at step ``i * join_every``; request 0 is
    aborted at step ``abort_at``."""
    engine = LLM(llm.model)._engine(16)
    engine.denoiser.table_steps = table
    tok = llm.tokenizer
    pending = list(enumerate(requests))
    ids, events, step = {}, [[] for _ in requests], 0
    while pending or engine.has_unfinished():
        while pending and pending[0][0] * join_every <= step:
            i, kw = pending.pop(0)
            kw = dict(kw)
            prompt = dp.PROMPTS[kw.pop("prompt", i) % len(dp.PROMPTS)]
            flat = dict({"speculative": False, "cache": cache, "ignore_eos": True, "max_tokens": 10}, **kw)
            for r in engine.add_request(tok(prompt).input_ids, SamplingParams.from_flat(**flat), f"r{i}"):
                ids[r.request_id] = i
        out = engine.abort("r0") if step == abort_at else []
        for ev in out + engine.step():
            o = ev.output
            done = None if o is None else (o.text, o.token_ids, o.finish_reason, o.logprobs, o.steps, o.nfe,
                                           o.steps_per_block, o.top_logprobs)
            events[ids[ev.request_id]].append((ev.block, ev.step, ev.nfe, pickle.dumps(ev.revealed), ev.canvas,
                                               ev.text, ev.finished, ev.finish_reason, ev.num_tokens, done))
        step += 1
    return events


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return dp.write_checkpoints(tmp_path_factory.mktemp("paths"))


#: the models the table step is checked on: in memory (transformers' SDPA over padded caches), loaded from disk
#: (attention per lane over the KV pool), int8 (row-invariant attention, prompt rows in tiles) and block-causal
#: with absolute block alignment (the prompt's tail in the first block)
MODELS = ["causal", "bidirectional", "bidirectional-lanes", "bidirectional-int8", "block_causal-int8"]


def _model(name: str, checkpoints):
    from unmask.engine.model import load_model

    if name == "causal":
        return tiny.loaded(attention="prefix_causal", block_size=4, initializer_range=0.5)
    if name == "bidirectional":
        return tiny.loaded(attention="bidirectional", logit_shift=False, block_size=4, initializer_range=0.5)
    kind, _, weights = name.partition("-")
    return load_model(checkpoints[kind], weights="native" if weights == "lanes" else weights)


@pytest.fixture(scope="module", params=MODELS)
def llm(request, checkpoints):
    return LLM(_model(request.param, checkpoints), max_batch_size=16)


def _ready_one(llm, kw: dict) -> dict:
    """``kw`` in the model's block size when it decodes with its own only."""
    if not llm.model.dllm.fixed_block_size:
        return kw
    return {k: v for k, v in kw.items() if k not in ("block_size", "sub_block_size")}


def _ready(llm) -> list[dict]:
    """:data:`READY` in the model's block size (:func:`_ready_one`)."""
    return [_ready_one(llm, kw) for kw in READY]


@pytest.mark.parametrize("join_every, abort_at", [(0, None), (2, 5)])
def test_table_steps_equal_the_general_path(llm, join_every, abort_at, monkeypatch):
    """Table-ready requests (greedy, sampled, quota, threshold, windows, stop strings, EOS, logprobs, prompts of
    other lengths), joining every ``join_every`` steps (other blocks, other widths: forwards split by width) and one
    aborted mid-way: every event equals the general path's, bit for bit (the same forwards)."""
    reqs = _ready(llm)
    general = _run(llm, reqs, False, join_every, abort_at)
    calls = _count_table_steps(monkeypatch)
    assert _run(llm, reqs, True, join_every, abort_at) == general
    assert max(calls) >= 2  # the requests stepped together as tables


@pytest.mark.parametrize("name", ["bidirectional", "bidirectional-lanes", "bidirectional-int8"])
@pytest.mark.parametrize("join_every, abort_at", [(0, None), (3, 4)])
def test_prefix_cache_table_steps_equal_the_general_path(name, join_every, abort_at, checkpoints, monkeypatch):
    """Fast-dLLM's prefix cache on a bidirectional model (a block's first step refills the lane's cache and commits
    the prefix, later steps forward ``[a, L)`` over it): table steps = the general path's events, with requests at
    other blocks (refills beside cached steps) and an abort; every step is a table step."""
    llm = LLM(_model(name, checkpoints))
    general = _run(llm, READY, False, join_every, abort_at, cache="prefix")
    calls = _count_table_steps(monkeypatch)
    assert _run(llm, READY, True, join_every, abort_at, cache="prefix") == general
    assert calls


def test_a_step_with_any_other_request_takes_the_general_path(llm, monkeypatch):
    """One forward per step for a mixed batch: a step with a request of another kind steps every sequence through
    the general path (the same events with the table step on or off), and the table step runs only in the steps
    after the others finished."""
    calls = _count_table_steps(monkeypatch)
    reqs = _ready(llm) + [dict(kw, max_tokens=4) for kw in OTHERS]
    assert _run(llm, reqs, True) == _run(llm, reqs, False)
    assert calls and max(calls) <= len(reqs) - len(OTHERS)


def test_a_finished_request_keeps_its_canvas_when_the_table_is_rebuilt(llm):
    """Requests finishing at different steps leave the table (rebuilt without them): the finished ones' outputs,
    log-probabilities included, equal the general path's; their tokens equal a lone decode's (float32 batch
    invariance is within tolerance, docs/design.md#exactness-contracts-by-device-and-dtype)."""
    reqs = [dict(temperature=0, block_size=4, max_tokens=m, logprobs=True, prompt=i) for i, m in enumerate((4, 8, 12))]
    together = _run(llm, reqs, True)
    assert together == _run(llm, reqs, False)
    for i, req in enumerate(reqs):
        assert _run(llm, [req], True)[0][-1][-1][:2] == together[i][-1][-1][:2]  # text, token ids


def test_which_requests_step_as_a_table(llm):
    """Only plain cache-less one-lane requests without per-row sampling extras are table-ready."""
    engine = LLM(llm.model)._engine(4)
    ids = llm.tokenizer(dp.PROMPTS[0]).input_ids
    vocab = llm.model.vocab_size

    def ready(**kw):
        flat = _ready_one(llm, dict({"speculative": False, "cache": "none", "max_tokens": 8, "block_size": 4}, **kw))
        return table_ready(engine.add_request(ids, SamplingParams.from_flat(**flat), f"q{len(kw)}{kw}")[0], vocab)

    assert ready() and ready(temperature=0.8, seed=1) and ready(threshold=0.5) and ready(logprobs=True)
    assert ready(top_k=vocab)  # a top-k of the whole vocabulary filters nothing
    for kw in (dict(top_k=5), dict(top_p=0.9), dict(min_tokens=2), dict(logit_bias={5: 1.0}),
               dict(presence_penalty=0.5), dict(repetition_penalty=1.1), dict(remasking="random"),
               dict(logprobs=True, top_logprobs=1), dict(cfg_scale=1.0)):
        assert not ready(**kw), kw
    # Fast-dLLM's prefix cache: on a bidirectional model without the logit shift (a causal model's is exact)
    assert ready(cache="prefix") == (llm.model.dllm.attention == "bidirectional")


@pytest.mark.parametrize("name", ["quota", "threshold"])
def test_a_table_step_reads_the_host_once_under_fake_cuda(name, checkpoints, monkeypatch):
    """Under fake CUDA a step of 8 table-ready requests (greedy and sampled) reads the host once, with no value
    read, data-dependent shape, boolean-mask index or blocking copy outside the forward."""
    from device_tags import fake_cuda
    from sync_counter import SyncCounter

    from unmask.engine.model import LoadedModel, load_model

    calls = _count_table_steps(monkeypatch)
    path = next(p for p in dp.PATHS if p.name == name)
    with fake_cuda(monkeypatch):
        llm = LLM(load_model(checkpoints[path.checkpoint], device="cuda", dtype="float32"), max_batch_size=8)
        assert llm.denoiser.table_steps and not Denoiser(llm.model, cuda_graphs=True).table_steps  # graphs: general
        engine = llm._engine(8)
        ids = llm.tokenizer(dp.PROMPTS[0]).input_ids
        for i in range(8):
            flat = dict(path.params, cache="none", max_tokens=8, ignore_eos=True, temperature=0.7 * (i % 2), seed=i)
            engine.add_request(ids, SamplingParams.from_flat(**flat), f"s{i}")
        with SyncCounter("cuda") as c, c.forward_methods(LoadedModel, ("hidden_states", "logits")), \
                c.step_method(Denoiser, "step"):
            while engine.has_unfinished():
                engine.step()
    assert len(c.steps) >= 2 and len(calls) == len(c.steps) and calls[0] == 8  # every step a table step
    for s in c.steps:
        outside = {k: v - s["forward_syncs"].get(k, 0) for k, v in s["syncs"].items()}
        assert outside.get("host read", 0) <= 1 and set(outside) <= {"host read"}, s


def test_one_request_after_another_each_gets_its_own_table(llm):
    """Requests decoded one after another on one denoiser (a new sequence may take a finished one's id()): each
    finishes in its steps with the general path's tokens (a table matched by id() left a new sequence's canvas
    outside the table: it never finished)."""
    denoiser = llm.denoiser
    ids = llm.tokenizer(dp.PROMPTS[1]).input_ids
    outs = []
    for table in (True, False) * 6:
        denoiser.table_steps = table
        engine = llm._engine(1)
        engine.add_request(ids, SamplingParams.from_flat(**_ready_one(llm, dict(
            speculative=False, cache="none", max_tokens=6, block_size=3, temperature=0, ignore_eos=True))), "one")
        for _ in range(50):
            done = [ev for ev in engine.step() if ev.finished]
            if done:
                outs.append(done[0].output.token_ids)
                break
        else:
            raise AssertionError("the request never finished")
    denoiser.table_steps = True
    assert all(o == outs[1] for o in outs)


def test_a_table_holds_only_its_members_in_order_with_their_views(llm):
    """``PlainTable.holds``: the same objects in the same order whose canvases are still the table's views (a new
    sequence is never matched by identity numbers, nor one whose canvas was replaced)."""
    from unmask.engine.plain_batch import PlainTable

    engine = LLM(llm.model)._engine(4)
    ids = llm.tokenizer(dp.PROMPTS[0]).input_ids
    p = SamplingParams.from_flat(**_ready_one(llm, dict(speculative=False, cache="none", max_tokens=4, block_size=4,
                                                        temperature=0)))
    a, b, c = (engine.add_request(ids, p, f"m{i}")[0] for i in range(3))
    before = a.canvas.clone()
    table = PlainTable([a, b])
    assert torch.equal(a.canvas, before) and a.canvas.data_ptr() == table.canvas.data_ptr()
    assert table.holds([a, b]) and not table.holds([b, a]) and not table.holds([a]) and not table.holds([a, c])
    a.canvas = a.canvas.clone()
    assert not table.holds([a, b])


@pytest.mark.parametrize("table", [True, False])
def test_a_final_only_choice_emits_only_its_final_event(llm, table):
    """``Request.final_only`` (``LLM.generate``'s choices): plain steps that do not finish a choice emit no event,
    through the table step and the general path (a top-k request beside), and the final events (outputs, tokens,
    log-probabilities, text) equal those of choices that emit every step."""
    reqs = [_ready_one(llm, kw) for kw in (READY[0], READY[1], READY[3], OTHERS[0])]

    def run(final_only: bool):
        engine = LLM(llm.model)._engine(8)
        engine.denoiser.table_steps = table
        tok = llm.tokenizer
        for i, kw in enumerate(reqs):
            flat = dict({"speculative": False, "cache": "none", "ignore_eos": True, "max_tokens": 10}, **kw)
            for r in engine.add_request(tok(dp.PROMPTS[i % len(dp.PROMPTS)]).input_ids,
                                        SamplingParams.from_flat(**flat), f"f{i}"):
                r.final_only = final_only
        events = []
        while engine.has_unfinished():
            events += engine.step()
        return events

    every, final = run(False), run(True)
    assert all(ev.finished for ev in final) and len(final) == len(reqs) < len(every)
    done = {ev.request_id: ev.output for ev in every if ev.finished}
    for ev in final:
        o, e = ev.output, done[ev.request_id]
        assert (o.token_ids, o.logprobs, o.text, o.steps, o.nfe) == (e.token_ids, e.logprobs, e.text, e.steps, e.nfe)


def test_generate_reads_final_events_only(llm, monkeypatch):
    """``LLM.generate`` marks its choices ``final_only`` and returns what ``LLM.stream`` (every event) ends with."""
    from unmask.engine.engine import Engine

    made, add = [], Engine.add_request
    monkeypatch.setattr(Engine, "add_request", lambda self, *a, **k: made.extend(add(self, *a, **k)) or made[-1:])
    p = SamplingParams.from_flat(**_ready_one(llm, dict(speculative=False, cache="none", max_tokens=8,
                                                        block_size=4, temperature=0, ignore_eos=True)))
    out = llm.generate([dp.PROMPTS[0]], p)[0].outputs[0]
    assert made and all(r.final_only for r in made)
    monkeypatch.undo()
    last = list(llm.stream(dp.PROMPTS[0], p))[-1].output
    assert (out.token_ids, out.text, out.steps) == (last.token_ids, last.text, last.steps)
