"""Trainer end to end on a tiny a2d checkpoint: every objective x trainable scope -> export -> the engine generates;
frozen parameters unchanged and the mask row trained; exact resume; kill -9 during a checkpoint write; DDP."""
from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import tiny
from unmask.engine.llm import LLM
from unmask.engine.model import load_model
from unmask.engine.params import SamplingParams
from unmask.training.export import export
from unmask.training.trainer import TrainConfig, TrainError, resolve_latest, train

ROOT = Path(__file__).resolve().parents[2]
DATA = [
    {"prompt": "What is two plus two?", "completion": "Two plus two is four."},
    {"prompt": "Name a quick animal.", "completion": "The quick brown fox."},
    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"},
                  {"role": "user", "content": "Count"}, {"role": "assistant", "content": "One two three"}]},
    {"prompt": "Capital of France?", "completion": "Paris is the capital of France."},
]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("train")
    tiny.training_dir(d, DATA)
    return d


def _cfg(workdir, out, **kw):
    base = dict(model=str(workdir / "src"), data=str(workdir / "data.jsonl"), out=str(out), batch_size=2,
                max_steps=2, seq_len=64, lr=1e-2, progress=False, seed=1)
    base.update(kw)
    return TrainConfig(**base)


def _weights(d):
    return load_file(str(Path(d) / "model.safetensors"))


MATRIX = [(o, s) for o in ("block", "mdlm") for s in ("full", "freeze_ffn", "qk_only", "lora", "qlora")]
QUANT = {"full": "none", "freeze_ffn": "nf4", "qk_only": "int8", "lora": "nf4", "qlora": "int8"}


@pytest.mark.parametrize("objective, scope", MATRIX)
def test_train_scope_export_generate(workdir, tmp_path, objective, scope):
    out = tmp_path / "run"
    extra = {"eval_every": 2, "eval_data": str(workdir / "data.jsonl"), "eval_t_points": 2} if scope == "full" else {}
    train(_cfg(workdir, out, objective=objective, trainable=scope, **extra))
    ckpt = resolve_latest(out)
    assert ckpt.name == "checkpoint-2" and (ckpt / "training_state.pt").is_file()
    rows = list(csv.DictReader(open(out / "metrics.csv")))
    assert [int(r["step"]) for r in rows] == [1, 2] and float(rows[-1]["tokens_per_s"]) > 0
    if extra:
        assert rows[-1]["eval_loss"] and 0 <= float(rows[-1]["eval_acc"]) <= 1
    assert (out / "loss.png").stat().st_size > 0

    src, new = _weights(workdir / "src"), _weights(ckpt)
    mask_id = load_model(workdir / "src", device="cpu").dllm.mask_token_id
    assert set(src) == set(new)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert not torch.equal(src[name][mask_id], new[name][mask_id]), f"{name}: mask row not trained"
    changed = {n for n in src if not torch.equal(src[n], new[n])}
    if scope == "freeze_ffn":
        assert not any(".mlp." in n for n in changed) and any("self_attn" in n for n in changed)
    if scope in ("qk_only", "lora", "qlora"):
        allowed = ("q_proj", "k_proj") if scope == "qk_only" else ("q_proj", "k_proj", "v_proj", "o_proj")
        rows_only = {"model.embed_tokens.weight", "lm_head.weight"}
        assert all(any(a in n for a in allowed) or n in rows_only for n in changed), sorted(changed)
        assert any("q_proj" in n for n in changed) and any("k_proj" in n for n in changed)
        for name in rows_only:  # every other row bit-identical
            keep = torch.ones(src[name].shape[0], dtype=torch.bool)
            keep[mask_id] = False
            assert torch.equal(src[name][keep], new[name][keep])
    if scope == "full":
        assert any(".mlp." in n for n in changed)

    q = QUANT[scope] if objective == "block" else {"none": "nf4", "nf4": "int8", "int8": "none"}[QUANT[scope]]
    res = export(out, tmp_path / "exp", quantization=q)
    assert res["max_abs_logit_diff"] == 0.0
    cfg = json.loads((tmp_path / "exp" / "config.json").read_text())
    assert ("quantization_config" in cfg) == (q != "none") and cfg["dllm"]["family"] == "a2d"
    llm = LLM(str(tmp_path / "exp"), device="cpu")
    o = llm.generate("Hi", SamplingParams(max_tokens=4, temperature=0.0))[0].outputs[0]
    assert 1 <= len(o.token_ids) <= 4


