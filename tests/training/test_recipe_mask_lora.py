"""The fast recipe (``unmask recipe --trainable mask_lora``, issue 25) on a tiny parent: the engine teacher, the block
stage, the draft stage continuing the same adapter, the adapter-only fp16 export with its record; resume after an
interruption; the teacher-KL rule of the engine teacher; ``TrainConfig.init_adapter`` and the adapter resume."""
from __future__ import annotations

import csv
import json

import pytest
import torch

import tiny
from unmask.engine.adapter_files import read_adapter
from unmask.training.recipes.smollm2 import (FAST_DEFAULTS, Recipe, RecipeConfig, RecipeError, add_arguments,
                                             config_from_args)
from unmask.training.trainer import TrainConfig, Trainer, TrainError, train

from test_training_mask_adapter import setup  # noqa: F401 (the fixture: a tiny parent and 16 answers)

LORA = {"lora_r": 4, "lora_alpha": 8.0}


def _tiny_parent(path):
    tok = tiny.make_tokenizer(320)
    tiny.make_llama(len(tok), seed=2).save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return path


def _cfg(tmp_path, **kw):
    return RecipeConfig(work=str(tmp_path / "work"), out=str(tmp_path / "adapter"), parent=str(tmp_path / "parent"),
                        trainable="mask_lora", prompts_limit=6, distill_max_tokens=8, distill_batch=3, max_steps=4,
                        batch_size=2, seq_len=64, save_every=2, warmup=0, draft_max_steps=2, draft_batch_size=2,
                        draft_groups=4, **kw)


def test_the_engine_teacher_and_the_teacher_kl_rule():
    # mask_lora: the fast defaults, the engine teacher without soft targets
    cfg = RecipeConfig(trainable="mask_lora")
    assert (cfg.distill_teacher, cfg.teacher_kl, cfg.top_k_dist) == ("engine", 0.0, 0)
    assert {k: getattr(cfg, k) for k in FAST_DEFAULTS} == FAST_DEFAULTS
    assert cfg.budget_minutes + cfg.draft_minutes <= 35  # + convert, distill, export: within 45 minutes quiet
    cfg.validate()
    # the other scopes keep their recipe; the engine teacher turns the KL off there too (it stores nothing)
    full = RecipeConfig()
    assert (full.distill_teacher, full.teacher_kl, full.top_k_dist, full.budget_minutes, full.lr) == \
        ("transformers", 1.0, 16, 60.0, 1e-4)
    assert (RecipeConfig(distill_teacher="engine").teacher_kl, RecipeConfig(distill_teacher="engine").top_k_dist) \
        == (0.0, 0)
    # an explicit KL (or soft targets) with the engine teacher is refused, naming both ways out
    for bad in (dict(teacher_kl=1.0), dict(top_k_dist=8), dict(trainable="full", distill_teacher="engine",
                                                               teacher_kl=0.5)):
        with pytest.raises(RecipeError, match="engine teacher stores no teacher distributions.*transformers"):
            RecipeConfig(**{"trainable": "mask_lora", **bad}).validate()
    with pytest.raises(RecipeError, match="--distill-teacher"):
        RecipeConfig(distill_teacher="gpt").validate()
    for bad in (dict(default_threshold=0.7), dict(default_speculative=False)):  # the adapter's default is fixed
        with pytest.raises(RecipeError, match="--default-threshold/--no-default-speculative"):
            RecipeConfig(trainable="mask_lora", **bad).validate()
    RecipeConfig(trainable="mask_lora", distill_teacher="transformers", top_k_dist=8, teacher_kl=0.5).validate()
    # the command line: unset options take the scope's defaults, set ones win
    import argparse

    args = add_arguments(argparse.ArgumentParser()).parse_args(["--trainable", "mask_lora", "--lr", "1e-3"])
    got = config_from_args(args)
    assert got.lr == 1e-3 and got.distill_teacher == "engine" and got.prompts_limit == FAST_DEFAULTS["prompts_limit"]
    assert config_from_args(add_arguments(argparse.ArgumentParser()).parse_args([])).lr == 1e-4


