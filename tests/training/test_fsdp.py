"""FSDP (training/distributed.py, docs/design.md#scale-out): a 2-process CPU (gloo) sharded run has the
single-process run's losses and weights, writes a full checkpoint the engine loads, and resumes exactly (the
full optimizer state re-sharded). Multi-process: system."""
from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import tiny
from unmask.engine.llm import LLM
from unmask.engine.params import SamplingParams
from unmask.training.trainer import TrainConfig, TrainError, resolve_latest, train

ROOT = Path(__file__).resolve().parents[2]
DATA = [{"prompt": "What is two plus two?", "completion": "Two plus two is four."},
        {"prompt": "Name a quick animal.", "completion": "The quick brown fox."},
        {"prompt": "Capital of France?", "completion": "Paris is the capital of France."},
        {"prompt": "Count to three.", "completion": "One two three."}]
STEPS = 3
#: loss agreement, relative: step 1 differs only by float summation order; later steps by the update, whose
#: gradients are reduce-scattered in another order than accumulated in one process (observed ~1e-6)
LOSS_RTOL = 1e-4
#: final weights, absolute (AdamW steps of lr 1e-2 from weights of size ~0.1)
WEIGHT_ATOL = 1e-4


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("fsdp")
    tiny.training_dir(d, DATA, num_hidden_layers=2)
    return d


def _losses(out: Path) -> list[float]:
    return [float(r["loss"]) for r in csv.DictReader(open(out / "metrics.csv"))]


def _torchrun(workdir: Path, out: Path, port: int, *extra: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
           "-m", "unmask.cli.main", "train", "--model", str(workdir / "src"), "--data", str(workdir / "data.jsonl"),
           "--out", str(out), "--batch-size", "1", "--grad-accum", "1", "--max-steps", str(STEPS), "--seq-len", "64",
           "--no-progress", "--trainable", "full", "--lr", "1e-2", "--seed", "1", "--fsdp", *extra]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-4000:]


def test_fsdp_refuses_scopes_it_cannot_shard(workdir, tmp_path):
    with pytest.raises(TrainError, match="--fsdp: needs --trainable full"):
        TrainConfig(model=str(workdir / "src"), data="x", out=str(tmp_path), trainable="lora", fsdp=True).validate()


@pytest.mark.system
def test_fsdp_two_processes_match_one_process(workdir, tmp_path):
    # one process, 2 micro-batches of 1 accumulated == two processes with 1 each (same data, same noise seeds)
    single = tmp_path / "single"
    train(TrainConfig(model=str(workdir / "src"), data=str(workdir / "data.jsonl"), out=str(single), batch_size=1,
                      grad_accum=2, max_steps=STEPS, seq_len=64, lr=1e-2, progress=False, seed=1, trainable="full"))
    sharded = tmp_path / "fsdp"
    _torchrun(workdir, sharded, 29541, "--save-every", "1")
    a, b = _losses(single), _losses(sharded)
    assert len(a) == len(b) == STEPS
    for x, y in zip(a, b):
        assert abs(x - y) <= LOSS_RTOL * abs(x), (a, b)
    ckpt = resolve_latest(sharded)
    state = torch.load(ckpt / "training_state.pt", weights_only=False)
    assert state["world_size"] == 2 and state["step"] == STEPS and state["config"]["fsdp"] is True
    wa, wb = load_file(str(resolve_latest(single) / "model.safetensors")), load_file(str(ckpt / "model.safetensors"))
    assert wa.keys() == wb.keys()
    worst = max((wa[k] - wb[k]).abs().max().item() for k in wa)
    assert worst <= WEIGHT_ATOL, worst
    src = load_file(str(workdir / "src" / "model.safetensors"))
    assert max((src[k] - wb[k]).abs().max().item() for k in src) > 1e-3  # it trained
    # the full checkpoint serves
    out = LLM(str(ckpt), device="cpu").generate("Hi", SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3

    # exact resume: from checkpoint-2 the re-sharded full optimizer state gives step 3 again
    (sharded / "latest").write_text("checkpoint-2\n")
    _torchrun(workdir, sharded, 29542, "--resume")
    again = _losses(sharded)
    assert len(again) == STEPS and abs(again[-1] - b[-1]) <= 1e-6 * abs(b[-1]), (b, again)
    wc = load_file(str(resolve_latest(sharded) / "model.safetensors"))
    assert all(torch.equal(wb[k], wc[k]) for k in wb)
