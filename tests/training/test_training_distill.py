"""distill-data with a tiny AR parent: batched greedy answers, top-k soft targets aligned to the answer tokens,
resume by skipping answered prompts, and training on the stored distributions (--teacher-kl without a parent)."""
from __future__ import annotations

import csv
import json

import pytest
import torch

import tiny
from unmask.cli.main import main as cli_main
from unmask.training.data import load_dataset
from unmask.training.trainer import TrainConfig, train


def test_distill_resume_topk_and_train(tmp_path, capsys):
    from unmask.engine.checkpoint import write_checkpoint

    tok = tiny.make_tokenizer(320)
    parent = tiny.make_llama(len(tok), seed=2)
    parent.save_pretrained(tmp_path / "parent")
    tok.save_pretrained(tmp_path / "parent")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(x) + "\n" for x in [
        {"prompt": "What is two plus two?"}, {"prompt": "Hi"},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fox."}]}]))
    out = tmp_path / "distilled.jsonl"
    args = ["distill-data", "--teacher", str(tmp_path / "parent"), "--prompts", str(prompts), "--out", str(out),
            "--max-new-tokens", "6", "--batch-size", "2", "--top-k-dist", "3", "--no-progress"]
    out.write_text("")  # an existing empty output is fine
    assert cli_main(args) == 0
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(recs) == 3 and recs[2]["messages"][-1]["role"] == "assistant"
    # greedy: each generated token is the top-1 of the stored distribution it was generated from
    for r in recs:
        assert [row[0] for row in r["teacher"]["ids"]] == r["completion_ids"]
        assert all(a >= b for row in r["teacher"]["logprobs"] for a, b in zip(row, row[1:]))
    # the same answers as an unbatched greedy generation of the parent (left padding is harmless)
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tok(text, add_special_tokens=False).input_ids])
    with torch.no_grad():
        ref = parent.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=[0, 2], pad_token_id=0)
    assert ref[0, ids.shape[1]:].tolist()[: len(recs[1]["completion_ids"])] == recs[1]["completion_ids"]
    capsys.readouterr()
    assert cli_main(args) == 0  # resume: nothing left to do
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == {"total": 3, "skipped": 3, "written": 0, "too_long": 0}
    assert len(out.read_text().splitlines()) == 3

    # train on the stored soft targets: a2d checkpoint of the same parent (mask token appended)
    a2d_tok = tiny.make_tokenizer(320, mask_token="[MASK]")
    lm = tiny.loaded(seed=2)
    write_checkpoint(tmp_path / "a2d", lm.model, lm.tokenizer, lm.dllm)
    ds = load_dataset(out, a2d_tok, 64)
    assert ds.teacher_top_k == 3 and all(e.teacher_ids is not None for e in ds.examples)
    run = tmp_path / "run"
    train(TrainConfig(model=str(tmp_path / "a2d"), data=str(out), out=str(run), max_steps=1, batch_size=3,
                      seq_len=64, teacher_kl=0.5, progress=False))
    row = next(csv.DictReader(open(run / "metrics.csv")))
    assert float(row["kl"]) > 0 and float(row["loss"]) == pytest.approx(float(row["ce"]) + 0.5 * float(row["kl"]),
                                                                           rel=1e-4)
    assert cli_main(["distill-data", "--teacher", str(tmp_path / "none"), "--prompts", str(prompts), "--out",
                     str(tmp_path / "o.jsonl")]) == 2