def test_mask_lora_recipe_end_to_end_with_resume(tmp_path, monkeypatch):
    """An interrupted train stage resumes; the draft stage continues the train stage's adapter over the converted
    parent; the export is adapter-only fp16 with its record, and serves the parent's greedy answers."""
    from unmask.engine import LLM, SamplingParams
    from unmask.engine.model import load_model

    _tiny_parent(tmp_path / "parent")
    logs: list[str] = []
    # 1) killed during training: the halted trainer leaves checkpoint-2 (save_every 2) after 3 steps
    Recipe(_cfg(tmp_path, extra={**LORA, "halt_after": 3}), log=logs.append).run(until="train")
    work = tmp_path / "work"
    assert (work / "train" / "latest").read_text().strip() == "checkpoint-2"
    recs = [json.loads(x) for x in (work / "distill.jsonl").read_text().splitlines()]
    assert len(recs) == 6 and all("teacher" not in r and r["completion_ids"] for r in recs)  # the engine teacher
    assert any("the engine at block 1" in line for line in logs)
    # 2) rerun: the train stage resumes at step 2, then draft and export
    logs.clear()
    recipe = Recipe(_cfg(tmp_path, extra=LORA, draft_block_sizes="2,4"), log=logs.append,
                    command="unmask recipe --trainable mask_lora")
    out = recipe.run()
    assert any("[recipe 4/6 train] resuming checkpoint-2" in line for line in logs), logs
    with open(work / "train" / "metrics.csv") as fh:
        assert [int(r["step"]) for r in csv.DictReader(fh)] == [1, 2, 3, 4]
    train_ckpt = work / "train" / "checkpoint-4"
    draft_ckpt = work / "draft" / "checkpoint-2"
    saved = torch.load(draft_ckpt / "training_state.pt", weights_only=False)["config"]
    assert saved["init_adapter"] == str(train_ckpt) and saved["model"] == str(work / "converted")
    assert saved["objective"] == "draft" and saved["trainable"] == "mask_lora" and saved["verifier"] is None
    # the export: the draft stage's adapter, fp16, parent = the conversion, and the record beside it
    assert sorted(p.name for p in out.iterdir()) == ["mask_adapter.json", "mask_adapter.safetensors", "recipe.json"]
    weights, acfg = read_adapter(out)
    ref_w, _ = read_adapter(draft_ckpt)
    from safetensors import safe_open

    with safe_open(str(out / "mask_adapter.safetensors"), "pt") as fh:
        assert {fh.get_tensor(k).dtype for k in fh.keys()} == {torch.float16}
    assert torch.allclose(weights.mask_embedding, ref_w.mask_embedding, atol=1e-2)
    assert acfg["parent"]["name"] == str((work / "converted").resolve())
    assert acfg["training"]["objective"] == "draft"
    rec = json.loads((out / "recipe.json").read_text())
    assert rec["command"] == "unmask recipe --trainable mask_lora" and rec["source"] == str(draft_ckpt)
    assert rec["data"]["teacher"] == "engine" and rec["data"]["answers"] == 6 and rec["data"]["prompts"] == 6
    assert rec["data"]["completion_tokens"] == sum(len(r["completion_ids"]) for r in recs)
    assert rec["train"]["steps"] == 4 and rec["draft"]["steps"] == 2 and rec["draft"]["accepted_final"] is not None
    assert set(rec["minutes"]) == {"convert", "prompts", "distill", "train", "draft", "export", "total"}
    assert rec["config"]["trainable"] == "mask_lora" and rec["config"]["teacher_kl"] == 0.0
    assert rec["config"]["draft_block_sizes"] == "2,4" and any("draft blocks 2,4 by turns" in line for line in logs)
    with pytest.raises(RecipeError, match="--draft-block-sizes: each must be in 2"):
        _cfg(tmp_path, draft_block_sizes="1,4").validate()
    with pytest.raises(RecipeError, match="--draft-block-sizes: each must be in 2"):
        _cfg(tmp_path, draft_block_sizes="2,100000").validate()
    with pytest.raises(RecipeError, match="--draft-block-sizes: expected comma-separated integers"):
        _cfg(tmp_path, draft_block_sizes="2,x").validate()
    # served: the parent + the adapter, speculative by default = the parent's block-1 greedy answer
    ref = LLM(str(work / "converted")).generate("Two plus", SamplingParams(
        max_tokens=8, temperature=0, block_size=1, ignore_eos=True))[0].outputs[0].token_ids
    got = LLM(load_model(out)).generate("Two plus", SamplingParams(max_tokens=8, ignore_eos=True))[0].outputs[0]
    assert got.speculative and got.token_ids == ref
    # shipped (default_adapter/): the same tensors and parent hash, no machine paths; it loads over the conversion
    from unmask.training.recipes.record import main as record_main

    assert record_main(["ship", str(out), str(tmp_path / "shipped")]) == 0
    shipped = tmp_path / "shipped"
    for name in ("mask_adapter.json", "recipe.json"):
        assert str(tmp_path) not in (shipped / name).read_text(), name
    assert json.loads((shipped / "recipe.json").read_text())["source"] == "WORK/draft/checkpoint-2"
    assert (shipped / "mask_adapter.safetensors").read_bytes() == (out / "mask_adapter.safetensors").read_bytes()
    assert read_adapter(shipped)[1]["parent"]["sha256"] == acfg["parent"]["sha256"]
    again = LLM(load_model(shipped, parent=work / "converted")).generate(
        "Two plus", SamplingParams(max_tokens=8, ignore_eos=True))[0].outputs[0]
    assert again.token_ids == ref
    # --block-size / --diffusion-block-size set the served default blocks (recorded), nothing else
    assert record_main(["ship", str(out), str(tmp_path / "shipped3"), "--block-size", "3",
                        "--diffusion-block-size", "2", "--default-remasking", "left_to_right"]) == 0
    assert read_adapter(tmp_path / "shipped3")[1]["dllm"]["block_size"] == 3
    assert read_adapter(tmp_path / "shipped3")[1]["dllm"]["diffusion_block_size"] == 2
    shipped_record = json.loads((tmp_path / "shipped3" / "recipe.json").read_text())
    assert shipped_record["shipped_block_size"] == 3 and shipped_record["shipped_diffusion_block_size"] == 2
    assert read_adapter(tmp_path / "shipped3")[1]["dllm"]["default_sampling"]["remasking"] == "left_to_right"
    assert shipped_record["shipped_default_remasking"] == "left_to_right"
    assert (tmp_path / "shipped3" / "mask_adapter.safetensors").read_bytes() == (shipped / "mask_adapter.safetensors").read_bytes()
    # refused before anything is written: a block the server cannot draft at, a DEST that is a file or the export
    from unmask.training.recipes.record import ship

    for bad in (0, 33):
        with pytest.raises(ValueError, match="--block-size: must be in 1..32"):
            ship(out, tmp_path / "shipped4", block_size=bad)
    with pytest.raises(ValueError, match="--diffusion-block-size: must be >= 1"):
        ship(out, tmp_path / "shipped4", diffusion_block_size=0)
    with pytest.raises(ValueError, match="--default-remasking: must be one of"):
        ship(out, tmp_path / "shipped4", default_remasking="best")
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        ship(out, tmp_path / "afile")
    with pytest.raises(ValueError, match="the export itself"):
        ship(out, out)
    assert not (tmp_path / "shipped4").exists()
    # a write that fails part-way (here: the record) leaves DEST's files as they were, and no temporary files
    before = {f.name: f.read_bytes() for f in (tmp_path / "shipped3").iterdir()}
    real_write = type(out).write_text

    def failing(self, *a, **k):
        if self.name.startswith(".recipe.json.tmp"):
            raise OSError("disk full")
        return real_write(self, *a, **k)

    import pathlib

    monkeypatch.setattr(pathlib.Path, "write_text", failing)
    with pytest.raises(OSError, match="disk full"):
        ship(out, tmp_path / "shipped3", block_size=2)
    monkeypatch.undo()
    assert {f.name: f.read_bytes() for f in (tmp_path / "shipped3").iterdir()} == before
    # a rerun finds every stage done and exports nothing new
    logs.clear()
    Recipe(_cfg(tmp_path, extra=LORA), log=logs.append).run()
    assert any("[recipe 6/6 export] done" in line for line in logs)
    assert not list(tmp_path.glob("adapter.old-*"))
    # another teacher for the same work directory is refused (the distilled data would differ)
    with pytest.raises(RecipeError, match="--distill-teacher"):
        Recipe(_cfg(tmp_path, extra=LORA, distill_teacher="transformers"), log=logs.append)


