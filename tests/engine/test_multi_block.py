"""Multi-block decoding (engine/multi_block.py, docs/design.md#the-seeds-methods) on tiny random models."""
from __future__ import annotations

import pytest
import torch

from tiny import loaded
from unmask.engine import Constraint, LLM, ParamError, SamplingParams
from unmask.engine.denoiser import Denoiser
from unmask.engine.engine import make_requests
from unmask.engine.multi_block import MultiBlockSequence
from unmask.engine.sequence import Sequence

PROMPTS = ["Hello world", "The quick brown fox jumps over the lazy dog. One two"]


@pytest.fixture(scope="module")
def models():
    return {att: loaded(attention=att) for att in ("prefix_causal", "block_causal", "bidirectional")}


def _decode(model, prompt, params):
    """Run one choice to the end; returns the strategy object (its history) and its events."""
    seq = make_requests(model, model.tokenizer.encode(prompt), params, "r")[0]
    den = Denoiser(model)
    events = []
    while not seq.finished:
        events.extend(den.step([seq]))
    return seq, events


@pytest.mark.parametrize("attention", ["prefix_causal", "block_causal"])
def test_fraction_one_is_single_block_decoding_token_for_token(models, attention):
    llm = LLM(models[attention])
    for prompt in PROMPTS:
        for kw in (dict(temperature=0), dict(temperature=0.9, seed=7), dict(temperature=0, threshold=0.3),
                   dict(temperature=0, cache="none"), dict(temperature=0.7, seed=3, block_size=3, steps=6)):
            base = SamplingParams(max_tokens=13, ignore_eos=True, **kw)
            multi = SamplingParams(max_tokens=13, ignore_eos=True, multi_block=1.0, **kw)
            a = llm.generate(prompt, base)[0].outputs[0]
            b = llm.generate(prompt, multi)[0].outputs[0]
            assert b.token_ids == a.token_ids, (prompt, kw)
            assert (b.nfe, b.steps, b.steps_per_block) == (a.nfe, a.steps, a.steps_per_block), (prompt, kw)


@pytest.mark.parametrize("fraction, expected", [
    # block 4, 12 tokens = 3 blocks, one token per step per active block; hand-computed:
    # f = 0.5: block 1 joins after block 0 has 2 of 4 revealed (end of step 1), block 2 after block 1 has 2 (step 3)
    (0.5, [[0], [0], [0, 1], [0, 1], [1, 2], [1, 2], [2], [2]]),
    # f = 0.25: a block joins as soon as its predecessor has revealed one token
    (0.25, [[0], [0, 1], [0, 1, 2], [0, 1, 2], [1, 2], [2]]),
    # f = 0.75: joins after 3 of 4
    (0.75, [[0], [0], [0], [0, 1], [1], [1], [1, 2], [2], [2], [2]]),
    (1.0, [[0]] * 4 + [[1]] * 4 + [[2]] * 4),
])
def test_activation_schedule_matches_the_hand_computed_one(models, fraction, expected):
    seq, events = _decode(models["prefix_causal"], "Hello world",
                          SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, multi_block=fraction))
    assert isinstance(seq, MultiBlockSequence)
    assert seq.active_history == expected
    # every active block with masks reveals exactly one token a step (its own quota: 1 of 4 steps)
    assert [len(e.revealed) for e in events] == [len(a) for a in expected]
    assert [e.block for e in events] == [a[0] for a in expected]
    assert len(seq.output_ids) == 12


