"""Speculative sampling (temperature > 0) in self-speculative decoding: the verification rule reproduces the target
distribution (Leviathan et al. 2023), end to end the revealed tokens are distributed as block_size=1 sampling from
the causal path, and a seeded request is reproducible and batch-invariant."""
from __future__ import annotations

import pytest
import torch

from tiny import loaded
from unmask.engine import LLM, SamplingParams
from unmask.engine.noise import DRAFT, Draws
from unmask.engine.sampler import sample_from_probs
from unmask.engine.speculative import speculative_accept


def _random_dist(gen, v, sharp=2.0):
    return torch.softmax(sharp * torch.randn(v, generator=gen, dtype=torch.float64), -1)


def _tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


@pytest.mark.parametrize("case", range(2))
def test_accept_rule_reproduces_the_target_distribution(case):
    """Drafts d0, d1 drawn from q; what is revealed at the two positions must follow p (position 1: given d0 was
    accepted), and the first draft must be accepted at the rate sum(min(p, q)) - not more (accepting drafts from q
    blindly) and not less (rejecting everything and sampling p would also give p)."""
    gen = torch.Generator().manual_seed(100 + case)
    V, N = 6, 20000
    p = torch.stack([_random_dist(gen, V) for _ in range(3)])
    q = torch.stack([_random_dist(gen, V) for _ in range(2)])
    assert _tv(p[0], q[0]) > 0.2  # the test has power: q alone is far from p
    first = torch.zeros(V, dtype=torch.float64)
    second = torch.zeros(V, dtype=torch.float64)
    accepted0 = 0
    for i in range(N):  # counter-based draws: a fresh step each time
        drafts = sample_from_probs(q, Draws(7 + case, i), DRAFT).tolist()
        n, tok = speculative_accept(p, q, drafts, Draws(7 + case, i))
        revealed = drafts[:n] + [tok]
        first[revealed[0]] += 1
        if n >= 1:
            accepted0 += 1
            second[revealed[1]] += 1
    assert (first / N - p[0]).abs().max() < 0.014  # 4 sigma
    assert (second / second.sum() - p[1]).abs().max() < 0.025
    assert abs(accepted0 / N - float(torch.minimum(p[0], q[0]).sum())) < 0.014


def test_equal_distributions_accept_every_draft():
    gen = torch.Generator().manual_seed(3)
    p = torch.stack([_random_dist(gen, 8) for _ in range(4)])
    for i in range(200):
        drafts = sample_from_probs(p[:3], Draws(3, i), DRAFT).tolist()
        assert speculative_accept(p, p[:3], drafts, Draws(3, i))[0] == 3


def test_sample_from_probs_never_draws_zero_probability_tokens():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5], [1.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    draws = torch.stack([sample_from_probs(probs, Draws(0, i)) for i in range(300)])
    assert set(draws[:, 0].tolist()) == {1, 3} and set(draws[:, 1].tolist()) == {0}


# ---------------------------------------------------------------- end to end on a tiny model
@pytest.fixture(scope="module")
def sharp_llm():
    """Sharp random weights: the mask rows' (drafter's) distribution differs clearly from the causal one."""
    return LLM(loaded(attention="prefix_causal", initializer_range=0.5), max_batch_size=64)


def _causal_probs(llm, ids: list[list[int]], temperature: float) -> torch.Tensor:
    """``[len(ids), V]`` next-token distributions of the causal path (plain causal forward = block_size=1 decoding
    of a prefix-causal model with the logit shift), at ``temperature``, never-generate ids excluded."""
    lm = llm.model
    with torch.no_grad():
        logits = lm.model(input_ids=torch.tensor(ids)).logits[:, -1].float()
    logits[:, lm.dllm.never_generate_ids] = float("-inf")
    return torch.softmax(logits.double() / temperature, -1)


def test_revealed_tokens_follow_block1_sampling(sharp_llm):
    """The second token (always verified: the first step has no drafts) has the marginal sum_x1 p(x1) p(x2 | x1)
    of block_size=1 sampling; the drafts' own marginal is far from it, so accepting them unchecked would fail."""
    llm, T, N = sharp_llm, 1.0, 1200
    prompt = llm.encode("The quick brown fox")
    p1 = _causal_probs(llm, [prompt], T)[0]
    support = (p1 > 1e-4).nonzero(as_tuple=True)[0].tolist()
    p2 = _causal_probs(llm, [prompt + [x] for x in support], T)
    marginal = (p1[support, None] * p2).sum(0)
    outs = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=T, block_size=4, speculative=True,
                                                 ignore_eos=True, seed=11), n=N)[0].outputs
    seen = torch.zeros_like(marginal)
    for o in outs:
        seen[o.token_ids[1]] += 1
    assert _tv(seen / N, marginal) < 0.08
    # the drafts for position 2 come from the mask group of step 1 (prompt only): their marginal is elsewhere
    seq = llm.make_sequences(prompt, SamplingParams(max_tokens=2, temperature=T, block_size=4, speculative=True,
                                                    ignore_eos=True, seed=11), "q")[0]
    llm.denoiser.step([seq])
    assert seq.draft_probs is not None and seq.draft_probs.shape == (1, marginal.numel())
    assert _tv(seq.draft_probs[0].cpu(), marginal) > 0.3


