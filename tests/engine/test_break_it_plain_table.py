"""Break-it tests of the plain table step (engine/plain_batch.py, docs/design.md#decoding "The plain table step"):
every event (tokens, log-probabilities, reveal order, canvas views, text, finish), every finished output and every
sequence's final canvas and log-probabilities equal the general path's (``Denoiser.table_steps = False``), for
batches mixing what the table step serves (canvas lengths, choices, infilling, fixed positions, windows, stop rules,
temperatures, thresholds, absolute alignment, low-bit weights, the prefix cache), with requests joining, aborting and
being written to between steps; its memo stays bounded; the APIs and the server's SSE bytes do not change."""
import dataclasses
import gc
import pickle
import re
import sys
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tiny  # noqa: E402

from unmask.engine import LLM, SamplingParams  # noqa: E402
from unmask.engine.denoiser import Denoiser  # noqa: E402

PROMPTS = ("Hello world the quick brown", "the quick brown fox jumps", "Hello world", "a",
           "def add(a, b): return a + b and more words here")


@pytest.fixture(scope="module")
def models():
    """In-memory tiny models: bidirectional (the table step's own case) and prefix-causal (logit shift)."""
    return {"bidirectional": tiny.loaded(attention="bidirectional", logit_shift=False, block_size=4,
                                         initializer_range=0.5),
            "causal": tiny.loaded(attention="prefix_causal", block_size=4, initializer_range=0.5)}


def _count_table_steps(monkeypatch) -> list[int]:
    """From now on, the size of every table step the denoiser runs."""
    from unmask.engine import plain_batch

    calls, real = [], plain_batch.table_step
    monkeypatch.setattr("unmask.engine.denoiser.table_step",
                        lambda d, seqs, groups: calls.append(len(seqs)) or real(d, seqs, groups))
    return calls


def _run(model, reqs: list[dict], table: bool, actions: dict | None = None, cache: str = "none",
         max_batch: int = 16, **engine_options) -> tuple[dict, dict]:
    """Decode ``reqs`` (each: ``SamplingParams.from_flat`` keywords plus ``prompt``, ``n`` and ``join``, the step it
    joins at) on a fresh engine with the table step on or off (``engine_options``: an ``Engine`` of its own with
    them, else ``LLM._engine``'s); ``actions[step](engine, seqs)`` runs before that step (its events, e.g. an
    abort's, are recorded). Returns every choice's events as comparable tuples (every field but wall times) and
    every choice's final canvas, log-probabilities and output."""
    from unmask.engine.engine import Engine

    engine = (Engine(model, max_batch_size=max_batch, **engine_options) if engine_options
              else LLM(model)._engine(max_batch))
    engine.denoiser.table_steps = table
    tok = model.tokenizer
    pending = sorted(enumerate(reqs), key=lambda x: x[1].get("join", 0))
    events, seqs, step = {}, {}, 0
    while pending or engine.has_unfinished():
        while pending and pending[0][1].get("join", 0) <= step:
            i, kw = pending.pop(0)
            kw = dict(kw)
            kw.pop("join", None)
            prompt, n = kw.pop("prompt", PROMPTS[i % len(PROMPTS)]), kw.pop("n", 1)
            flat = dict({"speculative": False, "cache": cache, "ignore_eos": True, "max_tokens": 10}, **kw)
            for r in engine.add_request(tok(prompt).input_ids, SamplingParams.from_flat(**flat), f"r{i}", n=n):
                seqs[(r.request_id, r.index)] = r
        out = (actions or {}).get(step, lambda e, s: [])(engine, seqs) or []
        for ev in out + engine.step():
            o = ev.output
            done = None if o is None else (o.text, o.token_ids, o.finish_reason, o.logprobs, o.steps, o.nfe,
                                           o.steps_per_block, o.top_logprobs, o.ended_by_eos, o.cached_tokens)
            events.setdefault((ev.request_id, ev.index), []).append(
                (ev.block, ev.step, ev.nfe, pickle.dumps(ev.revealed), ev.canvas, ev.text, ev.finished,
                 ev.finish_reason, ev.num_tokens, done))
        step += 1
        assert step < 400, "the requests never finished"
    engine.denoiser.table_steps = True
    final = {k: (s.canvas.tolist(), s.logprobs.tolist(),
                 dataclasses.replace(s.completion(), first_token_time=None, finish_time=None))  # not wall times
             for k, s in seqs.items()}
    return events, final


