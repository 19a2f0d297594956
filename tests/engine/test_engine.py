"""Decoding rules of the engine (docs/design.md#decoding and #decisions) on tiny random models."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from step_together import step_together
from tiny import loaded
from unmask.engine import LLM, ParamError, SamplingParams
from unmask.engine.plan import resolve_params
from unmask.engine.noise import Draws
from unmask.engine.reveal_rule import reveal_count
from unmask.engine.sampler import filter_top_k_top_p, sample_candidates
from unmask.engine.layout import split_steps
from unmask.engine.sequence import Sequence

PROMPTS = ["Hello world", "The quick brown fox jumps over the lazy dog. One two", "Paris"]


@pytest.fixture(scope="module")
def llms():
    return {att: LLM(loaded(attention=att)) for att in ("prefix_causal", "block_causal", "bidirectional")}


def _events(llm, prompt, params):
    return list(llm.stream(prompt, params))


# ---------------------------------------------------------------- step budget and reveal counts
def test_split_steps_even_remainder_first_and_at_least_one():
    assert split_steps(10, 4) == [3, 3, 2, 2]
    assert split_steps(8, 2) == [4, 4]
    assert split_steps(2, 5) == [1, 1, 1, 1, 1]  # steps < blocks: one step per block
    assert sum(split_steps(257, 8)) == 257


def test_reveal_count_recomputed_matches_llada_schedule():
    # LLaDA get_num_transfer_tokens for 10 masks over 4 steps: [3, 3, 2, 2]
    m, counts = 10, []
    for r in range(4, 0, -1):
        k = reveal_count(m, r)
        counts.append(k)
        m -= k
    assert counts == [3, 3, 2, 2]


@pytest.mark.parametrize("max_tokens,steps,block", [(12, 5, 4), (10, 3, 4), (9, 20, 4), (16, 16, 8)])
def test_reveals_per_block_sum_to_block_masks(llms, max_tokens, steps, block):
    p = SamplingParams(max_tokens=max_tokens, steps=steps, block_size=block, temperature=0, ignore_eos=True)
    evs = _events(llms["bidirectional"], PROMPTS[0], p)
    seq_len = -(-max_tokens // block) * block
    per_block: dict[int, int] = {}
    for ev in evs:
        per_block[ev.block] = per_block.get(ev.block, 0) + len(ev.revealed)
    # events show the first max_tokens positions only (the rounded-up tail is decoded, never shown)
    assert sum(per_block.values()) == max_tokens
    assert per_block == {b: min(block, max_tokens - b * block) for b in range(seq_len // block)}
    # each block took exactly its share of the step budget
    steps_per_block: dict[int, int] = {}
    for ev in evs:
        steps_per_block[ev.block] = steps_per_block.get(ev.block, 0) + 1
    # (a block never spends more steps than it has masks: LLaDA would run forwards that reveal nothing)
    assert list(steps_per_block.values()) == [min(s, block) for s in split_steps(steps, seq_len // block)]


def test_one_token_per_step_when_steps_cover_positions(llms):
    p = SamplingParams(max_tokens=8, block_size=4, temperature=0, ignore_eos=True)  # default steps
    evs = _events(llms["prefix_causal"], PROMPTS[1], p)
    assert all(len(ev.revealed) == 1 for ev in evs)
    assert [ev.step for ev in evs] == list(range(8))


@pytest.mark.parametrize("attention", ["prefix_causal", "bidirectional"])
@pytest.mark.parametrize("max_tokens", [5, 6, 7])
def test_default_steps_reveal_one_token_per_step_when_max_tokens_is_not_a_block_multiple(llms, attention,
                                                                                        max_tokens):
    """The default step budget covers the whole canvas (max_tokens rounded up to the block): one token per step in
    every block. It used to be max_tokens, shared with the last block's hidden positions, so every block revealed
    more than one token in some step (max_tokens=6, block 4: 3 steps for the first block's 4 masks)."""
    p = SamplingParams(max_tokens=max_tokens, block_size=4, temperature=0, ignore_eos=True)
    evs = _events(llms[attention], PROMPTS[1], p)
    assert all(len(ev.revealed) <= 1 for ev in evs)  # hidden tail reveals are not shown: 0 or 1 visible
    assert [len(ev.revealed) for ev in evs if ev.block == 0] == [1, 1, 1, 1]
    assert sum(len(ev.revealed) for ev in evs) == max_tokens and evs[-1].finished


@pytest.mark.parametrize("max_tokens", [5, 7, 9])
@pytest.mark.parametrize("kind", ["absolute", "sub_block"])
def test_default_steps_are_one_per_position_in_uneven_windows(max_tokens, kind):
    """Windows of unequal size get their own step counts by default: a partial first block under absolute block
    alignment (SDAR, Fast-dLLM v2) and sub-block windows that do not divide the block (an even split of the budget
    revealed 2 tokens in some steps there)."""
    if kind == "absolute":
        m = loaded(attention="block_causal", block_size=4, block_alignment="absolute", fixed_block_size=True)
        p = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    else:
        m = loaded(attention="block_causal", block_size=8, block_alignment="absolute", fixed_block_size=True)
        p = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, sub_block_size=3)
    evs = list(LLM(m).stream(PROMPTS[0], p))
    assert all(len(ev.revealed) <= 1 for ev in evs)
    assert sum(len(ev.revealed) for ev in evs) == max_tokens and evs[-1].finished