def test_distill_with_the_engine_matches_block1_greedy_and_resumes(tmp_path, capsys):
    """--engine: the a2d checkpoint's own block_size=1 greedy answers (the logit shift makes them its parent's),
    identical to the engine decoding each prompt alone, with EOS kept in completion_ids; resumable."""
    from unmask.engine import LLM, SamplingParams
    from unmask.engine.checkpoint import write_checkpoint

    lm = tiny.loaded(seed=3)
    write_checkpoint(tmp_path / "a2d", lm.model, lm.tokenizer, lm.dllm)
    prompts = tmp_path / "prompts.jsonl"
    items = [{"prompt": "What is two plus two?"}, {"prompt": "Hi"}, {"prompt": "Name three colours."},
             {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "A fox?"}]}]
    prompts.write_text("".join(json.dumps(x) + "\n" for x in items))
    out = tmp_path / "distilled.jsonl"
    args = ["distill-data", "--engine", "--teacher", str(tmp_path / "a2d"), "--prompts", str(prompts), "--out",
            str(out), "--max-new-tokens", "7", "--batch-size", "2", "--no-progress"]
    assert cli_main(args) == 0
    recs = [json.loads(x) for x in out.read_text().splitlines()]  # completion order
    by_prompt = {r["prompt"] if r["prompt"] is not None else r["messages"][-2]["content"]: r for r in recs}
    recs = [by_prompt[it.get("prompt") or it["messages"][-1]["content"]] for it in items]
    assert len(by_prompt) == 4 and recs[3]["messages"][-1]["role"] == "assistant" and "teacher" not in recs[0]
    llm = LLM(str(tmp_path / "a2d"))
    eos = set(llm.model.dllm.eos_token_ids)
    for item, rec in zip(items, recs):
        ids = llm.apply_chat_template(item.get("messages") or [{"role": "user", "content": item["prompt"]}])
        ref = llm.generate([ids], SamplingParams(max_tokens=7, temperature=0, block_size=1, speculative=False))[0]
        assert rec["completion_ids"] == ref.outputs[0].token_ids
        assert rec["finished"] == (rec["completion_ids"][-1] in eos)
        assert rec["completion"] == llm.tokenizer.decode(rec["completion_ids"], skip_special_tokens=True)
    capsys.readouterr()
    assert cli_main(args) == 0  # resume: nothing left
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == {"total": 4, "skipped": 4, "written": 0, "too_long": 0}
    # bad combinations name the option
    assert cli_main(args + ["--top-k-dist", "2"]) == 2
    assert "top-k-dist" in capsys.readouterr().err
    assert cli_main(["distill-data", "--engine", "--teacher", str(tmp_path / "prompts.jsonl"), "--prompts",
                     str(prompts), "--out", str(tmp_path / "o.jsonl")]) == 2
    assert "a2d checkpoint" in capsys.readouterr().err
    bidir = tiny.loaded(seed=3, attention="bidirectional")
    write_checkpoint(tmp_path / "bidir", bidir.model, bidir.tokenizer, bidir.dllm)
    assert cli_main(["distill-data", "--engine", "--teacher", str(tmp_path / "bidir"), "--prompts", str(prompts),
                     "--out", str(tmp_path / "o.jsonl")]) == 2
    assert "bidirectional" in capsys.readouterr().err


@pytest.mark.parametrize("engine", [True, False])
def test_distill_skips_prompts_that_fill_the_context_and_keeps_going(tmp_path, capsys, engine):
    """A prompt with no room left in the teacher's context is skipped with a warning naming file:line, on every
    rerun, instead of stopping the run (it used to raise a ParamError on every resume with --engine); a prompt near
    the edge gets the tokens that fit."""
    from unmask.engine.checkpoint import write_checkpoint

    lm = tiny.loaded(seed=3)
    write_checkpoint(tmp_path / "a2d", lm.model, lm.tokenizer, lm.dllm)
    ctx = 512  # tiny.make_llama's max_position_embeddings
    long_text = " ".join(["word"] * 2 * ctx)
    items = [{"prompt": "Hi"}, {"prompt": long_text}, {"prompt": "Name three colours."}]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(x) + "\n" for x in items))
    out = tmp_path / "distilled.jsonl"
    args = ["distill-data", "--teacher", str(tmp_path / "a2d"), "--prompts", str(prompts), "--out", str(out),
            "--max-new-tokens", "5", "--batch-size", "2", "--no-progress"] + (["--engine"] if engine else [])
    for attempt in range(2):
        with pytest.warns(UserWarning, match=rf"prompts.jsonl:2: the prompt has \d+ tokens .* context of {ctx}"):
            assert cli_main(args) == 0
        stats = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert stats == {"total": 3, "skipped": 2 * attempt, "written": 2 * (1 - attempt), "too_long": 1}
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted(r["prompt"] for r in recs) == ["Hi", "Name three colours."]
    # a prompt 2 tokens short of the context gets 2 tokens (transformers would run past the positions it knows)
    near = _prompt_with_tokens(lm.tokenizer, ctx - 2)
    prompts.write_text(json.dumps({"prompt": near}) + "\n")
    out2 = tmp_path / "near.jsonl"
    assert cli_main(args[:args.index("--out") + 1] + [str(out2)] + args[args.index("--out") + 2:]) == 0
    rec = json.loads(out2.read_text())
    assert 1 <= len(rec["completion_ids"]) <= 2