def _same(model, reqs: list[dict], monkeypatch, **kw) -> list[int]:
    """Assert that ``reqs`` decode to the same events and final state with the table step off and on; returns the
    sizes of the table steps run."""
    general = _run(model, reqs, False, **kw)
    calls = _count_table_steps(monkeypatch)
    table = _run(model, reqs, True, **kw)
    for key, evs in general[0].items():  # pickled: bit for bit, a NaN equal to itself
        assert pickle.dumps(table[0].get(key)) == pickle.dumps(evs), key
    assert pickle.dumps(table) == pickle.dumps(general)
    return calls


# ------------------------------------------------------------------ writes to a sequence's state between steps

def _first_masked(seq) -> int:
    return int((seq.canvas == seq.dllm.mask_token_id).nonzero()[0, 0])


def _write_one(engine, seqs):
    """A caller writes one token into a masked position of r1's canvas (outside inference mode)."""
    s = seqs[("r1", 0)]
    s.canvas[_first_masked(s)] = 42


def _fill_window(engine, seqs):
    """A caller fills r1's whole active window: r1's next step has no masked position in it."""
    s = seqs[("r1", 0)]
    _, a, e = s.windows[s.win_idx]
    s.canvas[a:e] = 43


def _fill_every_window(engine, seqs):
    """Every running sequence's window filled: a step in which no row has a masked position."""
    for s in seqs.values():
        if not s.finished:
            _, a, e = s.windows[s.win_idx]
            s.canvas[a:e] = 44


def _rebind_canvas(engine, seqs):
    """r1's canvas replaced by a copy (then written): the table must not keep writing the old one."""
    s = seqs[("r1", 0)]
    s.canvas = s.canvas.clone()
    s.canvas[_first_masked(s)] = 42


def _rebind_logprobs(engine, seqs):
    """r1's log-probabilities replaced by a copy: the table must not keep writing the old one."""
    s = seqs[("r1", 0)]
    s.logprobs = s.logprobs.clone()


WRITES = {"write-one": _write_one, "fill-window": _fill_window, "fill-every-window": _fill_every_window,
          "rebind-canvas": _rebind_canvas, "rebind-logprobs": _rebind_logprobs}


@pytest.mark.parametrize("name", list(WRITES))
@pytest.mark.parametrize("model", ["bidirectional", "causal"])
def test_writes_to_a_sequence_between_steps(models, model, name, monkeypatch):
    """A caller writing into a running sequence's canvas (in place, outside inference mode, as a test or a replay
    does), replacing its canvas or its log-probabilities between two table steps: the later steps and the outputs
    equal the general path's (the table's tensors were inference tensors: an in-place write after a table step
    raised "Inplace update to inference tensor outside InferenceMode"; a replaced ``logprobs`` kept the table
    writing the old tensor, and the output's log-probabilities read zeros)."""
    reqs = [dict(prompt=PROMPTS[i], max_tokens=m, temperature=0, block_size=4, logprobs=True)
            for i, m in enumerate((6, 9, 12))] + [dict(prompt=PROMPTS[3], join=3, max_tokens=5, temperature=0)]
    calls = _same(models[model], reqs, monkeypatch, actions={2: WRITES[name]})
    assert max(calls) >= 3


# ------------------------------------------------------------------ batches of every kind the table step serves

