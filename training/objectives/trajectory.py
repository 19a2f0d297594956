"""Pseudo-trajectory distillation (d3LLM, arXiv 2601.07568; ``unmask train --objective trajectory``;
docs/design.md#the-seeds-methods, docs/methods.md).

**Recording** (:func:`record_example`, :func:`ensure_trajectories`): for every answer span of every training
example, the step at which each answer token is revealed. The engine decodes the span's prefix as the prompt with
its own strategy (``unmask.engine.sequence``) and every revealed position is then overwritten by the ground-truth
token, so that later steps condition on the data's answer (a *pseudo* trajectory: the model's order, the data's
tokens). The step of each position is read from the engine's :class:`~unmask.engine.outputs.StepEvent` s. Modes:

* ``engine`` (default, as d3LLM records its teacher): greedy threshold decoding (``threshold`` tau, Fast-dLLM) at
  the training block size;
* ``entropy`` (the seed fork dLLM-castlehill's variant): the ground truth revealed lowest-entropy-first in ``K``
  steps (the engine's ``remasking="entropy"``, quota decoding, ``steps = K``, the whole span one block).

Trajectories are JSONL next to the data (``<data>.trajectory.jsonl``): a header line with the settings, then one
line per example ``{"ids": <sha256 of its token ids>, "spans": [[s, e], ...], "steps": [[r_s, ..., r_e-1], ...]}``,
appended as they are recorded (resumable: recorded examples are skipped; a header of other settings is an error).

**Training masks** (:func:`trajectory_noise`): for each block of each answer, a mask ratio t is drawn
``U(eps, cap)`` with the curriculum ``cap = 0.8 * progress`` (at least ``1 / block``; d3LLM's 0 -> 0.8), k =
``ceil(t * n)`` tokens of the block, and the step s chosen as the latest step with at least k tokens revealed after
it: the tokens revealed after s are masked. The complementary copy masks the others. The block size grows over
training (``block_size`` -> ``max_block_size``, doubling in equal stages of progress). The loss is CE on both copies
(weight 1, no ``1/t``) + the entropy term on correctly predicted masked tokens at temperature 0.5 (the certainty
term, ``training.losses.certainty_term``).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from ..common import TrainError, ids_hash
from ..jsonl import json_lines
from ..losses import Noise, NoisyBlock, answer_blocks, draw_noise
from .diffusion import Block

__all__ = ["TrajectoryError", "Trajectory", "record_example", "ensure_trajectories", "load_trajectories",
           "trajectory_noise", "mask_from_steps", "curriculum", "default_path", "MODES"]

MODES = ("engine", "entropy")
MAX_MASK_RATIO = 0.8  # d3LLM's curriculum end
TRAJECTORY_CERTAINTY = 1.0  # our choice of the d3LLM entropy term's weight when --certainty is not set


class TrajectoryError(ValueError):
    """Bad trajectory settings or file (the message names the option or ``file:line``)."""


def default_path(data: str) -> Path:
    """``<data>.trajectory.jsonl`` next to the data file."""
    return Path(str(data) + ".trajectory.jsonl")


def _sampling(mode: str, threshold: float, steps: int, span_len: int, block_size: int | None = None):
    from unmask.engine.params import SamplingParams

    if mode == "engine":
        return SamplingParams(max_tokens=span_len, temperature=0, threshold=threshold, ignore_eos=True, seed=0,
                              block_size=block_size)
    return SamplingParams(max_tokens=span_len, temperature=0, remasking="entropy", steps=max(1, min(steps, span_len)),
                          block_size=span_len, ignore_eos=True, seed=0, threshold=None)


def record_example(model, input_ids: list[int], spans: list[tuple[int, int]], mode: str = "engine",
                   threshold: float = 0.9, steps: int = 8, block_size: int | None = None) -> list[list[int]]:
    """The reveal step of every answer token of one example (``[len(span)]`` ints per span, steps from 0).

    Args:
        model: an engine ``LoadedModel`` (the recording model). input_ids / spans: the example.
        mode / threshold / steps: see the module docstring. block_size: the engine mode's block (``None`` = the
            checkpoint's; the trainer passes its training block size - a conversion's block 1 would record a
            left-to-right order).
    """
    from unmask.engine.denoiser import Denoiser
    from unmask.engine.engine import make_requests

    den = Denoiser(model)
    out = []
    for s, e in spans:
        truth = torch.tensor(input_ids[s:e], dtype=torch.long)
        seq = make_requests(model, list(input_ids[:s]), _sampling(mode, threshold, steps, e - s, block_size), "trajectory")[0]
        rec = [-1] * (e - s)
        while not seq.finished:
            for ev in den.step([seq]):
                for r in ev.revealed:
                    rec[r.position] = ev.step
                    seq.canvas[seq.prompt_len + r.position] = truth[r.position].to(seq.canvas.device)
        if min(rec) < 0:  # pragma: no cover - the engine reveals every returned position before finishing
            raise TrajectoryError(f"recording: positions {[i for i, r in enumerate(rec) if r < 0]} never revealed")
        out.append(rec)
    return out


def _header(mode: str, threshold: float, steps: int, model_path: str, block_size: int | None) -> dict:
    return {"trajectory": 1, "mode": mode, "threshold": threshold if mode == "engine" else None,
            "steps": steps if mode == "entropy" else None, "block_size": block_size if mode == "engine" else None,
            "model": str(model_path)}


def load_trajectories(path: Path, header: dict | None = None) -> dict[str, dict]:
    """``{ids hash: {span start: [steps]}}`` from a trajectory file (empty when it does not exist).

    Raises:
        TrajectoryError: a bad line (``file:line``), or a header other than ``header`` (when given).
    """
    path = Path(path)
    if not path.is_file():
        return {}
    out: dict[str, dict] = {}
    # a line cut by a killed recording ends the file: re-recorded on resume
    for i, rec in json_lines(path, TrajectoryError, cut_tail=True):
        if i == 1:
            if rec.get("trajectory") != 1:
                raise TrajectoryError(f"{path}:1: not a trajectory file header")
            if header is not None and rec != header:
                diff = {k: (rec.get(k), v) for k, v in header.items() if rec.get(k) != v}
                raise TrajectoryError(f"{path}:1: recorded with other settings {diff} (file, this run); use "
                                      "another --trajectories file or the same settings")
            continue
        try:
            out[rec["ids"]] = {int(s): list(map(int, st)) for (s, _e), st in zip(rec["spans"], rec["steps"])}
        except (KeyError, TypeError, ValueError):
            raise TrajectoryError(f"{path}:{i}: needs `ids`, `spans` and `steps`") from None
    return out


def ensure_trajectories(path, examples, model_path: str, mode: str = "engine", threshold: float = 0.9,
                        steps: int = 8, model=None, progress: bool = False, block_size: int | None = None
                        ) -> dict[str, dict]:
    """Record the trajectories of ``examples`` missing from ``path`` (appending, one line each), then return all.

    Args:
        examples: ``training.data.Example`` objects. model_path: the recording model (loaded with the engine unless
            ``model`` is given; named in the header).

    Raises:
        TrajectoryError: bad mode, or a file of other settings.
    """
    if mode not in MODES:
        raise TrajectoryError(f"--trajectory-mode: {mode!r} is not one of {MODES}")
    path = Path(path)
    header = _header(mode, threshold, steps, model_path, block_size)
    have = load_trajectories(path, header)
    todo = [ex for ex in examples if ids_hash(ex.input_ids) not in have]
    if not todo:
        return have
    if model is None:
        from unmask.engine.model import load_model

        model = load_model(model_path, device="cpu")
    fresh = not path.is_file() or path.stat().st_size == 0
    with open(path, "a") as fh:
        if fresh:
            fh.write(json.dumps(header) + "\n")
        for n, ex in enumerate(todo):
            h = ids_hash(ex.input_ids)
            if h in have:
                continue
            spans = [tuple(s) for s in ex.spans]
            rec = record_example(model, ex.input_ids, spans, mode, threshold, steps, block_size)
            fh.write(json.dumps({"ids": h, "spans": [list(s) for s in spans], "steps": rec}) + "\n")
            fh.flush()
            have[h] = {s: r for (s, _e), r in zip(spans, rec)}
            if progress and (n + 1) % 50 == 0:
                print(f"unmask train: recorded {n + 1}/{len(todo)} trajectories", flush=True)
    return have


def mask_from_steps(steps: list[int], k: int) -> list[int]:
    """The indices revealed after the latest step after which at least ``k`` tokens are revealed (``steps[j]``:
    token j's reveal step). ``mask_from_steps([0, 2, 1, 2], 1) == [1, 3]`` (both tokens of the last step),
    ``k = 3 -> [1, 2, 3]``; ``k`` beyond the tokens: all of them."""
    if k <= 0 or not steps:
        return []
    for s in sorted(set(steps), reverse=True):
        later = [j for j, r in enumerate(steps) if r >= s]  # revealed after step s - 1
        if len(later) >= k:
            return later
    return list(range(len(steps)))


def curriculum(progress: float, block_size: int, max_block_size: int) -> tuple[float, int]:
    """``(mask-ratio cap, block size)`` at training progress in [0, 1]: cap ``0.8 * progress`` (at least
    ``1 / block``), block size doubling from ``block_size`` to ``max_block_size`` in equal stages."""
    p = min(max(progress, 0.0), 1.0)
    stages = int(math.log2(max(1, max_block_size // block_size))) + 1
    bs = block_size * 2 ** min(stages - 1, int(p * stages))
    return max(MAX_MASK_RATIO * p, 1.0 / bs), bs


def trajectory_noise(batch, dllm, trajectories: dict[str, dict], progress: float, generator: torch.Generator,
                     block_size: int, max_block_size: int, eps: float = 1e-3) -> tuple[Noise, int]:
    """The noise of one micro-batch under the trajectories (module docstring); returns it and the block size used.

    Raises:
        TrajectoryError: an example without a recorded trajectory.
    """
    cap, bs = curriculum(progress, block_size, max_block_size)
    noise = Noise(copies=2)
    for b in range(batch.input_ids.shape[0]):
        n = int(batch.valid[b].sum())
        h = ids_hash(batch.input_ids[b, :n])
        traj = trajectories.get(h)
        if traj is None:
            raise TrajectoryError(f"no trajectory for a training example (token-id hash {h[:16]}): record it first")
        for a, e, s in answer_blocks(batch.spans[b], bs, dllm.block_alignment):
            lo = max(a, s)
            steps = traj[s][lo - s: e - s]
            u = float(torch.rand((), generator=generator, dtype=torch.float64))
            t = eps + (cap - eps) * u
            k = max(1, math.ceil(t * len(steps)))
            idx = mask_from_steps(steps, k)
            masked = [lo + j for j in idx]
            hidden = set(masked)
            rest = [p for p in range(lo, e) if p not in hidden]
            noise.blocks.append(NoisyBlock(b, a, e, s, 1.0, masked, 0))
            noise.blocks.append(NoisyBlock(b, a, e, s, 1.0, rest, 1))
    return noise, bs


class Trajectory(Block):
    """``trajectory``: the block objective with masks that follow the recorded reveal orders (the module docstring);
    its held-out evaluation is the block ELBO, comparable across objectives."""

    name = "trajectory"
    mask_lora = False
    fsdp_refusal = "not with --align-weight or --objective trajectory (untested together; docs/design.md#scale-out)"
    trajectories: dict[str, dict] | None = None

    @classmethod
    def check(cls, cfg) -> None:
        if cfg.trajectory_mode not in MODES:
            raise TrainError(f"--trajectory-mode: {cfg.trajectory_mode!r} is not one of {', '.join(MODES)}")
        if not 0 <= cfg.trajectory_threshold <= 1:
            raise TrainError(f"--trajectory-threshold: must be in [0, 1], got {cfg.trajectory_threshold}")
        if cfg.trajectory_steps < 1:
            raise TrainError(f"--trajectory-steps: must be >= 1, got {cfg.trajectory_steps}")
        if cfg.max_block_size is not None and not (cfg.block_size or 1) <= cfg.max_block_size <= cfg.seq_len:
            raise TrainError(f"--max-block-size: must be in --block-size..--seq-len ({cfg.block_size or 1}.."
                             f"{cfg.seq_len}), got {cfg.max_block_size}")

    def prepare(self, run) -> None:
        """The KL teacher where asked (:class:`~.diffusion.Mdlm`), then the trajectories: read, and recorded where
        missing (:func:`ensure_trajectories`)."""
        super().prepare(run)
        cfg = self.cfg
        try:
            self.trajectories = ensure_trajectories(
                cfg.trajectories or default_path(cfg.data), run.data.examples, cfg.trajectory_model or cfg.model,
                cfg.trajectory_mode, cfg.trajectory_threshold, cfg.trajectory_steps, progress=cfg.progress,
                block_size=run.block_size)
        except TrajectoryError as exc:
            raise TrainError(str(exc)) from exc

    def noise(self, run, batch, generator, fixed_t):
        if fixed_t is not None:  # held-out evaluation: the block ELBO
            return draw_noise(batch, run.tm.dllm, "block", generator, run.block_size, self.cfg.eps,
                              self.cfg.complementary, fixed_t=fixed_t), run.block_size
        return trajectory_noise(batch, run.tm.dllm, self.trajectories, run.progress(), generator, run.block_size,
                                self.cfg.max_block_size or 2 * run.block_size, self.cfg.eps)

    def certainty(self) -> float:
        """``--certainty``; the d3LLM entropy term defaults to 1.0 when it is not set (``TRAJECTORY_CERTAINTY``)."""
        return self.cfg.certainty or TRAJECTORY_CERTAINTY