@pytest.mark.parametrize("attention", ["prefix_causal", "block_causal"])
@pytest.mark.parametrize("fraction", [0.25, 0.5])
def test_a_later_block_never_commits_kv_of_an_unfinished_earlier_block(models, attention, fraction, monkeypatch):
    model = models[attention]
    mask_id = model.dllm.mask_token_id
    seen = []
    orig_inputs, orig_consume = MultiBlockSequence.lane_inputs, MultiBlockSequence.consume

    def lane_inputs(self):
        inputs = orig_inputs(self)
        self._recorded = [(inp.tokens.clone(), inp.chunk.clone()) for inp in inputs]
        return inputs

    def consume(self, logits, forbidden_ids):
        event, commits = orig_consume(self, logits, forbidden_ids)
        for (tokens, chunk), commit in zip(self._recorded, commits):
            if commit is not None and commit.numel():
                last = int(commit.max())
                # the committed rows and every row before them were final tokens in the forward that computed them
                assert not bool((tokens[: last + 1] == mask_id).any()), (self.step, chunk[commit].tolist())
                seen.append(chunk[commit].tolist())
        return event, commits

    monkeypatch.setattr(MultiBlockSequence, "lane_inputs", lane_inputs)
    monkeypatch.setattr(MultiBlockSequence, "consume", consume)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, multi_block=fraction)
    seq, _ = _decode(model, PROMPTS[1], params)
    assert max(len(a) for a in seq.active_history) >= 2  # blocks really overlapped
    # the cache holds exactly the finished blocks, with the keys/values of a clean causal forward of them
    cache = seq.lanes[0].cache
    P = seq.prompt_len
    last_block_start = seq.blocks[-1][0]
    assert cache.length == last_block_start
    assert cache.pos.tolist() == list(range(last_block_start))
    assert sum(len(s) for s in seen) == last_block_start
    assert seq.canvas[P:].ne(mask_id).all()
    if attention == "block_causal":  # committed blocks are bidirectional groups there: the no-cache test covers it
        return
    final = seq.canvas[:last_block_start].tolist()
    ref = make_requests(model, final, SamplingParams(max_tokens=1, temperature=0, block_size=1), "ref")[0]
    Denoiser(model).step([ref])
    ref_cache = ref.lanes[0].cache
    assert ref_cache.length == last_block_start
    for k, rk in zip(cache.keys, ref_cache.keys):
        torch.testing.assert_close(k, rk, rtol=1e-5, atol=1e-5)
    for v, rv in zip(cache.values, ref_cache.values):
        torch.testing.assert_close(v, rv, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("attention", ["prefix_causal", "block_causal"])
def test_exact_cache_equals_no_cache_with_overlapping_blocks(models, attention):
    llm = LLM(models[attention])
    for prompt in PROMPTS:
        outs = [llm.generate(prompt, SamplingParams(max_tokens=14, temperature=0, ignore_eos=True, multi_block=0.5,
                                                    cache=c))[0].outputs[0].token_ids for c in ("none", "auto")]
        assert outs[0] == outs[1], prompt


def test_fewer_steps_below_one_and_threshold_mode_reveals_in_every_active_block(models):
    llm = LLM(models["prefix_causal"])
    one = llm.generate("Hello world", SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0].outputs[0]
    half = llm.generate("Hello world", SamplingParams(max_tokens=16, temperature=0, ignore_eos=True,
                                                      multi_block=0.5))[0].outputs[0]
    assert len(half.token_ids) == len(one.token_ids) == 16
    assert half.steps < one.steps == 16
    assert sum(half.steps_per_block) >= half.steps  # blocks overlapped: their step counts add up to more
    seq, events = _decode(models["prefix_causal"], "Hello world",
                          SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, threshold=1.0,
                                         multi_block=0.5))
    for active, e in zip(seq.active_history, events):  # threshold 1.0: only each block's best
        assert len(e.revealed) == len(active)


def test_refused_where_it_cannot_apply_naming_the_field(models):
    with pytest.raises(ParamError) as e:
        SamplingParams(multi_block=0)
    assert e.value.field == "multi_block"
    with pytest.raises(ParamError):
        SamplingParams(multi_block=1.5)
    for model, params in ((models["bidirectional"], SamplingParams(multi_block=0.5)),
                          (models["prefix_causal"], SamplingParams(multi_block=0.5, block_size=4, sub_block_size=2)),
                          (models["prefix_causal"], SamplingParams(multi_block=0.5, speculative=True)),
                          (models["prefix_causal"], SamplingParams(multi_block=0.5, max_tokens=8,
                                                                   constraint=Constraint("json_object")))):
        with pytest.raises(ParamError) as e:
            make_requests(model, [5, 6, 7], params, "r")
        assert e.value.field == "multi_block"
    seq = make_requests(models["prefix_causal"], [5, 6, 7], SamplingParams(max_tokens=4), "r")[0]
    assert type(seq) is Sequence


def test_http_field_bounds_come_from_limits_and_reach_the_engine():
    from pydantic import ValidationError

    from unmask.server.protocol import ChatCompletionRequest

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    req = ChatCompletionRequest.model_validate({**body, "multi_block": 0.5})
    assert req.sampling_params(16, False).multi_block == 0.5
    assert ChatCompletionRequest.model_validate(body).sampling_params(16, False).multi_block is None
    for bad in (0, 1.01, -0.5):
        with pytest.raises(ValidationError):
            ChatCompletionRequest.model_validate({**body, "multi_block": bad})