def test_threshold_one_reveals_exactly_one_per_step(llms):
    p = SamplingParams(max_tokens=8, block_size=4, temperature=0, threshold=1.0, ignore_eos=True)
    evs = _events(llms["bidirectional"], PROMPTS[0], p)
    assert len(evs) == 8 and all(len(ev.revealed) == 1 for ev in evs)


def test_threshold_low_reveals_many_and_block_always_completes(llms):
    p = SamplingParams(max_tokens=8, block_size=4, temperature=0, threshold=0.0, ignore_eos=True, steps=1)
    evs = _events(llms["bidirectional"], PROMPTS[0], p)
    assert len(evs) == 2 and all(len(ev.revealed) == 4 for ev in evs)  # steps ignored in threshold mode


# ---------------------------------------------------------------- determinism and batching
def test_same_seed_same_output_different_seed_differs(llms):
    llm = llms["bidirectional"]
    a = llm.generate(PROMPTS[0], SamplingParams(max_tokens=16, temperature=1.0, seed=1, ignore_eos=True))
    b = llm.generate(PROMPTS[0], SamplingParams(max_tokens=16, temperature=1.0, seed=1, ignore_eos=True))
    c = llm.generate(PROMPTS[0], SamplingParams(max_tokens=16, temperature=1.0, seed=2, ignore_eos=True))
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids
    assert a[0].outputs[0].token_ids != c[0].outputs[0].token_ids


@pytest.mark.parametrize("attention", ["prefix_causal", "block_causal", "bidirectional"])
@pytest.mark.parametrize("cache", ["none", "auto"])
def test_batch_invariance(llms, attention, cache):
    """Each row of a batch of different prompt lengths and parameters equals generating it alone."""
    llm = llms[attention]
    params = [SamplingParams(max_tokens=10, temperature=0.8, seed=3, cache=cache, ignore_eos=True),
              SamplingParams(max_tokens=7, temperature=0, block_size=2, cache=cache, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=1.0, top_k=5, seed=9, threshold=0.3, cache=cache,
                             cfg_scale=0.5 if attention == "bidirectional" else 0.0, ignore_eos=True)]
    alone = [llm.generate(p, sp)[0].outputs[0].token_ids for p, sp in zip(PROMPTS, params)]
    seqs = []
    for i, (p, sp) in enumerate(zip(PROMPTS, params)):
        seqs += llm.make_sequences(llm.encode(p), sp, f"r{i}")
    assert [s.output_ids for s in step_together(llm.denoiser, seqs)] == alone


@pytest.mark.parametrize("attention", ["prefix_causal", "block_causal"])
def test_exact_cache_equals_no_cache(llms, attention):
    llm = llms[attention]
    for block in (1, 3, 4):
        for prompt in PROMPTS:
            outs = [llm.generate(prompt, SamplingParams(max_tokens=11, temperature=0, block_size=block, cache=c,
                                                        ignore_eos=True))[0].outputs[0]
                    for c in ("none", "auto")]
            assert outs[0].token_ids == outs[1].token_ids, (block, prompt)


def test_request_joining_mid_flight_gets_same_tokens(llms):
    llm = llms["prefix_causal"]
    from unmask.engine.scheduler import Scheduler

    sp = SamplingParams(max_tokens=12, temperature=0.7, seed=5, ignore_eos=True)
    alone = llm.generate(PROMPTS[1], sp)[0].outputs[0].token_ids
    first = llm.make_sequences(llm.encode(PROMPTS[0]), SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), "a")[0]
    late = llm.make_sequences(llm.encode(PROMPTS[1]), sp, "b")[0]
    sched = Scheduler(llm.denoiser, max_batch_size=4)
    sched.add(first)
    for _ in range(5):
        sched.step()
    sched.add(late)
    while sched.has_work():
        sched.step()
    assert late.output_ids == alone


