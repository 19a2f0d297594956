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


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


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
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == {"total": 3, "skipped": 3, "written": 0}
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
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(recs) == 4 and recs[3]["messages"][-1]["role"] == "assistant" and "teacher" not in recs[0]
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
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == {"total": 4, "skipped": 4, "written": 0}
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
