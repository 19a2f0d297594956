"""Pseudo-trajectory distillation (training/objectives/trajectory.py): recording from the engine's step events, the JSONL file,
and the training masks built from a trajectory."""
from __future__ import annotations

import csv
import json

import pytest
import torch

import tiny
from unmask.engine.llm import LLM
from unmask.engine.params import SamplingParams
from unmask.training.common import ids_hash
from unmask.training.data import collate, load_dataset
from unmask.training.trainer import TrainConfig, resolve_latest, train
from unmask.training.objectives.trajectory import (TrajectoryError, curriculum, ensure_trajectories, load_trajectories,
                                        mask_from_steps, record_example, trajectory_noise)

DATA = [{"prompt": "What is two plus two?", "completion": "Two plus two is four."},
        {"prompt": "Name a quick animal.", "completion": "The quick brown fox."}]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("traj")
    lm = tiny.training_dir(d, DATA)
    ds = load_dataset(str(d / "data.jsonl"), lm.tokenizer, 64, set(lm.dllm.eos_token_ids))
    return d, lm, ds


def test_recording_follows_the_engines_step_events_on_the_ground_truth(setup):
    _, lm, ds = setup
    ex = ds.examples[0]
    (s, e), = ex.spans
    rec, = record_example(lm, ex.input_ids, ex.spans, mode="engine", threshold=1.0)
    # threshold 1.0 reveals exactly one token a step, block by block: every step once, blocks in order
    assert sorted(rec) == list(range(e - s))
    bs = lm.dllm.block_size
    for b in range(0, e - s, bs):
        assert min(rec[b:b + bs]) == b
    # the same run by hand: the engine's own order when every revealed token is replaced by the ground truth
    from unmask.engine.denoiser import Denoiser
    from unmask.engine.engine import make_requests

    seq = make_requests(lm, ex.input_ids[:s], SamplingParams(max_tokens=e - s, temperature=0, threshold=1.0,
                                                             ignore_eos=True, seed=0), "x")[0]
    den, order = Denoiser(lm), []
    while not seq.finished:
        for ev in den.step([seq]):
            for r in ev.revealed:
                order.append(r.position)
                seq.canvas[seq.prompt_len + r.position] = ex.input_ids[s + r.position]
    assert [rec[p] for p in order] == list(range(e - s))
    # entropy mode: K steps for the whole answer
    rec_k, = record_example(lm, ex.input_ids, ex.spans, mode="entropy", steps=3)
    assert sorted(set(rec_k)) == [0, 1, 2] and len(rec_k) == e - s


def test_trajectory_file_is_resumable_and_checks_its_settings(setup, tmp_path):
    d, lm, ds = setup
    path = tmp_path / "t.jsonl"
    one = ensure_trajectories(path, ds.examples[:1], str(d / "src"), model=lm, threshold=0.5)
    assert len(one) == 1
    lines = path.read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[0])["mode"] == "engine"
    calls = []
    orig = record_example

    def counting(*a, **k):
        calls.append(1)
        return orig(*a, **k)

    import unmask.training.objectives.trajectory as tr
    tr.record_example = counting
    try:
        both = ensure_trajectories(path, ds.examples, str(d / "src"), model=lm, threshold=0.5)
    finally:
        tr.record_example = orig
    assert len(both) == 2 and len(calls) == 1  # only the missing example was recorded
    assert both[ids_hash(ds.examples[0].input_ids)] == one[ids_hash(ds.examples[0].input_ids)]
    with pytest.raises(TrajectoryError, match="other settings"):
        ensure_trajectories(path, ds.examples, str(d / "src"), model=lm, threshold=0.7)
    with open(path, "a") as fh:
        fh.write('{"ids": "abc", "spans"')  # a line cut by a kill: ignored, re-recorded on resume
    assert len(load_trajectories(path)) == 2


def test_masks_follow_the_trajectory():
    assert mask_from_steps([0, 2, 1, 2], 1) == [1, 3]
    assert mask_from_steps([0, 2, 1, 2], 2) == [1, 3]
    assert mask_from_steps([0, 2, 1, 2], 3) == [1, 2, 3]
    assert mask_from_steps([0, 2, 1, 2], 4) == [0, 1, 2, 3]
    assert mask_from_steps([5, 5], 1) == [0, 1]
    assert curriculum(0.0, 4, 16) == (0.25, 4)
    assert curriculum(0.5, 4, 16) == (0.4, 8)
    assert curriculum(1.0, 4, 16) == (pytest.approx(0.8), 16)


def test_trajectory_noise_masks_the_late_tokens_and_the_complement(setup):
    _, lm, ds = setup
    batch = collate(ds.examples, lm.dllm.pad_token_id)
    traj = {}
    for ex in ds.examples:
        (s, e), = ex.spans
        traj[ids_hash(ex.input_ids)] = {s: list(range(e - s))[::-1]}  # right to left
    g = torch.Generator().manual_seed(0)
    noise, bs = trajectory_noise(batch, lm.dllm, traj, 1.0, g, 4, 4)
    assert bs == 4 and noise.copies == 2
    for blk, comp in zip(noise.blocks[::2], noise.blocks[1::2]):
        assert (blk.copy, comp.copy) == (0, 1)
        span = range(max(blk.start, blk.span_start), blk.end)
        assert sorted(blk.masked + comp.masked) == list(span)
        # revealed right to left: the tokens revealed latest are the leftmost, so the mask is a left prefix
        assert blk.masked == list(span)[: len(blk.masked)] and blk.masked
    with pytest.raises(TrajectoryError, match="no trajectory"):
        trajectory_noise(batch, lm.dllm, {}, 0.5, g, 4, 8)


def test_training_with_the_trajectory_objective_records_then_trains(setup, tmp_path):
    d, _, _ = setup
    cfg = TrainConfig(model=str(d / "src"), data=str(d / "data.jsonl"), out=str(tmp_path / "o"), batch_size=2,
                      max_steps=3, seq_len=64, lr=1e-2, progress=False, seed=1, objective="trajectory",
                      trajectories=str(tmp_path / "t.jsonl"), eval_every=3, eval_data=str(d / "data.jsonl"))
    train(cfg)
    rows = list(csv.DictReader(open(tmp_path / "o" / "metrics.csv")))
    assert len(rows) == 3 and all(float(r["loss"]) > 0 for r in rows) and rows[-1]["eval_loss"]
    assert len(load_trajectories(tmp_path / "t.jsonl")) == 2
    out = LLM(str(resolve_latest(tmp_path / "o"))).generate("Hi", SamplingParams(max_tokens=4, temperature=0))
    assert len(out[0].outputs[0].token_ids) <= 4