@pytest.mark.parametrize("scope", ["full", "lora"])
def test_resume_is_exact(workdir, tmp_path, scope):
    kw = dict(trainable=scope, max_steps=4, save_every=2, objective="block", complementary=True, grad_accum=2,
              batch_size=1, lr_schedule="cosine", warmup=1, weight_decay=0.1)
    train(_cfg(workdir, tmp_path / "straight", **kw))
    train(_cfg(workdir, tmp_path / "resumed", halt_after=2, **kw))  # interrupted after step 2
    assert resolve_latest(tmp_path / "resumed").name == "checkpoint-2"
    assert not (tmp_path / "resumed" / "checkpoint-4").exists()
    train(_cfg(workdir, tmp_path / "resumed", resume=True, **kw))
    a, b = _weights(tmp_path / "straight" / "checkpoint-4"), _weights(tmp_path / "resumed" / "checkpoint-4")
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not all(torch.equal(a[n], _weights(workdir / "src")[n]) for n in a)
    la = [r["loss"] for r in csv.DictReader(open(tmp_path / "straight" / "metrics.csv"))]
    lb = [r["loss"] for r in csv.DictReader(open(tmp_path / "resumed" / "metrics.csv"))]
    assert la == lb and len(la) == 4
    with pytest.raises(TrainError, match="--lr-schedule"):
        train(_cfg(workdir, tmp_path / "resumed", resume=True, **{**kw, "lr_schedule": "linear"}))
    with pytest.raises(TrainError, match="already holds checkpoints"):
        train(_cfg(workdir, tmp_path / "resumed", **kw))


def test_kill_between_checkpoint_and_latest_resumes(workdir, tmp_path, monkeypatch):
    """A kill after checkpoint-N is in place but before `latest` names it: resuming recomputes step N from the
    older `latest` and must replace the orphan checkpoint (it used to refuse to overwrite it, for ever)."""
    import unmask.training.checkpoints as tr

    kw = dict(max_steps=4, save_every=2, batch_size=1)
    real = tr.write_latest

    def killed(out, name):
        if name == "checkpoint-4":
            raise SystemExit("killed")
        real(out, name)

    monkeypatch.setattr(tr, "write_latest", killed)
    with pytest.raises(SystemExit):
        train(_cfg(workdir, tmp_path / "run", **kw))
    assert resolve_latest(tmp_path / "run").name == "checkpoint-2" and (tmp_path / "run" / "checkpoint-4").is_dir()
    monkeypatch.setattr(tr, "write_latest", real)
    train(_cfg(workdir, tmp_path / "run", resume=True, **kw))
    assert resolve_latest(tmp_path / "run").name == "checkpoint-4"
    train(_cfg(workdir, tmp_path / "straight", **kw))
    a, b = _weights(tmp_path / "straight" / "checkpoint-4"), _weights(tmp_path / "run" / "checkpoint-4")
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_teacher_kl_in_process(workdir, tmp_path):
    # the a2d source run causally is its own AR parent; KL only (--no-ce); gradient checkpointing; time budget
    out = tmp_path / "kl"
    train(_cfg(workdir, out, teacher=str(workdir / "src"), teacher_kl=1.0, no_ce=True, gradient_checkpointing=True,
               max_steps=50, max_minutes=1e-6))
    assert resolve_latest(out).name == "checkpoint-1"  # --max-minutes stopped it after one step, and saved
    rows = list(csv.DictReader(open(out / "metrics.csv")))
    assert all(float(r["kl"]) > 0 and float(r["loss"]) == pytest.approx(float(r["kl"]), rel=1e-4) for r in rows)
    with pytest.raises(TrainError, match="--teacher-kl"):
        train(_cfg(workdir, tmp_path / "kl2", teacher_kl=1.0))


