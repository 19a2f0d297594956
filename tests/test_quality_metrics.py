"""Unit tests of benchmarks/quality_metrics.py (pure functions + parent NLL on a tiny Llama)."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import quality_metrics as qm  # noqa: E402


@pytest.mark.parametrize("text,expected", [
    ("The answer is 1,000.0!", "answer is 1000"),
    ("  Seven. ", "7"),
    ("3.50", "3.5"),
    ("007", "7"),
    ("Oslo", "oslo"),
    ("“Wednesday”…", "wednesday"),
    ("carbon-dioxide", "carbon dioxide"),
    ("0.25", "0.25"),
    ("-3", "-3"),
])
def test_normalize_answer(text, expected):
    assert qm.normalize_answer(text) == expected


def test_exact_match_and_contains():
    assert qm.exact_match("180.", "180")
    assert qm.exact_match("Twelve", "12")
    assert qm.exact_match("The Pacific", "Pacific")
    assert not qm.exact_match("The answer is 180.", "180")
    assert not qm.exact_match("18", "180")
    assert qm.contains_answer("The answer is 180.", "180")
    assert qm.contains_answer("The capital of Norway is Oslo.", "Oslo")
    assert not qm.contains_answer("150 seconds", "15")
    assert qm.contains_answer("It is carbon dioxide.", "carbon dioxide")
    assert not qm.contains_answer("anything", "")
    with pytest.raises(TypeError):
        qm.normalize_answer(None)


def test_token_f1():
    assert qm.token_f1("the cat sat", "the cat sat") == 1.0
    assert qm.token_f1("", "") == 1.0
    assert qm.token_f1("cat", "") == 0.0
    assert qm.token_f1("dog", "cat") == 0.0
    # pred 4 words, ref 2, common 2 -> P=0.5, R=1 -> F1=2/3
    assert qm.token_f1("a red big cat", "red cat") == pytest.approx(2 / 3)
    # multiset overlap: "cat cat" vs "cat": common 1, P=0.5, R=1
    assert qm.token_f1("cat cat", "cat") == pytest.approx(2 / 3)
    assert qm.token_f1("Cat!", "cat") == 1.0


def test_repeated_ngram_rate():
    assert qm.repeated_ngram_rate([1, 2, 3, 4, 5], n=3) == 0.0
    # trigrams of 1 2 1 2 1 2: (121)(212)(121)(212) -> 2 unique of 4 -> 0.5
    assert qm.repeated_ngram_rate([1, 2, 1, 2, 1, 2], n=3) == pytest.approx(0.5)
    assert qm.repeated_ngram_rate([7] * 10, n=2) == pytest.approx(1 - 1 / 9)
    assert qm.repeated_ngram_rate([1, 2], n=3) is None
    with pytest.raises(ValueError, match="n:"):
        qm.repeated_ngram_rate([1, 2, 3], n=0)


def test_distinct_n():
    # bigrams: (1,2),(2,3) | (1,2),(2,4) -> 3 unique of 4; no bigram across the boundary
    assert qm.distinct_n([[1, 2, 3], [1, 2, 4]], n=2) == pytest.approx(0.75)
    assert qm.distinct_n([[1, 2], [3, 4]], n=2) == 1.0
    assert qm.distinct_n([[1], []], n=2) is None
    assert qm.distinct_n([[5, 5, 5, 5]], n=1) == 0.25


def test_generative_perplexity():
    assert qm.generative_perplexity([2.0, 4.0], [2, 4]) == pytest.approx(math.exp(1.0))
    assert qm.generative_perplexity([], []) is None
    with pytest.raises(ValueError):
        qm.generative_perplexity([1.0], [1, 2])


def test_continuation_nll_matches_manual_sum():
    from tiny import make_llama

    model = make_llama(64, seed=3)
    prompt, out = [1, 5, 9], [4, 7, 2, 3]
    got = qm.continuation_nll(model, prompt, out)
    # manual: feed prefixes one at a time
    want = 0.0
    ids = list(prompt)
    for t in out:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
        want -= float(torch.log_softmax(logits, -1)[t])
        ids.append(t)
    assert got == pytest.approx(want, rel=1e-5)
    assert qm.continuation_nll(model, prompt, []) == 0.0
    with pytest.raises(ValueError, match="outside"):
        qm.continuation_nll(model, prompt, [999])
    with pytest.raises(ValueError, match="prompt_ids"):
        qm.continuation_nll(model, [], [1])
