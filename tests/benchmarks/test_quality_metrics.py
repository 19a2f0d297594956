"""Unit tests of the quality measures (unmask.cli.evaluation.metrics; benchmarks/quality_metrics.py is its alias):
pure functions + parent NLL on a tiny Llama."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

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


# (matcher, output text, reference answer, match?)
MATCHES = [
    ("exact_match", "180.", "180", True),
    ("exact_match", "Twelve", "12", True),
    ("exact_match", "The Pacific", "Pacific", True),
    ("exact_match", "The answer is 180.", "180", False),
    ("exact_match", "18", "180", False),
    ("contains_answer", "The answer is 180.", "180", True),
    ("contains_answer", "The capital of Norway is Oslo.", "Oslo", True),
    ("contains_answer", "150 seconds", "15", False),
    ("contains_answer", "It is carbon dioxide.", "carbon dioxide", True),
    ("contains_answer", "anything", "", False),
    ("answer_match", "3 minutes is 3 * 60 = 180 seconds.", "180", True),
    ("answer_match", "The answer is 60.", "55", False),
    ("answer_match", "10 centimeters is approximately 10.00000000000001 millimeters.", "100", False),
    ("answer_match", "180 or maybe 18", "180", False),  # the last number counts
    ("answer_match", "Twelve.", "12", True),
    ("answer_match", "The scarf is a shade of gray.", "gray", True),
    ("answer_match", "It is grey.", "gray", False),
    ("answer_match", "no number here", "7", False),
    ("answer_match", "The sum is 47. That one was easy.", "47", True),
    ("answer_match", "A dog has four legs.", "4", True),
    ("answer_match", "I'm not sure.", "m", False),
    ("answer_match", "It\u2019s k.", "s", False),
]


@pytest.mark.parametrize("matcher, text, answer, want", MATCHES)
def test_answer_matchers(matcher, text, answer, want):
    """exact_match (the whole answer after normalisation), contains_answer, answer_match (the final number, or the
    answer word; "one" the pronoun after the result is not the last number; number words count without digits;
    apostrophes join a word instead of leaving one-letter words that match one-letter answers)."""
    assert bool(getattr(qm, matcher)(text, answer)) is want


def test_normalize_answer_refuses_none_and_joins_apostrophes():
    with pytest.raises(TypeError):
        qm.normalize_answer(None)
    assert qm.normalize_answer("It's Bob's") == "its bobs"


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


def test_short_output_rate():
    assert qm.short_output_rate([1, 4, 5, 64], 4) == 0.5
    assert qm.short_output_rate([0], 0) == 1.0
    assert qm.short_output_rate([]) is None
    with pytest.raises(ValueError, match="max_len"):
        qm.short_output_rate([3], -1)


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


# ------------------------------------------------------------------------------ the harness, end to end (tiny)
def _parent_and_conversion(tmp_path):
    """A tiny random AR parent saved at ``tmp_path/parent`` and its conversion at block 1: ``(parent, conv)``."""
    from tiny import make_llama, make_tokenizer

    from unmask.training.convert import convert_checkpoint

    tok = make_tokenizer(320)
    parent_dir = tmp_path / "parent"
    make_llama(len(tok), seed=1).save_pretrained(str(parent_dir))
    tok.save_pretrained(str(parent_dir))
    conv = convert_checkpoint(parent_dir, tmp_path / "conv", attention="prefix_causal", block_size=1,
                              logit_shift=True)
    return parent_dir, conv


def _tiny_eval_data(root: Path) -> Path:
    import json

    data = root / "data"
    data.mkdir()
    rows = [{"id": "eval-0000", "template": "eval.t.a", "category": "arithmetic", "prompt": "one two three",
             "answer": "4"},
            {"id": "eval-0001", "template": "eval.t.b", "category": "writing", "prompt": "The quick brown fox"},
            {"id": "eval-0002", "template": "eval.t.a", "category": "arithmetic", "prompt": "What is the capital?",
             "answer": "Paris"},
            {"id": "eval-0003", "template": "eval.t.c", "category": "writing", "prompt": "Diffusion models"}]
    (data / "eval_prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ids = [r["id"] for r in rows]
    (data / "eval_grid_ids.json").write_text(json.dumps({"ids": ids, "quick_ids": ids[:3]}))
    return data


def test_harness_end_to_end_on_tiny_models(tmp_path):
    """Parent (tiny HF Llama) + its prefix-causal conversion: block 1 reproduces the parent token for token, the
    metrics are consistent, and the JSON / Markdown / PNG / samples files are written."""
    import argparse
    import json

    import eval_quality as ev

    parent_dir, conv = _parent_and_conversion(tmp_path)
    data = _tiny_eval_data(tmp_path)
    p = ev.add_arguments(argparse.ArgumentParser())
    a = p.parse_args(["--parent", str(parent_dir), "--no-defaults", "--model", f"conv={conv}", "--out",
                      str(tmp_path / "res"), "--data", str(data), "--grid", "b1-s12", "b4-s6", "--max-tokens", "12",
                      "--speed-prompts", "1", "--grid-prompts", "3", "--full-settings", "b4-t0.9",
                      "--batch-size", "2"])
    logs: list[str] = []
    result = ev.run_eval(a, log=logs.append)
    runs = {(r["model"], r["subset"], r["setting"]): r for r in result["runs"]}
    assert set(runs) == {("parent", "grid", "ar-greedy"), ("parent", "full", "ar-greedy"),
                         ("conv", "grid", "b1-s12"), ("conv", "grid", "b4-s6"), ("conv", "full", "b4-t0.9")}
    par = runs[("parent", "grid", "ar-greedy")]
    b1, b4 = runs[("conv", "grid", "b1-s12")], runs[("conv", "grid", "b4-s6")]
    assert par["n"] == b1["n"] == 3 and runs[("conv", "full", "b4-t0.9")]["n"] == 4
    assert b1["same_as_parent"] == 1.0 and b1["token_f1_vs_parent"] == 1.0
    assert b1["gen_ppl"] == pytest.approx(par["gen_ppl"], rel=1e-4)
    assert par["tpf"] == 1.0 and par["token_f1_vs_parent"] == 1.0
    assert b4["tpf"] > b1["tpf"] - 1e-9          # 2 tokens per step vs one
    assert b1["n_checkable"] == 2 and b1["tokens_per_s_b1"] > 0 and b1["ttft_s_b1"] > 0
    assert b1["batch1_vs_batched_mismatches"] == 0 and b4["batch1_vs_batched_mismatches"] == 0
    out = tmp_path / "res"
    saved = json.loads((out / "eval_quality.json").read_text())
    assert saved["meta"]["finished"] and len(saved["runs"]) == 5
    md = (out / "eval_quality.md").read_text()
    assert md.count("\n| conv |") == 3 and "F1 vs parent" in md
    assert (out / "eval_quality.png").stat().st_size > 1000
    assert len((out / "eval_quality_samples.jsonl").read_text().splitlines()) == 3 + 4 + 3 + 3 + 4
    # --full-models: the full held-out pass only for the named models (the parent always)
    base = ["--parent", str(parent_dir), "--no-defaults", "--model", f"conv={conv}", "--model", f"other={conv}",
            "--out", str(tmp_path / "res2"), "--data", str(data), "--grid", "b1-s12", "--max-tokens", "12",
            "--speed-prompts", "0", "--grid-prompts", "2", "--full-settings", "b1-s12", "--batch-size", "2"]
    result = ev.run_eval(p.parse_args(base + ["--full-models", "other"]), log=logs.append)
    assert sorted((r["model"], r["subset"]) for r in result["runs"]) == [
        ("conv", "grid"), ("other", "full"), ("other", "grid"), ("parent", "full"), ("parent", "grid")]
    with pytest.raises(ev.EvalError, match="--full-models"):
        ev.run_eval(p.parse_args(base + ["--full-models", "nope", "--overwrite"]), log=logs.append)
    # progress as it runs; a folder holding results is not written over unless asked
    assert logs[0] == f"[eval] writing to {tmp_path / 'res'}" and "[conv] grid b4-s6: decoding 3 prompts, then " \
        "timing 1 at batch 1" in logs
    with pytest.raises(ev.EvalError, match="--out .*eval_quality.json.*--overwrite"):
        ev.run_eval(p.parse_args(base), log=logs.append)


def test_setting_and_spec_parsing():
    import eval_quality as ev

    assert ev.parse_setting("b4-s32") == ev.Setting("b4-s32", 4, steps=32)
    assert ev.parse_setting("b8-t0.95") == ev.Setting("b8-t0.95", 8, threshold=0.95)
    vanilla = ev.parse_setting("b32-s256-cache-none")
    assert vanilla == ev.Setting("b32-s256-cache-none", 32, steps=256, cache="none")
    assert vanilla.params(256).cache == "none" and ev.parse_setting("b4-t0.9").params(64).cache == "auto"
    sampled = ev.parse_setting("b4-spec-T0.7")
    assert sampled.speculative and sampled.temperature == 0.7 and sampled.params(8).temperature == 0.7
    assert ev.parse_setting("b1-s64-cache-none-T1").params(8).temperature == 1.0
    assert ev.parse_setting("b4-spec").params(8).temperature == 0.0
    ratio = ev.parse_setting("b4-spec-br2-r0.25").params(8)
    assert ratio.speculative_ratio == 0.25 and ratio.speculative_epsilon is None and ratio.speculative_branches == 2
    typical = ev.parse_setting("b4-spec-e0.03").params(8)
    assert typical.speculative_epsilon == 0.03 and typical.speculative_ratio is None
    assert typical.speculative_no_repeat_ngram is None  # the engine's default guard
    assert ev.parse_setting("b4-spec-e0.03-ng0").params(8).speculative_no_repeat_ngram == 0
    assert ev.parse_setting("b4-spec-r0.1-ng4-T0").params(8).speculative_no_repeat_ngram == 4
    for bad in ("b4", "b0-s4", "b4-s0", "b4-t1.5", "x4-s2", "b4-s32-cache-", "b4-s32-cache-fast", "b4-s32-none",
                "b4-spec-T", "b4-spec-T-1", "b4-T0.7-spec",
                "b4-spec-r0", "b4-spec-r1.5", "b4-spec-e0.1-r0.1", "b4-spec-r0.5-T0.7", "b4-spec-e0.1-T0.7",
                "b64-spec-r0.5", "b4-spec-ng3", "b4-spec-r0.1-ng", "b4-spec-r0.1-ng65"):
        with pytest.raises(ev.EvalError, match="setting"):
            ev.parse_setting(bad)
    assert ev.parse_model_spec("a=~/x")[0] == "a"
    with pytest.raises(ev.EvalError, match="NAME=PATH"):
        ev.parse_model_spec("nopath")
    with pytest.raises(ev.EvalError, match="reserved"):
        ev.parse_model_spec("parent=/x")


def test_eval_cli_bad_paths_are_one_line_errors(tmp_path, capsys):
    from unmask.cli.main import main

    not_a_ckpt = tmp_path / "plain"
    not_a_ckpt.mkdir()
    assert main(["eval", "--quick", "--no-defaults", "--model", f"m={not_a_ckpt}", "--out", str(tmp_path / "o")]) == 2
    assert "not a diffusion checkpoint" in capsys.readouterr().err
    import tiny
    from unmask.engine.checkpoint import write_checkpoint

    m = tiny.loaded()
    write_checkpoint(tmp_path / "ck", m.model, m.tokenizer, m.dllm)
    assert main(["eval", "--quick", "--no-defaults", "--model", f"m={tmp_path / 'ck'}", "--parent",
                 str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    assert "--parent" in capsys.readouterr().err


def test_rescore_samples_recomputes_text_measures(tmp_path):
    import rescore_samples as rs

    rows = [
        {"model": "parent", "setting": "ar-greedy", "subset": "grid", "id": "a", "text": "It is 47.", "n_tokens": 5,
         "finish_reason": "stop", "answer": "47"},
        {"model": "parent", "setting": "ar-greedy", "subset": "grid", "id": "b", "text": "Hello there friend",
         "n_tokens": 4, "finish_reason": "length"},
        {"model": "m", "setting": "b4-s8", "subset": "grid", "id": "a", "text": "47, that one.", "n_tokens": 6,
         "finish_reason": "stop", "answer": "47"},
        {"model": "m", "setting": "b4-s8", "subset": "grid", "id": "b", "text": "Hello", "n_tokens": 2,
         "finish_reason": "stop"},
    ]
    f = tmp_path / "s.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    out = {(r["model"], r["subset"]): r for r in rs.rescore(rs.load_samples(f))}
    m = out[("m", "grid")]
    assert m["n"] == 2 and m["n_checkable"] == 1 and m["answer_acc"] == 1.0 and m["eos_rate"] == 1.0
    assert m["short_rate"] == 0.5 and m["tokens_median"] == 4
    assert m["token_f1_vs_parent"] == pytest.approx((qm.token_f1("47, that one.", "It is 47.")
                                                     + qm.token_f1("Hello", "Hello there friend")) / 2)
    assert out[("parent", "grid")]["token_f1_vs_parent"] == 1.0
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"model": "x"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        rs.load_samples(bad)
    assert rs.main([str(bad)]) == 2


def test_harness_takes_an_adapter_directory(tmp_path):
    """``--model NAME=ADAPTER_DIR`` (an adapter-only checkpoint, as ``unmask serve`` takes it) is evaluated like a
    checkpoint (it was refused as 'not a diffusion checkpoint directory'); its block 1 is the parent's answers."""
    import argparse

    from tiny import random_adapter_weights

    import eval_quality as ev
    from unmask.engine.adapter_files import parent_hash, write_adapter
    from unmask.engine.model import load_model

    parent_dir, conv = _parent_and_conversion(tmp_path)
    write_adapter(tmp_path / "adapter", random_adapter_weights(load_model(conv, weights="native")),
                  {"sha256": parent_hash(conv), "name": str(conv)})
    p = ev.add_arguments(argparse.ArgumentParser())
    a = p.parse_args(["--parent", str(parent_dir), "--no-defaults", "--model", f"ad={tmp_path / 'adapter'}",
                      "--out", str(tmp_path / "res"), "--data", str(_tiny_eval_data(tmp_path)), "--grid", "b1-s12",
                      "--max-tokens", "12", "--speed-prompts", "0", "--grid-prompts", "2", "--skip-full",
                      "--batch-size", "2"])
    result = ev.run_eval(a, log=lambda _: None)
    run = next(r for r in result["runs"] if r["model"] == "ad")
    assert run["n"] == 2 and run["same_as_parent"] == 1.0