def test_certainty_forcing_option_trains_and_logs(workdir, tmp_path, capsys, monkeypatch):
    import unmask.training.losses as losses
    from unmask.cli.main import main

    # the tiny random model rarely predicts a token right (the real term would often be 0 here): a stand-in term
    # of known value, connected to the graph, shows the option reaches the loss and the log
    monkeypatch.setattr(losses, "certainty_term", lambda logits, labels, t: logits.float().mean() * 0 + 0.25 / t)
    out = tmp_path / "cf"
    assert main(["train", "--model", str(workdir / "src"), "--data", str(workdir / "data.jsonl"), "--out", str(out),
                 "--no-progress", "--max-steps", "2", "--batch-size", "2", "--seq-len", "64", "--complementary",
                 "--certainty", "2", "--certainty-temperature", "0.5", "--lr", "1e-2"]) == 0
    rows = list(csv.DictReader(open(out / "metrics.csv")))
    assert len(rows) == 2
    for r in rows:  # loss = CE + 2 * H_correct (no KL); the stand-in H is 0.25 / T = 0.5
        assert float(r["certainty"]) == pytest.approx(0.5)
        assert float(r["loss"]) == pytest.approx(float(r["ce"]) + 2 * 0.5, rel=1e-4, abs=1e-5)
    for bad, name in ((["--certainty", "-1"], "--certainty"), (["--certainty-temperature", "0"],
                                                               "--certainty-temperature")):
        capsys.readouterr()
        assert main(["train", "--model", str(workdir / "src"), "--data", str(workdir / "data.jsonl"), "--out",
                     str(tmp_path / "bad"), "--no-progress", "--max-steps", "1"] + bad) == 2
        assert name in capsys.readouterr().err


def test_cli_errors_are_one_line(workdir, tmp_path, capsys):
    from unmask.cli.main import main

    base = ["train", "--model", str(workdir / "src"), "--out", str(tmp_path / "o"), "--no-progress"]
    assert main(base + ["--data", str(tmp_path / "missing.jsonl")]) == 2
    assert "missing.jsonl: no such file" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "completion": "b"}\n{"prompt": "a"}\n')
    assert main(base + ["--data", str(bad)]) == 2
    assert "bad.jsonl:2: expected `messages` or `prompt` + `completion`" in capsys.readouterr().err
    assert main(base + ["--data", str(workdir / "data.jsonl"), "--no-ce"]) == 2
    assert "--no-ce" in capsys.readouterr().err
    assert main(base + ["--data", str(workdir / "data.jsonl"), "--model", str(tmp_path)]) == 2
    assert "--model" in capsys.readouterr().err
    # options that used to end in tracebacks
    data = ["--data", str(workdir / "data.jsonl")]
    assert main(base + data + ["--teacher", str(tmp_path / "nope"), "--teacher-kl", "1", "--max-steps", "1"]) == 2
    assert "--teacher" in capsys.readouterr().err
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert main(["train", "--model", str(workdir / "src"), "--out", str(afile), "--no-progress"] + data) == 2
    assert "--out" in capsys.readouterr().err and afile.read_text() == "x"
    run = tmp_path / "r"
    assert main(["train", "--model", str(workdir / "src"), "--out", str(run), "--no-progress", "--max-steps", "1",
                 "--batch-size", "1"] + data) == 0
    (run / "checkpoint-1" / "training_state.pt").unlink()
    capsys.readouterr()
    assert main(["train", "--model", str(workdir / "src"), "--out", str(run), "--no-progress", "--max-steps", "2",
                 "--batch-size", "1", "--resume"] + data) == 2
    assert "training_state.pt is missing" in capsys.readouterr().err
    assert main(["export", str(workdir / "src"), str(tmp_path / "e"), "--device", "foo"]) == 2
    assert "device" in capsys.readouterr().err
    assert main(["export", str(workdir / "src"), str(afile), "--quantization", "none"]) == 2
    assert "is a file" in capsys.readouterr().err



def test_block_size_is_bounded_by_seq_len_before_anything_is_allocated(workdir, tmp_path, capsys):
    """--block-size 100000 used to train (or, drafting, die on a 2 TB allocation); it is a one-line usage error
    naming the option and the bound, before --out exists (--max-block-size likewise)."""
    from unmask.cli.main import main

    out = tmp_path / "o"
    base = ["train", "--model", str(workdir / "src"), "--data", str(workdir / "data.jsonl"), "--out", str(out),
            "--no-progress", "--max-steps", "1", "--batch-size", "1"]
    for extra, words in ((["--block-size", "100000"], "--block-size: must be in 1..--seq-len (256), got 100000"),
                         (["--block-size", "65", "--seq-len", "64"], "--block-size: must be in 1..--seq-len (64)"),
                         (["--block-size", "100000", "--objective", "draft", "--trainable", "mask_lora"],
                          "--block-size: must be in 1..--seq-len (256)"),
                         (["--objective", "trajectory", "--block-size", "2", "--max-block-size", "100000"],
                          "--max-block-size: must be in --block-size..--seq-len (2..256), got 100000")):
        assert main(base + extra) == 2, extra
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1, (extra, err)
        assert not out.exists(), extra
    _cfg(workdir, out, block_size=64).validate()  # the bound itself is fine