def _train_cfg(setup, out, **kw):
    base = dict(model=str(setup / "parent"), data=str(setup / "d.jsonl"), out=str(out), objective="block",
                trainable="mask_lora", lora_r=4, lora_alpha=8, max_steps=4, batch_size=2, lr=1e-2, progress=False,
                seq_len=64, save_every=2)
    return TrainConfig(**{**base, **kw})


def test_mask_lora_resume_continues_exactly(setup, tmp_path):
    """An adapter-only checkpoint is a resume point (``latest`` used to be refused: no config.json)."""
    train(_train_cfg(setup, tmp_path / "a"))
    train(_train_cfg(setup, tmp_path / "b", halt_after=3))
    assert (tmp_path / "b" / "latest").read_text().strip() == "checkpoint-2"
    train(_train_cfg(setup, tmp_path / "b", resume=True))
    a, _ = read_adapter(tmp_path / "a" / "checkpoint-4")
    b, _ = read_adapter(tmp_path / "b" / "checkpoint-4")
    for key, (xa, xb) in a.layers.items():
        assert torch.allclose(xa, b.layers[key][0], atol=1e-6) and torch.allclose(xb, b.layers[key][1], atol=1e-6)
    assert torch.allclose(a.mask_embedding, b.mask_embedding, atol=1e-6)


