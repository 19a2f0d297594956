"""``remasking: left_to_right`` (engine/sampler.py ``score_candidates``): the leftmost masked position first. Quota
mode is semi-autoregressive decoding; threshold mode reveals the leftmost position plus every confident one, so
on a logit-shift model each step keeps the causal row's prediction (docs/design.md#decoding)."""
from __future__ import annotations

import pytest
import torch

from tiny import loaded
from unmask.engine import LLM, SamplingParams
from unmask.engine.noise import Draws
from unmask.engine.reveal_rule import select_reveals
from unmask.engine.sampler import sample_candidates


def _cands(probs):
    logits = torch.log(torch.tensor(probs, dtype=torch.float32))
    return sample_candidates(logits, SamplingParams(temperature=0, remasking="left_to_right"), Draws(0, 0))


def test_quota_reveals_the_leftmost_positions():
    c = _cands([[0.4, 0.6], [0.05, 0.95], [0.01, 0.99], [0.3, 0.7]])
    assert select_reveals(c, quota=2, threshold=None).tolist() == [0, 1]   # not the most confident 2 and 1


def test_threshold_reveals_the_leftmost_and_every_confident_one():
    c = _cands([[0.4, 0.6], [0.5, 0.5], [0.01, 0.99], [0.3, 0.7]])
    assert select_reveals(c, quota=None, threshold=0.9).tolist() == [0, 2]
    assert select_reveals(c, quota=None, threshold=1.0).tolist() == [0]   # nothing confident: the leftmost only


def test_one_token_per_step_is_left_to_right_decoding():
    """Block 4, one reveal per step: every step reveals the first masked position of the block."""
    llm = LLM(loaded(block_size=4))
    ids = llm.encode("Hello world the quick brown")
    events = list(llm.stream(ids, SamplingParams(max_tokens=8, temperature=0, steps=8, ignore_eos=True,
                                                 remasking="left_to_right")))
    first = [ev.revealed[0].position for ev in events if ev.revealed]
    assert first == sorted(first) and len(set(first)) == len(first) == 8
    assert all(len(ev.revealed) == 1 for ev in events if ev.revealed)


def _dllm(**default_sampling):
    from unmask.engine.config import DllmConfig

    return DllmConfig(family="a2d", mask_token_id=3, attention="prefix_causal", block_size=4, logit_shift=True,
                      eos_token_ids=[0], default_sampling=default_sampling)


@pytest.mark.parametrize("fields, remasking", [
    ({"threshold": 0.7}, "left_to_right"), ({"steps": 8}, "left_to_right"), ({"speculative": False}, "left_to_right"),
    ({}, "low_confidence"), ({"speculative": True}, "low_confidence"),   # speculative: reveals in order anyway
    ({"threshold": 0.7, "remasking": "margin"}, "margin"),              # the request's own wins
])
def test_a_checkpoint_default_order_applies_to_plain_diffusion(fields, remasking):
    from unmask.engine.plan import resolve

    d = _dllm(speculative=True, temperature=0.0, remasking="left_to_right")
    assert resolve(SamplingParams.from_flat(max_tokens=16, **fields), d, default_drafts="on").remasking == remasking


def test_without_one_the_order_is_low_confidence_and_the_default_threshold_still_applies():
    from unmask.engine.plan import resolve

    plan = resolve(SamplingParams(max_tokens=16), _dllm(threshold=0.8), default_drafts="on")
    assert plan.remasking == "low_confidence" and plan.threshold == 0.8


def test_a_bad_default_order_names_the_field():
    from unmask.engine.config import CheckpointError

    with pytest.raises(CheckpointError, match=r"default_sampling\.remasking: must be one of"):
        _dllm(remasking="best")


def test_sending_the_checkpoints_own_order_keeps_its_default_threshold():
    """An explicit remasking equal to the checkpoint's default decodes as leaving it out (break-it: it dropped the
    checkpoint's threshold)."""
    from unmask.engine.plan import resolve

    d = _dllm(threshold=0.5, remasking="left_to_right")
    for remasking in (None, "left_to_right", "low_confidence"):
        plan = resolve(SamplingParams(max_tokens=16, remasking=remasking), d, default_drafts="on")
        assert plan.threshold == 0.5, remasking
    assert resolve(SamplingParams(max_tokens=16, remasking="margin"), d, default_drafts="on").threshold is None


def test_generate_leaves_the_order_to_the_checkpoint():
    from unmask.cli.main import build_parser

    assert build_parser().parse_args(["generate", "--prompt", "x"]).remasking is None