def _mixed(model_name: str) -> list[dict]:
    """One batch of table-ready requests of every kind: canvases of other lengths (padded rows), two choices,
    infilling and fixed positions (a whole block fixed: skipped), sub-block windows, fewer steps than blocks,
    ``max_tokens`` of 1 and not a multiple of the block, EOS mid-block, stop strings and stop ids, logprobs,
    temperatures below the argmax cutoff and at the top of the range, thresholds 0 and 1, the largest seed (its
    second choice's wraps to 0), late joins (beyond 16 rows: waiting for a slot)."""
    bidirectional = model_name == "bidirectional"
    reqs = [
        dict(prompt=PROMPTS[0], max_tokens=7, temperature=0, block_size=4),
        dict(prompt=PROMPTS[4], n=2, temperature=0.8, seed=3, max_tokens=6, block_size=2, logprobs=True),
        dict(prompt=PROMPTS[3], block_size=8, sub_block_size=3, max_tokens=11, temperature=0, steps=5),
        dict(prompt=PROMPTS[2], block_size=2, max_tokens=10, steps=2, temperature=0.6, seed=8),
        dict(prompt=PROMPTS[1], ignore_eos=False, max_tokens=24, temperature=1.5, seed=1, block_size=4),
        dict(prompt=PROMPTS[2], stop=["e"], max_tokens=16, temperature=1.0, seed=0, block_size=4, join=1),
        dict(prompt=PROMPTS[0], stop_token_ids=list(range(100, 300)), max_tokens=16, temperature=1.0, seed=9,
             block_size=4, join=2),
        dict(prompt=PROMPTS[1], temperature=1e-9, seed=4, max_tokens=5, block_size=4, logprobs=True),
        dict(prompt=PROMPTS[3], temperature=2.0, seed=4, max_tokens=6, block_size=4, join=3),
        dict(prompt=PROMPTS[4], threshold=0.0, temperature=0, max_tokens=9, block_size=4, join=3),
        dict(prompt=PROMPTS[0], threshold=1.0, temperature=0.7, seed=2, max_tokens=9, block_size=4, join=5),
        dict(prompt=PROMPTS[2], max_tokens=1, temperature=0, block_size=4, join=6),
        dict(prompt=PROMPTS[1], n=2, seed=2**63 - 1, temperature=1.0, max_tokens=5, block_size=4, join=1),
    ]
    if bidirectional:
        reqs += [dict(prompt=PROMPTS[1], suffix=" fox jumps", max_tokens=8, temperature=0, block_size=4, join=2),
                 dict(prompt=PROMPTS[3], constraints={0: 5, 4: 8, 5: 9, 6: 10, 7: 11}, max_tokens=10,
                      temperature=0.5, seed=1, block_size=4, logprobs=True)]
    return reqs


@pytest.mark.parametrize("overhead", [None, 6])
@pytest.mark.parametrize("model, cache", [("bidirectional", "none"), ("bidirectional", "prefix"), ("causal", "none")])
def test_a_batch_of_every_table_ready_kind(models, model, cache, overhead, monkeypatch):
    """Every table-ready kind in one batch of up to 16 rows, joining at different steps, cache-less or under
    Fast-dLLM's prefix cache, in one forward or (a forward's overhead of 6 rows, as a large model's cost model
    splits a batch; the tiny models' never do) in several forwards by width, whose logits the table step puts back
    in row order: the same events, outputs and final canvases as the general path; the batch stepped as tables,
    and the stop rules fired (an EOS mid-block, a stop string or id, the length)."""
    groups = []

    def forwards(engine, seqs):
        if overhead is not None:
            engine.denoiser.forward_overhead_rows = overhead
        real = engine.denoiser.step
        engine.denoiser.step = lambda s: groups.append(plan_sizes(engine.denoiser, s)) or real(s)

    def plan_sizes(denoiser, seqs):
        from unmask.engine.denoiser import plan_forwards
        from unmask.engine.plain_batch import forward_rows

        widths = [hi - lo for lo, hi, _, _ in map(forward_rows, seqs)]
        return len(plan_forwards(widths, [1] * len(seqs), denoiser.forward_overhead_rows))

    calls = _same(models[model], _mixed(model), monkeypatch, cache=cache, actions={0: forwards})
    assert max(calls) >= 10
    assert (max(groups) >= 3) == (overhead is not None)  # the steps of several forwards, or of one
    if overhead is None:
        outs = [evs[-1][-1] for evs in _run(models[model], _mixed(model), True, cache=cache)[0].values()]
        assert {o[2] for o in outs} == {"stop", "length"} and any(o[8] for o in outs)  # ended_by_eos


@pytest.fixture(scope="module")
def absolute(tmp_path_factory):
    """A bidirectional checkpoint with absolute block alignment (a block may start inside the prompt), written to
    disk: loaded natively (attention per lane over the KV pool) and as int4 (row-invariant, prompt rows in tiles)."""
    from unmask.engine.checkpoint import write_checkpoint
    from unmask.engine.model import load_model

    m = tiny.loaded(attention="bidirectional", logit_shift=False, block_size=4, initializer_range=0.5,
                    block_alignment="absolute")
    path = write_checkpoint(tmp_path_factory.mktemp("absolute") / "bi", m.model, m.tokenizer, m.dllm)
    return {(w, d): load_model(path, weights=w, dtype=d) for w, d in LOADS} | {"path": path}