def test_init_adapter_starts_from_the_checkpoint_with_a_fresh_optimizer(setup, tmp_path):
    from unmask.engine.mask_adapter import extract

    train(_train_cfg(setup, tmp_path / "block", max_steps=2))
    src = tmp_path / "block" / "checkpoint-2"
    want, _ = read_adapter(src)
    t = Trainer(_train_cfg(setup, tmp_path / "draft", objective="draft", init_adapter=str(src)))
    t._load()
    got = extract(t.tm.base.get_decoder(), t.tm.adapter_template)
    assert any(float(b.abs().max()) > 0 for _, b in want.layers.values())  # trained: B is no longer zero
    for key, (a, b) in want.layers.items():
        assert torch.equal(got.layers[key][0], a) and torch.equal(got.layers[key][1], b)
    assert torch.equal(got.mask_embedding, want.mask_embedding)
    assert t.step == 0 and not t.optimizer.state_dict()["state"]
    # refused: another scope, another rank, another parent
    with pytest.raises(TrainError, match="--init-adapter: only with --trainable mask_lora"):
        TrainConfig(model="m", data="d", out="o", trainable="full", init_adapter=str(src)).validate()
    with pytest.raises(TrainError, match="--init-adapter: .*rank"):
        Trainer(_train_cfg(setup, tmp_path / "r8", lora_r=8, init_adapter=str(src)))._load()
    from unmask.engine.checkpoint import write_checkpoint

    other = tiny.loaded(initializer_range=0.5, seed=5)
    write_checkpoint(tmp_path / "other", other.model, other.tokenizer, other.dllm)
    with pytest.raises(TrainError, match="--init-adapter: .*another|trained on the parent"):
        Trainer(_train_cfg(setup, tmp_path / "o", model=str(tmp_path / "other"),
                           init_adapter=str(src)))._load()
