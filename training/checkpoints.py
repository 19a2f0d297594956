"""A run's checkpoints (docs/design.md#training): ``OUT/checkpoint-<step>/`` (servable, or adapter-only under
``--trainable mask_lora``) with ``training_state.pt``, written under a temporary name and renamed; ``OUT/latest``
replaced atomically after it, so a kill at any moment leaves ``latest`` naming a loadable checkpoint; pruning to the
newest N; and what ``--resume`` reads back and checks.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import shutil
from pathlib import Path

import torch

from unmask.engine.checkpoint import unique_suffix, write_checkpoint

from .common import TrainError, resolve_latest
from .scopes import trainable_state

#: options a resumed run must repeat (the data order, the noise and the schedule depend on them)
RESUME_KEYS = ("objective", "trainable", "batch_size", "grad_accum", "seq_len", "seed", "block_size", "complementary",
               "max_steps", "lr_schedule", "warmup", "eps", "fsdp")
LORA_SCOPES = ("lora", "qlora", "mask_lora")
LORA_KEYS = ("lora_r", "lora_alpha", "lora_targets")


def write_latest(out: Path, name: str) -> None:
    """Point ``OUT/latest`` at ``name`` (a temporary file renamed over it, then the directory synced)."""
    tmp = out / f"latest.tmp-{unique_suffix()}"
    with open(tmp, "w") as fh:
        fh.write(name + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, out / "latest")
    with contextlib.suppress(OSError):  # make the rename durable
        fd = os.open(out, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


def prune_checkpoints(out: Path, keep: int) -> list[Path]:
    """Delete all but the ``keep`` newest ``OUT/checkpoint-<step>`` directories (by step); the one ``OUT/latest``
    points to is never deleted. Returns the deleted paths (HF Trainer's ``save_total_limit``)."""
    ckpts = []
    for p in Path(out).glob("checkpoint-*"):
        step = p.name[len("checkpoint-"):]
        if p.is_dir() and step.isdigit():
            ckpts.append((int(step), p))
    ckpts.sort()
    pointer = Path(out) / "latest"
    latest = pointer.read_text().strip() if pointer.is_file() else None
    gone = []
    for _, p in ckpts[: max(0, len(ckpts) - keep)]:
        if p.name == latest:
            continue
        shutil.rmtree(p, ignore_errors=True)
        gone.append(p)
    return gone


def publish(out: Path, path: Path, keep_last: int) -> None:
    """``latest`` names the checkpoint just written at ``path``; then ``--keep-last`` prunes."""
    write_latest(out, path.name)
    if keep_last:
        prune_checkpoints(out, keep_last)


def remove_stale(out: Path) -> None:
    """Delete what a killed run left half-written (never named by ``latest``)."""
    for stale in [*out.glob("checkpoint-*.tmp-*"), *out.glob("latest.tmp-*")]:
        shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() else stale.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------------- resume
def open_resume(cfg, out: Path, world: int, keys: list[str], comparable=lambda key, value: value, log=print):
    """``(checkpoint, state)`` to resume from (``latest``'s, its ``training_state.pt`` loaded and checked against
    ``cfg``), or ``(None, None)`` for a fresh run.

    Args:
        keys: options beyond :data:`RESUME_KEYS` (and the LoRA ones) that must be the same, each compared as
            ``comparable(key, value)`` (an objective resolves a path).

    Raises:
        TrainError: ``OUT`` holds checkpoints without ``--resume``; the state file is missing; an option or the
            process count differs from the run being resumed.
    """
    resume_from = resolve_latest(out) if cfg.resume else None
    if cfg.resume and resume_from is None and log:
        log(f"unmask train: --resume: no {out / 'latest'} yet; starting from step 0")
    if not cfg.resume and out.exists() and any(".tmp-" not in c.name for c in out.glob("checkpoint-*")):
        raise TrainError(f"--out: {out} already holds checkpoints; use --resume or a new directory")
    if resume_from is None:
        return None, None
    state_file = resume_from / "training_state.pt"
    if not state_file.is_file():
        raise TrainError(f"--resume: {state_file} is missing (the checkpoint is servable but cannot be "
                         "resumed); point `latest` at an earlier checkpoint or start a new --out")
    state = torch.load(state_file, map_location="cpu", weights_only=False)
    saved = state["config"]
    lora = LORA_KEYS if cfg.trainable in LORA_SCOPES else ()
    for key in (*RESUME_KEYS, *lora, *keys):
        theirs = comparable(key, saved.get(key, False if key == "fsdp" else None))
        if theirs != comparable(key, getattr(cfg, key)):
            raise TrainError(f"--resume: --{key.replace('_', '-')} {getattr(cfg, key)!r} differs from the "
                             f"run being resumed ({theirs!r})")
    if state.get("world_size", 1) != world:
        raise TrainError(f"--resume: the run being resumed used {state.get('world_size', 1)} processes, this "
                         f"one {world} (the data order depends on it)")
    return resume_from, state


# ---------------------------------------------------------------------------------------------------- writing
def training_state(step: int, optimizer_state: dict, scheduler, tm, cfg, world: int) -> bytes:
    """``training_state.pt``'s bytes: optimizer, scheduler, RNG, step, the trainable tensors, the run's settings."""
    buf = io.BytesIO()
    torch.save({"step": step, "optimizer": optimizer_state, "scheduler": scheduler.state_dict(),
                "rng": torch.get_rng_state(), "trainable": trainable_state(tm), "config": dataclasses.asdict(cfg),
                "world_size": world}, buf)
    return buf.getvalue()


def write_full(path: Path, model, tm, state: bytes, step: int, overwrite: bool) -> None:
    """``model`` (full precision, trained) as a servable checkpoint at ``path`` with ``training_state.pt``.

    Raises:
        TrainError: non-finite weights (nothing is written; the last good checkpoint stays ``latest``).
    """
    bad = [n for n, t in model.state_dict().items() if t.is_floating_point() and not torch.isfinite(t).all()]
    if bad:
        raise TrainError(f"step {step}: non-finite weights ({len(bad)} tensors, e.g. {bad[0]}); "
                         f"not saving - lower --lr or --max-grad-norm (the last good checkpoint stays latest)")
    write_checkpoint(path, model, tm.tokenizer, tm.dllm, overwrite=overwrite,
                     extra_files={"training_state.pt": state})