_KILL_SCRIPT = """
import sys, time
import unmask.engine.checkpoint as ck
orig = ck._fsync_tree
def slow(root):
    orig(root)
    if root.name.startswith("checkpoint-2"):
        time.sleep(60)
ck._fsync_tree = slow
from unmask.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def test_kill_during_checkpoint_write_leaves_latest_loadable(workdir, tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-c", _KILL_SCRIPT, "train", "--model", str(workdir / "src"), "--data",
           str(workdir / "data.jsonl"), "--out", str(out), "--batch-size", "2", "--max-steps", "3", "--save-every",
           "1", "--seq-len", "64", "--no-progress"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None:
            if any(p.name.startswith("checkpoint-2.tmp") for p in out.glob("checkpoint-2*")):
                break
            time.sleep(0.05)
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        time.sleep(0.2)  # in the middle of the write (files there, not yet renamed)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not (out / "checkpoint-2").exists()
    ckpt = resolve_latest(out)
    assert ckpt.name == "checkpoint-1"
    lm = load_model(ckpt, device="cpu")
    assert lm.dllm.family == "a2d"
    train(_cfg(workdir, out, max_steps=3, save_every=1, resume=True, lr=5e-5, seed=0))
    assert resolve_latest(out).name == "checkpoint-3"
    assert not list(out.glob("*.tmp*"))


@pytest.mark.slow
def test_ddp_two_process_gloo(workdir, tmp_path):
    out = tmp_path / "ddp"
    from serving import free_port  # a fixed port collided with another run of this test on a shared machine

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "-m", "unmask.cli.main", "train", "--model", str(workdir / "src"), "--data", str(workdir / "data.jsonl"),
           "--out", str(out), "--batch-size", "1", "--max-steps", "2", "--seq-len", "64", "--no-progress",
           "--trainable", "lora", "--lr", "1e-2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[:3000] + "\n...\n" + r.stderr[-3000:]  # the first error and the launcher's tail
    ckpt = resolve_latest(out)
    state = torch.load(ckpt / "training_state.pt", weights_only=False)
    assert state["world_size"] == 2 and state["step"] == 2
    rows = list(csv.DictReader(open(out / "metrics.csv")))
    assert len(rows) == 2 and int(rows[0]["tokens"]) > 0
    LLM(str(ckpt), device="cpu").generate("Hi", SamplingParams(max_tokens=2, temperature=0.0))


@pytest.mark.slow
def test_real_smollm2_train_export_generate(tmp_path):
    """SmolLM2-135M (GGUF) -> a2d -> 1 LoRA block-diffusion step -> nf4 export -> the engine generates."""
    from unmask.training.convert import convert_checkpoint
    from unmask.training.realmodel import RealModelMissing, smollm2_gguf_path

    try:
        gguf = smollm2_gguf_path()
    except RealModelMissing as exc:
        pytest.skip(str(exc))
    src = convert_checkpoint(gguf.parent, tmp_path / "a2d", attention="prefix_causal", block_size=4, logit_shift=True,
                             gguf_file=gguf.name)
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "Name a colour.", "completion": "Blue is a colour."}) + "\n")
    out = tmp_path / "run"
    train(TrainConfig(model=str(src), data=str(data), out=str(out), trainable="lora", max_steps=1, batch_size=1,
                      seq_len=64, progress=False))
    res = export(out, tmp_path / "nf4", quantization="nf4")
    assert res["max_abs_logit_diff"] == 0.0
    o = LLM(str(tmp_path / "nf4"), device="cpu").generate("Hello", SamplingParams(max_tokens=4, temperature=0.0))
    assert len(o[0].outputs[0].token_ids) >= 1


@pytest.mark.parametrize("field,value", [("lr", float("inf")), ("lr", float("nan")), ("max_minutes", float("nan"))])
def test_non_finite_options_rejected(field, value):
    from unmask.training.trainer import TrainConfig, TrainError

    cfg = TrainConfig(model="m", data="d", out="o", **{field: value})
    with pytest.raises(TrainError, match=field.replace("_", "-")):
        cfg.validate()


def test_cosine_time_schedule_follows_the_clock():
    """cosine_time: linear warmup by steps, then 0.5 (1 + cos(pi f)) of the budget fraction f (across processes:
    minutes_before counts toward it); it needs a time budget."""
    import math

    from unmask.training.schedule import BudgetClock, make_scheduler

    class FakeClock(BudgetClock):
        f = 0.0

        def fraction(self):
            return self.f

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    clock = FakeClock(0.0, 60.0)
    sched = make_scheduler(opt, "cosine_time", warmup=2, total=10, clock=clock)
    assert opt.param_groups[0]["lr"] == 0.0
    opt.step(); sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5)
    for f, want in ((0.0, 1.0), (0.5, 0.5), (0.75, 0.5 * (1 + math.cos(0.75 * math.pi))), (1.0, 0.0)):
        clock.f = f
        opt.step(); sched.step()
        assert opt.param_groups[0]["lr"] == pytest.approx(want, abs=1e-12)
    real = BudgetClock(30.0, 60.0)
    assert real.fraction() == pytest.approx(0.5)       # half the budget spent by an earlier process
    real.start()
    assert 0.5 <= real.fraction() < 0.51
    with pytest.raises(TrainError, match="cosine_time"):
        TrainConfig(model="m", data="d", out="o", lr_schedule="cosine_time").validate()
    with pytest.raises(TrainError, match="minutes_before"):
        TrainConfig(model="m", data="d", out="o", minutes_before=-1.0).validate()


def test_keep_last_prunes_old_checkpoints_but_never_latest(tmp_path):
    from unmask.training.checkpoints import prune_checkpoints, write_latest

    for step in (2, 4, 10, 6):
        (tmp_path / f"checkpoint-{step}").mkdir()
    (tmp_path / "checkpoint-x").mkdir()            # not ours: untouched
    write_latest(tmp_path, "checkpoint-4")        # e.g. a resumed run whose latest is older
    gone = prune_checkpoints(tmp_path, 2)
    assert sorted(p.name for p in gone) == ["checkpoint-2"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == [
        "checkpoint-10", "checkpoint-4", "checkpoint-6", "checkpoint-x"]
    write_latest(tmp_path, "checkpoint-10")
    prune_checkpoints(tmp_path, 1)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["checkpoint-10", "checkpoint-x"]
    with pytest.raises(TrainError, match="--keep-last"):
        TrainConfig(model="m", data="d", out="o", keep_last=-1).validate()


def test_resume_applies_a_new_learning_rate(workdir, tmp_path):
    """`--resume --lr X` (what the trainer's own divergence error advises) used to run on at the saved rate."""
    kw = dict(max_steps=3, save_every=1, batch_size=1, lr_schedule="constant", warmup=0)
    train(_cfg(workdir, tmp_path / "run", halt_after=2, **{**kw, "lr": 1e-3}))
    train(_cfg(workdir, tmp_path / "run", resume=True, **{**kw, "lr": 1e-5}))
    rows = list(csv.DictReader(open(tmp_path / "run" / "metrics.csv")))
    assert [float(r["lr"]) for r in rows] == pytest.approx([1e-3, 1e-3, 1e-5])


def test_continuing_from_a_trained_checkpoint_warns_about_the_repeated_data_order(workdir, tmp_path, capsys):
    """A new run from an `unmask train` checkpoint on the same data and --seed revisits its examples in the same
    order (the stream depends only on the seed): the trainer says so; another seed or other data: no note."""
    train(_cfg(workdir, tmp_path / "first", max_steps=2, batch_size=2))
    first = resolve_latest(tmp_path / "first")
    capsys.readouterr()
    train(_cfg(workdir, tmp_path / "again", model=str(first), max_steps=1))
    out = capsys.readouterr().out
    assert "same examples in the same order" in out and "2 steps (4 examples)" in out and "--seed" in out
    train(_cfg(workdir, tmp_path / "fresh", model=str(first), max_steps=1, seed=2))
    assert "same examples" not in capsys.readouterr().out
    other = tmp_path / "other.jsonl"
    other.write_text((workdir / "data.jsonl").read_text())
    train(_cfg(workdir, tmp_path / "other", model=str(first), data=str(other), max_steps=1))
    assert "same examples" not in capsys.readouterr().out
