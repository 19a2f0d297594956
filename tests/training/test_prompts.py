"""The committed prompt sets (benchmarks/data) and their generator (training/recipes/prompts.py)."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from unmask.training.recipes import prompts as P

DATA = Path(__file__).resolve().parents[2] / "benchmarks" / "data"


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


# ------------------------------------------------------------------------- the recipe (training/recipes/smollm2.py)
def test_training_minutes_used_sums_process_segments(tmp_path):
    from unmask.training.recipes.smollm2 import training_minutes_used

    csv = tmp_path / "metrics.csv"
    assert training_minutes_used(csv) == 0.0
    # two processes: 0..120 s, then a resumed one 0..60 s
    rows = ["step,elapsed_s", "1,30", "2,60", "3,120", "4,20", "5,60"]
    csv.write_text("\n".join(rows) + "\n")
    assert training_minutes_used(csv) == pytest.approx(3.0)
    # resuming from checkpoint-3: the 60 s of steps 4-5 are lost and redone, so not spent
    assert training_minutes_used(csv, up_to_step=3) == pytest.approx(2.0)
    assert training_minutes_used(csv, up_to_step=0) == 0.0


def test_recipe_options_and_state_lock(tmp_path):
    from unmask.training.recipes.smollm2 import Recipe, RecipeConfig, RecipeError

    for bad in (dict(block_size=0), dict(budget_minutes=0), dict(quantize="fp8"), dict(teacher_kl=1, top_k_dist=0),
                dict(lr=0), dict(trainable="most"), dict(lr=float("nan")), dict(teacher_kl=float("nan")),
                dict(seq_len=1), dict(budget_minutes=float("inf")), dict(certainty=-1), dict(certainty=float("nan")),
                dict(default_threshold=1.5), dict(default_threshold=True), dict(default_threshold=10 ** 400)):
        with pytest.raises(RecipeError, match="--"):
            RecipeConfig(work=str(tmp_path), **bad).validate()
    r = Recipe(RecipeConfig(work=str(tmp_path / "w"), out=str(tmp_path / "o"), prompts_limit=50), log=lambda m: None)
    r.stage_prompts()
    rows = P.load_prompts(r.prompts_file)
    import random

    shuffled = list(P.build_train())
    random.Random(0).shuffle(shuffled)
    assert [x["prompt"] for x in rows] == [x["prompt"] for x in shuffled[:50]]
    # a limited subset is spread over the templates, not the first few of them
    assert len({x["id"] for x in rows}) == 50
    full = {x["prompt"]: x["template"] for x in P.build_train()}
    assert len({full[x["prompt"]] for x in rows}) >= 20
    r._save_state()
    with pytest.raises(RecipeError, match="--block-size"):
        Recipe(RecipeConfig(work=str(tmp_path / "w"), block_size=8, prompts_limit=50), log=lambda m: None)
    with pytest.raises(RecipeError, match="--parent"):
        Recipe(RecipeConfig(work=str(tmp_path / "w2"), parent=str(tmp_path / "nope")), log=lambda m: None).parent_path()



def test_recipe_block_options_are_refused_before_work_is_created(tmp_path, capsys):
    """--block-size beyond --seq-len (a huge allocation in the train stage, after the conversion wrote it) and
    --draft-block-sizes with the draft stage off (silently ignored) are one-line usage errors naming the options,
    raised before WORK exists."""
    from unmask.cli.main import main
    from unmask.training.recipes.smollm2 import RecipeConfig, RecipeError

    work = tmp_path / "w"
    base = ["recipe", "--work", str(work), "--out", str(tmp_path / "o"), "--parent", str(tmp_path / "none.gguf")]
    for extra, words in ((["--block-size", "100000"], "--block-size: must be in 1..--seq-len (128), got 100000"),
                         (["--block-size", "65", "--seq-len", "64"], "--block-size: must be in 1..--seq-len (64)"),
                         (["--draft-block-sizes", "2,4", "--draft-minutes", "0"],
                          "--draft-block-sizes: only used by the draft stage, which --draft-minutes 0 skips"),
                         (["--draft-block-sizes", "2,4"], "--draft-minutes 0 skips")):  # full: no draft by default
        assert main(base + extra) == 2, extra
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1, (extra, err)
        assert not work.exists(), extra
    with pytest.raises(RecipeError, match="--draft-block-sizes.*--draft-minutes.*--draft-block-sizes"):
        RecipeConfig(work=str(work), draft_block_sizes="2,4", draft_minutes=0).validate()
    # with the draft stage on (a budget, a step cap, or mask_lora's default budget) the option applies
    RecipeConfig(work=str(work), draft_block_sizes="2,4", draft_minutes=5).validate()
    RecipeConfig(work=str(work), draft_block_sizes="2,4", draft_max_steps=3).validate()
    RecipeConfig(work=str(work), trainable="mask_lora", draft_block_sizes="2,4").validate()
    RecipeConfig(work=str(work), block_size=128, seq_len=128).validate()  # the bound itself is fine

def test_recipe_pipeline_on_a_tiny_parent(tmp_path):
    """convert -> prompts -> distill -> train (3 steps) -> export, then a rerun that finds every stage done."""
    from tiny import make_llama, make_tokenizer

    from unmask.training.realmodel import is_checkpoint
    from unmask.training.recipes.smollm2 import Recipe, RecipeConfig, RecipeError, trained_fp32_checkpoint

    tok = make_tokenizer(320)
    parent = tmp_path / "parent"
    make_llama(len(tok), seed=2).save_pretrained(str(parent))
    tok.save_pretrained(str(parent))
    cfg = RecipeConfig(work=str(tmp_path / "work"), out=str(tmp_path / "trained"), parent=str(parent),
                       prompts_limit=6, distill_max_tokens=6, distill_batch=3, top_k_dist=4, max_steps=3,
                       budget_minutes=5, batch_size=2, seq_len=64, save_every=0, warmup=0, draft_max_steps=2,
                       draft_batch_size=2, draft_groups=4)
    logs: list[str] = []
    try:
        import unmask.training.export  # noqa: F401
        have_export = True
    except ImportError:
        have_export = False
    recipe = Recipe(cfg, log=logs.append)
    if have_export:
        recipe.run()
        assert is_checkpoint(tmp_path / "trained")
    else:
        with pytest.raises(RecipeError, match="export"):
            recipe.run()
    ck = trained_fp32_checkpoint(tmp_path / "work")  # the draft stage's: the drafter of the converted parent
    assert ck is not None and ck.parent.name == "draft" and ck.name == "checkpoint-2"
    assert json.loads((ck / "config.json").read_text())["dllm"]["verifier"] == \
        str((tmp_path / "work" / "converted").resolve())
    if have_export:  # the export is self-contained: the verifier travels with it and decodes the parent's tokens
        assert json.loads((tmp_path / "trained" / "config.json").read_text())["dllm"]["verifier"] == "verifier"
        assert is_checkpoint(tmp_path / "trained" / "verifier")
        from unmask.engine import LLM, SamplingParams

        served = LLM(str(tmp_path / "trained"))
        ref = LLM(str(tmp_path / "trained" / "verifier")).generate("Two plus", SamplingParams(
            max_tokens=6, temperature=0, block_size=1, ignore_eos=True))[0].outputs[0].token_ids
        got = served.generate("Two plus", SamplingParams(max_tokens=6, speculative=True, ignore_eos=True))
        assert got[0].outputs[0].token_ids == ref and len(ref) == 6
    assert is_checkpoint(tmp_path / "work" / "converted")
    assert len((tmp_path / "work" / "distill.jsonl").read_text().splitlines()) == 6
    state = json.loads((tmp_path / "work" / "recipe.json").read_text())
    assert state["stages"]["distill"]["answered"] == 6
    assert any(line.startswith("[recipe 4/6 train]") for line in logs)
    assert any(line.startswith("[recipe 5/6 draft]") for line in logs)
    # rerun: everything up to train is found done
    logs.clear()
    Recipe(cfg, log=logs.append).run(until="train")
    assert any("[recipe 1/6 convert] done" in line for line in logs)
    assert any("[recipe 4/6 train] done" in line for line in logs)
    if not have_export:
        return
    # export: skipped when OUT holds this very checkpoint; redone when the checkpoint at the same path was
    # retrained; a failed export leaves the previous one in place (it used to be moved aside first)
    import os

    import unmask.training.recipes.smollm2 as rs

    calls = []
    real = rs._export_function

    def counting():
        fn = real()
        return lambda *a: calls.append(a) or fn(*a)

    rs_export, rs._export_function = rs._export_function, counting
    try:
        Recipe(cfg, log=logs.append).stage_export()
        assert calls == []
        weights = ck / "model.safetensors"
        os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10 ** 9))
        Recipe(cfg, log=logs.append).stage_export()
        assert len(calls) == 1 and is_checkpoint(tmp_path / "trained")
        assert len(list(tmp_path.glob("trained.old-*"))) == 1
        # a new decoding default is an export of its own; the served config carries it
        cfg.default_threshold = 0.7
        Recipe(cfg, log=logs.append).stage_export()
        assert len(calls) == 2
        dllm = json.loads((tmp_path / "trained" / "config.json").read_text())["dllm"]
        assert dllm["default_sampling"]["threshold"] == 0.7
        assert dllm["default_sampling"]["speculative"] is True  # the recipe's default
        cfg.default_speculative = False  # turning it off is an export of its own too, and clears it
        Recipe(cfg, log=logs.append).stage_export()
        assert len(calls) == 3
        dllm = json.loads((tmp_path / "trained" / "config.json").read_text())["dllm"]
        assert dllm["default_sampling"]["speculative"] is False

        def failing():
            def fn(*a):
                raise RecipeError("export: verification failed")
            return fn

        rs._export_function = failing
        os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10 ** 9))
        before = (tmp_path / "trained" / "config.json").read_text()
        with pytest.raises(RecipeError, match="verification"):
            Recipe(cfg, log=logs.append).stage_export()
        assert (tmp_path / "trained" / "config.json").read_text() == before
    finally:
        rs._export_function = rs_export


def test_recipe_budget_run_decays_lr_over_the_whole_budget(tmp_path, monkeypatch):
    """A budget-only recipe (no --max-steps) trains with cosine_time spanning the whole budget: a resumed run is
    told the minutes already spent (from metrics.csv) and gets only what is left."""
    import unmask.training.trainer as trainer
    from unmask.training.recipes.smollm2 import Recipe, RecipeConfig, RecipeError

    work = tmp_path / "w"
    train_dir = work / "train"
    (train_dir / "checkpoint-5").mkdir(parents=True)
    (train_dir / "checkpoint-5" / "config.json").write_text("{}")
    (train_dir / "latest").write_text("checkpoint-5")
    # steps 6-7 ran after checkpoint-5 and were lost by the interruption: their 10 minutes are redone
    (train_dir / "metrics.csv").write_text("step,elapsed_s\n1,600\n5,1200\n6,1500\n7,1800\n")
    seen = []
    monkeypatch.setattr(trainer, "train", lambda cfg: seen.append(cfg))
    Recipe(RecipeConfig(work=str(work), out=str(tmp_path / "o"), budget_minutes=60), log=lambda m: None).stage_train()
    (cfg,) = seen
    assert cfg.lr_schedule == "cosine_time" and cfg.resume
    assert cfg.minutes_before == pytest.approx(20.0) and cfg.max_minutes == pytest.approx(40.0)
    cfg.validate()
    # killed before the first checkpoint: everything is redone from step 0, the whole budget is left
    (train_dir / "latest").unlink()
    seen.clear()
    with pytest.raises(RecipeError, match="without a checkpoint"):  # (the stub trainer writes none)
        Recipe(RecipeConfig(work=str(work), out=str(tmp_path / "o"), budget_minutes=60),
               log=lambda m: None).stage_train()
    (cfg,) = seen
    assert not cfg.resume and cfg.minutes_before == 0.0 and cfg.max_minutes == pytest.approx(60.0)


def test_recipe_draft_stage(tmp_path, monkeypatch):
    """The draft stage trains the train stage's latest checkpoint as the drafter of WORK/converted; --draft-minutes 0
    skips it (the export and the evaluation then take the train checkpoint); a draft run of another (or retrained)
    train checkpoint - or of an unknown one - is started afresh, never resumed."""
    import os

    import unmask.training.trainer as trainer
    from unmask.training.recipes.smollm2 import Recipe, RecipeConfig, RecipeError, trained_fp32_checkpoint

    work = tmp_path / "w"
    for stage, step in (("train", 5), ("draft", 3)):
        d = work / stage / f"checkpoint-{step}"
        d.mkdir(parents=True)
        (d / "config.json").write_text("{}")
        (d / "model.safetensors").write_text("weights")
        (work / stage / "latest").write_text(d.name)
    assert trained_fp32_checkpoint(work).parent.name == "draft"
    seen = []
    monkeypatch.setattr(trainer, "train", lambda cfg: seen.append(cfg))
    logs = []

    def recipe(**kw):
        return Recipe(RecipeConfig(work=str(work), out=str(tmp_path / "o"), **kw), log=logs.append)

    recipe(draft_minutes=0).stage_draft()
    assert seen == [] and any("skipped" in m for m in logs)
    assert trained_fp32_checkpoint(work).parent.name == "train"  # skipped: the drafter is not the model
    # a draft directory of unknown origin is discarded and the drafter trained afresh from the current checkpoint
    with pytest.raises(RecipeError, match="without a checkpoint"):  # (the stub trainer writes none)
        recipe(draft_minutes=10).stage_draft()
    (cfg,) = seen
    assert not (work / "draft" / "checkpoint-3").exists() and not cfg.resume
    assert cfg.objective == "draft" and cfg.verifier == str(work / "converted")
    assert cfg.model == str(work / "train" / "checkpoint-5") and cfg.out == str(work / "draft")
    assert cfg.max_minutes == pytest.approx(10.0) and cfg.block_size == 4
    # interrupted after a checkpoint: resumed while the train checkpoint is the same ...
    d = work / "draft" / "checkpoint-2"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (work / "draft" / "latest").write_text(d.name)
    seen.clear()
    recipe(draft_minutes=10).stage_draft()
    assert seen[0].resume and d.exists()
    # ... and started afresh once that checkpoint was retrained (same path, new weights)
    w = work / "train" / "checkpoint-5" / "model.safetensors"
    os.utime(w, ns=(w.stat().st_atime_ns, w.stat().st_mtime_ns + 10 ** 9))
    seen.clear()
    with pytest.raises(RecipeError, match="without a checkpoint"):
        recipe(draft_minutes=10).stage_draft()
    assert not seen[0].resume and not d.exists() and any("afresh" in m for m in logs)
    with pytest.raises(RecipeError, match="block-size >= 2"):
        RecipeConfig(block_size=1, draft_minutes=5).validate()
    RecipeConfig(block_size=1).validate()  # the draft stage is opt-in


def test_train_extra_is_disjoint_and_deterministic(sets, tmp_path):
    train, evals, _ = sets
    extra = P.build_train_extra(2)
    assert extra == P.build_train_extra(2)  # deterministic
    texts = [r["prompt"] for r in extra]
    assert len(set(texts)) == len(texts) > 1000
    assert not set(texts) & ({r["prompt"] for r in train} | {r["prompt"] for r in evals})
    assert all(r["template"].startswith("train.") and not r["template"].startswith("train.hand.") for r in extra)
    assert {r["template"] for r in extra} <= {r["template"] for r in train}
    assert extra[0]["id"] == "trainx-00000"
    # per template at most factor x its training count
    base = Counter(r["template"] for r in train)
    assert all(n <= 2 * base[t] for t, n in Counter(r["template"] for r in extra).items())
    assert P.main(["--out", str(tmp_path), "--extra-train", "1"]) == 0
    assert P.load_prompts(tmp_path / P.EXTRA_FILE) == [dict(r) for r in P.build_train_extra(1)]
    with pytest.raises(ValueError, match="factor"):
        P.build_train_extra(0)