#: (weights, dtype) of the loads: lane attention in float32 and bfloat16, fbgemm fp16 weights, int4 with prompt tiles
LOADS = [("native", "float32"), ("native", "bfloat16"), ("auto", "float32"), ("int4", "float32")]


@pytest.mark.parametrize("cache", ["none", "prefix"])
@pytest.mark.parametrize("weights, dtype", LOADS)
def test_absolute_alignment_low_bit_and_the_prefix_cache(absolute, weights, dtype, cache, monkeypatch):
    """Blocks starting inside the prompt (absolute alignment: Fast-dLLM's prefix cache commits part of the prompt,
    later steps forward the prompt's tail again), on lane attention (float32, bfloat16), packed fp16 and int4
    weights with prompt tiles, requests at different blocks (refills beside cached steps) and one aborted: the
    general path's events."""
    model = absolute[(weights, dtype)]
    assert model.tiles_prompt_rows == (weights == "int4") and model.lane_attention == (weights != "int4")
    reqs = [dict(prompt=PROMPTS[0], max_tokens=9, temperature=0, block_size=4, logprobs=True),
            dict(prompt=PROMPTS[2], max_tokens=7, temperature=0.7, seed=1, join=2, block_size=4, logprobs=True),
            dict(prompt=PROMPTS[4], max_tokens=11, threshold=0.5, temperature=0, join=3, block_size=4),
            dict(prompt=PROMPTS[3], max_tokens=5, temperature=0, join=5, block_size=2, suffix=" the"),
            dict(prompt=PROMPTS[1], max_tokens=8, block_size=8, sub_block_size=2, temperature=0, join=1)]
    calls = _same(model, reqs, monkeypatch, cache=cache, actions={4: lambda e, s: e.abort("r1")})
    assert max(calls) >= 4


def test_an_abort_then_new_requests(models, monkeypatch):
    """A request aborted between two table steps, then new requests joining (the table rebuilt without it, then
    with them): its partial output and log-probabilities, and its canvas, stay as they were at the abort; the
    others' events equal the general path's."""
    reqs = [dict(prompt=PROMPTS[0], max_tokens=12, temperature=0, block_size=4, logprobs=True),
            dict(prompt=PROMPTS[1], max_tokens=8, temperature=0.9, seed=5, block_size=4, logprobs=True),
            dict(prompt=PROMPTS[2], max_tokens=6, temperature=0, block_size=2, join=4),
            dict(prompt=PROMPTS[4], max_tokens=6, temperature=0, block_size=4, join=4, logprobs=True)]
    snapshot = {}

    def abort(engine, seqs):
        out = engine.abort("r0")
        seq = seqs[("r0", 0)]
        snapshot["r0"] = (seq.canvas.tolist(), seq.logprobs.tolist())
        return out

    _same(models["bidirectional"], reqs, monkeypatch, actions={3: abort})
    events, final = _run(models["bidirectional"], reqs, True, actions={3: abort})
    aborted = events[("r0", 0)][-1][-1]
    assert aborted[2] == "abort" and aborted[1] and len(aborted[3]) == len(aborted[1])  # a partial output, logprobs
    assert final[("r0", 0)][:2] == snapshot["r0"]  # nothing wrote its canvas or log-probabilities afterwards
    assert aborted[3] == snapshot["r0"][1][:len(aborted[1])]


def test_steps_of_part_of_the_batch_and_preemption(models, monkeypatch):
    """A step cost limit (``max_step_rows``: each step runs only some of the running sequences, so the table's
    members change every step) and preemption (a request of another group pauses a sequence, which resumes later
    with its canvas): the general path's events."""
    reqs = [dict(prompt=PROMPTS[0], n=3, max_tokens=8, temperature=0.5, seed=2, block_size=4, logprobs=True),
            dict(prompt=PROMPTS[1], max_tokens=6, temperature=0, block_size=4, join=2),
            dict(prompt=PROMPTS[4], max_tokens=5, temperature=0, block_size=2, join=3)]
    engines = []
    keep = {0: lambda engine, seqs: engines.append(engine)}
    for batch, rows in ((5, 18), (3, None)):  # 3 x 6 + 6 + 4 row-equivalents > 18: parts of the batch step
        calls = _same(models["bidirectional"], reqs, monkeypatch, actions=keep, max_batch=batch, max_step_rows=rows)
        assert calls and max(calls) == 3
    assert [e.scheduler.preemptions for e in engines] == [0, 0, 2, 2]


