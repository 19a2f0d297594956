"""The A2D fine-tuning loop (docs/design.md#training and #decisions, issue 4).

Built on accelerate: one CPU process by default; the same call under ``accelerate launch`` / ``torchrun`` runs DDP
(gloo on CPU, NCCL on GPU), bf16 autocast on GPU. Each optimizer step consumes ``batch_size * grad_accum *
world_size`` examples from a deterministic stream (an epoch-seeded permutation of the data), and the noise of
micro-batch ``m`` of rank ``r`` at step ``s`` is drawn from a generator seeded by ``(seed, s, m, r)`` - so the data
position *is* the step, and ``--resume`` continues with identical data, noise, optimizer and scheduler state.

Output directory ``OUT``:

* ``checkpoint-<step>/``: servable checkpoints (``unmask.engine.checkpoint.write_checkpoint``: written under a
  temporary name and renamed, never over a non-empty directory) + ``training_state.pt`` (optimizer, scheduler,
  RNG, step, LoRA adapters, the run's settings);
* ``latest``: a small file naming the newest complete checkpoint, replaced atomically (``os.replace``) after the
  checkpoint is in place - a kill at any moment leaves ``latest`` pointing at a loadable checkpoint;
* ``metrics.csv`` (one row per step; eval columns on eval steps) and ``loss.png`` (matplotlib Agg).
"""
from __future__ import annotations

import contextlib
import csv
import dataclasses
import hashlib
import io
import json
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .common import TrainError, resolve_latest, seed_of
from .config import SCHEDULES, TrainConfig, config_from_json
from .data import Batch, Dataset, collate, eos_ids_of, load_dataset
from .losses import (OBJECTIVES, accepted_draft_length, build_draft_layout, build_layout, diffusion_loss, draw_noise,
                     eval_t_grid, stored_teacher)
from .scopes import SCOPES, TrainModel, load_trainable_state, merged_full_precision, prepare_model, trainable_state
from unmask.engine.checkpoint import unique_suffix

TRAJECTORY_CERTAINTY = 1.0  # our choice of the d3LLM entropy term's weight when --certainty is not set
METRIC_FIELDS = ["step", "epoch", "loss", "ce", "kl", "certainty", "align", "lr", "grad_norm", "tokens",
                 "tokens_per_s",
                 "forward_tokens_per_s", "elapsed_s", "eval_loss", "eval_acc", "accepted", "eval_accepted"]


class DiffusionForward(torch.nn.Module):
    """The module accelerate/DDP wraps: decoder forward with the training mask, LM head only on scored outputs.

    ``forward(input_ids [B,T], position_ids [B,T], attention_mask [B,1,T,T] bool, src_row [N], src_col [N])
    -> [N, V]`` float32 logits.
    """

    def __init__(self, tm: TrainModel):
        super().__init__()
        self.lm = tm.model
        self._tm = [tm]

    def forward(self, input_ids, position_ids, attention_mask, src_row, src_col, hidden_layers=()):
        """``[N, V]`` float32 logits of the decoder outputs at ``(src_row[i], src_col[i])`` (see the class doc);
        with ``hidden_layers`` (1-based decoder layers, Repr-Align) ``(logits, [[N, H] per layer])``."""
        base = self._tm[0].base
        out = base.get_decoder()(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                                 use_cache=False, output_hidden_states=bool(hidden_layers))
        hidden = out.last_hidden_state[src_row, src_col]
        logits = base.get_output_embeddings()(hidden).float()
        if hidden_layers:
            return logits, [out.hidden_states[l][src_row, src_col] for l in hidden_layers]
        return logits


class DraftForward(torch.nn.Module):
    """The ``draft`` objective's module (what accelerate/DDP wraps): the frozen verifier forwards the clean context
    causally (no gradient) and the model forwards its draft groups against the verifier's keys/values - the
    verifier-routed speculative step of ``unmask.engine.routed``, in training.

    ``forward(context_ids [B,L], context_mask [B,1,L,L], input_ids [B,R], position_ids [B,R],
    attention_mask [B,1,R,L+R], src_row [N], src_col [N]) -> [N, V]`` float32 logits.
    """

    def __init__(self, tm: TrainModel, verifier):
        super().__init__()
        self.lm = tm.model
        self._tm = [tm]
        self._verifier = [verifier]  # a list: not a submodule (frozen, never in the optimizer or DDP)

    def forward(self, context_ids, context_mask, input_ids, position_ids, attention_mask, src_row, src_col):
        """``[N, V]`` float32 logits of the draft rows at ``(src_row[i], src_col[i])`` (see the class doc)."""
        from unmask.engine.kv_cache import BatchKV, LaneCache

        verifier = self._verifier[0]
        B, L = context_ids.shape
        dev = context_ids.device
        ctx_pos = torch.arange(L, device=dev).expand(B, L)
        with torch.no_grad():
            ctx = BatchKV([LaneCache() for _ in range(B)], dev)
            verifier.get_decoder()(input_ids=context_ids, position_ids=ctx_pos, attention_mask=context_mask,
                                   use_cache=False, **{_cache_kw(verifier): ctx})
        layers = sorted(ctx.new_keys)
        lanes = [LaneCache.committed([ctx.new_keys[i][b] for i in layers], [ctx.new_values[i][b] for i in layers],
                                     ctx_pos[b], ctx_pos[b]) for b in range(B)]
        base = self._tm[0].base
        out = base.get_decoder()(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                                 use_cache=False, **{_cache_kw(base): BatchKV(lanes, dev)})
        hidden = out.last_hidden_state[src_row, src_col]
        return base.get_output_embeddings()(hidden).float()