def test_generate_iter_streams_requests_through_a_full_batch(llms, monkeypatch):
    """generate_iter: requests with their own parameters, read lazily, yielded as they finish (completion order)
    with the tokens each gets alone; a finished request's slot is refilled at the next step, so the batch stays full
    while requests remain."""
    llm = llms["prefix_causal"]
    from unmask.engine.scheduler import Scheduler

    reqs = [(PROMPTS[i % 3], SamplingParams(max_tokens=m, temperature=t, seed=i, ignore_eos=True, block_size=1))
            for i, (m, t) in enumerate([(9, 0), (3, 0.8), (6, 0), (2, 0), (7, 0.5)])]
    alone = [llm.generate(p, sp)[0].outputs[0].token_ids for p, sp in reqs]
    read, running = [], []
    real_step = Scheduler.step

    def step(self):
        events = real_step(self)
        running.append(len(self.running) + sum(1 for e in events if e.finished))
        return events

    monkeypatch.setattr(Scheduler, "step", step)

    def source():
        for i, r in enumerate(reqs):
            read.append(i)
            yield r

    old_batch = llm.max_batch_size
    llm.max_batch_size = 2
    try:
        it = llm.generate_iter(source(), lookahead=1)
        first_i, first = next(it)
        assert len(read) == 3  # 2 running + 1 ahead, not all 5
        got = dict([(first_i, first)] + list(it))
    finally:
        llm.max_batch_size = old_batch
    assert first_i == 1  # the shortest of the first two requests finishes first
    assert {i: o.outputs[0].token_ids for i, o in got.items()} == dict(enumerate(alone))
    # one token per step each: 27 tokens = 11 steps with both slots busy, then the last (7-token) request's
    # remaining 5 alone; a batch that waited for its slowest member before refilling would show 1-slot steps earlier
    assert running == [2] * 11 + [1] * 5
    with pytest.raises(ParamError, match="max_tokens"):
        list(llm.generate_iter([(PROMPTS[0], SamplingParams(max_tokens=10 ** 6))]))


def test_abort_frees_slot_and_cache(llms):
    llm = llms["prefix_causal"]
    from unmask.engine.scheduler import Scheduler

    seq = llm.make_sequences(llm.encode(PROMPTS[0]), SamplingParams(max_tokens=32, ignore_eos=True), "x")[0]
    sched = Scheduler(llm.denoiser)
    sched.add(seq)
    sched.step()
    assert seq.cache_bytes() > 0
    evs = sched.abort("x")
    assert evs and evs[0].finish_reason == "abort"
    assert not sched.running and seq.cache_bytes() == 0


# ---------------------------------------------------------------- outputs, EOS, stop, lengths
def test_never_mask_token_and_length_never_past_max_tokens(llms):
    for att, llm in llms.items():
        for mt in (1, 5, 9):
            out = llm.generate(PROMPTS, SamplingParams(max_tokens=mt, block_size=4, temperature=1.0, seed=0))
            for o in out:
                ids = o.outputs[0].token_ids
                assert len(ids) <= mt
                assert llm.model.dllm.mask_token_id not in ids
                if o.outputs[0].finish_reason == "length":
                    assert len(ids) == mt


def test_forbidden_ids_never_sampled_even_when_favoured():
    logits = torch.zeros(3, 10)
    logits[:, 7] = 50.0  # the mask id dominates
    sp = resolve_params(SamplingParams(temperature=1.0, seed=0))
    c = sample_candidates(logits, sp, Draws(0, 0), forbidden_ids=torch.tensor([7]))
    assert 7 not in c.tokens.tolist()


def test_top_p_keeps_smallest_nucleus_and_top_k():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = torch.isfinite(filter_top_k_top_p(logits.clone(), 0, 0.7))
    assert kept.tolist() == [[True, True, False, False]]
    kept = torch.isfinite(filter_top_k_top_p(logits.clone(), 1, 1.0))
    assert kept.tolist() == [[True, False, False, False]]


def test_eos_ends_request_and_is_counted_not_rendered():
    m = loaded(attention="prefix_causal")
    eos = m.dllm.eos_token_ids[0]
    with torch.no_grad():  # make EOS overwhelmingly likely after a few tokens
        m.model.lm_head.weight[eos] = m.model.lm_head.weight.mean(0) * 0 + 0.0
        m.model.lm_head.bias = None
    llm = LLM(m)
    sp = SamplingParams(max_tokens=12, temperature=0, constraints={})
    out = llm.generate(PROMPTS[0], sp)[0].outputs[0]
    if eos in out.token_ids:
        assert out.token_ids[-1] == eos and out.finish_reason == "stop"
        assert out.token_ids.count(eos) == 1
    # min_tokens forbids EOS at the first positions, ignore_eos never stops on it
    out2 = llm.generate(PROMPTS[0], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].outputs[0]
    assert out2.finish_reason == "length" and len(out2.token_ids) == 12


def test_min_tokens_forbids_eos_early():
    m = loaded(attention="bidirectional")
    eos = m.dllm.eos_token_ids
    with torch.no_grad():
        for e in eos:
            m.model.lm_head.weight[e] = m.model.lm_head.weight[e] * 0 + 1.0  # EOS strongly preferred
    llm = LLM(m)
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=8, temperature=0))[0].outputs[0]
    out_min = llm.generate(PROMPTS[0], SamplingParams(max_tokens=8, temperature=0, min_tokens=5))[0].outputs[0]
    assert len(out_min.token_ids) >= 5 and not (set(out_min.token_ids[:5]) & set(eos))
    assert len(out.token_ids) <= len(out_min.token_ids)


