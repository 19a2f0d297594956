"""benchmarks/methods_runs.py (issue 26's fixed-budget arms) on a tiny model: the held-out split, the training-minute
curve, the skip of finished arms, the exact continuation of an interrupted arm, and the locked settings."""
from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import methods_runs as mr  # noqa: E402

DATA = [{"prompt": "What is two plus two?", "completion": "Two plus two is four."},
        {"prompt": "Name a quick animal.", "completion": "The quick brown fox."},
        {"prompt": "Capital of France?", "completion": "Paris is the capital of France."},
        {"prompt": "Count to three.", "completion": "One two three."},
        {"prompt": "Say hello.", "completion": "Hello world."}]


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    import tiny

    d = tmp_path_factory.mktemp("methods")
    tiny.training_dir(d, DATA, data="all.jsonl", block_size=1)
    (d / "heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in DATA[3:]))
    return d


def _argv(src, work, *extra):
    return ["--work", str(work), "--data", str(src / "all.jsonl"), "--heldout", str(src / "heldout.jsonl"),
            "--model", str(src / "src"), "--results", str(work / "results"), "--minutes", "100", "--max-steps", "4",
            "--batch-size", "2", "--seq-len", "64", "--lr", "1e-3", "--warmup", "0", "--eval-every", "2",
            "--eval-t-points", "2", "--save-every", "2", *extra]


def _rows(path):
    return list(csv.DictReader(open(path)))


def test_split_removes_heldout_prompts_and_is_locked(src, tmp_path):
    train, held, info = mr.split_data(src / "all.jsonl", src / "heldout.jsonl", tmp_path / "w")
    assert info["train_rows"] == 3 and info["heldout_rows"] == 2 and info["removed_from_data"] == 2
    assert [json.loads(x)["prompt"] for x in train.read_text().splitlines()] == [r["prompt"] for r in DATA[:3]]
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps(DATA[0]) + "\n")
    with pytest.raises(mr.RunsError, match="another split"):
        mr.split_data(src / "all.jsonl", other, tmp_path / "w")
    assert mr.parse_arms("full,base,align") == ["base", "align"]
    with pytest.raises(mr.RunsError, match="--arms"):
        mr.parse_arms("base,nope")


def test_arms_finish_skip_and_resume_exactly(src, tmp_path, monkeypatch):
    from unmask.training import trainer

    # reference: the arm uninterrupted
    logs: list[str] = []
    assert mr.main(_argv(src, tmp_path / "a", "--arms", "base,qk_only"), log=logs.append) == 0
    done = json.loads((tmp_path / "a" / "base" / "done.json").read_text())
    assert done["steps"] == 4 and done["final_eval_loss"] > 0
    res = json.loads((tmp_path / "a" / "results" / "runs.json").read_text())
    assert set(res["arms"]) == {"base", "qk_only"}
    curve = res["arms"]["base"]["curve"]
    assert [p["step"] for p in curve] == [2, 4]                        # the trainer's evaluations every 2 steps
    assert curve[0]["train_min"] < curve[1]["train_min"] == done["train_minutes"]
    assert curve[1]["eval_loss"] == pytest.approx(done["final_eval_loss"], rel=1e-4)  # the same evaluation
    assert (tmp_path / "a" / "results" / "runs.png").stat().st_size > 1000
    assert "Alignment target" in (tmp_path / "a" / "results" / "runs.md").read_text()
    assert "--arms base,qk_only" in res["meta"]["command"]
    # a rerun skips the finished arms
    logs.clear()
    assert mr.main(_argv(src, tmp_path / "a", "--arms", "base"), log=logs.append) == 0
    assert any("finished earlier" in x for x in logs) and not any("launch" in x for x in logs)
    # interrupted after 2 steps (checkpoint-2 saved), then rerun: continues from step 2 to the same losses
    real = trainer.train

    def killed(cfg):
        real(type(cfg)(**{**cfg.__dict__, "halt_after": 2}))
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer, "train", killed)
    with pytest.raises(KeyboardInterrupt):
        mr.main(_argv(src, tmp_path / "b", "--arms", "base"), log=logs.append)
    assert not (tmp_path / "b" / "base" / "done.json").exists()
    monkeypatch.setattr(trainer, "train", real)
    logs.clear()
    assert mr.main(_argv(src, tmp_path / "b", "--arms", "base"), log=logs.append) == 0
    assert any("launch 1: step 2" in x for x in logs)
    a_rows, b_rows = _rows(tmp_path / "a" / "base" / "metrics.csv"), _rows(tmp_path / "b" / "base" / "metrics.csv")
    assert [r["step"] for r in b_rows] == ["1", "2", "3", "4"]
    for ra, rb in zip(a_rows, b_rows):
        assert float(ra["loss"]) == pytest.approx(float(rb["loss"]), rel=1e-5)
    # other settings for a started arm: an error naming the field
    assert mr.main(_argv(src, tmp_path / "b", "--arms", "base", "--lr", "2e-3"), log=logs.append) == 2


def test_budget_in_training_minutes(src, tmp_path):
    """A small training-minute budget: the arm stops within a step of it (relaunching while the trainer's wall
    clock, which includes the evaluations, stopped it early)."""
    argv = _argv(src, tmp_path / "c", "--arms", "base")
    argv[argv.index("--minutes") + 1] = "0.005"
    argv[argv.index("--max-steps") + 1] = "100000"
    argv += ["--save-every", "1000", "--eval-every", "1000"]
    assert mr.main(argv, log=print) == 0
    done = json.loads((tmp_path / "c" / "base" / "done.json").read_text())
    curve = mr.read_curve(tmp_path / "c" / "base" / "metrics.csv")
    step_min = max(b["train_min"] - a["train_min"] for a, b in zip(curve, curve[1:]))
    rounding = 2e-4   # metrics.csv's per-row minutes are rounded to 1e-4
    assert done["train_minutes"] >= 0.005 - max(5e-5, step_min) - rounding
    assert done["train_minutes"] <= 0.005 + step_min + rounding


def test_number_formatting_is_eval_qualitys():
    """One formatter for every results table: methods_runs uses eval_quality's ``_f`` (no copy that could drift)."""
    import eval_quality as ev

    assert mr._f is ev._f
    assert [mr._f(x) for x in (None, float("nan"), 0.12345, 7)] == ["-", "-", "0.123", "7"]