def _prompt_with_tokens(tok, n_tokens):
    """A user prompt whose chat-rendered prompt has exactly ``n_tokens`` tokens (found by search)."""
    def count(text):
        rendered = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                           tokenize=False)
        return len(tok(rendered, add_special_tokens=False).input_ids)

    for filler in ("a", "b c", "word", "x"):
        lo, hi = 0, 4 * n_tokens  # count(filler * k) grows with k: bisect for the exact length
        while lo < hi:
            mid = (lo + hi) // 2
            if count(" ".join([filler] * mid)) < n_tokens:
                lo = mid + 1
            else:
                hi = mid
        for k in (lo, lo + 1):
            for tail in ("", " z", " q"):
                text = " ".join([filler] * k) + tail
                if count(text) == n_tokens:
                    return text
    raise AssertionError(f"no prompt of {n_tokens} tokens found")


def test_engine_teacher_clamps_answers_at_the_context_edge_and_stops_at_the_tokenizers_eos(tmp_path, monkeypatch):
    """The engine teacher ends answers at the same ids as the transformers teacher (eos_ids_of(tokenizer)), not
    only at dllm.eos_token_ids, and a prompt a few tokens short of the context gets those few tokens."""
    from unmask.engine import LLM, SamplingParams
    from unmask.engine.checkpoint import write_checkpoint
    import unmask.training.distill as distill_mod

    lm = tiny.loaded(seed=3)
    write_checkpoint(tmp_path / "a2d", lm.model, lm.tokenizer, lm.dllm)
    llm = LLM(str(tmp_path / "a2d"))
    item = {"prompt": "Name three colours."}
    ids = llm.apply_chat_template([{"role": "user", "content": item["prompt"]}])
    free = llm.generate([ids], SamplingParams(max_tokens=6, temperature=0, block_size=1, speculative=False,
                                              ignore_eos=True))[0].outputs[0].token_ids
    stop_at = free[2]
    assert stop_at not in free[:2] and stop_at not in lm.dllm.eos_token_ids
    real = distill_mod.eos_ids_of
    monkeypatch.setattr(distill_mod, "eos_ids_of", lambda tok, model=None, extra=None: [*real(tok, model, extra), stop_at])
    teacher = distill_mod.EngineTeacher(tmp_path / "a2d", batch_size=2)
    rec = teacher.answer([dict(item)], 6)[0]
    assert rec["completion_ids"] == free[:3] and rec["finished"]
    # a prompt 3 tokens short of the context: 3 tokens, not a ParamError
    teacher.context = len(ids) + 3
    teacher.llm.model.max_context = len(ids) + 3
    monkeypatch.setattr(distill_mod, "eos_ids_of", real)
    teacher.stop_ids = []
    rec = teacher.answer([dict(item)], 6)[0]
    got = rec["completion_ids"]
    assert got == free[: len(got)] and (len(got) == 3 or got[-1] in lm.dllm.eos_token_ids)


def test_ctrl_c_says_how_to_resume(monkeypatch, capsys):
    """Ctrl-C exits 130 and a resumable command says how to continue."""
    import unmask.cli.distill as distill_cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(distill_cli, "run", interrupted)
    assert cli_main(["distill-data", "--teacher", "t", "--prompts", "p", "--out", "o"]) == 130
    assert "interrupted; rerun the same command to continue" in capsys.readouterr().err
