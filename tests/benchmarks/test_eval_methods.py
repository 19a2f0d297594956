"""benchmarks/eval_methods.py (issue 26's evaluation): the paired bootstrap on hand-computed cases, the two targets on
synthetic curves, the multi-block setting syntax, and one end-to-end run on a tiny conversion."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import eval_methods as em  # noqa: E402
import eval_quality as ev  # noqa: E402
import methods_runs as mr  # noqa: E402


def test_bootstrap_hand_computed_two_prompts():
    # x - y = [1, 0]: a resample's mean difference is 0, 0.5 or 1 with probability 1/4, 1/2, 1/4, so the 2.5% and
    # 97.5% percentiles are exactly 0 and 1
    assert em.bootstrap_ci([1, 0], [0, 0], resamples=5000) == (0.0, 1.0)
    assert em.bootstrap_ci([1, 0], resamples=5000) == (0.0, 1.0)
    # three prompts, differences [1, 0, 0]: P(mean 0) = 8/27 > 2.5% and P(mean 1) = 1/27 > 2.5%
    assert em.bootstrap_ci([1, 0, 1], [0, 0, 1], resamples=5000) == (0.0, 1.0)


def test_bootstrap_pairing_matters():
    x = [1, 0, 1, 0, 1, 0, 1, 0]
    # the same per-prompt values in both runs: every paired resample differs by exactly 0
    assert em.bootstrap_ci(x, x) == (0.0, 0.0)
    # a constant paired shift of 0.25 is the point itself, however spread the runs are
    y = [v - 0.25 for v in x]
    assert em.bootstrap_ci(x, y) == (0.25, 0.25)
    # unpaired, the same mean has a wide interval
    lo, hi = em.bootstrap_ci(x)
    assert lo < 0.5 - 0.1 and hi > 0.5 + 0.1
    with pytest.raises(ValueError, match="paired"):
        em.bootstrap_ci([1, 0], [1])
    with pytest.raises(ValueError, match="no values"):
        em.bootstrap_ci([])


def test_run_stats_tpf_and_paired_difference():
    recs = [{"id": "a", "tokens": 8, "nfe": 4, "answer_acc": True, "exact_match": False, "token_f1": 0.5},
            {"id": "b", "tokens": 4, "nfe": 2, "answer_acc": False, "exact_match": False, "token_f1": 1.0}]
    ref = [{"id": "a", "tokens": 8, "nfe": 8, "answer_acc": True, "exact_match": True, "token_f1": 1.0},
           {"id": "b", "tokens": 4, "nfe": 4, "answer_acc": False, "exact_match": False, "token_f1": 1.0}]
    s = em.run_stats(recs, ref, resamples=2000)
    assert s["tpf"] == 2.0 and s["n"] == 2
    assert s["answer_acc"]["mean"] == 0.5 and s["answer_acc"]["diff"] == 0.0 and s["answer_acc"]["diff_ci"] == [0, 0]
    assert s["token_f1"]["diff"] == pytest.approx(-0.25)
    with pytest.raises(ValueError, match="reference"):
        em.run_stats(recs, ref[:1], resamples=10)


def _run(model, setting, tpf, lo, hi, mean=None):
    mean = (lo + hi) / 2 if mean is None else mean
    return {"model": model, "setting": setting, "tpf": tpf, "answer_acc": {"mean": mean, "ci": [lo, hi]}}


def test_tpf_target_on_synthetic_curves():
    runs = [_run("base", "b1-s64", 1.0, 0.30, 0.40), _run("base", "b4-t0.9", 1.3, 0.28, 0.38),
            _run("base", "b4-t0.5", 2.0, 0.10, 0.20),
            _run("fast", "b1-s64", 1.0, 0.31, 0.41), _run("fast", "b4-t0.7", 2.1, 0.25, 0.35),
            _run("fast", "b4-t0.5", 3.0, 0.05, 0.29),   # its interval ends below the base's: out
            _run("slow", "b4-t0.9", 1.5, 0.20, 0.29)]   # never overlaps
    t = em.tpf_target(runs, "base")
    assert t["base_interval"] == [0.30, 0.40] and t["base_tpf_at_base_quality"] == 1.3
    assert t["models"]["fast"] == {"tpf_at_base_quality": 2.1, "setting": "b4-t0.7",
                                   "ratio": pytest.approx(2.1 / 1.3), "pass": True}
    assert t["models"]["slow"]["tpf_at_base_quality"] is None and t["models"]["slow"]["pass"] is False
    runs[4] = _run("fast", "b4-t0.7", 1.9, 0.25, 0.35)   # 1.9 / 1.3 < 1.5
    assert em.tpf_target(runs, "base")["models"]["fast"]["pass"] is False
    with pytest.raises(ValueError, match="base model"):
        em.tpf_target(runs, "nope")


def test_tpf_target_counts_the_point_estimate_not_an_overlapping_interval():
    # issue 26: "the TPF at which a model's accuracy is still inside the base's one-token-per-step interval"; the
    # base's b1 interval is [0.30, 0.40]
    runs = [_run("base", "b1-s64", 1.0, 0.30, 0.40), _run("base", "b4-t0.9", 1.2, 0.26, 0.36, mean=0.31),
            _run("base", "b4-t0.7", 1.6, 0.20, 0.31, mean=0.25),   # interval overlaps, point below: out
            _run("noisy", "b1-s64", 1.0, 0.29, 0.39, mean=0.34),
            _run("noisy", "b4-t0.5", 3.0, 0.12, 0.32, mean=0.22),   # overlaps by 0.02, point far below: out
            _run("better", "b1-s64", 1.0, 0.41, 0.51, mean=0.46),
            _run("better", "b4-t0.6", 2.4, 0.42, 0.50, mean=0.46),  # above the whole interval: counts
            _run("edge", "b4-t0.8", 1.9, 0.25, 0.35, mean=0.30)]    # exactly the lower bound: counts
    t = em.tpf_target(runs, "base")
    assert t["base_tpf_at_base_quality"] == 1.2 and t["base_setting"] == "b4-t0.9"
    assert t["models"]["noisy"]["setting"] == "b1-s64" and t["models"]["noisy"]["pass"] is False
    assert t["models"]["better"] == {"tpf_at_base_quality": 2.4, "setting": "b4-t0.6",
                                     "ratio": pytest.approx(2.0), "pass": True}
    assert t["models"]["edge"]["tpf_at_base_quality"] == 1.9 and t["models"]["edge"]["pass"] is True


def test_alignment_target_on_synthetic_training_curves():
    def arm(points, minutes):
        return {"train_minutes": minutes,
                "curve": [{"train_min": m, "eval_loss": v, "eval_acc": 1 - v} for m, v in points]}

    base = arm([(5, 3.0), (10, 2.6), (15, 2.4), (20, 2.2)], 20.0)
    fast = arm([(4, 2.9), (9, 2.2), (14, 2.0), (20, 1.9)], 20.0)
    t = mr.alignment_target({"base": base, "align": fast})
    assert t["base_final"] == 2.2 and t["aligned_minutes_to_reach"] == 9 and t["ratio"] == 9 / 20 and t["pass"]
    acc = mr.alignment_target({"base": base, "align": fast}, "eval_acc")
    assert acc["base_final"] == pytest.approx(1 - 2.2) and acc["aligned_minutes_to_reach"] == 9
    slow = arm([(5, 2.8), (12, 2.2), (20, 2.1)], 20.0)   # reaches it at minute 12: 0.6 > 0.5
    t = mr.alignment_target({"base": base, "align": slow})
    assert t["ratio"] == pytest.approx(0.6) and t["pass"] is False
    never = arm([(10, 2.5), (20, 2.3)], 20.0)
    t = mr.alignment_target({"base": base, "align": never})
    assert t["aligned_minutes_to_reach"] is None and t["pass"] is False
    assert mr.alignment_target({"base": base})["pass"] is None
    # a metric that peaked before the base's last point: the base's minutes are those of its first point at its
    # final value (here minute 5), so an aligned arm at minute 6 is slower, not 0.3 x the budget
    peaked = arm([(5, 2.2), (10, 2.6), (20, 2.2)], 20.0)
    late = arm([(6, 2.2), (20, 2.1)], 20.0)
    t = mr.alignment_target({"base": peaked, "align": late})
    assert t["base_minutes_to_reach"] == 5 and t["aligned_minutes_to_reach"] == 6
    assert t["ratio"] == pytest.approx(1.2) and t["pass"] is False
    assert mr.alignment_target({"base": base, "align": fast})["base_minutes_to_reach"] == 20
    assert mr.minutes_to_reach([(3, 0.5), (1, 0.2), (2, 0.6)], 0.55, lower_is_better=False) == 2


def test_multi_block_setting_syntax():
    st = ev.parse_setting("b4-t0.9-mb0.5")
    assert st.threshold == 0.9 and st.multi_block == 0.5 and st.params(16).multi_block == 0.5
    assert ev.parse_setting("b4-s32-mb1.0-cache-none").cache == "none"
    assert ev.parse_setting("b4-s32").params(16).multi_block is None
    for bad in ("b4-t0.9-mb0", "b4-t0.9-mb1.5", "b4-spec-mb0.5", "b4-mb0.5"):
        with pytest.raises(ev.EvalError, match="setting"):
            ev.parse_setting(bad)


def test_end_to_end_on_a_tiny_conversion(tmp_path):
    """Two 'models' (the same tiny conversion under two names), block 1 and multi-block settings, on 2 checkable
    prompts: block 1 of the conversion equals the parent's answers, the files are written, a rerun reads the
    samples back instead of decoding."""
    import tiny
    from unmask.engine.checkpoint import write_checkpoint

    lm = tiny.loaded(block_size=1)
    ck = tmp_path / "ck"
    write_checkpoint(ck, lm.model, lm.tokenizer, lm.dllm)
    run = tmp_path / "run"   # a training run's --out: `latest` names its checkpoint
    write_checkpoint(run / "checkpoint-3", lm.model, lm.tokenizer, lm.dllm)
    (run / "latest").write_text("checkpoint-3\n")
    data = tmp_path / "data"
    data.mkdir()
    rows = [{"id": "eval-0000", "template": "eval.t.a", "prompt": "one two three", "answer": "4"},
            {"id": "eval-0001", "template": "eval.t.b", "prompt": "The quick brown fox"},
            {"id": "eval-0002", "template": "eval.t.a", "prompt": "What is the capital?", "answer": "Paris"}]
    (data / "eval_prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (data / "eval_grid_ids.json").write_text(json.dumps({"ids": [r["id"] for r in rows]}))
    argv = ["--model", f"base={ck}", "--model", f"other={run}", "--parent", str(ck), "--data", str(data),
            "--out", str(tmp_path / "out"), "--settings", "b1-s8", "b4-s4-mb0.5", "--reference", "b1-s8",
            "--max-tokens", "8", "--batch-size", "2", "--resamples", "200", "--weights", "native"]
    logs: list[str] = []
    assert em.main(argv, log=logs.append) == 0
    res = json.loads((tmp_path / "out" / "eval_methods.json").read_text())
    runs = {(r["model"], r["setting"]): r for r in res["runs"]}
    assert set(runs) == {("parent", "b1-s8"), ("base", "b1-s8"), ("base", "b4-s4-mb0.5"), ("other", "b1-s8"),
                         ("other", "b4-s4-mb0.5")}
    assert runs[("base", "b1-s8")]["n"] == 2 and runs[("base", "b1-s8")]["token_f1"]["mean"] == 1.0
    assert runs[("base", "b1-s8")]["tpf"] == 1.0 and runs[("base", "b4-s4-mb0.5")]["tpf"] > 1.0
    assert runs[("other", "b1-s8")]["answer_acc"]["diff_ci"] == [0.0, 0.0]   # the same model, paired
    assert res["targets"]["tpf"]["models"]["other"]["ratio"] == pytest.approx(1.0)
    md = (tmp_path / "out" / "eval_methods.md").read_text()
    assert "Target 1" in md and "| other | b4-s4-mb0.5 |" in md
    assert (tmp_path / "out" / "eval_methods.png").stat().st_size > 1000
    decoded = [x for x in logs if "s, acc" in x]
    assert len(decoded) == 5
    logs.clear()
    assert em.main(argv, log=logs.append) == 0
    assert not [x for x in logs if "s, acc" in x]            # every run read back from the samples file
    assert res["meta"]["models"]["other"] == str(run / "checkpoint-3")
    assert em.main(argv[:2] + ["--base", "nope"] + argv[2:], log=logs.append) == 2
    assert em.main(["--model", f"x={tmp_path}"] + argv[4:], log=logs.append) == 2   # not a checkpoint