def test_stop_string_truncates_and_reports_stop(llms):
    llm = llms["prefix_causal"]
    full = llm.generate(PROMPTS[0], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0].outputs[0]
    assert len(full.text) > 4
    stop = full.text[3:5]
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop=[stop]))[0]
    o = out.outputs[0]
    assert o.finish_reason == "stop" and stop not in o.text and full.text.startswith(o.text)
    assert o.text == full.text[: full.text.find(stop)]
    # streamed text never contains a stop-string prefix beyond the final text
    for ev in llm.stream(PROMPTS[0], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop=[stop])):
        assert o.text.startswith(ev.text)


def test_stream_events_one_per_step_monotone_text(llms):
    llm = llms["bidirectional"]
    evs = _events(llm, PROMPTS[2], SamplingParams(max_tokens=8, block_size=4, temperature=0, cfg_scale=1.0,
                                                   ignore_eos=True))
    assert [e.step for e in evs] == list(range(len(evs)))
    assert [e.nfe for e in evs] == [2 * (i + 1) for i in range(len(evs))]  # CFG: two forwards per step
    assert evs[-1].finished and not any(e.finished for e in evs[:-1])
    for a, b in zip(evs, evs[1:]):
        assert b.text.startswith(a.text)
        assert sum(t is None for t in b.canvas) <= sum(t is None for t in a.canvas)
    assert all(t is not None for t in evs[-1].canvas)


def test_cfg_zero_is_one_forward_per_step(llms):
    evs = _events(llms["bidirectional"], PROMPTS[0], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert [e.nfe for e in evs] == [1, 2, 3, 4]


def test_penalties_change_output_and_reduce_repeats(llms):
    llm = llms["prefix_causal"]
    base = llm.generate(PROMPTS[1], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0].outputs[0]
    pen = llm.generate(PROMPTS[1], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True,
                                                  repetition_penalty=3.0, frequency_penalty=2.0))[0].outputs[0]
    assert len(set(pen.token_ids)) >= len(set(base.token_ids))


# ---------------------------------------------------------------- infilling and block alignment
def test_suffix_infilling_bidirectional_and_rejected_for_causal(llms):
    llm = llms["bidirectional"]
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=6, temperature=0, suffix=" the end", ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 6
    with pytest.raises(ParamError, match="suffix"):
        llms["prefix_causal"].generate(PROMPTS[0], SamplingParams(max_tokens=6, suffix="x"))
    with pytest.raises(ParamError, match="constraints"):
        llms["block_causal"].generate(PROMPTS[0], SamplingParams(max_tokens=6, constraints={0: 5}))


def test_constraints_fix_tokens(llms):
    llm = llms["bidirectional"]
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=6, temperature=0, constraints={0: 42, 3: 43},
                                                  ignore_eos=True))[0].outputs[0]
    assert out.token_ids[0] == 42 and out.token_ids[3] == 43