def _cache_kw(model) -> str:
    """Name of the decoder's external-cache argument (``cache`` in newer transformers, else ``past_key_values``)."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.get_decoder().forward).parameters else "past_key_values"


def load_verifier(path: str, device, dllm) -> torch.nn.Module:
    """The frozen verifier of the ``draft`` objective: an a2d checkpoint with the model's attention, logit shift,
    mask id and vocabulary (full precision, eval mode, no gradients).

    Raises:
        TrainError: not loadable, or differs from the model in one of those (names ``--verifier``).
    """
    from unmask.engine.config import CheckpointError, DllmConfig

    from .scopes import load_source

    try:
        model, _, vdllm = load_source(path, device=device)
    except (CheckpointError, OSError, ValueError) as exc:
        raise TrainError(f"--verifier {path}: {exc}") from exc
    if (vdllm.attention, vdllm.logit_shift, vdllm.mask_token_id) != (dllm.attention, dllm.logit_shift,
                                                                     dllm.mask_token_id):
        raise TrainError(f"--verifier {path}: attention/logit_shift/mask_token_id {vdllm.attention}/"
                         f"{vdllm.logit_shift}/{vdllm.mask_token_id} differ from the model's {dllm.attention}/"
                         f"{dllm.logit_shift}/{dllm.mask_token_id}")
    if vdllm.verifier:
        raise TrainError(f"--verifier {path}: names a verifier itself ({vdllm.verifier}); chains are not supported")
    if (vdllm.eos_token_ids, vdllm.pad_token_id, vdllm.suppress_token_ids) != (
            dllm.eos_token_ids, dllm.pad_token_id, dllm.suppress_token_ids):
        raise TrainError(f"--verifier {path}: eos/pad/suppressed token ids differ from the model's")
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


class Teacher:
    """The AR parent run in-process: its next-token log-probabilities for scored answer tokens."""

    def __init__(self, path: str, device, student_vocab: int):
        from .common import load_parent

        self.model, _ = load_parent(path, device=device)
        v = self.model.get_output_embeddings().weight.shape[0]
        if v > student_vocab:
            raise TrainError(f"--teacher: its vocabulary ({v}) is larger than the student's ({student_vocab}); "
                             "the teacher must be the AR parent of this checkpoint")

    @torch.no_grad()
    def logprobs(self, batch: Batch, label_row: torch.Tensor, label_pos: torch.Tensor) -> torch.Tensor:
        """``[N, V_t]`` float32 log-probabilities of the parent's output at ``label_pos - 1`` (causal, clean)."""
        dev = self.model.device
        out = self.model.get_decoder()(input_ids=batch.input_ids.to(dev), attention_mask=batch.valid.long().to(dev),
                                       use_cache=False)
        hidden = out.last_hidden_state[label_row.to(dev), (label_pos - 1).to(dev)]
        return torch.log_softmax(self.model.get_output_embeddings()(hidden).float(), -1)


# ---------------------------------------------------------------------------------------------- helpers
_seed_of = seed_of


def repeated_data_order_note(cfg: "TrainConfig") -> str | None:
    """A warning when a new run starts from a checkpoint that ``unmask train`` made on the same data with the same
    ``--seed``, else ``None``.

    The data order depends only on ``(seed, epoch)`` (:func:`example_indices`), so such a run draws the very examples
    its starting checkpoint was trained on first, in the same order, and the same masking noise per step: a
    continued run (e.g. more drafter training from a finished run) should pass another ``--seed``, or ``--resume``
    the original run. Reads only the ``config``/``step`` of ``<model>/training_state.pt`` (memory-mapped, with
    ``weights_only=True``: a checkpoint from elsewhere cannot run code here; a missing or unreadable file means no
    note).
    """
    state_file = Path(cfg.model).expanduser() / "training_state.pt"
    if not state_file.is_file():
        return None
    try:
        state = torch.load(state_file, map_location="cpu", weights_only=True, mmap=True)  # no pickled code
        saved, step = state["config"], int(state["step"])
        same_data = Path(saved["data"]).expanduser().resolve() == Path(cfg.data).expanduser().resolve()
        consumed = step * int(saved["batch_size"]) * int(saved.get("grad_accum", 1)) * int(state.get("world_size", 1))
    except Exception:  # an older or foreign state file: nothing to say
        return None
    if not same_data or int(saved.get("seed", 0)) != int(cfg.seed):
        return None
    return (f"unmask train: note: --model {cfg.model} was trained by `unmask train` on this --data with --seed "
            f"{cfg.seed} for {step} steps ({consumed} examples); this run draws the same examples in the same order "
            f"first. Pass another --seed for a fresh order (or --resume that run's --out to continue it).")


def example_indices(n: int, seed: int, start: int, count: int) -> list[int]:
    """Indices ``start .. start+count-1`` of the endless example stream (epoch ``e`` = permutation seeded by
    ``(seed, e)``)."""
    out, cache = [], {}
    for i in range(start, start + count):
        e, j = divmod(i, n)
        if e not in cache:
            g = torch.Generator().manual_seed(_seed_of(seed, e, 17))
            cache[e] = torch.randperm(n, generator=g).tolist()
        out.append(cache[e][j])
    return out