# ------------------------------------------------------------------ memory

def test_the_geometry_memo_and_the_table_stay_bounded(models, monkeypatch):
    """Steps over many batch geometries (every step a new member list, other canvas lengths, blocks and widths):
    the denoiser keeps at most ``_MEMO_SIZE`` geometries (each holds a ``[B, 1, Q, Q]`` mask) and one table of
    the current members; a finished sequence is garbage-collected once the table moved on (or was dropped)."""
    import weakref

    from unmask.engine import plain_batch

    model = models["bidirectional"]
    engine = LLM(model)._engine(8)
    denoiser = engine.denoiser
    calls = _count_table_steps(monkeypatch)
    tok, refs = model.tokenizer, []
    for k in range(24):
        prompt = PROMPTS[k % len(PROMPTS)] + " x" * (k % 7)
        params = SamplingParams(max_tokens=2 + k % 5, temperature=0, block_size=1 + k % 4, speculative=False,
                                cache="none", ignore_eos=True)
        refs += [weakref.ref(r) for r in engine.add_request(tok(prompt).input_ids, params, f"m{k}")]
        engine.step()
        assert len(denoiser.table_memo) <= plain_batch._MEMO_SIZE
        assert denoiser.table is None or len(denoiser.table.members) <= 8
    while engine.has_unfinished():
        engine.step()
    gc.collect()
    with warnings.catch_warnings():  # isinstance on every object touches deprecated module attributes
        warnings.simplefilter("ignore")
        live = sum(isinstance(o, plain_batch.TableGeometry) for o in gc.get_objects())
    assert len(calls) > 24 and len(set(calls)) >= 4 and live <= plain_batch._MEMO_SIZE
    engine.add_request(tok(PROMPTS[0]).input_ids, SamplingParams(max_tokens=2, temperature=0, block_size=2,
                                                                 speculative=False, cache="none"), "last")
    while engine.has_unfinished():
        engine.step()
    gc.collect()
    assert sum(r() is not None for r in refs) == 0  # the last request's sequence at most is still held


# ------------------------------------------------------------------ the APIs

def _strip(out) -> tuple:
    """A ``RequestOutput`` without its wall times and request id."""
    return (out.prompt, out.prompt_token_ids,
            [dataclasses.replace(o, first_token_time=None, finish_time=None) for o in out.outputs])


def _stream_events(events) -> list:
    return [(ev.request_id, ev.block, ev.step, pickle.dumps(ev.revealed), ev.canvas, ev.text, ev.finished,
             None if ev.output is None else dataclasses.replace(ev.output, first_token_time=None, finish_time=None))
            for ev in events]


def test_generate_generate_iter_and_stream(models, monkeypatch):
    """``LLM.generate`` (final-only choices, n=2, one shared ``SamplingParams``), ``generate_iter`` (each request
    its own parameters, completion order), ``stream`` and two streams advanced in turn over one ``LLM`` (one
    denoiser: the table rebuilt at every step) give the same outputs and events with the table step on or off."""
    model = models["bidirectional"]
    shared = SamplingParams(max_tokens=7, temperature=0.8, seed=11, block_size=4, speculative=False, logprobs=True,
                            ignore_eos=False)
    own = [(PROMPTS[i], SamplingParams(max_tokens=3 + i, temperature=0.3 * i, seed=i, block_size=1 + i % 4,
                                       threshold=0.5 if i % 2 else None, speculative=False, stop=["e"] if i else []))
           for i in range(5)]

    def run():
        llm = LLM(model, max_batch_size=4)
        gen = [_strip(o) for o in llm.generate(list(PROMPTS), shared, n=2)]
        it = [(i, _strip(o)) for i, o in llm.generate_iter(own)]
        one = _stream_events(llm.stream(PROMPTS[1], shared, request_id="s"))
        a = llm.stream(PROMPTS[0], own[2][1], request_id="a")
        b = llm.stream(PROMPTS[4], own[3][1], request_id="b")
        both = []
        for x, y in zip(a, b):  # in turn (the shorter one ends the loop; the rest of the other after)
            both += [x, y]
        both += list(a) + list(b)
        return gen, it, one, _stream_events(both)

    monkeypatch.setattr(Denoiser, "table_steps", False)
    general = run()
    calls = _count_table_steps(monkeypatch)
    monkeypatch.setattr(Denoiser, "table_steps", True)
    assert run() == general
    assert max(calls) >= 4


