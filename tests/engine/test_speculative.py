"""Self-speculative decoding (unmask.engine.speculative): exact w.r.t. block_size=1 greedy decoding, KV rollback of
rejected drafts, batching with ordinary requests, parameter checks, and the HTTP/CLI surface."""
from __future__ import annotations

import math

import pytest
import torch

from tiny import loaded
from unmask.engine import LLM, ParamError, SamplingParams
from unmask.engine.plan import resolve_params
from unmask.engine.scheduler import Scheduler
from unmask.engine.speculative import SpeculativeSequence
from unmask.engine.speculative_batch import relaxed_accept

PROMPTS = ["Hello world", "The quick brown fox jumps over the lazy dog. One two", "Paris"]


@pytest.fixture(scope="module")
def llm():
    return LLM(loaded(attention="prefix_causal"))


@pytest.fixture(scope="module")
def sharp_llm():
    """Larger initial weights: mask-block predictions depend on the context (with the default initialisation a tiny
    random model drafts the same tokens whatever the context, so draft provenance could not be told apart)."""
    return LLM(loaded(attention="prefix_causal", initializer_range=0.5))


def _greedy_b1(llm, prompt, max_tokens, **kw):
    return llm.generate(prompt, SamplingParams.from_flat(max_tokens=max_tokens, temperature=0, block_size=1, **kw))[0].outputs[0]


def _run(llm, seqs, hook=None):
    """Step ``seqs`` together to the end; ``hook(seq)`` runs after every step (to inspect or to plant drafts)."""
    sched = Scheduler(llm.denoiser, max_batch_size=8)
    for s in seqs:
        sched.add(s)
    while sched.has_work():
        sched.step()
        if hook:
            for s in seqs:
                if not s.finished:
                    hook(s)
    return seqs


@pytest.mark.parametrize("block", [1, 2, 4])
@pytest.mark.parametrize("branches", [None, 0, 1])
@pytest.mark.parametrize("cache", ["auto", "none"])
def test_output_is_block1_greedy_token_for_token(llm, block, branches, cache):
    if branches is not None and branches > block - 1:  # more fallback groups than drafts: refused, not clamped
        with pytest.raises(ParamError, match="speculative_branches"):
            llm.generate(PROMPTS[0], SamplingParams.from_flat(max_tokens=4, block_size=block, speculative=True,
                                                              speculative_branches=branches, cache=cache))
        return
    for prompt in PROMPTS:
        for max_tokens in (1, 2, 7, 13):
            ref = _greedy_b1(llm, prompt, max_tokens, ignore_eos=True)
            out = llm.generate(prompt, SamplingParams.from_flat(max_tokens=max_tokens, block_size=block, speculative=True,
                                                      speculative_branches=branches, cache=cache,
                                                      ignore_eos=True))[0].outputs[0]
            assert out.token_ids == ref.token_ids, (prompt, max_tokens)


def _plant(reference: list[int], wrong_from: int | None = None):
    """A hook that replaces the drafts by the reference continuation (wrong from draft index ``wrong_from`` on)."""
    def hook(seq: SpeculativeSequence):
        done = seq.final_len - seq.prompt_len
        drafts = list(reference[done: done + seq.draft_block - 1])
        if wrong_from is not None:
            drafts[wrong_from:] = [(t + 1) % 300 for t in drafts[wrong_from:]]
        seq.drafts = drafts
    return hook


def test_correct_drafts_are_all_accepted(llm):
    """With the true continuation planted as drafts every draft is accepted: block 4 reveals 4 tokens per forward
    after the prefill (which reveals 1), and the output is unchanged."""
    ref = _greedy_b1(llm, PROMPTS[1], 21, ignore_eos=True).token_ids
    seq = llm.make_sequences(llm.encode(PROMPTS[1]), SamplingParams.from_flat(max_tokens=21, block_size=4, speculative=True,
                                                                   ignore_eos=True), "s")[0]
    _run(llm, [seq], _plant(ref))
    assert seq.output_ids == ref
    assert seq.nfe == 1 + 5  # 1 + 5 * 4 = 21 tokens
    assert seq.accepted_drafts == 15
    assert seq.lanes[0].cache.length == 0  # released at the end


@pytest.mark.parametrize("wrong_from", [0, 1, 2])
def test_rejected_drafts_never_reach_the_cache(llm, wrong_from):
    """Drafts wrong from index ``wrong_from``: each step accepts exactly ``wrong_from`` drafts plus the correction,
    the output is unchanged, and the KV cache holds exactly the final tokens but the newest (rollback)."""
    ref = _greedy_b1(llm, PROMPTS[0], 16, ignore_eos=True).token_ids
    seq = llm.make_sequences(llm.encode(PROMPTS[0]), SamplingParams.from_flat(max_tokens=16, block_size=4, speculative=True,
                                                                   ignore_eos=True), "s")[0]
    planted = _plant(ref, wrong_from)
    lengths = []

    def hook(s):
        lengths.append((s.lanes[0].cache.length, s.final_len))
        k = s.lanes[0].cache.keys[0]
        assert k.shape[1] == s.lanes[0].cache.length == int(s.lanes[0].cache.pos.numel())
        assert s.lanes[0].cache.pos.tolist() == list(range(s.final_len - 1))
        planted(s)

    _run(llm, [seq], hook)
    assert seq.output_ids == ref
    assert all(c == f - 1 for c, f in lengths)
    # every step but the prefill and the last (whose drafts are cut at max_tokens) accepts exactly wrong_from
    assert wrong_from * (seq.step - 2) <= seq.accepted_drafts <= wrong_from * (seq.step - 1)