def test_absolute_block_alignment_completes_prompt_block_first():
    m = loaded(attention="block_causal", block_size=4, block_alignment="absolute", fixed_block_size=True)
    llm = LLM(m)
    ids = llm.encode(PROMPTS[0])
    seq = llm.make_sequences(ids, SamplingParams(max_tokens=5), "a")[0]
    P = len(ids)
    assert seq.blocks[0][0] == (P // 4) * 4 and (P + seq.gen_len) % 4 == 0 and seq.gen_len >= 5
    with pytest.raises(ParamError, match="block_size"):
        llm.generate(PROMPTS[0], SamplingParams(max_tokens=5, block_size=8))
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 5


def test_context_overflow_names_both_numbers(llms):
    with pytest.raises(ParamError, match="exceeds the model's context of 512"):
        llms["prefix_causal"].generate(PROMPTS[0], SamplingParams(max_tokens=600))


@pytest.mark.parametrize("attention", ["prefix_causal", "block_causal", "bidirectional"])
def test_request_that_fits_the_context_exactly_is_served(llms, attention):
    """prompt + max_tokens == context with a block size that does not divide max_tokens: the last block is cut
    short at the context edge instead of the request being refused; one token more is refused, naming max_tokens
    and how many fit; a prompt that fills the context is refused naming the prompt."""
    llm = llms[attention]
    ctx = llm.model.max_context
    prompt = [5 + i % 50 for i in range(ctx - 7)]             # 7 positions left; blocks of 4 would need 8
    params = SamplingParams(max_tokens=7, block_size=4, temperature=0, ignore_eos=True, steps=7)
    out = llm.generate([prompt], params)[0].outputs[0]
    assert len(out.token_ids) == 7 and out.finish_reason == "length"
    with pytest.raises(ParamError, match="at most 7 new tokens fit") as exc:
        llm.generate([prompt], SamplingParams(max_tokens=8, block_size=4))
    assert exc.value.field == "max_tokens"
    with pytest.raises(ParamError, match="leaves no room") as exc:
        llm.generate([[5 + i % 50 for i in range(ctx)]], SamplingParams(max_tokens=1))
    assert exc.value.field == "prompt"


@pytest.mark.parametrize("field,value", [("max_tokens", 0), ("temperature", -1), ("top_p", 0), ("top_k", -2),
                                         ("steps", 0), ("threshold", 1.5), ("remasking", "best"),
                                         ("cfg_scale", float("nan")), ("stop", ["a", "b", "c", "d", "e"]),
                                         ("stop", [""]), ("cache", "full"), ("repetition_penalty", 0)])
def test_bad_params_name_the_field(field, value):
    with pytest.raises(ParamError) as exc:
        SamplingParams(**{field: value})
    assert exc.value.field == field


def test_attention_masks_take_effect():
    """Bidirectional rows see later tokens; prefix-causal committed rows do not (docs/design.md#decisions)."""
    from unmask.engine.attention import build_attention_mask, canvas_groups

    m = loaded()
    x = torch.tensor([[5, 9, 17, 33, 40, 41]])
    y = x.clone()
    y[0, -1] = 77
    pos = torch.arange(6)[None]

    def logits(ids, att):
        g, s, c = canvas_groups(6, att, committed_until=4, active_start=4, active_end=6, block_size=2,
                                block_origin=4)
        v = torch.ones(1, 6, dtype=torch.bool)
        mask = build_attention_mask(pos, g[None], s[None], v, pos, g[None], c[None], v)
        with torch.no_grad():
            return m.logits(m.hidden_states(ids, pos, mask)[0])

    for att, changes_early in (("bidirectional", True), ("prefix_causal", False)):
        a, b = logits(x, att), logits(y, att)
        assert (not torch.allclose(a[0], b[0], atol=1e-5)) == changes_early, att
        assert not torch.allclose(a[4], b[4], atol=1e-5)  # the active block is bidirectional in both


# ---------------------------------------------------------------- command line
def test_cli_generate_json_and_bad_value(tmp_path):
    from unmask.engine.checkpoint import write_checkpoint

    m = loaded()
    write_checkpoint(tmp_path / "ckpt", m.model, m.tokenizer, m.dllm)
    cmd = [sys.executable, "-m", "unmask.cli.main", "generate", str(tmp_path / "ckpt"), "--prompt", "Hello",
           "--max-tokens", "6", "--json", "--show-steps"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    obj = json.loads(r.stdout)
    assert set(obj) == {"text", "token_ids", "finish_reason", "steps", "nfe", "seconds", "tokens_per_second"}
    assert obj["steps"] >= 1 and obj["nfe"] >= obj["steps"]
    assert "[block 0 step 0" in r.stderr
    bad = subprocess.run(cmd[:-2] + ["--top-p", "0"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "top-p" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    missing = subprocess.run([sys.executable, "-m", "unmask.cli.main", "generate", str(tmp_path / "nope"),
                              "--prompt", "x"], capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "nope" in missing.stderr


def test_sub_block_windows_reveal_window_by_window():
    """Fast-dLLM v2 sub-blocks: inside a block of 8, windows of 4 are revealed in order; the step budget is split
    over windows; attention stays per block (exact cache still equals no cache)."""
    m = loaded(attention="block_causal", block_size=8, block_alignment="absolute", fixed_block_size=True)
    llm = LLM(m)
    ids = llm.encode(PROMPTS[1])
    P = len(ids)
    sp = SamplingParams(max_tokens=16, temperature=0, sub_block_size=4, ignore_eos=True, steps=8)
    seq = llm.make_sequences(ids, sp, "w")[0]
    assert all(e - s <= 4 for _, s, e in seq.windows)
    assert sum(seq.window_steps) == 8 and len(seq.window_steps) == len(seq.windows)
    evs = list(llm.stream(ids, sp))
    order = [(seq.prompt_len + r.position) for ev in evs for r in ev.revealed]
    win_of = [next(i for i, (_, s, e) in enumerate(seq.windows) if s <= p < e) for p in order]
    assert win_of == sorted(win_of)  # never a position of a later window before an earlier one is full
    outs = [llm.generate(ids, SamplingParams(max_tokens=16, temperature=0, sub_block_size=4, ignore_eos=True,
                                             cache=c))[0].outputs[0].token_ids for c in ("none", "auto")]
    assert outs[0] == outs[1]
    # the window defaults to the whole block: identical to not setting it
    a = llm.generate(ids, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0].outputs[0].token_ids
    b = llm.generate(ids, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True,
                                         sub_block_size=8))[0].outputs[0].token_ids
    assert a == b
    with pytest.raises(ParamError, match="sub_block_size"):
        SamplingParams(sub_block_size=0)


# ---------------------------------------------------------------- request validation (one bad request, one error)
@pytest.mark.parametrize("field,params", [
    ("stop_token_ids", dict(min_tokens=1, stop_token_ids=[10 ** 6])),
    ("stop_token_ids", dict(stop_token_ids=["vocab"])),
])
def test_token_ids_outside_the_vocabulary_are_a_param_error(llms, field, params):
    llm = llms["prefix_causal"]
    params = {k: [llm.model.vocab_size if t == "vocab" else t for t in v] if isinstance(v, list) else v
              for k, v in params.items()}  # the first id past the LM head's rows
    with pytest.raises(ParamError) as e:
        llm.generate("Hi", SamplingParams(max_tokens=4, temperature=0, **params))
    assert e.value.field == field
    with pytest.raises(ParamError) as e:
        llm.generate([[1, 2, 10 ** 6]], SamplingParams(max_tokens=4, temperature=0))
    assert e.value.field == "prompt"
    bid = llms["bidirectional"]
    with pytest.raises(ParamError) as e:
        bid.generate("Hi", SamplingParams(max_tokens=4, temperature=0, constraints={0: 999}))
    assert e.value.field == "constraints"
    with pytest.raises(ParamError) as e:
        bid.generate("Hi", SamplingParams(max_tokens=4, temperature=0, suffix=[3, -1]))
    assert e.value.field == "suffix"


@pytest.mark.parametrize("field", ["max_tokens", "top_k", "min_tokens", "steps", "seed", "block_size",
                                   "sub_block_size"])
def test_integers_too_large_for_a_float_give_a_param_error_or_an_answer(llms, field):
    """10**400 overflows float(): it must end as a ParamError naming the field, or be served (top_k, steps:
    no upper bound, a k past the vocabulary keeps every token, steps are capped by the masks; block_size,
    sub_block_size), never crash."""
    big = 10 ** 400
    kw = {"max_tokens": 4, "temperature": 0, field: big}
    if field == "seed":
        with pytest.raises(ParamError) as e:
            SamplingParams(**kw)
        assert e.value.field == "seed"
        return
    try:
        out = llms["prefix_causal"].generate("Hi", SamplingParams(**kw))
    except ParamError as e:
        assert e.field == field
        return
    # served: a block (window) longer than the canvas is one block (window) cut at the canvas end
    assert field in ("top_k", "steps", "block_size", "sub_block_size") and len(out[0].outputs[0].token_ids) == 4


def test_largest_seed_with_several_choices_wraps(llms):
    outs = llms["prefix_causal"].generate("Hi", SamplingParams(max_tokens=4, temperature=1.0, seed=2 ** 63 - 1),
                                          n=2)
    assert len(outs[0].outputs) == 2


def test_step_events_never_report_positions_past_max_tokens(llms):
    # max_tokens 5 at block 4: positions 5-7 of the second block are decoded but never shown
    for att, llm in llms.items():
        evs = _events(llm, "Hello", SamplingParams(max_tokens=5, block_size=4, temperature=0, ignore_eos=True))
        assert evs and all(r.position < len(ev.canvas) == 5 for ev in evs for r in ev.revealed), att
        assert sum(len(ev.revealed) for ev in evs) == 5, att


def test_min_tokens_holds_back_stop_strings_like_vllm(llms):
    llm = llms["prefix_causal"]
    free = llm.generate("Hello", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].outputs[0]
    stop = free.text.strip()[:1]
    assert stop
    cut = llm.generate("Hello", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=[stop]))
    assert len(cut[0].outputs[0].token_ids) < 8  # the stop string occurs early without min_tokens
    held = llm.generate("Hello", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=[stop],
                                                min_tokens=8))[0].outputs[0]
    assert len(held.token_ids) >= 8
    assert held.token_ids == free.token_ids[:len(held.token_ids)]


def test_abort_keeps_the_partial_output(llms):
    """An aborted request reports what it generated so far (usage, the request log), not zero tokens."""
    from unmask.engine.scheduler import Scheduler

    llm = llms["prefix_causal"]
    p = SamplingParams(max_tokens=16, block_size=4, temperature=0, ignore_eos=True)
    full = llm.generate("Hello", p)[0].outputs[0].token_ids
    seq = llm.make_sequences(llm.encode("Hello"), p, "a")[0]
    sched = Scheduler(llm.denoiser, max_batch_size=1)
    sched.add(seq)
    for _ in range(9):
        sched.step()
    ev = seq.abort()
    assert ev.finish_reason == "abort" and 4 <= len(seq.output_ids) < 16
    assert seq.output_ids == full[: len(seq.output_ids)]


def test_checkpoint_default_threshold_applies_only_without_steps_or_threshold():
    from unmask.engine.config import CheckpointError, DllmConfig

    lm = loaded(block_size=4)
    # threshold 0: every masked position is revealed at once (one step per block); the tiny random model is
    # never confident, so any threshold it reaches would be indistinguishable from quota decoding
    lm.dllm.default_sampling = {"temperature": 0.0, "threshold": 0.0}
    llm = LLM(lm)
    prompt = [5, 6, 7, 8]

    def run(**kw):
        return llm.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True, seed=0, **kw))[0].outputs[0]

    default, explicit = run(), run(threshold=0.0)
    assert default.token_ids == explicit.token_ids and default.nfe == explicit.nfe == 3
    quota = run(steps=12)  # asking for steps means quota decoding: one token per step here
    assert quota.nfe == 12
    assert run(remasking="random").nfe == 12  # another remasking order: quota decoding as well
    assert resolve_params(SamplingParams(steps=3), {"threshold": 0.5}).threshold is None
    assert resolve_params(SamplingParams(remasking="margin"), {"threshold": 0.5}).threshold is None
    assert resolve_params(SamplingParams(), {"threshold": 0.5}).threshold == 0.5
    assert resolve_params(SamplingParams(threshold=0.9), {"threshold": 0.5}).threshold == 0.9
    base = dict(family="a2d", mask_token_id=1, attention="prefix_causal", block_size=4, logit_shift=True,
                eos_token_ids=[0])
    for bad, field in (({"threshold": 1.5}, "threshold"), ({"threshold": "0.5"}, "threshold"),
                       ({"top_k": 5}, "top_k"), ({"temperature": float("nan")}, "temperature"),
                       ({"threshold": 10 ** 400}, "threshold"), ({"temperature": -(10 ** 400)}, "temperature")):
        with pytest.raises(CheckpointError, match=f"default_sampling.{field}"):
            DllmConfig(**base, default_sampling=bad)


