"""Repr-Align (training/experimental/align.py) and the anchor cache (training/experimental/anchors.py) on
hand-computed cases and a tiny model."""
from __future__ import annotations

import csv
import math

import pytest
import torch

import tiny
from unmask.training.experimental.align import (AlignError, LiveTeacher, alignment_loss, confidence_weighted,
                                                layer_weights, parse_layers)
from unmask.training.experimental.anchors import AnchorCache, AnchorError
from unmask.training.data import collate, load_dataset
from unmask.training.trainer import TrainConfig, TrainError, train

DATA = [{"prompt": "What is two plus two?", "completion": "Two plus two is four."},
        {"prompt": "Name a quick animal.", "completion": "The quick brown fox."},
        {"prompt": "Capital of France?", "completion": "Paris is the capital of France."}]


def test_alignment_loss_hand_computed():
    # layer 1: cos((1,0),(1,0)) = 1 -> 0; cos((0,1),(1,1)) = 1/sqrt2 -> 1 - 0.7071; mean = 0.14645
    # layer 2: cos((1,0),(-1,0)) = -1 -> 2; cos((3,4),(3,4)) = 1 -> 0; mean = 1
    s = [torch.tensor([[1.0, 0.0], [0.0, 1.0]], requires_grad=True), torch.tensor([[1.0, 0.0], [3.0, 4.0]])]
    t = [torch.tensor([[1.0, 0.0], [1.0, 1.0]]), torch.tensor([[-1.0, 0.0], [3.0, 4.0]])]
    w = torch.tensor([0.25, 0.75])
    got = alignment_loss(s, t, w)
    want = 0.25 * (1 - 1 / math.sqrt(2)) / 2 + 0.75 * 1.0
    assert float(got.detach()) == pytest.approx(want, rel=1e-6)
    got.backward()
    assert s[0].grad is not None and s[0].grad.abs().sum() > 0


def test_layer_weights_and_layer_parsing():
    assert layer_weights([1, 2], 2).tolist() == [0.5, 0.5]
    w = layer_weights([1, 2], 2, exp_gamma=2.0)
    assert float(w[1] / w[0]) == pytest.approx(math.e, rel=1e-6) and float(w.sum()) == pytest.approx(1.0)
    assert parse_layers("all", 3) == [1, 2, 3] and parse_layers("3,1", 3) == [1, 3]
    for bad in ("0", "4", "x", ""):
        with pytest.raises(AlignError, match="--align-layers"):
            parse_layers(bad, 3)


def test_confidence_weighted_term_value_and_gradient():
    ce = torch.tensor([0.0, 1.0, 2.0], requires_grad=True)
    out = confidence_weighted(ce)
    assert out.tolist() == pytest.approx([0.0, math.exp(-1), 2 * math.exp(-2)])
    out.sum().backward()
    assert ce.grad.tolist() == pytest.approx([1.0, math.exp(-1), math.exp(-2)])  # the weight is detached


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("align")
    lm = tiny.training_dir(d, DATA)
    eos = set(lm.dllm.eos_token_ids)
    ds = load_dataset(str(d / "data.jsonl"), lm.tokenizer, 64, eos)
    return d, lm, ds


def test_anchor_cache_returns_the_live_teachers_states(setup, tmp_path):
    d, lm, ds = setup
    teacher = LiveTeacher(str(d / "src"), "cpu", [1, 2])
    cache = AnchorCache.build(tmp_path / "anchors", teacher, lm.tokenizer, ds.examples, dtype="float32")
    batch = collate(ds.examples, lm.dllm.pad_token_id)
    rows, pos = batch.answer.nonzero(as_tuple=True)
    live = teacher.states(batch, rows, pos, True)
    cached = AnchorCache.open(tmp_path / "anchors", teacher, lm.tokenizer, dtype="float32").states(batch, rows, pos)
    for a, b in zip(live, cached):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert len(cache.manifest["examples"]) == len(ds.examples)


def test_anchor_cache_key_mismatch_is_an_error(setup, tmp_path):
    d, lm, ds = setup
    teacher = LiveTeacher(str(d / "src"), "cpu", [1, 2])
    AnchorCache.build(tmp_path / "a", teacher, lm.tokenizer, ds.examples)
    AnchorCache.open(tmp_path / "a", teacher, lm.tokenizer)  # the same setup opens
    with torch.no_grad():  # one changed teacher weight
        teacher.model.model.layers[0].mlp.up_proj.weight[0, 0] += 1e-3
    with pytest.raises(AnchorError, match="teacher"):
        AnchorCache.open(tmp_path / "a", teacher, lm.tokenizer)
    with torch.no_grad():
        teacher.model.model.layers[0].mlp.up_proj.weight[0, 0] -= 1e-3
    with pytest.raises(AnchorError, match="layers"):
        AnchorCache.open(tmp_path / "a", LiveTeacher("", "cpu", [2], model=teacher.model), lm.tokenizer)
    with pytest.raises(AnchorError, match="dtype"):
        AnchorCache.open(tmp_path / "a", teacher, lm.tokenizer, dtype="float32")
    other_tok = tiny.make_tokenizer(300, mask_token="[MASK]")
    with pytest.raises(AnchorError, match="tokenizer"):
        AnchorCache.open(tmp_path / "a", teacher, other_tok)
    cache = AnchorCache.open(tmp_path / "a", teacher, lm.tokenizer)
    with pytest.raises(AnchorError, match="no states"):  # an example the cache never saw: no silent miss
        cache.example_states([1, 2, 3])
    with pytest.raises(AnchorError, match="budget"):
        AnchorCache.build(tmp_path / "b", teacher, lm.tokenizer, ds.examples, budget_bytes=10)


def _cfg(d, out, **kw):
    return TrainConfig(model=str(d / "src"), data=str(d / "data.jsonl"), out=str(out), batch_size=2, max_steps=2,
                       seq_len=64, lr=1e-2, progress=False, seed=1, **kw)


def test_training_with_alignment_logs_the_term_and_the_cache_gives_the_same_losses(setup, tmp_path):
    d, _, _ = setup
    train(_cfg(d, tmp_path / "live", align_weight=10.0, align_layers="1,2"))
    train(_cfg(d, tmp_path / "cached", align_weight=10.0, align_layers="1,2", align_anchors=str(tmp_path / "anc"),
               ))
    rows = {k: list(csv.DictReader(open(tmp_path / k / "metrics.csv"))) for k in ("live", "cached")}
    # step 1 starts from the teacher itself: the clean-copy rows align exactly, noisy rows do not
    assert float(rows["live"][0]["align"]) > 0
    for a, b in zip(rows["live"], rows["cached"]):  # fp16 anchors: the same run to rounding
        assert float(a["align"]) == pytest.approx(float(b["align"]), rel=2e-2, abs=1e-4)
        assert float(a["ce"]) == pytest.approx(float(b["ce"]), rel=2e-2)
    with pytest.raises(TrainError, match="--align-weight"):
        _cfg(d, tmp_path / "x", align_confidence=True).validate()
    with pytest.raises(TrainError, match="--align-layers"):
        train(_cfg(d, tmp_path / "y", align_weight=1.0, align_layers="9"))
