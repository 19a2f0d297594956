"""The committed prompt sets (benchmarks/data) and their generator (training/recipes/prompts.py)."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from unmask.training.recipes import prompts as P

DATA = Path(__file__).resolve().parents[1] / "benchmarks" / "data"


@pytest.fixture(scope="module")
def sets():
    train = P.load_prompts(DATA / P.TRAIN_FILE)
    evals = P.load_prompts(DATA / P.EVAL_FILE)
    grid = json.loads((DATA / P.GRID_FILE).read_text())
    return train, evals, grid


def test_generator_reproduces_committed_files(tmp_path):
    P.write_all(tmp_path)
    for name in (P.TRAIN_FILE, P.EVAL_FILE, P.GRID_FILE):
        assert (tmp_path / name).read_bytes() == (DATA / name).read_bytes(), f"{name} is stale: rerun the generator"


def test_counts_and_categories(sets):
    train, evals, grid = sets
    assert len(train) >= 2000
    assert len(evals) >= 200
    assert sum("answer" in r for r in evals) >= 100
    want = {"everyday", "explanation", "writing", "list", "arithmetic", "conversion", "rewriting", "extraction"}
    assert set(Counter(r["category"] for r in train)) == want
    assert set(Counter(r["category"] for r in evals)) == want
    # diversity: many templates, no template dominating, hand-written items present
    t_counts = Counter(r["template"] for r in train)
    assert len(t_counts) >= 50 and max(t_counts.values()) <= 0.05 * len(train)
    assert sum(v for k, v in t_counts.items() if k.startswith("train.hand.")) >= 100
    assert len({r["prompt"] for r in train}) == len(train)
    assert len({r["prompt"] for r in evals}) == len(evals)


def test_template_disjoint(sets):
    train, evals, _ = sets
    t_train = {r["template"] for r in train}
    t_eval = {r["template"] for r in evals}
    assert not t_train & t_eval
    assert all(t.startswith("train.") for t in t_train) and all(t.startswith("eval.") for t in t_eval)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in evals}
    # structural check: a template's skeleton (the word prefix and suffix shared by all its prompts) differs
    # between every eval template and every training template
    def skeletons(rows):
        by_t: dict[str, list[list[str]]] = {}
        for r in rows:
            by_t.setdefault(r["template"], []).append(r["prompt"].split())
        out = {}
        for t, items in by_t.items():
            if ".hand." in t or len(items) < 2:
                continue
            pre = 0
            while all(len(w) > pre and w[pre] == items[0][pre] for w in items):
                pre += 1
            suf = 0
            while all(len(w) > suf + pre and w[-1 - suf] == items[0][-1 - suf] for w in items):
                suf += 1
            out[t] = (tuple(items[0][:pre]), tuple(items[0][len(items[0]) - suf:]))
        return out

    sk_train, sk_eval = skeletons(train), skeletons(evals)
    assert len(sk_eval) >= 30
    clashes = [(te, tt) for te, ke in sk_eval.items() for tt, kt in sk_train.items() if ke == kt]
    assert not clashes


def test_checkable_answers_are_right(sets):
    _, evals, _ = sets
    ops = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
           "div": lambda a, b: a // b, "max": max, "seq": lambda a, d: a + 4 * d}
    checked = 0
    for r in evals:
        meta = r.get("meta")
        if not meta:
            continue
        if meta["op"] == "words":
            assert r["answer"] == str(len(meta["text"].split()))
        else:
            a, b = meta["a"], meta["b"]
            assert r["answer"] == str(ops[meta["op"]](a, b)), r
            assert str(a) in r["prompt"]
            if meta["op"] == "div":
                assert a % b == 0
        checked += 1
    assert checked >= 60
    # spot-check the wording of arithmetic prompts against the stored operands
    for r in evals:
        if r["template"] == "eval.arith.add_words":
            assert r["prompt"].startswith(f"Add {r['meta']['a']} and {r['meta']['b']}.")
        if r["template"] == "eval.arith.sub_words":
            assert r["prompt"].startswith(f"Subtract {r['meta']['b']} from {r['meta']['a']}.")
    for r in evals:
        if "answer" in r:
            assert isinstance(r["answer"], str) and r["answer"].strip()


def test_grid_subset(sets):
    _, evals, grid = sets
    ids = grid["ids"]
    by_id = {r["id"]: r for r in evals}
    assert len(ids) == 60 and len(set(ids)) == 60 and all(i in by_id for i in ids)
    assert grid["quick_ids"] == ids[:12]
    n_check = sum("answer" in by_id[i] for i in ids)
    assert n_check == 36
    assert len({by_id[i]["template"] for i in ids}) >= 30
    quick = [by_id[i] for i in grid["quick_ids"]]
    assert any("answer" in r for r in quick) and any("answer" not in r for r in quick)


def test_load_prompts_errors(tmp_path):
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"id": "a", "prompt": "x"}\n{"id": "b"}\n')
    with pytest.raises(ValueError, match=r"p.jsonl:2: .*prompt"):
        P.load_prompts(bad)
    bad.write_text('{"id": "a", "prompt": "x"}\nnot json\n')
    with pytest.raises(ValueError, match=r"p.jsonl:2: not JSON"):
        P.load_prompts(bad)
    bad.write_text('{"id": "a", "prompt": "x"}\n{"id": "a", "prompt": "y"}\n')
    with pytest.raises(ValueError, match="duplicated id"):
        P.load_prompts(bad)