def test_cache_equals_recomputed_causal_kv(llm):
    """After a step with rejected drafts, the cached keys equal those of a fresh causal forward of the final
    tokens (no trace of the rejected drafts)."""
    ref = _greedy_b1(llm, PROMPTS[2], 9, ignore_eos=True).token_ids
    seq = llm.make_sequences(llm.encode(PROMPTS[2]), SamplingParams.from_flat(max_tokens=9, block_size=4, speculative=True,
                                                                   ignore_eos=True), "s")[0]
    sched = Scheduler(llm.denoiser)
    sched.add(seq)
    hook = _plant(ref, 1)
    for _ in range(3):
        sched.step()
        hook(seq)
    cache = seq.lanes[0].cache
    n = cache.length
    fresh = llm.make_sequences(seq.canvas[:n].tolist(), SamplingParams.from_flat(max_tokens=3, block_size=1, temperature=0,
                                                                      ignore_eos=True), "f")[0]
    sched2 = Scheduler(llm.denoiser)
    sched2.add(fresh)
    sched2.step()  # prefill: caches the n prompt tokens causally
    # the last layer: its keys/values depend on the attention of every earlier layer (layer 0's keys would not)
    torch.testing.assert_close(cache.keys[-1], fresh.lanes[0].cache.keys[-1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache.values[-1], fresh.lanes[0].cache.values[-1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("i", [0, 1, 2])
def test_next_drafts_come_from_the_right_mask_group(sharp_llm, i):
    """Draft i rejected (the first i correct): the next drafts come from fallback group i, which sees the context
    up to the rejected position - the same drafts as group A of a request whose only drafts were those i correct
    ones (all accepted). A swapped or shifted group would differ."""
    llm = sharp_llm
    ref = _greedy_b1(llm, PROMPTS[1], 14, ignore_eos=True).token_ids
    sp = SamplingParams.from_flat(max_tokens=14, block_size=4, speculative=True, ignore_eos=True)
    seqs = [llm.make_sequences(llm.encode(PROMPTS[1]), sp, f"s{k}")[0] for k in range(2)]
    for k, seq in enumerate(seqs):
        sched = Scheduler(llm.denoiser)
        sched.add(seq)
        sched.step()  # prefill: one token
        done = seq.final_len - seq.prompt_len
        good = list(ref[done: done + i])
        seq.drafts = good + [(ref[done + i] + 1) % 300, ref[done + i + 1]] if k == 0 else good
        sched.step()
        assert seq.final_len - seq.prompt_len == done + i + 1  # i accepted + the correction
    assert len(seqs[0].drafts) == 3
    assert seqs[0].drafts == seqs[1].drafts


def test_typical_acceptance_accepts_probable_drafts(llm):
    """Medusa's typical acceptance: with a vanishing epsilon every draft of non-zero causal probability passes,
    so planted wrong drafts are kept (4 tokens per forward), while the tokens after each accepted draft are still
    the causal argmax given it; exact verification (no epsilon) rejects the same drafts."""
    ref = _greedy_b1(llm, PROMPTS[1], 13, ignore_eos=True).token_ids
    outs = {}
    for eps in (None, 1e-12):
        seq = llm.make_sequences(llm.encode(PROMPTS[1]), SamplingParams.from_flat(
            max_tokens=13, block_size=4, speculative=True, speculative_epsilon=eps, ignore_eos=True,
            speculative_no_repeat_ngram=None if eps is None else 0), "s")[0]
        _run(llm, [seq], _plant(ref, 0))
        outs[eps] = seq
    assert outs[None].output_ids == ref and outs[None].accepted_drafts == 0
    lax = outs[1e-12]
    assert lax.output_ids != ref and lax.nfe == 1 + 3 and lax.accepted_drafts == 9
    # the kept tokens are the planted drafts (reference + 1) at 3 of every 4 positions after the first token
    assert [lax.output_ids[i] for i in (1, 2, 3)] == [(t + 1) % 300 for t in ref[1:4]]


def test_ratio_acceptance_keeps_near_ties_only(llm):
    """``speculative_ratio``: a draft that is not the causal argmax is kept iff p(draft) >= ratio * max p (checked on
    hand-made distributions at the boundary); end to end, a vanishing ratio keeps planted wrong drafts (4 tokens
    per forward) and ratio 1 is exact verification (the greedy output, every planted draft rejected)."""
    probs = torch.tensor([[0.40, 0.21, 0.19, 0.20], [0.40, 0.21, 0.19, 0.20], [0.1, 0.1, 0.1, 0.7],
                          [0.25, 0.25, 0.25, 0.25]], dtype=torch.float64)
    logits = torch.full((4, 300), float("-inf"))
    logits[:, :4] = probs.log().float()
    ok = relaxed_accept(logits, torch.tensor([1, 2, 2, 0]), torch.full((4,), math.log(0.5), dtype=torch.float64),
                        torch.ones(4, dtype=torch.float64), torch.ones(4, dtype=torch.bool))
    assert ok.tolist() == [True, False, False, True]  # 0.21 >= 0.5 * 0.40; 0.19 < 0.20; 0.1 < 0.35; the argmax
    ref = _greedy_b1(llm, PROMPTS[1], 13, ignore_eos=True).token_ids
    outs = {}
    for ratio in (1.0, 1e-30):
        s = llm.make_sequences(llm.encode(PROMPTS[1]), SamplingParams.from_flat(
            max_tokens=13, block_size=4, speculative=True, speculative_ratio=ratio, ignore_eos=True,
            speculative_no_repeat_ngram=0), "s")[0]
        _run(llm, [s], _plant(ref, 0))
        outs[ratio] = s
    assert outs[1.0].output_ids == ref and outs[1.0].accepted_drafts == 0
    lax = outs[1e-30]
    assert lax.nfe == 1 + 3 and lax.accepted_drafts == 9
    assert [lax.output_ids[i] for i in (1, 2, 3)] == [(t + 1) % 300 for t in ref[1:4]]


def _verify_planted(llm, generated: list[int], drafts: list[int], **kw):
    """Verify ``drafts`` after the final ``generated`` tokens with made-up logits whose argmax (299) is none of
    them and under a vanishing ratio (every draft passes the rule): what the loop guard alone lets through."""
    seq = llm.make_sequences(llm.encode(PROMPTS[0]), SamplingParams.from_flat(
        max_tokens=16, block_size=4, speculative=True, speculative_ratio=1e-30, ignore_eos=True, **kw), "g")[0]
    p = seq.prompt_len
    seq.canvas[p: p + len(generated)] = torch.tensor(generated)
    seq.final_len = p + len(generated)
    seq.drafts = list(drafts)
    n = len(seq.lane_inputs()[0].needed)
    logits = torch.zeros(n, 300)
    logits[:, 299] = 5.0
    seq.verify(logits)
    return seq


def _final(seq) -> list[int]:
    return seq.canvas[seq.prompt_len: seq.final_len].tolist()


def test_loop_guard_off_is_accepted_without_a_relaxed_rule(llm):
    """``speculative_no_repeat_ngram=0`` (off) has nothing to guard under exact verification or speculative
    sampling and is accepted there; a positive size needs a relaxed rule."""
    ref = _greedy_b1(llm, PROMPTS[0], 6, ignore_eos=True).token_ids
    out = llm.generate(PROMPTS[0], SamplingParams.from_flat(max_tokens=6, block_size=4, speculative=True, ignore_eos=True,
                                                  speculative_no_repeat_ngram=0))[0].outputs[0]
    assert out.token_ids == ref
    llm.generate(PROMPTS[0], SamplingParams.from_flat(max_tokens=4, speculative=True, temperature=0.7, seed=1,
                                            speculative_no_repeat_ngram=0))
    with pytest.raises(ParamError) as err:
        llm.generate(PROMPTS[0], SamplingParams.from_flat(max_tokens=4, speculative=True, temperature=0.7,
                                                speculative_no_repeat_ngram=2))
    assert err.value.field == "speculative_no_repeat_ngram" and "greedy" in str(err.value)


def test_loop_guard_rejects_relaxed_drafts_that_repeat_an_ngram():
    """``speculative_no_repeat_ngram`` (default 3 with a relaxed rule): a draft kept only by the relaxed rule must
    not complete an n-gram the generated text already holds - earlier final tokens or the step's own accepted
    drafts; the causal argmax (the correction) takes its place. 0 turns the guard off; the prompt does not count."""
    llm = LLM(loaded(attention="prefix_causal"))
    seq = _verify_planted(llm, [10, 11, 12, 13], [10, 11, 12])  # (10, 11, 12) is already in the text
    assert seq.accepted_drafts == 2 and _final(seq) == [10, 11, 12, 13, 10, 11, 299]
    assert _verify_planted(llm, [10, 11, 12, 13], [10, 11, 12], speculative_no_repeat_ngram=0).accepted_drafts == 3
    assert _verify_planted(llm, [10, 11, 12, 13], [10, 11, 12], speculative_no_repeat_ngram=4).accepted_drafts == 3
    seq = _verify_planted(llm, [5, 7], [8, 7, 8], speculative_no_repeat_ngram=2)  # (7, 8) ends at the first draft
    assert seq.accepted_drafts == 2 and _final(seq) == [5, 7, 8, 7, 299]
    prompt_ids = llm.encode(PROMPTS[0])
    assert _verify_planted(llm, [], prompt_ids[-3:] or [1, 2, 3]).accepted_drafts == 3
    # the index of the final text's n-grams is incremental: a gram revealed by one step blocks a draft in the next
    seq = _verify_planted(llm, [20, 21, 22], [23, 24, 25])
    assert seq.accepted_drafts == 3 and _final(seq) == [20, 21, 22, 23, 24, 25, 299]
    seq.drafts = [23, 24, 25]  # after (25, 299): 23, 24 pass, 25 would repeat (23, 24, 25)
    n = len(seq.lane_inputs()[0].needed)
    logits = torch.zeros(n, 300)
    logits[:, 299] = 5.0
    seq.verify(logits)
    assert _final(seq)[7:] == [23, 24, 299] and seq.accepted_drafts == 5
    # the gram of the last final tokens counts; so does one ending at the draft just before (a run like 5 5 5)
    assert _verify_planted(llm, [7, 8], [7, 8], speculative_no_repeat_ngram=2).accepted_drafts == 1
    assert _verify_planted(llm, [9], [5, 5, 5], speculative_no_repeat_ngram=2).accepted_drafts == 2
    # the causal argmax is never blocked, even when it repeats: here every draft is the argmax of its row
    seq = llm.make_sequences(llm.encode(PROMPTS[0]), SamplingParams.from_flat(
        max_tokens=16, block_size=4, speculative=True, speculative_ratio=1e-30, ignore_eos=True), "h")[0]
    p = seq.prompt_len
    seq.canvas[p: p + 4] = torch.tensor([10, 11, 12, 13])
    seq.final_len, seq.drafts = p + 4, [10, 11, 12]
    n = len(seq.lane_inputs()[0].needed)
    logits = torch.zeros(n, 300)
    for row, tok in enumerate([10, 11, 12, 299]):
        logits[row, tok] = 5.0
    seq.verify(logits)
    assert seq.accepted_drafts == 3 and _final(seq)[4:] == [10, 11, 12, 299]


def test_batched_with_ordinary_requests_is_batch_invariant(llm):
    params = [SamplingParams.from_flat(max_tokens=10, block_size=4, speculative=True, ignore_eos=True),
              SamplingParams.from_flat(max_tokens=7, temperature=0.8, seed=2, block_size=2, ignore_eos=True),
              SamplingParams.from_flat(max_tokens=12, block_size=3, speculative=True, speculative_branches=1, ignore_eos=True)]
    alone = [llm.generate(p, sp)[0].outputs[0].token_ids for p, sp in zip(PROMPTS, params)]
    seqs = [llm.make_sequences(llm.encode(p), sp, f"r{i}")[0] for i, (p, sp) in enumerate(zip(PROMPTS, params))]
    _run(llm, seqs)
    assert [s.output_ids for s in seqs] == alone


def test_eos_stop_ids_min_tokens_and_logprobs_match_block1(llm):
    ref = _greedy_b1(llm, PROMPTS[1], 16, ignore_eos=True).token_ids
    stop_id = ref[5]
    for kw in ({"stop_token_ids": [stop_id]}, {"stop_token_ids": [stop_id], "min_tokens": 7},
               {"stop_token_ids": [stop_id], "logprobs": True}):
        a = _greedy_b1(llm, PROMPTS[1], 16, **kw)
        b = llm.generate(PROMPTS[1], SamplingParams.from_flat(max_tokens=16, block_size=4, speculative=True, **kw))[0].outputs[0]
        assert b.token_ids == a.token_ids and b.finish_reason == a.finish_reason, kw
        assert a.finish_reason == ("length" if "min_tokens" in kw else "stop")  # min_tokens forbids the early stop
        assert b.text == a.text
        if kw.get("logprobs"):
            assert [round(x, 4) for x in b.logprobs] == [round(x, 4) for x in a.logprobs]


def test_stop_strings_and_top_k_logprobs_match_block1(llm):
    ref = _greedy_b1(llm, PROMPTS[0], 16, ignore_eos=True)
    stop = ref.text[4:7]
    assert stop
    kws = ({"stop": [stop]}, {"top_k": 1, "logprobs": True}, {"top_p": 0.5, "logprobs": True})
    for kw in kws:
        a = _greedy_b1(llm, PROMPTS[0], 16, ignore_eos=True, **kw)
        b = llm.generate(PROMPTS[0], SamplingParams.from_flat(max_tokens=16, block_size=4, speculative=True, ignore_eos=True,
                                                    **kw))[0].outputs[0]
        assert (b.text, b.token_ids, b.finish_reason) == (a.text, a.token_ids, a.finish_reason), kw
        if "logprobs" in kw:  # after the top-k/top-p filter, as the other decoding modes report them
            assert [round(x, 4) for x in b.logprobs] == [round(x, 4) for x in a.logprobs], kw
    assert a.finish_reason == "length" and _greedy_b1(llm, PROMPTS[0], 16, stop=[stop]).finish_reason == "stop"


def test_stream_events_reveal_left_to_right(llm):
    events = list(llm.stream(PROMPTS[0], SamplingParams.from_flat(max_tokens=12, block_size=4, speculative=True,
                                                        ignore_eos=True)))
    seen = []
    for ev in events:
        seen += [r.position for r in ev.revealed]
        assert ev.canvas[: len(seen)] == [t for t in ev.canvas[: len(seen)] if t is not None]
    assert seen == list(range(12))
    assert events[-1].finished and events[-1].nfe == len(events)


def test_abort_frees_the_cache(llm):
    seq = llm.make_sequences(llm.encode(PROMPTS[0]), SamplingParams.from_flat(max_tokens=32, speculative=True,
                                                                   ignore_eos=True), "x")[0]
    sched = Scheduler(llm.denoiser)
    sched.add(seq)
    sched.step()
    assert seq.cache_bytes() > 0
    assert sched.abort("x")[0].finish_reason == "abort"
    assert seq.cache_bytes() == 0 and not sched.running


def test_temperature_resolves_to_the_checkpoints_else_greedy_and_default_threshold_ignored(llm):
    sp = resolve_params(SamplingParams.from_flat(max_tokens=4, speculative=True),
                        {"temperature": 0.7, "threshold": 0.5})
    assert sp.temperature == 0.7 and sp.threshold is None
    assert resolve_params(SamplingParams.from_flat(max_tokens=4, speculative=True),
                          {"threshold": 0.5}).temperature == 0.0
    assert resolve_params(SamplingParams.from_flat(max_tokens=4), {}).temperature == 1.0  # OpenAI's default otherwise


@pytest.mark.parametrize("attention", ["block_causal", "bidirectional"])
def test_other_attention_modes_are_refused(attention):
    other = LLM(loaded(attention=attention))
    with pytest.raises(ParamError) as err:
        other.generate("Hello", SamplingParams.from_flat(max_tokens=4, speculative=True))
    assert err.value.field == "speculative" and attention in str(err.value)


@pytest.mark.parametrize("kw, field, words", [
    ({"cfg_scale": 1.0}, "speculative", "cfg_scale"), ({"repetition_penalty": 1.2}, "speculative", "penalties"),
    ({"presence_penalty": 0.5}, "speculative", "penalties"),
    ({"temperature": 0.7, "speculative_epsilon": 0.1}, "speculative_epsilon", "temperature 0"),
    ({"temperature": 0.7, "speculative_ratio": 0.1}, "speculative_ratio", "temperature 0"),
    ({"speculative_no_repeat_ngram": 3}, "speculative_no_repeat_ngram", "speculative_epsilon or speculative_ratio")])
def test_incompatible_parameters_name_the_field(llm, kw, field, words):
    with pytest.raises(ParamError) as err:
        llm.generate("Hello", SamplingParams.from_flat(max_tokens=4, speculative=True, **kw))
    assert err.value.field == field and words in str(err.value)


@pytest.mark.parametrize("kw, field", [({"speculative": "yes"}, "speculative"),
                                       ({"speculative_branches": -1}, "speculative_branches"),
                                       ({"speculative_branches": 1.5}, "speculative_branches"),
                                       ({"speculative_epsilon": 0}, "speculative_epsilon"),
                                       ({"speculative_epsilon": 1.5}, "speculative_epsilon"),
                                       ({"speculative_branches": 2, "speculative": False}, "speculative_branches"),
                                       ({"speculative_epsilon": 0.1, "speculative": False}, "speculative_epsilon"),
                                       ({"speculative_ratio": 0}, "speculative_ratio"),
                                       ({"speculative_ratio": 1.01}, "speculative_ratio"),
                                       ({"speculative_ratio": 0.3, "speculative": False}, "speculative_ratio"),
                                       ({"speculative_ratio": 0.3, "speculative_epsilon": 0.1}, "speculative_ratio"),
                                       ({"speculative_no_repeat_ngram": -1}, "speculative_no_repeat_ngram"),
                                       ({"speculative_no_repeat_ngram": 65}, "speculative_no_repeat_ngram"),
                                       ({"speculative_no_repeat_ngram": 2.5}, "speculative_no_repeat_ngram"),
                                       ({"speculative_no_repeat_ngram": 3, "speculative": False},
                                        "speculative_no_repeat_ngram")])
def test_bad_values_name_the_field(kw, field):
    with pytest.raises(ParamError) as err:
        SamplingParams.from_flat(**kw)
    assert err.value.field == field


def test_draft_block_is_bounded(llm):
    """A step forwards up to block_size^2 rows: a huge draft block is a 400-style ParamError, not an OOM that fails
    the whole batch."""
    with pytest.raises(ParamError) as err:
        llm.generate("Hello", SamplingParams.from_flat(max_tokens=64, block_size=64, speculative=True))
    assert err.value.field == "block_size" and "32" in str(err.value)
    seq = llm.make_sequences(llm.encode("Hello"), SamplingParams.from_flat(max_tokens=64, block_size=32, speculative=True),
                             "b")[0]
    assert seq.branches == 3 and len(seq.lane_inputs()[0].chunk) <= 1 + 31 + 32 * 4 + len(llm.encode("Hello"))


# ---------------------------------------------------------------- HTTP and command line
def test_http_field_streams_the_block1_answer_and_400_names_the_field():
    from fastapi.testclient import TestClient

    from unmask.engine.async_engine import AsyncEngine
    from unmask.server.app import build_app

    model = loaded(block_size=4)
    ref = LLM(model).generate("Hello world", SamplingParams.from_flat(max_tokens=9, temperature=0, block_size=1,
                                                            ignore_eos=True))[0].outputs[0].text
    body = {"model": "m", "prompt": "Hello world", "max_tokens": 9, "ignore_eos": True, "speculative": True}
    with TestClient(build_app(AsyncEngine(model), "m")) as client:
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == ref
        text = ""
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    import json

                    text += json.loads(line[6:])["choices"][0]["text"]
        assert text == ref
        sampled = client.post("/v1/completions", json={**body, "temperature": 0.9, "seed": 3})  # speculative sampling
        assert sampled.status_code == 200 and sampled.json()["usage"]["completion_tokens"] == 9
        bad = client.post("/v1/completions", json={**body, "temperature": 0.9, "speculative_epsilon": 0.1})
        assert bad.status_code == 400 and "speculative_epsilon" in bad.text
        bad = client.post("/v1/completions", json={**body, "temperature": 0.9, "speculative_ratio": 0.3})
        assert bad.status_code == 400 and "speculative_ratio" in bad.text
        bad = client.post("/v1/completions", json={**body, "speculative_ratio": 1.5})
        assert bad.status_code == 400 and "speculative_ratio" in bad.text
        bad = client.post("/v1/completions", json={**body, "speculative_no_repeat_ngram": 3})  # no relaxed rule
        assert bad.status_code == 400 and "speculative_no_repeat_ngram" in bad.text
        bad = client.post("/v1/completions", json={**body, "speculative_ratio": 0.5, "speculative_no_repeat_ngram": 99})
        assert bad.status_code == 400 and "speculative_no_repeat_ngram" in bad.text
        ok = client.post("/v1/completions", json={**body, "speculative_ratio": 1.0, "speculative_no_repeat_ngram": 0})
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == ref
        lax = client.post("/v1/completions", json={**body, "speculative_ratio": 1.0})  # exact up to exact ties
        assert lax.status_code == 200 and lax.json()["choices"][0]["text"] == ref
        bad = client.post("/v1/completions", json={**body, "speculative_branches": -1})
        assert bad.status_code == 400 and "speculative_branches" in bad.text
        assert client.post("/v1/completions", json={**body, "speculative": None}).status_code == 200  # null = default
        bad = client.post("/v1/completions", json={**body, "speculative": False, "speculative_branches": 1})
        assert bad.status_code == 400 and "speculative_branches" in bad.text
        assert client.post("/v1/completions", json=body).json()["choices"][0]["text"] == ref  # still serving
        text = client.get("/metrics").text
        values = {name: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if not line.startswith("#")
                  for name in ("spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total")
                  if line.startswith(f"unmask:{name}")}
        # 4 speculative requests of 9 tokens: drafts were verified (the first step has none), few accepted here
        assert values["spec_decode_num_draft_tokens_total"] > 0
        assert 0 <= values["spec_decode_num_accepted_tokens_total"] <= values["spec_decode_num_draft_tokens_total"]


def test_cli_generate_speculative(tmp_path):
    import json
    import subprocess
    import sys

    from unmask.engine.checkpoint import write_checkpoint

    m = loaded()
    ckpt = tmp_path / "ckpt"
    write_checkpoint(ckpt, m.model, m.tokenizer, m.dllm)
    base = [sys.executable, "-m", "unmask.cli.main", "generate", str(ckpt), "--prompt", "Hello", "--max-tokens", "6",
            "--json"]
    # --temperature unset = the checkpoint's default (1.0 here) for plain decoding: greedy is asked for explicitly
    a = json.loads(subprocess.run(base + ["--block-size", "1", "--temperature", "0"], capture_output=True, text=True, timeout=120,
                                  check=True).stdout)
    b = json.loads(subprocess.run(base + ["--speculative", "--speculative-branches", "1"], capture_output=True,
                                  text=True, timeout=120, check=True).stdout)
    assert b["token_ids"] == a["token_ids"]
    bad = subprocess.run(base + ["--speculative", "--temperature", "0.5", "--speculative-epsilon", "0.1"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--speculative-epsilon:" in bad.stderr and "temperature 0" in bad.stderr
    c = json.loads(subprocess.run(base + ["--speculative", "--speculative-ratio", "1"], capture_output=True,
                                  text=True, timeout=120, check=True).stdout)
    assert c["token_ids"] == a["token_ids"]
    bad = subprocess.run(base + ["--speculative", "--speculative-ratio", "0"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "--speculative-ratio" in bad.stderr
    bad = subprocess.run(base + ["--speculative", "--speculative-ratio", "0.5", "--speculative-no-repeat-ngram", "-1"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--speculative-no-repeat-ngram" in bad.stderr


# ---------------------------------------------------------------- the checkpoint's default
def test_checkpoint_default_applies_to_greedy_requests_that_fit_it():
    from unmask.engine.speculative import SpeculativeSequence as Spec

    lm = loaded(block_size=4)
    lm.dllm.default_sampling = {"temperature": 0.0, "speculative": True}
    llm = LLM(lm)
    ids = llm.encode(PROMPTS[1])

    def kind(**kw):
        return type(llm.make_sequences(ids, SamplingParams.from_flat(**{"max_tokens": 8, **kw}), "k")[0])

    assert kind() is Spec and kind(temperature=0) is Spec and kind(speculative_epsilon=0.1) is Spec
    assert kind(temperature=0.7) is Spec  # speculative sampling
    # requests outside it keep the ordinary decoding, without an error
    for kw in ({"steps": 8}, {"threshold": 0.9}, {"remasking": "margin"}, {"cfg_scale": 1.0},
               {"repetition_penalty": 1.1}, {"block_size": 64, "max_tokens": 64}, {"speculative": False}):
        assert kind(**kw) is not Spec, kw
    # a block size the server set above the limit (`unmask serve --block-size 64`): ordinary decoding, no 400
    lm.dllm.block_size = 64
    assert kind() is not Spec and kind(block_size=4) is Spec
    lm.dllm.block_size = 4
    # a checkpoint that samples by default samples speculatively at its temperature
    lm.dllm.default_sampling = {"temperature": 0.7, "speculative": True}
    assert kind() is Spec and kind(temperature=0) is Spec
    assert llm.make_sequences(ids, SamplingParams.from_flat(max_tokens=8), "k")[0].temperature == 0.7
    lm.dllm.default_sampling = {"temperature": 0.0, "speculative": True}
    ref = _greedy_b1(llm, PROMPTS[1], 10, ignore_eos=True)
    out = llm.generate(PROMPTS[1], SamplingParams.from_flat(max_tokens=10, ignore_eos=True))[0].outputs[0]
    assert out.token_ids == ref.token_ids
    with pytest.raises(ParamError) as err:  # knobs of speculative decoding on a request that opted out
        llm.make_sequences(ids, SamplingParams.from_flat(max_tokens=8, steps=8, speculative_branches=1), "k")
    assert err.value.field == "speculative_branches"



def test_steps_or_threshold_on_an_explicit_speculative_request_are_refused_by_name():
    """speculative=true with steps / threshold used to decode speculatively and ignore them; the request's own
    values are refused naming the field. The checkpoint's defaults never cause it: its default threshold is not
    applied to a speculative request, and a request with steps/threshold does not get its speculative default."""
    from unmask.engine.speculative import SpeculativeSequence as Spec

    lm = loaded(block_size=4)
    lm.dllm.default_sampling = {"temperature": 0.0, "speculative": True, "threshold": 0.9}
    llm = LLM(lm)
    ids = llm.encode(PROMPTS[1])

    def seqs(**kw):
        return llm.make_sequences(ids, SamplingParams.from_flat(**{"max_tokens": 8, **kw}), "k")

    for field, value in (("steps", 4), ("threshold", 0.9), ("threshold", 0.0)):
        for extra in ({}, {"block_size": 2}, {"temperature": 0.7}):
            with pytest.raises(ParamError) as err:
                seqs(speculative=True, **{field: value}, **extra)
            assert err.value.field == field and "speculative decoding" in str(err.value), (field, extra)
            assert "decides its own reveals" in str(err.value)
    with pytest.raises(ParamError) as err:  # through the public API too
        llm.generate(PROMPTS[1], SamplingParams.from_flat(max_tokens=4, speculative=True, steps=4))
    assert err.value.field == "steps"
    # unchanged: the checkpoint's speculative default (its default threshold not applied), an explicit
    # speculative request without them, steps/threshold without speculative or with speculative=false
    assert isinstance(seqs()[0], Spec) and seqs()[0].plan.threshold is None
    assert isinstance(seqs(speculative=True)[0], Spec)
    for kw in ({"steps": 4}, {"threshold": 0.5}, {"steps": 4, "speculative": False},
               {"threshold": 0.5, "speculative": False}):
        assert not isinstance(seqs(**kw)[0], Spec), kw
    out = llm.generate(PROMPTS[1], SamplingParams.from_flat(max_tokens=4, steps=4, speculative=False))[0].outputs[0]
    assert len(out.token_ids) >= 1

# every request field self-speculative decoding has no use for (engine/plan.py NOT_SPECULATIVE_FIELDS), with values
# other than its default; each used to be ignored by an explicit speculative request (steps/threshold: refused since)
NOT_SPECULATIVE = [("steps", 4), ("threshold", 0.9), ("threshold", 0.0), ("remasking", "margin"),
                   ("remasking", "entropy"), ("remasking", "random"), ("sub_block_size", 2), ("sub_block_size", 4)]


def test_the_not_speculative_table_is_what_the_tests_cover():
    from unmask.engine.plan import NOT_SPECULATIVE_FIELDS

    assert set(NOT_SPECULATIVE_FIELDS) == {f for f, _ in NOT_SPECULATIVE}


@pytest.mark.parametrize("field, value", NOT_SPECULATIVE)
def test_a_field_speculative_decoding_has_no_use_for_is_refused_by_name(field, value):
    """speculative=true with a plain-diffusion knob speculative decoding does not use (a remasking order, a
    sub-block window, steps, a threshold) decoded speculatively and ignored it; the request's own value is refused
    naming the field and saying why. The checkpoint's defaults never cause it (its default threshold is not applied
    to a speculative request, its own sub_block_size is not the request's, and a request that sets the field does
    not get its speculative default), and with speculative=false the field is decoded with."""
    from unmask.engine.speculative import SpeculativeSequence as Spec

    lm = loaded(block_size=4)
    lm.dllm.default_sampling = {"temperature": 0.0, "speculative": True, "threshold": 0.9}
    lm.dllm.sub_block_size = 2  # the checkpoint's window (as a Fast-dLLM v2 checkpoint has): not the request's
    llm = LLM(lm)
    ids = llm.encode(PROMPTS[1])

    def seqs(**kw):
        return llm.make_sequences(ids, SamplingParams.from_flat(**{"max_tokens": 8, **kw}), "k")

    for extra in ({}, {"block_size": 4, "temperature": 0.7}, {"speculative_branches": 1, "cache": "none"}):
        with pytest.raises(ParamError) as err:
            seqs(speculative=True, **{field: value}, **extra)
        msg = str(err.value)
        assert err.value.field == field, (extra, msg)
        assert "has no effect with speculative decoding" in msg and "decides its own reveals" in msg, msg
        assert "speculative=false" in msg, msg
    with pytest.raises(ParamError) as err:  # through the public API too
        llm.generate(PROMPTS[1], SamplingParams.from_flat(max_tokens=4, speculative=True, **{field: value}))
    assert err.value.field == field
    # the checkpoint's defaults (speculative, threshold, sub_block_size) never cause it
    assert isinstance(seqs()[0], Spec) and isinstance(seqs(speculative=True)[0], Spec)
    assert isinstance(seqs(speculative=True, remasking="low_confidence")[0], Spec)  # the default value: no effect
    # the field without `speculative`: the checkpoint's speculative default does not apply, no error
    assert not isinstance(seqs(**{field: value})[0], Spec)
    # with speculative=false: decoded with the field
    assert not isinstance(seqs(speculative=False, **{field: value})[0], Spec)
    out = llm.generate(PROMPTS[1], SamplingParams.from_flat(max_tokens=4, speculative=False, ignore_eos=True,
                                                            **{field: value}))[0].outputs[0]
    assert len(out.token_ids) == 4 and not out.speculative


@pytest.mark.parametrize("dllm_kw, value, words", [
    ({}, "yes", "true or false"),
    ({"attention": "bidirectional"}, True, "prefix_causal"),
    ({"logit_shift": False}, True, "logit shift"),
    ({"block_size": 64}, True, "block size <= 32"),
])
def test_checkpoint_default_is_validated(dllm_kw, value, words):
    from unmask.engine.config import CheckpointError, DllmConfig

    base = dict(family="a2d", mask_token_id=1, attention="prefix_causal", block_size=4, logit_shift=True,
                eos_token_ids=[0])
    with pytest.raises(CheckpointError, match="default_sampling.speculative") as err:
        DllmConfig(**{**base, **dllm_kw}, default_sampling={"speculative": value})
    assert words in str(err.value)
    DllmConfig(**{**base, **dllm_kw}, default_sampling={"speculative": False})  # off is always allowed


def test_export_writes_and_clears_the_default(tmp_path):
    from unmask.engine.checkpoint import write_checkpoint
    from unmask.engine.model import read_config
    from unmask.training.export import ExportError, export

    m = loaded()
    write_checkpoint(tmp_path / "src", m.model, m.tokenizer, m.dllm)
    export(tmp_path / "src", tmp_path / "on", quantization="none", default_speculative=True)
    assert read_config(tmp_path / "on")["dllm"]["default_sampling"]["speculative"] is True
    export(tmp_path / "on", tmp_path / "off", quantization="none", default_speculative=False)
    assert read_config(tmp_path / "off")["dllm"]["default_sampling"]["speculative"] is False
    bi = loaded(attention="bidirectional")
    write_checkpoint(tmp_path / "bi", bi.model, bi.tokenizer, bi.dllm)
    with pytest.raises(ExportError, match="prefix_causal"):
        export(tmp_path / "bi", tmp_path / "bi-out", quantization="none", default_speculative=True)
    assert not (tmp_path / "bi-out").exists()


# ---------------------------------------------------------------- the draft policy of checkpoint defaults
def test_checkpoint_default_drafts_per_policy_with_the_same_tokens():
    """On a CPU (``default_drafts`` auto) a request that only gets speculative decoding from the checkpoint's default
    decodes one token per forward (draft block 1: no mask rows) - the same tokens as drafting; asking for anything
    speculative-specific, or policy ``on``, drafts at the checkpoint's block."""
    from unmask.engine.plan import drafts_by_default

    lm = loaded(block_size=4)
    lm.dllm.default_sampling = {"temperature": 0.0, "speculative": True}
    llm = LLM(lm)
    ids = llm.encode(PROMPTS[1])

    def seq(llm=llm, **kw):
        s = llm.make_sequences(ids, SamplingParams.from_flat(max_tokens=10, ignore_eos=True, **kw), "k")[0]
        assert isinstance(s, SpeculativeSequence)
        return s

    assert lm.device.type == "cpu" and llm.default_drafts == "auto" and not drafts_by_default("auto", "cpu")
    assert drafts_by_default("auto", "cuda")
    assert seq().draft_block == 1 and seq(temperature=0.7).draft_block == 1
    for kw in ({"speculative": True}, {"block_size": 4}, {"speculative_branches": 1}, {"speculative_epsilon": 0.1},
               {"speculative_ratio": 0.5}):
        assert seq(**kw).draft_block == 4, kw
    one = llm.generate(PROMPTS[1], SamplingParams.from_flat(max_tokens=10, ignore_eos=True))[0].outputs[0]
    on = LLM(lm, default_drafts="on")
    assert seq(on).draft_block == 4
    drafted = on.generate(PROMPTS[1], SamplingParams.from_flat(max_tokens=10, ignore_eos=True))[0].outputs[0]
    assert one.token_ids == drafted.token_ids and one.nfe == 10
    assert seq(LLM(lm, default_drafts="off")).draft_block == 1
    with pytest.raises(ValueError, match="default_drafts"):
        LLM(lm, default_drafts="sometimes")


def test_speculative_only_fields_explain_why_the_request_is_not_speculative():
    """A speculative-only field on a request that does not get self-speculative decoding names the field and says
    why: no speculative default to fall back on, or a request the default does not cover (steps, cfg, ...)."""
    for name, value in (("speculative_ratio", 0.1), ("speculative_epsilon", 0.1), ("speculative_branches", 1),
                        ("speculative_no_repeat_ngram", 3)):
        with pytest.raises(ParamError) as err:
            resolve_params(SamplingParams.from_flat(**{name: value}), {}, 4)
        assert err.value.field == name and "set speculative=true" in str(err.value)
        for other, named in (({"steps": 8}, "steps"), ({"cfg_scale": 1.5}, "cfg_scale"),
                             ({"repetition_penalty": 1.1}, "repetition_penalty"), ({"block_size": 64}, "block_size"),
                             ({"steps": 8, "remasking": "random"}, "steps and remasking")):
            with pytest.raises(ParamError) as err:
                resolve_params(SamplingParams.from_flat(**{name: value}, **other), {"speculative": True}, 4)
            msg = str(err.value)
            assert err.value.field == name and "keeps the ordinary decoding" in msg, other
            assert f"drop {name}, or drop {named}" in msg, msg  # the request's own conflicting fields, no others
            assert ("cfg_scale" in msg) == ("cfg_scale" in other), msg
        assert resolve_params(SamplingParams.from_flat(**{name: value}), {"speculative": True}, 4).speculative is True