def _set_partitions(items):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _set_partitions(rest):
        for i in range(len(part)):
            yield part[:i] + [[first] + part[i]] + part[i + 1:]
        yield [[first]] + part


@pytest.mark.parametrize("seed", range(6))
def test_plan_forwards_is_the_cheapest_split(seed):
    from unmask.engine.denoiser import plan_forwards

    rng = torch.Generator().manual_seed(seed)
    n = 1 + seed % 6
    widths = torch.randint(1, 60, (n,), generator=rng).tolist()
    lanes = torch.randint(1, 3, (n,), generator=rng).tolist()
    overhead = [0, 4, 16, 1000][seed % 4]

    def cost(groups):
        return sum(overhead + sum(lanes[i] for i in g) * max(widths[i] for i in g) for g in groups)

    groups = plan_forwards(widths, lanes, overhead)
    assert sorted(i for g in groups for i in g) == list(range(n))
    assert cost(groups) == min(cost(p) for p in _set_partitions(list(range(n))))
    if overhead == 1000:
        assert len(groups) == 1  # never worth a second forward
    assert plan_forwards([1] * 31 + [40], [1] * 32, 16) == [list(range(31)), [31]]


def test_a_forwards_fixed_cost_in_rows_follows_the_models_size():
    """``forward_overhead_rows``: 16 rows of weight streaming plus the host's per-layer work over a row's FLOPs, so
    a tiny model (a padded row costs it next to nothing) is not split into several forwards and a real one is."""
    from types import SimpleNamespace

    from unmask.engine.prefill_cost import HOST_FLOPS_PER_LAYER, forward_overhead_rows

    def model(layers, params):  # ``params`` parameters on the meta device (no memory)
        m = torch.nn.Linear(1, params, bias=False, device="meta")
        m.config = SimpleNamespace(num_hidden_layers=layers)
        return m

    small, big = model(2, 100_000), model(30, 135_000_000)  # the tests' tiny Llama; SmolLM2-135M
    assert forward_overhead_rows(small) == int(16 + 2 * HOST_FLOPS_PER_LAYER / (2 * 100_000)) > 400
    assert 16 <= forward_overhead_rows(big) <= 30
    packed = torch.nn.Module()  # a low-bit linear keeps its weights in buffers: they count all the same
    packed.config, packed.proj = big.config, torch.nn.Module()
    packed.proj.in_features, packed.proj.out_features = 1, 135_000_000
    assert forward_overhead_rows(packed) == forward_overhead_rows(big)


