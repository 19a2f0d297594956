"""The output objects built without their frozen ``__init__`` (``engine/outputs.py``: ``filled``,
``revealed_token``) are the objects the constructor makes, and the engine's events carry every field."""
from __future__ import annotations

import dataclasses
import pickle

import pytest

import tiny
from unmask.engine import LLM, SamplingParams
from unmask.engine.outputs import CompletionOutput, Revealed, StepEvent, filled, revealed_token


def test_filled_equals_the_constructor():
    kw = dict(request_id="r", block=1, step=2, nfe=3, revealed=[revealed_token(0, 5, 0.5, -0.7)], canvas=[5, None],
              text="x", finished=True, finish_reason="length", index=1, num_tokens=1, drafts_proposed=2,
              drafts_accepted=1, output=None, cached_tokens=4)
    made, built = filled(StepEvent, **kw), StepEvent(**kw)
    assert made == built and repr(made) == repr(built) and made.final is None
    assert pickle.loads(pickle.dumps(made)) == built
    assert dataclasses.replace(made, final=3) == StepEvent(**kw, final=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.text = "y"
    assert revealed_token(3, 7, 0.25, -1.5, ((7, -1.5),)) == Revealed(3, 7, 0.25, -1.5, ((7, -1.5),))
    assert revealed_token(3, 7, 0.25, -1.5).top == ()


def test_every_event_has_every_field():
    llm = LLM(tiny.loaded(attention="prefix_causal", block_size=4))
    params = SamplingParams.from_flat(temperature=0, max_tokens=8, block_size=4, ignore_eos=True, logprobs=True,
                                      top_logprobs=2)
    events = list(llm.stream([1, 2, 3], params))
    assert events and events[-1].finished
    names = {f.name for f in dataclasses.fields(StepEvent)}
    for ev in events:
        assert set(vars(ev)) == names
        assert dataclasses.replace(ev) == ev
        for r in ev.revealed:
            assert set(vars(r)) == {f.name for f in dataclasses.fields(Revealed)}
    assert isinstance(events[-1].output, CompletionOutput)