# ------------------------------------------------------------------ the server's streams

_ID = re.compile(rb'"id":"(chatcmpl|cmpl|resp)-[0-9a-f]+"')
_CREATED = re.compile(rb'"created(_at)?":\d+')


def test_sse_bytes_of_a_bidirectional_model(models, monkeypatch):
    """The server's SSE streams of a bidirectional model (cache-less by default: the table step), completions and
    chat, with every denoising step streamed (canvas views), logprobs, two choices, stop strings, infilling and a
    threshold, one request after another through one engine: the same bytes (id and created normalized) with the
    table step on or off. (The golden streams of tests/server/test_sse_golden.py serve prefix-causal models only.)"""
    from fastapi.testclient import TestClient

    from unmask.engine import EngineConfig
    from unmask.engine.async_engine import AsyncEngine
    from unmask.server.app import build_app
    from unmask.server.config import ServerConfig

    denoising = {"include_denoising": True, "include_usage": True}
    bodies = [
        ("/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0, "block_size": 4,
                             "stream_options": denoising, "logprobs": 1, "ignore_eos": True}),
        ("/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 9, "temperature": 0.9, "seed": 3, "n": 2,
                             "block_size": 2, "stream_options": denoising, "stop": ["e"]}),
        ("/v1/completions", {"prompt": PROMPTS[2], "suffix": " fox jumps", "max_tokens": 6, "temperature": 0,
                             "block_size": 4, "stream_options": denoising, "ignore_eos": True}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPTS[4]}], "max_tokens": 8,
                                  "temperature": 0.5, "seed": 1, "threshold": 0.6, "logprobs": True,
                                  "stream_options": denoising}),
    ]

    def serve() -> list[bytes]:
        app = build_app(AsyncEngine(models["bidirectional"], EngineConfig()), "m", ServerConfig())
        out = []
        with TestClient(app) as client:
            for route, body in bodies:  # one after another: batches side by side would depend on arrival times
                with client.stream("POST", route, json={"model": "m", "stream": True, **body}) as r:
                    assert r.status_code == 200, r.read()
                    out.append(_CREATED.sub(rb'"created\1":0', _ID.sub(rb'"id":"\1-<id>"', r.read())))
        return out

    monkeypatch.setattr(Denoiser, "table_steps", False)
    general = serve()
    calls = _count_table_steps(monkeypatch)
    monkeypatch.setattr(Denoiser, "table_steps", True)
    assert serve() == general
    assert calls and all(b'"denoising"' in g or b'"canvas"' in g for g in general)


def test_a_failed_forward_counts_no_forward(models, monkeypatch):
    """A forward that raises (an out-of-memory error, injected) in the middle of a run whose caller catches it and
    steps on: the failed step counted no NFE and revealed nothing, as on the general path (the table step counted
    every sequence's NFE before its forward: every later event and the output reported one forward too many)."""
    from unmask.engine.model import LoadedModel

    model, real, calls = models["bidirectional"], LoadedModel.hidden_states, [0]

    def flaky(self, *args, **kw):
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("out of memory (injected)")
        return real(self, *args, **kw)

    monkeypatch.setattr(LoadedModel, "hidden_states", flaky)

    def run(table: bool) -> list:
        calls[0] = 0
        engine = LLM(model)._engine(4)
        engine.denoiser.table_steps = table
        for i, kw in enumerate((dict(max_tokens=6, block_size=4), dict(max_tokens=8, block_size=2))):
            engine.add_request(model.tokenizer(PROMPTS[i]).input_ids, SamplingParams(
                temperature=0, cache="none", speculative=False, ignore_eos=True, **kw), f"r{i}")
        out = []
        while engine.has_unfinished():
            try:
                out += [(e.request_id, e.step, e.nfe, e.canvas, e.finished, e.output and e.output.nfe)
                        for e in engine.step()]
            except RuntimeError as exc:
                out.append(str(exc))
        return out

    general = run(False)
    assert "out of memory (injected)" in general
    assert run(True) == general