def test_prefill_joining_one_row_steps_runs_apart_and_changes_nothing(llms, monkeypatch):
    """A joining request's prompt prefill is forwarded apart from the others' one-row block-1 steps (no [B, prompt]
    padding) at a real model's forward cost (16 rows; the tiny model's own, hundreds of rows, never splits), and
    every request (CFG lanes included) still gets the tokens it gets alone."""
    from unmask.engine.scheduler import Scheduler

    llm = llms["prefix_causal"]
    monkeypatch.setattr(llm.denoiser, "forward_overhead_rows", 16)
    params = [SamplingParams(max_tokens=10, temperature=0.8, seed=s, block_size=1, ignore_eos=True,
                             cfg_scale=1.5 if s == 2 else 0.0) for s in range(3)]
    alone = [llm.generate(PROMPTS[i], p)[0].outputs[0].token_ids for i, p in enumerate(params)]
    seqs = [llm.make_sequences(llm.encode(PROMPTS[i]), p, f"r{i}")[0] for i, p in enumerate(params)]
    sched = Scheduler(llm.denoiser, max_batch_size=4)
    sched.add(seqs[0])
    sched.add(seqs[2])
    for _ in range(3):
        sched.step()
    before = llm.denoiser.forwards
    sched.add(seqs[1])  # its prompt prefill joins the others' one-row steps
    sched.step()
    assert llm.denoiser.forwards - before == 2
    while sched.has_work():
        sched.step()
    assert [s.output_ids for s in seqs] == alone