class BudgetClock:
    """Fraction of a wall-clock budget spent: ``(minutes_before + minutes since start()) / span_minutes``, in
    [0, 1]; 0 until :meth:`start` is called."""

    def __init__(self, minutes_before: float, span_minutes: float):
        self.minutes_before = minutes_before
        self.span = span_minutes
        self.t0: float | None = None

    def start(self) -> None:
        """Start counting this process's minutes (``time.perf_counter``)."""
        self.t0 = time.perf_counter()

    def fraction(self) -> float:
        """Spent fraction of the budget in [0, 1]; 0.0 when ``span_minutes <= 0``."""
        if self.span <= 0:
            return 0.0
        here = 0.0 if self.t0 is None else (time.perf_counter() - self.t0) / 60.0
        return min(1.0, max(0.0, (self.minutes_before + here) / self.span))


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


def make_scheduler(optimizer, name: str, warmup: int, total: int, clock: BudgetClock | None = None):
    """Learning-rate schedule: transformers ``get_scheduler`` (``cosine`` / ``linear`` decay to 0 over ``total``
    steps, or ``constant`` after linear warmup), or ``cosine_time``: linear warmup over ``warmup`` steps, then
    ``0.5 * (1 + cos(pi * clock.fraction()))`` (a cosine over the wall-clock budget; SGDR's cosine, Loshchilov &
    Hutter 2017, indexed by time instead of steps).

    Raises:
        ValueError: ``cosine_time`` without a clock.
    """
    if name == "cosine_time":
        if clock is None:
            raise ValueError("cosine_time: needs a BudgetClock")
        from torch.optim.lr_scheduler import LambdaLR

        def factor(step: int) -> float:
            if step < warmup:
                return step / max(1, warmup)
            return 0.5 * (1.0 + math.cos(math.pi * clock.fraction()))
        return LambdaLR(optimizer, factor)
    from transformers import get_scheduler

    kind = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}[name]
    return get_scheduler(kind, optimizer, num_warmup_steps=warmup, num_training_steps=total)


def _write_latest(out: Path, name: str) -> None:
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