def test_the_show_steps_and_chat_canvas_views(models, monkeypatch, capsys):
    """``unmask generate --show-steps`` (piped: one line per step) and ``unmask chat``'s canvas (rich, coloured by
    reveal step, block marks) drawn from ``LLM.stream``'s events of an infilling and a sub-block request: the same
    lines and the same styled text with the table step on or off."""
    from unmask.cli.generate import _StepView
    from unmask.clients.chat import render_canvas

    model = models["bidirectional"]
    cases = [SamplingParams(max_tokens=9, temperature=0.6, seed=3, block_size=4, speculative=False, suffix=" fox",
                            ignore_eos=False),
             SamplingParams(max_tokens=10, temperature=0, block_size=8, sub_block_size=3, speculative=False,
                            ignore_eos=True)]

    def draw() -> tuple[str, list]:
        llm, frames = LLM(model), []
        for params in cases:
            view = _StepView(lambda t: llm.tokenizer.decode([t]), params.block_size)
            for ev in llm.stream(PROMPTS[1], params):
                view.update(ev)
                text = render_canvas(view.canvas)
                frames.append((text.plain, [(s.start, s.end, str(s.style)) for s in text.spans]))
            view.close()
        return capsys.readouterr().err, frames

    monkeypatch.setattr(Denoiser, "table_steps", False)
    general = draw()
    calls = _count_table_steps(monkeypatch)
    monkeypatch.setattr(Denoiser, "table_steps", True)
    assert draw() == general
    assert calls and general[0].count("[block ") == len(general[1]) >= 6


@pytest.mark.parametrize("model", ["bidirectional", "causal"])
def test_general_steps_between_table_steps_write_the_held_table(models, model, monkeypatch):
    """Table steps, then general steps while requests of other kinds (top-k, margin remasking) run beside the same
    sequences (their reveals written through the views into the held table), then table steps again over the
    same table: the general path's events and outputs."""
    from unmask.engine import plain_batch

    reqs = [dict(prompt=PROMPTS[i], max_tokens=16, temperature=0.5 * (i % 2), seed=i, block_size=4, logprobs=True)
            for i in range(3)]
    reqs += [dict(prompt=PROMPTS[3], max_tokens=4, top_k=5, temperature=0.9, seed=1, block_size=4, join=2),
             dict(prompt=PROMPTS[4], max_tokens=4, remasking="margin", temperature=0, block_size=2, join=3)]
    general = _run(models[model], reqs, False)
    steps, real = [], plain_batch.table_step

    def spy(denoiser, seqs, groups):
        steps.append((seqs[0].step, denoiser.table is not None and denoiser.table.holds(seqs)))
        return real(denoiser, seqs, groups)

    monkeypatch.setattr("unmask.engine.denoiser.table_step", spy)
    assert _run(models[model], reqs, True) == general
    # a table step after a gap of general steps found its table still holding the same sequences
    assert any(held and step - prev > 1 for (prev, _), (step, held) in zip(steps, steps[1:])), steps


def test_under_fake_cuda_in_bfloat16(absolute, monkeypatch):
    """On a (fake) CUDA device in bfloat16 (tensors tagged ``cuda``: an op mixing devices as CUDA refuses raises),
    under Fast-dLLM's prefix cache with blocks starting inside the prompt and the steps split into several forwards:
    the general path's events."""
    from device_tags import fake_cuda

    from unmask.engine.model import load_model

    reqs = [dict(prompt=PROMPTS[0], max_tokens=6, temperature=0.8, seed=4, block_size=4, logprobs=True),
            dict(prompt=PROMPTS[4], max_tokens=5, threshold=0.4, temperature=0, block_size=2, join=1),
            dict(prompt=PROMPTS[3], max_tokens=4, temperature=0, block_size=4, join=2, suffix=" the")]

    def split(engine, seqs):
        engine.denoiser.forward_overhead_rows = 6

    with fake_cuda(monkeypatch):
        model = load_model(absolute["path"], device="cuda", dtype="bfloat16", weights="native")
        assert model.device.type == "cuda"
        calls = _same(model, reqs, monkeypatch, cache="prefix", actions={0: split})
    assert max(calls) == 3