def test_generate_checks_every_request_before_the_first_step_with_several_choices(llms, monkeypatch):
    """generate() builds (and so validates) every request before any step runs, also with n > 1 (the read-ahead
    counts sequences): a bad last prompt must not cost the others' decoding first."""
    llm = llms["prefix_causal"]
    from unmask.engine.scheduler import Scheduler

    stepped = []
    monkeypatch.setattr(Scheduler, "step", lambda self: stepped.append(1) or [])
    old = llm.max_batch_size
    llm.max_batch_size = 2
    try:
        with pytest.raises(ParamError):
            llm.generate(["Hi", "Hey", "x " * 600], SamplingParams(max_tokens=4), n=3)
    finally:
        llm.max_batch_size = old
    assert not stepped


# ---------------------------------------------------------------- the redesign's seams
def test_engine_loop_equals_llm_generate_and_aborts(llms):
    """``Engine`` (add_request / step / abort / has_unfinished) is the one loop: its outputs are LLM.generate's."""
    from unmask.engine import Engine

    llm = llms["prefix_causal"]
    sp = SamplingParams(max_tokens=9, temperature=0.8, seed=4, ignore_eos=True)
    want = llm.generate(PROMPTS[0], sp, n=2)[0].outputs
    engine = Engine(llm.model, max_batch_size=4)
    engine.add_request(llm.encode(PROMPTS[0]), sp, "a", n=2)
    engine.add_request(llm.encode(PROMPTS[1]), sp, "b")
    got, aborted = {}, []
    while engine.has_unfinished():
        for ev in engine.step():
            if ev.request_id == "b" and ev.step == 1 and not ev.finished:
                aborted = engine.abort("b")
            if ev.finished and ev.request_id == "a":
                got[ev.index] = ev.output
    assert [got[0].token_ids, got[1].token_ids] == [o.token_ids for o in want]
    assert [got[0].logprobs, got[0].nfe, got[0].steps] == [want[0].logprobs, want[0].nfe, want[0].steps]
    assert len(aborted) == 1 and aborted[0].finish_reason == "abort" and aborted[0].output.finish_reason == "abort"
    assert aborted[0].output.token_ids == aborted[0].canvas[: aborted[0].num_tokens]


def test_speculative_options_nested_and_flat_are_one_request():
    from unmask.engine import SpeculativeOptions
    from unmask.engine.plan import resolve

    nested = SamplingParams(speculative=True, speculative_options=SpeculativeOptions(epsilon=0.03))
    flat = SamplingParams.from_flat(speculative=True, speculative_epsilon=0.03)
    assert nested == flat and flat.speculative_epsilon == 0.03 and flat.speculative_ratio is None
    assert SamplingParams(speculative_options=SpeculativeOptions()).speculative_options is None  # all defaults
    with pytest.raises(ParamError) as err:  # errors keep the HTTP (flat) names
        SamplingParams(speculative_options=SpeculativeOptions(ratio=1.5))
    assert err.value.field == "speculative_ratio"
    with pytest.raises(ParamError) as err:
        SamplingParams(speculative_options={"epsilon": 0.1})
    assert err.value.field == "speculative_options"
    dllm = loaded(block_size=4).dllm
    plan = resolve(SamplingParams(speculative=True, temperature=0, seed=1, speculative_options=SpeculativeOptions(
        ratio=0.5)), dllm)
    assert plan.speculative and plan.draft_block == 4 and plan.ratio == 0.5 and plan.no_repeat_ngram == 3
    assert plan.branches == 3 and plan.for_choice(1).seed == 2 and plan.for_choice(1).params.seed == 2
    with pytest.raises(Exception):
        plan.temperature = 1.0  # frozen


def test_layout_length_without_building_and_one_forward_path():
    """The KV-budget fit reads the canvas length from the layout alone; the denoiser never branches on the
    strategy's type."""
    import inspect

    from unmask.engine import denoiser
    from unmask.engine.layout import build_layout

    lm = loaded(block_size=4)
    llm = LLM(lm)
    for m in (1, 5, 8, 13):
        seq = llm.make_sequences([5] * 7, SamplingParams(max_tokens=m), "x")[0]
        lay = build_layout(7, m, 0, 4, 4, lm.dllm.block_alignment == "absolute", lm.max_context)
        assert lay.length == seq.length and list(lay.blocks) == seq.blocks and list(lay.window_steps) == seq.window_steps
    assert "isinstance" not in inspect.getsource(denoiser)