def plot_metrics(csv_path: Path, png_path: Path) -> None:
    """Loss curve (train loss per step, eval loss where measured) as a PNG (matplotlib Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(csv.DictReader(open(csv_path)))
    if not rows:
        return
    steps = [int(r["step"]) for r in rows]
    loss = [float(r["loss"]) for r in rows]
    ev = [(int(r["step"]), float(r["eval_loss"])) for r in rows if r.get("eval_loss")]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, loss, label="train loss", lw=1)
    if ev:
        ax.plot([s for s, _ in ev], [v for _, v in ev], "o-", label="eval loss (t grid)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("masked-diffusion loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = png_path.with_name(png_path.name + ".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, png_path)


# ---------------------------------------------------------------------------------------------- trainer
class Trainer:
    """One training run. ``Trainer(cfg).train()`` returns the output directory.

    Raises:
        TrainError: bad settings or inputs (names the option / file).
    """

    def __init__(self, cfg: TrainConfig):
        cfg.validate()
        self.cfg = cfg
        from accelerate import Accelerator

        from unmask.engine.model import resolve_device

        cuda = resolve_device("auto").type == "cuda"  # the one resolution of `auto` (the tests pin it to the CPU)
        mp = cfg.mixed_precision
        if mp == "auto":
            mp = ("bf16" if torch.cuda.is_bf16_supported() else "fp16") if cuda else "no"
        self.acc = Accelerator(mixed_precision=mp, cpu=not cuda)
        self.out = Path(cfg.out)

    # .................................................................. setup
    def _load(self) -> None:
        cfg, acc = self.cfg, self.acc
        from unmask.engine.config import CheckpointError

        from .data import DataError

        self.resume_from = resolve_latest(self.out) if cfg.resume else None
        if cfg.resume and self.resume_from is None and acc.is_main_process:
            print(f"unmask train: --resume: no {self.out / 'latest'} yet; starting from step 0")
        if not cfg.resume and self.out.exists() and any(".tmp-" not in c.name for c in self.out.glob("checkpoint-*")):
            raise TrainError(f"--out: {self.out} already holds checkpoints; use --resume or a new directory")
        state = None
        src = cfg.model
        if self.resume_from is not None:
            state_file = self.resume_from / "training_state.pt"
            if not state_file.is_file():
                raise TrainError(f"--resume: {state_file} is missing (the checkpoint is servable but cannot be "
                                 "resumed); point `latest` at an earlier checkpoint or start a new --out")
            state = torch.load(state_file, map_location="cpu", weights_only=False)
            saved = state["config"]
            keys = ["objective", "trainable", "batch_size", "grad_accum", "seq_len", "seed", "block_size",
                    "complementary", "max_steps", "lr_schedule", "warmup", "eps", "fsdp"]
            if cfg.trainable in ("lora", "qlora", "mask_lora"):
                keys += ["lora_r", "lora_alpha", "lora_targets"]
            if cfg.objective == "vfm":
                keys += ["vfm_gen_len", "vfm_beta", "vfm_beta_warmup", "vfm_width", "vfm_full", "init_adapter"]
            if cfg.align_weight > 0:  # (runs saved before Repr-Align existed have no align keys)
                keys += ["align_weight", "align_layers", "align_exp", "align_confidence"]
            if cfg.objective == "draft" and cfg.trainable != "mask_lora":  # (runs saved before the draft objective existed have neither key)
                keys += ["draft_groups", "verifier"]
                saved = {**saved, "verifier": saved.get("verifier") and str(Path(saved["verifier"]).expanduser()
                                                                            .resolve())}
            for key in keys:
                mine = getattr(cfg, key)
                if key == "verifier":
                    mine = str(Path(mine).expanduser().resolve())
                if saved.get(key, False if key == "fsdp" else None) != mine:
                    raise TrainError(f"--resume: --{key.replace('_', '-')} {getattr(cfg, key)!r} differs from the "
                                     f"run being resumed ({saved.get(key)!r})")
            if state.get("world_size", 1) != acc.num_processes:
                raise TrainError(f"--resume: the run being resumed used {state.get('world_size', 1)} processes, this "
                                 f"one {acc.num_processes} (the data order depends on it)")
            if cfg.trainable not in ("lora", "qlora", "mask_lora"):
                src = str(self.resume_from)  # its weights are the trained parameters, bit for bit
        if state is None and acc.is_main_process:
            note = repeated_data_order_note(cfg)
            if note:
                print(note, flush=True)
        torch.manual_seed(_seed_of(cfg.seed, 3))  # LoRA initialisation (peft draws from the global RNG)
        try:
            self.tm = prepare_model(src, cfg.trainable, cfg.lora_r, cfg.lora_alpha, cfg.lora_targets,
                                    device=acc.device, gradient_checkpointing=cfg.gradient_checkpointing)
        except (CheckpointError, ValueError, OSError) as exc:
            raise TrainError(f"--model: {exc}") from exc
        self.tm.path = cfg.model  # LoRA merges into the original full-precision base
        # a new run continuing another run's adapter (the recipe's draft stage); the VFM trial's mask-row adapter is
        # frozen (not in the trainable state), so a resumed VFM run reads it from --init-adapter again
        if cfg.init_adapter and (state is None or cfg.objective == "vfm"):
            from .mask_adapter import initialise_from

            try:
                initialise_from(self.tm, cfg.init_adapter)
            except (CheckpointError, ValueError) as exc:
                raise TrainError(f"--init-adapter: {exc}") from exc
        if cfg.objective == "vfm":
            from .vfm import attach

            attach(self.tm, cfg.vfm_gen_len, cfg.vfm_width, seed=_seed_of(cfg.seed, 5))
        if state is not None and state.get("trainable"):
            load_trainable_state(self.tm, state["trainable"])
        dllm = self.tm.dllm
        if cfg.objective in ("block", "trajectory") and dllm.attention == "bidirectional":
            raise TrainError("--objective block: needs a prefix_causal or block_causal checkpoint; this one is "
                             "bidirectional (use --objective mdlm)")
        if cfg.complementary and dllm.attention == "bidirectional":
            raise TrainError("--complementary: needs the block layout (a prefix_causal or block_causal checkpoint)")
        block = cfg.block_size
        if block is None and cfg.objective == "draft" and cfg.draft_block_sizes and dllm.block_size < 2:
            # --draft-block-sizes alone on a block-1 checkpoint (e.g. a conversion at block 1): the checkpoints
            # this run writes draft at the largest of them by default (`record ship --block-size` changes it later)
            block = max(int(b) for b in cfg.draft_block_sizes)
        if dllm.fixed_block_size and block not in (None, dllm.block_size):
            raise TrainError(f"--block-size: this checkpoint decodes with block size {dllm.block_size} only")
        self.block_size = block or dllm.block_size
        self.verifier = None
        if cfg.objective == "draft":
            if dllm.attention != "prefix_causal" or not dllm.logit_shift:
                raise TrainError("--objective draft: needs a prefix_causal checkpoint with the logit shift")
            if self.block_size < 2:
                raise TrainError(f"--block-size: the draft objective drafts groups of >= 2 masks; this checkpoint's "
                                 f"block size is {self.block_size}: give --block-size K >= 2 or --draft-block-sizes")
            if cfg.trainable == "mask_lora":  # the parent verifies (training/mask_adapter.py)
                dllm.block_size = self.block_size
        if cfg.objective == "draft" and cfg.trainable != "mask_lora":
            self.verifier = load_verifier(cfg.verifier, acc.device, dllm)
            from unmask.engine.routed import architecture_mismatch

            diff = architecture_mismatch(self.verifier.config, self.tm.base.config)
            if diff or self.verifier.get_output_embeddings().weight.shape != \
                    self.tm.base.get_output_embeddings().weight.shape:
                raise TrainError(f"--verifier {cfg.verifier}: another architecture than --model "
                                 f"({diff or 'LM head shape'})")
            # the saved checkpoints decode with this verifier (unmask.engine.routed) and at this draft block
            dllm.verifier = str(Path(cfg.verifier).expanduser().resolve())
            dllm.block_size = self.block_size
        elif dllm.verifier and not Path(dllm.verifier).expanduser().is_absolute():
            # the source names its verifier relatively (an export): the saved checkpoints live elsewhere
            dllm.verifier = str((Path(cfg.model) / Path(dllm.verifier)).resolve())
        eos = set(eos_ids_of(self.tm.tokenizer, extra=dllm.eos_token_ids))
        try:
            self.data = load_dataset(cfg.data, self.tm.tokenizer, cfg.seq_len, eos)
            self.eval_data = load_dataset(cfg.eval_data, self.tm.tokenizer, cfg.seq_len, eos) if cfg.eval_data else None
        except DataError as exc:
            raise TrainError(str(exc)) from exc
        self.pad_id = dllm.pad_token_id if dllm.pad_token_id is not None else dllm.eos_token_ids[0]
        self.teacher = None
        if cfg.teacher_kl > 0:
            if cfg.teacher:
                try:
                    self.teacher = Teacher(cfg.teacher, acc.device,
                                           self.tm.base.get_output_embeddings().weight.shape[0])
                except TrainError:
                    raise
                except Exception as exc:  # a missing or unreadable parent: one line naming the option
                    raise TrainError(f"--teacher {cfg.teacher}: {exc}") from exc
            elif not self.data.teacher_top_k:
                raise TrainError("--teacher-kl: needs --teacher MODEL or distill-data lines with `teacher` top-k "
                                 "distributions (unmask distill-data --top-k-dist K)")
        from .distributed import shard_model

        if cfg.fsdp and (cfg.align_weight > 0 or cfg.objective == "trajectory"):
            raise TrainError("--fsdp: not with --align-weight or --objective trajectory (untested together; "
                             "docs/design.md#scale-out)")
        self.forward = DraftForward(self.tm, self.verifier) if self.verifier is not None else DiffusionForward(self.tm)
        if cfg.objective == "vfm":
            from .vfm import VfmForward

            self.forward = VfmForward(self.tm)
        elif cfg.trainable == "mask_lora":
            from .mask_adapter import forward_module

            self.forward = forward_module(self.tm, cfg.objective)
        # before the optimizer sees the parameters; the module the loop calls is the root unit
        self.sharded = cfg.fsdp and shard_model(self.forward, self.tm.model, acc.device)
        self.trajectories = None
        if cfg.objective == "trajectory":
            from .trajectory import TrajectoryError, default_path, ensure_trajectories

            try:
                self.trajectories = ensure_trajectories(
                    cfg.trajectories or default_path(cfg.data), self.data.examples, cfg.trajectory_model or cfg.model,
                    cfg.trajectory_mode, cfg.trajectory_threshold, cfg.trajectory_steps, progress=cfg.progress,
                    block_size=self.block_size)
            except TrajectoryError as exc:
                raise TrainError(str(exc)) from exc
        self.aligner = None
        if cfg.align_weight > 0:
            from .align import AlignError, make_aligner

            try:
                self.aligner = make_aligner(cfg, acc.device, self.tm, self.data)
            except AlignError as exc:
                raise TrainError(str(exc)) from exc
        groups = self.tm.param_groups(cfg.weight_decay)
        self.optimizer = torch.optim.AdamW(groups, lr=cfg.lr)
        self.clock = BudgetClock(cfg.minutes_before, cfg.minutes_before + cfg.max_minutes)
        self.scheduler = make_scheduler(self.optimizer, cfg.lr_schedule, cfg.warmup, cfg.max_steps, self.clock)
        self.step = 0
        if state is not None:
            if self.sharded:
                from .distributed import load_full_optimizer_state

                load_full_optimizer_state(self.forward, self.optimizer, state["optimizer"])
            else:
                self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            torch.set_rng_state(state["rng"])
            self.step = int(state["step"])
            self._apply_changed_hyperparameters(state["config"])
        if self.sharded:  # FSDP2 does the gradient reductions; accelerate would wrap the module in DDP
            self.optimizer = self.acc.prepare(self.optimizer)
        else:
            self.forward, self.optimizer = self.acc.prepare(self.forward, self.optimizer)

    def _apply_changed_hyperparameters(self, saved: dict) -> None:
        """``--resume`` with a new ``--lr`` / ``--weight-decay``: the restored optimizer and scheduler states carry
        the old values; rescale every group's learning rates (current, initial, the scheduler's base) by
        ``new / old`` and set the weight decay of the groups that had the old one (no-decay groups stay at 0)."""
        cfg = self.cfg
        old_lr, old_wd = saved.get("lr", cfg.lr), saved.get("weight_decay", cfg.weight_decay)
        if old_lr != cfg.lr and old_lr > 0:
            ratio = cfg.lr / old_lr
            for g in self.optimizer.param_groups:
                g["lr"] *= ratio
                if "initial_lr" in g:
                    g["initial_lr"] *= ratio
            self.scheduler.base_lrs = [b * ratio for b in self.scheduler.base_lrs]
            if self.acc.is_main_process:
                print(f"unmask train: --resume: learning rate {old_lr:g} -> {cfg.lr:g} from step {self.step}")
        if old_wd != cfg.weight_decay:
            for g in self.optimizer.param_groups:
                if g.get("weight_decay") == old_wd:
                    g["weight_decay"] = cfg.weight_decay

    # .................................................................. one micro-batch
    def _micro_batch(self, ds: Dataset, indices: list[int]) -> Batch:
        return collate([ds.examples[i] for i in indices], self.pad_id, ds.teacher_top_k)

    def _loss(self, module, batch: Batch, generator: torch.Generator, fixed_t: float | None = None):
        cfg, dllm = self.cfg, self.tm.dllm
        if cfg.objective == "vfm":
            from .vfm import beta_at, rows_from_batch, vfm_loss

            rows = rows_from_batch(batch, cfg.vfm_gen_len, dllm.mask_token_id, dllm.eos_token_ids[0], self.pad_id,
                                   generator, cfg.vfm_full).to(self.acc.device)
            with self.acc.autocast():
                parts = vfm_loss(module, rows, generator, beta_at(self._progress(), cfg.vfm_beta,
                                                                  cfg.vfm_beta_warmup))
            return parts, rows
        if cfg.objective == "draft":
            sizes = cfg.draft_block_sizes or [self.block_size]
            # a mixture of draft block sizes: step s drafts groups of sizes[s % len(sizes)] (one size per step)
            lay = build_draft_layout(batch, dllm, int(sizes[self.step % len(sizes)]), generator,
                                     cfg.draft_groups).to(self.acc.device)
            with self.acc.autocast():
                logits = module(lay.context_ids, lay.context_mask, lay.input_ids, lay.position_ids,
                                lay.attention_mask, lay.src_row, lay.src_col)
            parts = diffusion_loss(logits, lay)
            parts.accepted = accepted_draft_length(logits.detach(), lay)
            return parts, lay
        block_size = self.block_size
        if cfg.objective == "trajectory" and fixed_t is None:
            from .trajectory import trajectory_noise

            noise, block_size = trajectory_noise(batch, dllm, self.trajectories, self._progress(), generator,
                                                 self.block_size,
                                                 cfg.max_block_size or 2 * self.block_size, cfg.eps)
        else:  # held-out evaluation of the trajectory objective: the block ELBO, comparable across objectives
            objective = "block" if cfg.objective == "trajectory" else cfg.objective
            noise = draw_noise(batch, dllm, objective, generator, block_size, cfg.eps, cfg.complementary,
                               fixed_t=fixed_t)
        layout = build_layout(batch, dllm, noise, block_size).to(self.acc.device)
        align_on = self.aligner is not None and fixed_t is None
        with self.acc.autocast():
            logits = module(layout.input_ids, layout.position_ids, layout.attention_mask, layout.src_row,
                            layout.src_col, **({"hidden_layers": self.aligner.layers} if align_on else {}))
        if align_on:
            logits, student_states = logits
        t_lp = t_ids = present = None
        if cfg.teacher_kl > 0 and fixed_t is None:
            if self.teacher is not None:
                t_lp = self.teacher.logprobs(batch, layout.label_row, layout.label_pos)
            else:
                st = stored_teacher(batch, layout)
                if st is not None:
                    t_lp, t_ids, present = st
        parts = diffusion_loss(logits, layout, teacher_kl=cfg.teacher_kl if fixed_t is None else 0.0,
                               ce=not cfg.no_ce or fixed_t is not None, teacher_logprobs=t_lp, teacher_ids=t_ids,
                               teacher_present=present, certainty=self._certainty() if fixed_t is None else 0.0,
                               certainty_temperature=cfg.certainty_temperature,
                               confidence_weighted_ce=cfg.align_confidence and fixed_t is None)
        if align_on:
            term = self.aligner.loss(student_states, batch, layout, dllm.logit_shift)
            parts.loss = parts.loss + cfg.align_weight * term
            parts.align = float(term.detach())
        return parts, layout

    def _progress(self) -> float:
        """The run's progress in [0, 1]: the wall-clock budget's fraction under ``--max-minutes``, else
        step / max_steps (the trajectory curriculum's and the VFM beta's clock)."""
        cfg = self.cfg
        return self.clock.fraction() if cfg.max_minutes > 0 else self.step / max(cfg.max_steps, 1)

    def _certainty(self) -> float:
        """The certainty (entropy) weight: ``--certainty``; the trajectory objective's d3LLM entropy term defaults
        to 1.0 when it is not set (``TRAJECTORY_CERTAINTY``)."""
        if self.cfg.objective == "trajectory" and self.cfg.certainty == 0:
            return TRAJECTORY_CERTAINTY
        return self.cfg.certainty

    @torch.no_grad()
    def evaluate(self) -> tuple[float, float]:
        """Held-out masked-diffusion loss averaged over the fixed ``t`` grid (an ELBO estimate: CE/t per answer
        token) and masked-token accuracy, with a fixed noise seed (comparable across steps). For the ``draft``
        objective: the draft CE and draft accuracy (and ``self.eval_accepted``, the mean accepted draft length)."""
        module = self.acc.unwrap_model(self.forward)
        was = module.training
        module.eval()
        losses, correct, scored = [], 0, 0
        accepted = []
        ds = self.eval_data
        bs = self.cfg.batch_size
        grid = [None] if self.cfg.objective == "draft" else eval_t_grid(self.cfg.eval_t_points)
        for ti, t in enumerate(grid):
            tot, norm = 0.0, 0.0
            for k in range(0, len(ds), bs):
                batch = self._micro_batch(ds, list(range(k, min(k + bs, len(ds)))))
                g = torch.Generator().manual_seed(_seed_of(self.cfg.seed, 99, ti, k))
                parts, layout = self._loss(module, batch, g, fixed_t=t)
                tot += parts.ce * layout.norm
                norm += layout.norm
                correct += parts.n_correct
                scored += parts.n_scored
                if hasattr(parts, "accepted"):
                    accepted.append(parts.accepted)
            losses.append(tot / max(norm, 1.0))
        self.eval_accepted = sum(accepted) / len(accepted) if accepted else None
        module.train(was)
        return sum(losses) / len(losses), correct / max(scored, 1)

    # .................................................................. saving
    def save(self) -> Path | None:
        """Write ``OUT/checkpoint-<step>`` (servable + training state) and point ``OUT/latest`` at it."""
        acc = self.acc
        acc.wait_for_everyone()
        path = self.out / f"checkpoint-{self.step}"
        full = None
        if self.sharded:  # every process joins the gather; process 0 gets the full states (distributed.py)
            from .distributed import full_states

            full = full_states(self.forward, self.optimizer)
        if acc.is_main_process:
            orphan = False
            if path.exists() and any(path.iterdir()):
                if resolve_latest(self.out) == path:
                    return path  # resumed at this very step: nothing new to save
                # written by a run of this directory that was killed before `latest` named it (resume starts
                # from `latest`, so this step was just recomputed): replace it
                orphan = True
            buf = io.BytesIO()
            torch.save({"step": self.step, "optimizer": full[1] if full else self.optimizer.state_dict(),
                        "scheduler": self.scheduler.state_dict(), "rng": torch.get_rng_state(),
                        "trainable": trainable_state(self.tm), "config": dataclasses.asdict(self.cfg),
                        "world_size": acc.num_processes}, buf)
            if self.tm.scope == "mask_lora":  # an adapter-only checkpoint (training/mask_adapter.py)
                from .mask_adapter import save as save_adapter

                extra = None
                if self.cfg.objective == "vfm":  # the noise adapter beside the (frozen) mask-row adapter
                    from .vfm import adapter_files

                    extra = adapter_files(self.tm.base.vfm_noise, {"step": self.step, "data": str(self.cfg.data),
                                                                   "init_adapter": self.cfg.init_adapter})
                try:
                    save_adapter(path, self.tm, self.block_size, self.cfg.objective, buf.getvalue(),
                                 {"step": self.step, "data": str(self.cfg.data)}, extra_files=extra)
                except ValueError as exc:
                    raise TrainError(f"step {self.step}: {exc}") from exc
                _write_latest(self.out, path.name)
                if self.cfg.keep_last:
                    prune_checkpoints(self.out, self.cfg.keep_last)
            else:
                self._write_full_checkpoint(path, full, buf, orphan)
        acc.wait_for_everyone()
        return path

    def _write_full_checkpoint(self, path: Path, full, buf: io.BytesIO, orphan: bool) -> None:
        """Process 0: the merged (or FSDP-gathered) full-precision model as a servable checkpoint at ``path``."""
        from unmask.engine.checkpoint import write_checkpoint

        if full:
            from .distributed import servable_model

            model = servable_model(self.tm.path, full[0])
        else:
            model = merged_full_precision(self.tm)
        bad = [n for n, t in model.state_dict().items() if t.is_floating_point() and not torch.isfinite(t).all()]
        if bad:
            raise TrainError(f"step {self.step}: non-finite weights ({len(bad)} tensors, e.g. {bad[0]}); "
                             f"not saving - lower --lr or --max-grad-norm (the last good checkpoint stays latest)")
        write_checkpoint(path, model, self.tm.tokenizer, self.tm.dllm, overwrite=orphan,
                         extra_files={"training_state.pt": buf.getvalue()})
        _write_latest(self.out, path.name)
        if self.cfg.keep_last:
            prune_checkpoints(self.out, self.cfg.keep_last)
        if self.metrics_path.is_file():
            with contextlib.suppress(Exception):
                plot_metrics(self.metrics_path, self.out / "loss.png")

    def _open_metrics(self) -> None:
        self.metrics_path = self.out / "metrics.csv"
        if not self.acc.is_main_process:
            return
        rows = []
        if self.metrics_path.is_file() and self.step > 0:
            rows = [r for r in csv.DictReader(open(self.metrics_path)) if int(r["step"]) <= self.step]
        with open(self.metrics_path, "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=METRIC_FIELDS)
            w.writeheader()
            w.writerows(rows)

    def _log(self, row: dict) -> None:
        if not self.acc.is_main_process:
            return
        with open(self.metrics_path, "a", newline="") as fh:
            csv.DictWriter(fh, fieldnames=METRIC_FIELDS).writerow({k: row.get(k, "") for k in METRIC_FIELDS})

    # .................................................................. loop
    def train(self) -> Path:
        """Load (or resume) the model, then step until ``max_steps``, ``max_minutes`` or ``halt_after``.

        Appends a row per step to ``OUT/metrics.csv``; saves every ``save_every`` steps and at the end (not after
        ``halt_after``). Returns ``OUT``.

        Raises:
            TrainError: bad ``--out``/``--resume``/``--model``/data, an option the checkpoint does not support, a
                non-finite loss or non-finite weights.
        """
        cfg, acc = self.cfg, self.acc
        if self.out.exists() and not self.out.is_dir():
            raise TrainError(f"--out: {self.out} is a file, not a directory")
        # every option is checked against the checkpoint and the data before OUT is created: a refused run leaves
        # no directory behind (loading writes nothing into OUT)
        self._load()
        if acc.is_main_process:
            self.out.mkdir(parents=True, exist_ok=True)
            for stale in [*self.out.glob("checkpoint-*.tmp-*"), *self.out.glob("latest.tmp-*")]:
                # left by a killed run: never referenced by `latest`
                shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() else stale.unlink(missing_ok=True)
        acc.wait_for_everyone()
        self._open_metrics()
        world, rank = acc.num_processes, acc.process_index
        per_step = cfg.batch_size * cfg.grad_accum * world
        n = len(self.data)
        params = [p for p in self.tm.model.parameters() if p.requires_grad]
        from tqdm.auto import tqdm

        bar = tqdm(total=cfg.max_steps, initial=self.step, desc="train", unit="step",
                   disable=not (cfg.progress and acc.is_main_process))
        t_start = time.perf_counter()
        self.clock.start()
        steps_here = 0
        halted = False
        while self.step < cfg.max_steps:
            t0 = time.perf_counter()
            stream = example_indices(n, cfg.seed, self.step * per_step, per_step)
            loss_sum = ce_sum = kl_sum = cert_sum = align_sum = 0.0
            accepted = []
            tokens = fwd_tokens = 0
            for m in range(cfg.grad_accum):
                lo = (m * world + rank) * cfg.batch_size
                batch = self._micro_batch(self.data, stream[lo: lo + cfg.batch_size])
                # seeded by the micro-batch's global index (m * world + rank; world 1: m, 0 as before), so the
                # noise, like the data, does not depend on how micro-batches are split over processes
                g = torch.Generator().manual_seed(_seed_of(cfg.seed, self.step, m * world + rank, 0))
                sync = m == cfg.grad_accum - 1
                ctx = contextlib.nullcontext() if sync else acc.no_sync(self.forward)
                with ctx:
                    parts, layout = self._loss(self.forward, batch, g)
                    acc.backward(parts.loss / cfg.grad_accum)
                loss_sum += float(parts.loss.detach())
                ce_sum += parts.ce
                kl_sum += parts.kl
                cert_sum += parts.certainty
                align_sum += parts.align
                if hasattr(parts, "accepted"):
                    accepted.append(parts.accepted)
                tokens += batch.n_tokens
                fwd_tokens += layout.n_tokens
            grad_norm = float("nan")
            if cfg.max_grad_norm > 0:
                from .distributed import as_float

                grad_norm = as_float(acc.clip_grad_norm_(params, cfg.max_grad_norm))
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.step += 1
            steps_here += 1
            stats = torch.tensor([loss_sum, ce_sum, kl_sum, tokens, fwd_tokens, cert_sum, align_sum],
                                 dtype=torch.float64,
                                 device=acc.device)
            stats = acc.reduce(stats, reduction="sum") if world > 1 else stats
            dt = time.perf_counter() - t0
            ga_w = cfg.grad_accum * world
            row = {"step": self.step, "epoch": round(self.step * per_step / n, 4),
                   "loss": round(float(stats[0]) / ga_w, 6), "ce": round(float(stats[1]) / ga_w, 6),
                   "kl": round(float(stats[2]) / ga_w, 6), "certainty": round(float(stats[5]) / ga_w, 6),
                   "align": round(float(stats[6]) / ga_w, 6),
                   "lr": self.scheduler.get_last_lr()[0],
                   "grad_norm": round(grad_norm, 6), "tokens": int(stats[3]),
                   "tokens_per_s": round(float(stats[3]) / dt, 2), "forward_tokens_per_s": round(float(stats[4]) / dt, 2),
                   "elapsed_s": round(time.perf_counter() - t_start, 3)}
            if cfg.eval_every and self.eval_data is not None and (self.step % cfg.eval_every == 0
                                                                  or self.step == cfg.max_steps):
                el, ea = self.evaluate()
                row["eval_loss"], row["eval_acc"] = round(el, 6), round(ea, 6)
                if self.eval_accepted is not None:
                    row["eval_accepted"] = round(self.eval_accepted, 4)
            if accepted:
                row["accepted"] = round(sum(accepted) / len(accepted), 4)
            self._log(row)
            bar.set_postfix(loss=f"{row['loss']:.4f}", tok_s=f"{row['tokens_per_s']:.0f}")
            bar.update(1)
            if not math.isfinite(row["loss"]):
                raise TrainError(f"step {self.step}: the loss is not finite ({row['loss']}); lower --lr")
            out_of_time = cfg.max_minutes > 0 and (time.perf_counter() - t_start) / 60 >= cfg.max_minutes
            if world > 1:
                flag = torch.tensor([1.0 if out_of_time else 0.0], device=acc.device)
                out_of_time = bool(acc.reduce(flag, reduction="sum") > 0)
            if cfg.save_every and self.step % cfg.save_every == 0 and self.step < cfg.max_steps:
                self.save()
            if cfg.halt_after is not None and steps_here >= cfg.halt_after:
                halted = True
                break
            if out_of_time:
                break
        bar.close()
        if not halted:
            self.save()
        if acc.is_main_process and self.metrics_path.is_file():
            with contextlib.suppress(Exception):
                plot_metrics(self.metrics_path, self.out / "loss.png")
        acc.wait_for_everyone()
        return self.out


def train(cfg: TrainConfig) -> Path:
    """Run training (see :class:`Trainer`); returns ``cfg.out``."""
    return Trainer(cfg).train()
