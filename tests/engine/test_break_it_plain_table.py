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
         max_batch: int = 16) -> tuple[dict, dict]:
    """Decode ``reqs`` (each: ``SamplingParams.from_flat`` keywords plus ``prompt``, ``n`` and ``join``, the step it
    joins at) on a fresh engine with the table step on or off; ``actions[step](engine, seqs)`` runs before that
    step (its events, e.g. an abort's, are recorded). Returns every choice's events as comparable tuples (every
    field but wall times) and every choice's final canvas, log-probabilities and output."""
    engine = LLM(model)._engine(max_batch)
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
    for key, evs in general[0].items():
        assert table[0].get(key) == evs, key
    assert table == general
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