def test_a_sequence_that_left_the_table_holds_only_its_own_rows(models, monkeypatch):
    """A sequence that left the table (finished, aborted, or paused for a starved request) and that a caller still
    holds (a server's stream holds its choices until the client has read them) keeps only its own canvas and
    log-probabilities alive, not the whole ``[B, L]`` tables of the batch it left (B times its own memory each)."""
    import weakref

    from unmask.engine import plain_batch

    model = models["bidirectional"]
    engine = LLM(model)._engine(4)
    tok, held, tables, real = model.tokenizer, [], [], plain_batch.PlainTable.__init__

    def tracked(self, seqs):
        real(self, seqs)
        tables.extend((weakref.ref(self.canvas), weakref.ref(self.logprobs)))

    monkeypatch.setattr(plain_batch.PlainTable, "__init__", tracked)

    def add(i: int, max_tokens: int, n: int = 1, group: str | None = None):
        held.extend(engine.add_request(tok(PROMPTS[i]).input_ids, SamplingParams(
            max_tokens=max_tokens, temperature=0, block_size=2, speculative=False, cache="none", ignore_eos=True),
            f"h{len(held)}", n=n, group=group))

    add(0, 6)
    add(4, 16, n=3)
    for step in range(60):
        if step == 2:
            add(1, 6)  # another group: starved, it pauses one of the n=3 request's choices
        if step == 5:
            engine.abort("h1")  # ... and the n=3 request is aborted a few steps later
        if not engine.has_unfinished():
            break
        engine.step()
    assert engine.scheduler.preemptions and all(s.finished for s in held)
    for s in held:
        assert s.canvas.untyped_storage().nbytes() == s.length * 8, s.request_id
        assert s.logprobs.untyped_storage().nbytes() == s.gen_len * 4, s.request_id
    gc.collect()
    assert len(tables) > 4 and not [t for t in tables if t() is not None]  # no table kept alive by anything


def test_no_old_table_stays_alive_while_requests_join(models, monkeypatch):
    """A request joining at every step (a new table each step, its members mostly not at their stop-rule position,
    so their steps never read their canvas through ``Request.host_canvas``): after each step only the current table
    is alive (each member's memo of its NumPy views kept the views of the table it was in before: up to one old
    ``[B, L]`` table per member alive)."""
    import weakref

    from unmask.engine import plain_batch

    model = models["bidirectional"]
    engine = LLM(model)._engine(16)
    tables, real = [], plain_batch.PlainTable.__init__

    def tracked(self, seqs):
        real(self, seqs)
        tables.append((weakref.ref(self.canvas), weakref.ref(self.logprobs)))

    monkeypatch.setattr(plain_batch.PlainTable, "__init__", tracked)
    params = SamplingParams(max_tokens=16, temperature=0, block_size=8, speculative=False, cache="none",
                            ignore_eos=True)
    for k in range(10):
        engine.add_request(model.tokenizer(PROMPTS[k % len(PROMPTS)]).input_ids, params, f"j{k}")
        engine.step()
        assert len(tables) == k + 1 and sum(c() is not None or lp() is not None for c, lp in tables) == 1, k


def test_nan_scores_reveal_in_the_general_paths_order(models, monkeypatch):
    """A model whose logits hold NaN rows (an overflow in half precision): the revealed tokens of a quota step come
    in the general path's order (``HostRows.picked``'s sort, in which a NaN score compares equal to every score; the
    table step's ``lexsort`` put NaN rows last), tokens, canvases and outputs alike."""
    from unmask.engine.model import LoadedModel

    real = LoadedModel.logits

    def with_nan(self, hidden, *args, **kw):
        out = real(self, hidden, *args, **kw).clone()
        out[::2] = float("nan")
        return out

    monkeypatch.setattr(LoadedModel, "logits", with_nan)
    reqs = [dict(prompt=PROMPTS[i], max_tokens=8, temperature=t, seed=1, block_size=8, steps=2, logprobs=True)
            for i, t in enumerate((0, 0.7, 0))]
    reqs.append(dict(prompt=PROMPTS[3], threshold=0.5, max_tokens=8, temperature=0, block_size=8))
    _same(models["bidirectional"], reqs, monkeypatch)
