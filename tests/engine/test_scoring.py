"""Prompt log-probabilities (engine/scoring.py): exact on a causal path (the parent's float32 log-likelihood),
a Monte-Carlo estimate on a bidirectional model whose mean over seeds lies within its standard error of a
many-sample estimate, refused where neither applies."""
from __future__ import annotations

import math

import pytest
import torch

from tiny import loaded
from unmask.engine import ParamError
from unmask.engine.scoring import score_prompt, scoring_method

PROMPT = [5, 17, 42, 99, 3, 250, 7, 18, 64, 120, 33, 2]


def _parent_logprobs(m, ids):
    with torch.no_grad():
        logits = m.model(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return [lp[i - 1, ids[i]].item() for i in range(1, len(ids))], lp


def test_causal_path_is_the_parent():
    m = loaded(attention="prefix_causal", logit_shift=True)
    s = score_prompt(m, PROMPT, top_k=3)
    want, lp = _parent_logprobs(m, PROMPT)
    assert s.method == "causal" and not s.estimate and s.logprobs[0] is None and s.top[0] is None
    assert max(abs(a - b) for a, b in zip(s.logprobs[1:], want)) < 1e-5
    assert abs(s.total - sum(want)) < 1e-4
    for i in range(1, len(PROMPT)):
        vals, idx = lp[i - 1].topk(3)
        assert list(s.top[i]) == idx.tolist()
        assert s.ranks[i] == int((lp[i - 1] > lp[i - 1, PROMPT[i]]).sum()) + 1


def test_block_causal_generation_aligned_is_causal_absolute_is_refused():
    assert scoring_method(loaded(attention="block_causal", logit_shift=True)) == "causal"
    m = loaded(attention="block_causal", logit_shift=False, block_alignment="absolute", fixed_block_size=True)
    assert scoring_method(m) is None
    with pytest.raises(ParamError, match="causal path"):
        score_prompt(m, PROMPT)


def test_monte_carlo_mean_over_seeds_within_its_stderr_of_many_samples():
    m = loaded(attention="bidirectional", logit_shift=False)
    assert scoring_method(m) == "monte_carlo"
    runs = [score_prompt(m, PROMPT, samples=32, seed=s) for s in range(8)]
    assert all(r.estimate and r.samples == 32 and r.stderr > 0 for r in runs)
    a = score_prompt(m, PROMPT, samples=32, seed=3)
    assert a.logprobs == runs[3].logprobs  # a fixed seed: the same estimate
    assert abs(sum(a.logprobs[1:]) - a.total) < 1e-6
    mean = sum(r.total for r in runs) / len(runs)
    stderr_of_mean = math.sqrt(sum(r.stderr ** 2 for r in runs)) / len(runs)
    many = score_prompt(m, PROMPT, samples=1024, seed=1000)
    assert abs(mean - many.total) <= 2 * math.hypot(stderr_of_mean, many.stderr), (mean, many.total, stderr_of_mean)
    assert all(abs(mean - many.total) <= r.stderr for r in runs)  # within each run's reported standard error
    # each run's own stderr covers the many-sample estimate within 3 standard errors
    assert all(abs(r.total - many.total) <= 3 * math.hypot(r.stderr, many.stderr) for r in runs)
    print(f"MC: mean of 8 x 32 = {mean:.3f} +- {stderr_of_mean:.3f}; 1024 samples = {many.total:.3f} "
          f"+- {many.stderr:.3f}; per-run stderr {runs[0].stderr:.3f}")


def test_monte_carlo_with_logit_shift_reads_the_previous_output():
    m = loaded(attention="bidirectional", logit_shift=True)  # Dream's layout
    s = score_prompt(m, PROMPT, samples=8, seed=0)
    assert s.estimate and all(v is not None and v <= 0 for v in s.logprobs[1:])


def test_limits():
    m = loaded()
    with pytest.raises(ParamError, match="samples"):
        score_prompt(m, PROMPT, samples=0)
    with pytest.raises(ParamError, match="context"):
        score_prompt(m, [1] * 600)


def test_async_engine_scores_on_its_thread():
    import asyncio

    from unmask.engine import AsyncEngine

    m = loaded()
    eng = AsyncEngine(m)
    try:
        s = asyncio.run(eng.score(PROMPT, top_k=2))
        assert s.logprobs == score_prompt(m, PROMPT, top_k=2).logprobs
        with pytest.raises(ParamError):
            asyncio.run(eng.score(PROMPT, samples=0))
    finally:
        eng.shutdown()


def test_llm_scores_a_string():
    from unmask.engine import LLM

    m = loaded()
    llm = LLM(m)
    s = llm.score("hello world", top_k=1)
    assert s.token_ids == llm.encode("hello world") and s.logprobs == score_prompt(m, s.token_ids, 1).logprobs


@pytest.mark.parametrize("attention", ["prefix_causal", "bidirectional"])
def test_ids_outside_the_vocabulary_are_a_param_error_naming_the_prompt(attention):
    """Was a 500 over HTTP (schemathesis: ``echo`` + ``logprobs`` with ``prompt: [1024]`` on a 321-token model):
    the id failed an embedding index inside the forward."""
    m = loaded(attention=attention, logit_shift=attention != "bidirectional")
    for bad in ([5, m.vocab_size], [-1, 5], [5, True]):
        with pytest.raises(ParamError, match="prompt") as err:
            score_prompt(m, bad)
        assert err.value.field == "prompt"