def _run_together(llm, requests):
    """Decode ``[(prompt, params), ...]`` in one batch; the finished sequences, in order."""
    from unmask.engine.scheduler import Scheduler

    sched = Scheduler(llm.denoiser, max_batch_size=8)
    seqs = [llm.make_sequences(llm.encode(p), sp, f"r{i}")[0] for i, (p, sp) in enumerate(requests)]
    for s in seqs:
        sched.add(s)
    while sched.has_work():
        sched.step()
    return seqs


def test_sampling_is_reproducible_batch_invariant_and_accepts_drafts(sharp_llm):
    llm = sharp_llm
    params = SamplingParams(max_tokens=24, temperature=0.7, top_p=0.95, block_size=4, speculative=True,
                            ignore_eos=True, seed=5)
    alone = _run_together(llm, [("Hello world", params)])[0]
    again = llm.generate("Hello world", params)[0].outputs[0]
    assert again.token_ids == alone.canvas[alone.prompt_len:].tolist()
    batch = _run_together(llm, [("Paris", SamplingParams(max_tokens=9, temperature=0.7, seed=1, speculative=True)),
                                ("Hello world", params),
                                ("One two three", SamplingParams(max_tokens=13, temperature=0.0, block_size=2))])
    assert batch[1].canvas.tolist() == alone.canvas.tolist()
    others = {tuple(llm.generate("Hello world", SamplingParams(
        max_tokens=24, temperature=0.7, top_p=0.95, block_size=4, speculative=True, ignore_eos=True,
        seed=s))[0].outputs[0].token_ids) for s in range(6)}
    assert len(others) > 1  # the seed matters


def test_drafts_are_accepted_where_drafter_and_causal_path_overlap():
    """With the default initialisation the mask rows and the causal rows agree often enough that some sampled
    drafts pass (min(1, p/q) > 0): steps reveal more than one token."""
    llm = LLM(loaded(attention="prefix_causal"))
    seq = llm.make_sequences(llm.encode("Hello world"), SamplingParams(
        max_tokens=24, temperature=0.7, block_size=4, speculative=True, ignore_eos=True, seed=5), "a")[0]
    while not seq.finished:
        llm.denoiser.step([seq])
    assert seq.accepted_drafts > 0 and seq.nfe < 24


def test_greedy_limit_equals_greedy_speculative(sharp_llm):
    """A vanishing temperature samples the argmax: the same tokens as greedy speculative decoding."""
    llm = sharp_llm
    kw = dict(max_tokens=12, block_size=4, speculative=True, ignore_eos=True)
    greedy = llm.generate("Hello world", SamplingParams(temperature=0, **kw))[0].outputs[0]
    cold = llm.generate("Hello world", SamplingParams(temperature=1e-4, seed=3, **kw))[0].outputs[0]
    assert cold.token_ids == greedy.token_ids
