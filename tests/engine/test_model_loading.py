"""Loading checkpoints: local directories, hub ids through the local hub cache, clear errors."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tiny import loaded
from unmask.engine import CheckpointError, LLM, SamplingParams
from unmask.engine.checkpoint import CheckpointWriteError, write_checkpoint
from unmask.engine.model import load_model


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    m = loaded(attention="prefix_causal")
    out = tmp_path_factory.mktemp("ck") / "a2d"
    write_checkpoint(out, m.model, m.tokenizer, m.dllm)
    return out, m


def test_a2d_round_trip_same_logits_and_tokens(ckpt):
    out, m = ckpt
    re = load_model(out, weights="native")  # the round trip itself: exact
    assert re.dllm == m.dllm
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    assert LLM(re).generate("Hello", sp)[0].outputs[0].token_ids == LLM(m).generate("Hello", sp)[0].outputs[0].token_ids


def test_checkpoint_files_readable_by_others(ckpt):
    import os
    import stat

    out, _ = ckpt
    umask = os.umask(0)
    os.umask(umask)
    for f in out.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == (0o666 & ~umask), f


def test_hub_id_resolves_from_local_cache(ckpt, tmp_path):
    """`org/name` goes through huggingface_hub; offline it is served from the local hub cache."""
    out, _ = ckpt
    code = f"""
import os, shutil, pathlib
cache = pathlib.Path({str(tmp_path)!r}) / "hub"
snap = cache / "models--tiny-org--tiny-a2d" / "snapshots" / ("0" * 40)
snap.parent.mkdir(parents=True)
shutil.copytree({str(out)!r}, snap)
(cache / "models--tiny-org--tiny-a2d" / "refs").mkdir()
(cache / "models--tiny-org--tiny-a2d" / "refs" / "main").write_text("0" * 40)
os.environ["HF_HUB_CACHE"] = str(cache)
os.environ["HF_HUB_OFFLINE"] = "1"
from unmask.engine.model import load_model
m = load_model("tiny-org/tiny-a2d")
print(m.dllm.family, m.path)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("a2d ") and "snapshots" in r.stdout


def test_errors_name_the_file(tmp_path):
    with pytest.raises(CheckpointError, match="no such directory"):
        load_model(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="config.json"):
        load_model(tmp_path / "empty")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text('{"a": 1,\n "b": }')
    with pytest.raises(CheckpointError, match=r"config.json:2:\d+: invalid JSON"):
        load_model(bad)
    ar = tmp_path / "ar"
    ar.mkdir()
    (ar / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    with pytest.raises(CheckpointError, match="unmask convert"):
        load_model(ar)
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    (wrong / "config.json").write_text(json.dumps({"dllm": {"family": "a2d", "mask_token_id": 1,
                                                            "attention": "sideways", "block_size": 4,
                                                            "logit_shift": True, "eos_token_ids": [0]}}))
    with pytest.raises(CheckpointError, match="attention"):
        load_model(wrong)


def test_write_checkpoint_never_over_non_empty_dir(ckpt, tmp_path):
    _, m = ckpt
    target = tmp_path / "t"
    target.mkdir()
    (target / "keep.txt").write_text("x")
    with pytest.raises(CheckpointWriteError, match="not empty"):
        write_checkpoint(target, m.model, m.tokenizer, m.dllm)
    assert (target / "keep.txt").read_text() == "x"
    assert not list(tmp_path.glob("t.tmp-*"))


def _dead_pid() -> int:
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)


def test_stale_temporary_of_a_killed_writer_is_removed(ckpt, tmp_path):
    import socket

    from unmask.engine.checkpoint import WRITER_MARKER

    _, m = ckpt
    pid = _dead_pid()
    stale = tmp_path / f"out.tmp-{pid}"
    nested = tmp_path / f"out.verify-{pid}.tmp-{pid}"  # an export's staging checkpoint (unmask export)
    for d in (stale, nested):
        d.mkdir()
        (d / "config.json").write_text("{}")
        (d / WRITER_MARKER).write_text(f"{socket.gethostname()} {pid}\n")
    # look alike, but not ours: a user's directories, a writer of another host (container) - never deleted
    mine = [tmp_path / "out.old-99999999", tmp_path / "out.old-20240101", tmp_path / f"out.verify-{pid}",
            tmp_path / f"out.verify-{pid}.tmp-1"]
    for d in mine:
        d.mkdir()
        (d / "keep.txt").write_text("x")
    (mine[2] / WRITER_MARKER).write_text(f"another-host {pid}\n")
    (mine[3] / WRITER_MARKER).write_text(f"{socket.gethostname()} {pid}\n")  # two pids in one name: not ours
    write_checkpoint(tmp_path / "out", m.model, m.tokenizer, m.dllm)
    assert not stale.exists() and not nested.exists() and (tmp_path / "out" / "config.json").is_file()
    assert all((d / "keep.txt").is_file() for d in mine)
    assert not (tmp_path / "out" / WRITER_MARKER).exists()


def test_writer_killed_while_flushing_leaves_a_temporary_the_next_write_removes(tmp_path):
    """kill -9 during the final fsync (seconds for a real model) used to leave an unclaimed <out>.tmp-<pid>: the
    writer marker was removed before flushing, so no later write could tell it was a dead writer's."""
    from unmask.engine.checkpoint import WRITER_MARKER

    script = (
        "import os, sys; sys.path.insert(0, {tests!r}); import tiny\n"
        "import unmask.engine.checkpoint as c\n"
        "c._fsync_tree = lambda root: os._exit(9)\n"
        "m = tiny.loaded(); c.write_checkpoint({out!r}, m.model, m.tokenizer, m.dllm)\n"
    ).format(tests=str(Path(__file__).resolve().parents[1]), out=str(tmp_path / "out"))
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert child.returncode == 9, child.stderr
    left = list(tmp_path.glob("out.tmp-*"))
    assert len(left) == 1 and (left[0] / WRITER_MARKER).is_file() and not (tmp_path / "out").exists()
    m = loaded()
    write_checkpoint(tmp_path / "out", m.model, m.tokenizer, m.dllm)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_training_output_dir_resolves_to_latest(ckpt, tmp_path):
    import shutil

    out, _ = ckpt
    run = tmp_path / "run"
    shutil.copytree(out, run / "checkpoint-7")
    (run / "latest").write_text("checkpoint-7\n")
    assert load_model(run).path == str(run / "checkpoint-7")


def test_unavailable_device_is_a_clear_error():
    import torch

    from unmask.engine.model import resolve_device

    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda")
    with pytest.raises(ValueError, match="device"):
        resolve_device("bogus")
