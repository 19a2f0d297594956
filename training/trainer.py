"""The A2D fine-tuning loop (docs/design.md#training and #decisions, issue 4).

Built on accelerate: one CPU process by default; the same call under ``accelerate launch`` / ``torchrun`` runs DDP
(gloo on CPU, NCCL on GPU), bf16 autocast on GPU. Each optimizer step consumes ``batch_size * grad_accum *
world_size`` examples from a deterministic stream (an epoch-seeded permutation of the data), and the noise of
micro-batch ``m`` of rank ``r`` at step ``s`` is drawn from a generator seeded by ``(seed, s, m, r)`` - so the data
position *is* the step, and ``--resume`` continues with identical data, noise, optimizer and scheduler state.

The loop never asks which objective it runs: the objective (``unmask.training.registry``) gives the module, the
loss of a micro-batch and the evaluation grid. Output directory ``OUT``:

* ``checkpoint-<step>/``: servable checkpoints (``unmask.engine.checkpoint.write_checkpoint``: written under a
  temporary name and renamed, never over a non-empty directory) + ``training_state.pt`` (optimizer, scheduler,
  RNG, step, LoRA adapters, the run's settings); ``unmask.training.checkpoints``;
* ``latest``: a small file naming the newest complete checkpoint, replaced atomically (``os.replace``) after the
  checkpoint is in place - a kill at any moment leaves ``latest`` pointing at a loadable checkpoint;
* ``metrics.csv`` (one row per step; eval columns on eval steps) and ``loss.png`` (``unmask.training.metrics``).
"""
from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path

import torch

from unmask.engine.config import CheckpointError

from . import checkpoints
from .common import TrainError, resolve_latest, seed_of
from .config import TrainConfig, config_from_json
from .data import Batch, DataError, Dataset, collate, eos_ids_of, load_dataset
from .distributed import as_float, full_states, load_full_optimizer_state, servable_model, shard_model
from .mask_adapter import initialise_from
from .mask_adapter import save as save_adapter
from .metrics import MetricsLog
from .registry import aux_resume_keys, make_aux, make_objective
from .schedule import BudgetClock, example_indices, make_scheduler, repeated_data_order_note
from .scopes import load_trainable_state, merged_full_precision, prepare_model

__all__ = ["TrainConfig", "TrainError", "Trainer", "config_from_json", "resolve_latest", "train"]


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
        self.objective = make_objective(cfg)
        self.aux = None
        self.step = 0

    # .................................................................. setup
    def _load(self) -> None:
        """Load (or resume) the model, the data and what the objective needs, then the optimizer; every rule that
        depends on the checkpoint or the data is checked here, before ``OUT`` is created."""
        state = self._resume()
        self._load_model(state)
        self._configure(self.tm.dllm)
        self._load_data()
        self.objective.prepare(self)
        self.forward = self.objective.forward_module(self)
        # before the optimizer sees the parameters; the module the loop calls is the root unit
        self.sharded = self.cfg.fsdp and shard_model(self.forward, self.tm.model, self.acc.device)
        self.aux = make_aux(self.cfg, self.acc.device, self.tm, self.data)
        self._build_optimizer(state)

    def _resume(self) -> dict | None:
        """The state of the run ``--resume`` continues (checked against this one), or None."""
        cfg, acc = self.cfg, self.acc
        keys = [*self.objective.resume_keys(), *aux_resume_keys(cfg)]
        self.resume_from, state = checkpoints.open_resume(cfg, self.out, acc.num_processes, keys,
                                                          self.objective.comparable,
                                                          log=print if acc.is_main_process else None)
        if state is None and acc.is_main_process:
            note = repeated_data_order_note(cfg)
            if note:
                print(note, flush=True)
        return state

    def _load_model(self, state: dict | None) -> None:
        cfg = self.cfg
        src = cfg.model
        if state is not None and cfg.trainable not in checkpoints.LORA_SCOPES:
            src = str(self.resume_from)  # its weights are the trained parameters, bit for bit
        torch.manual_seed(seed_of(cfg.seed, 3))  # LoRA initialisation (peft draws from the global RNG)
        try:
            self.tm = prepare_model(src, cfg.trainable, cfg.lora_r, cfg.lora_alpha, cfg.lora_targets,
                                    device=self.acc.device, gradient_checkpointing=cfg.gradient_checkpointing)
        except (CheckpointError, ValueError, OSError) as exc:
            raise TrainError(f"--model: {exc}") from exc
        self.tm.path = cfg.model  # LoRA merges into the original full-precision base
        # a new run continuing another run's adapter (the recipe's draft stage); an objective that keeps that
        # adapter frozen (not in the trainable state) reads it from --init-adapter again on resume
        if cfg.init_adapter and (state is None or self.objective.frozen_init_adapter):
            try:
                initialise_from(self.tm, cfg.init_adapter)
            except (CheckpointError, ValueError) as exc:
                raise TrainError(f"--init-adapter: {exc}") from exc
        self.objective.attach(self)
        if state is not None and state.get("trainable"):
            load_trainable_state(self.tm, state["trainable"])

    def _configure(self, dllm) -> None:
        """The block size and the objective's checks against the checkpoint's ``dllm`` settings."""
        cfg = self.cfg
        self.objective.check_checkpoint(dllm)
        if cfg.complementary and dllm.attention == "bidirectional":
            raise TrainError("--complementary: needs the block layout (a prefix_causal or block_causal checkpoint)")
        block = self.objective.block_size(dllm)
        if dllm.fixed_block_size and block not in (None, dllm.block_size):
            raise TrainError(f"--block-size: this checkpoint decodes with block size {dllm.block_size} only")
        self.block_size = block or dllm.block_size
        self.objective.configure(self)
        if dllm.verifier and not Path(dllm.verifier).expanduser().is_absolute():
            # the source names its verifier relatively (an export): the saved checkpoints live elsewhere
            dllm.verifier = str((Path(cfg.model) / Path(dllm.verifier)).resolve())

    def _load_data(self) -> None:
        cfg, dllm = self.cfg, self.tm.dllm
        eos = set(eos_ids_of(self.tm.tokenizer, extra=dllm.eos_token_ids))
        try:
            self.data = load_dataset(cfg.data, self.tm.tokenizer, cfg.seq_len, eos)
            self.eval_data = load_dataset(cfg.eval_data, self.tm.tokenizer, cfg.seq_len, eos) if cfg.eval_data else None
        except DataError as exc:
            raise TrainError(str(exc)) from exc
        self.pad_id = dllm.pad_token_id if dllm.pad_token_id is not None else dllm.eos_token_ids[0]

    def _build_optimizer(self, state: dict | None) -> None:
        """AdamW, the schedule and its clock; a resumed run's states restored; accelerate prepares them."""
        cfg = self.cfg
        self.optimizer = torch.optim.AdamW(self.tm.param_groups(cfg.weight_decay), lr=cfg.lr)
        self.clock = BudgetClock(cfg.minutes_before, cfg.minutes_before + cfg.max_minutes)
        self.scheduler = make_scheduler(self.optimizer, cfg.lr_schedule, cfg.warmup, cfg.max_steps, self.clock)
        self.step = 0
        if state is not None:
            if self.sharded:
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

    # .................................................................. what objectives read
    def progress(self) -> float:
        """The run's progress in [0, 1]: the wall-clock budget's fraction under ``--max-minutes``, else
        step / max_steps (the trajectory curriculum's and the VFM beta's clock)."""
        cfg = self.cfg
        return self.clock.fraction() if cfg.max_minutes > 0 else self.step / max(cfg.max_steps, 1)

    def _micro_batch(self, ds: Dataset, indices: list[int]) -> Batch:
        return collate([ds.examples[i] for i in indices], self.pad_id, ds.teacher_top_k)

    @torch.no_grad()
    def evaluate(self) -> tuple[float, float]:
        """Held-out loss averaged over the objective's grid (diffusion: the fixed ``t`` grid, an ELBO estimate, CE/t
        per answer token) and accuracy on the scored tokens, with a fixed noise seed (comparable across steps);
        ``self.eval_accepted``: the mean accepted draft length where the objective reports one."""
        module = self.acc.unwrap_model(self.forward)
        was = module.training
        module.eval()
        losses, correct, scored, accepted = [], 0, 0, []
        ds, bs = self.eval_data, self.cfg.batch_size
        for ti, t in enumerate(self.objective.eval_grid()):
            tot, norm = 0.0, 0.0
            for k in range(0, len(ds), bs):
                batch = self._micro_batch(ds, list(range(k, min(k + bs, len(ds)))))
                g = torch.Generator().manual_seed(seed_of(self.cfg.seed, 99, ti, k))
                parts, layout = self.objective.loss(self, module, batch, g, fixed_t=t)
                tot += parts.ce * layout.norm
                norm += layout.norm
                correct += parts.n_correct
                scored += parts.n_scored
                if parts.accepted is not None:
                    accepted.append(parts.accepted)
            losses.append(tot / max(norm, 1.0))
        self.eval_accepted = sum(accepted) / len(accepted) if accepted else None
        module.train(was)
        return sum(losses) / len(losses), correct / max(scored, 1)

    # .................................................................. saving
    def save(self) -> Path | None:
        """Write ``OUT/checkpoint-<step>`` (servable, or adapter-only, + training state) and point ``OUT/latest`` at
        it."""
        acc = self.acc
        acc.wait_for_everyone()
        path = self.out / f"checkpoint-{self.step}"
        # under FSDP every process joins the gather; process 0 gets the full states (distributed.py)
        full = full_states(self.forward, self.optimizer) if self.sharded else None
        if acc.is_main_process:
            orphan = False
            if path.exists() and any(path.iterdir()):
                if resolve_latest(self.out) == path:
                    return path  # resumed at this very step: nothing new to save
                # written by a run of this directory that was killed before `latest` named it (resume starts
                # from `latest`, so this step was just recomputed): replace it
                orphan = True
            state = checkpoints.training_state(self.step, full[1] if full else self.optimizer.state_dict(),
                                               self.scheduler, self.tm, self.cfg, acc.num_processes)
            if self.tm.scope == "mask_lora":  # an adapter-only checkpoint (training/mask_adapter.py)
                try:
                    save_adapter(path, self.tm, self.block_size, self.cfg.objective, state,
                                 {"step": self.step, "data": str(self.cfg.data)},
                                 extra_files=self.objective.adapter_files(self))
                except ValueError as exc:
                    raise TrainError(f"step {self.step}: {exc}") from exc
                checkpoints.publish(self.out, path, self.cfg.keep_last)
            else:  # the merged (or FSDP-gathered) full-precision model, servable
                model = servable_model(self.tm.path, full[0]) if full else merged_full_precision(self.tm)
                checkpoints.write_full(path, model, self.tm, state, self.step, overwrite=orphan)
                checkpoints.publish(self.out, path, self.cfg.keep_last)
                self.metrics.plot(self.out / "loss.png")
        acc.wait_for_everyone()
        return path

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
            checkpoints.remove_stale(self.out)  # left by a killed run: never referenced by `latest`
        acc.wait_for_everyone()
        self.metrics = MetricsLog(self.out, self.step, acc.is_main_process)
        self._params = [p for p in self.tm.model.parameters() if p.requires_grad]
        from tqdm.auto import tqdm

        bar = tqdm(total=cfg.max_steps, initial=self.step, desc="train", unit="step",
                   disable=not (cfg.progress and acc.is_main_process))
        t_start = time.perf_counter()
        self.clock.start()
        steps_here, halted = 0, False
        while self.step < cfg.max_steps:
            row = self._step(t_start)
            steps_here += 1
            bar.set_postfix(loss=f"{row['loss']:.4f}", tok_s=f"{row['tokens_per_s']:.0f}")
            bar.update(1)
            if not math.isfinite(row["loss"]):
                raise TrainError(f"step {self.step}: the loss is not finite ({row['loss']}); lower --lr")
            out_of_time = self._out_of_time(t_start)
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
        self.metrics.plot(self.out / "loss.png")
        acc.wait_for_everyone()
        return self.out

    def _step(self, t_start: float) -> dict:
        """One optimizer step: ``grad_accum`` micro-batches on every process; returns its metrics row (logged)."""
        cfg, acc = self.cfg, self.acc
        world, rank = acc.num_processes, acc.process_index
        per_step = cfg.batch_size * cfg.grad_accum * world
        t0 = time.perf_counter()
        stream = example_indices(len(self.data), cfg.seed, self.step * per_step, per_step)
        sums = [0.0] * 7  # loss, ce, kl, tokens, forward tokens, certainty, align
        accepted = []
        for m in range(cfg.grad_accum):
            lo = (m * world + rank) * cfg.batch_size
            batch = self._micro_batch(self.data, stream[lo: lo + cfg.batch_size])
            # seeded by the micro-batch's global index (m * world + rank; world 1: m, 0 as before), so the
            # noise, like the data, does not depend on how micro-batches are split over processes
            g = torch.Generator().manual_seed(seed_of(cfg.seed, self.step, m * world + rank, 0))
            ctx = contextlib.nullcontext() if m == cfg.grad_accum - 1 else acc.no_sync(self.forward)
            with ctx:
                parts, layout = self.objective.loss(self, self.forward, batch, g)
                acc.backward(parts.loss / cfg.grad_accum)
            for i, v in enumerate((float(parts.loss.detach()), parts.ce, parts.kl, batch.n_tokens, layout.n_tokens,
                                   parts.certainty, parts.align)):
                sums[i] += v
            if parts.accepted is not None:
                accepted.append(parts.accepted)
        grad_norm = float("nan")
        if cfg.max_grad_norm > 0:
            grad_norm = as_float(acc.clip_grad_norm_(self._params, cfg.max_grad_norm))
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        stats = torch.tensor(sums, dtype=torch.float64, device=acc.device)
        stats = acc.reduce(stats, reduction="sum") if world > 1 else stats
        dt = time.perf_counter() - t0
        ga_w = cfg.grad_accum * world
        row = {"step": self.step, "epoch": round(self.step * per_step / len(self.data), 4),
               "loss": round(float(stats[0]) / ga_w, 6), "ce": round(float(stats[1]) / ga_w, 6),
               "kl": round(float(stats[2]) / ga_w, 6), "certainty": round(float(stats[5]) / ga_w, 6),
               "align": round(float(stats[6]) / ga_w, 6), "lr": self.scheduler.get_last_lr()[0],
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
        self.metrics.log(row)
        return row

    def _out_of_time(self, t_start: float) -> bool:
        """``--max-minutes`` spent (on any process: they stop together)."""
        cfg, acc = self.cfg, self.acc
        out_of_time = cfg.max_minutes > 0 and (time.perf_counter() - t_start) / 60 >= cfg.max_minutes
        if acc.num_processes > 1:
            flag = torch.tensor([1.0 if out_of_time else 0.0], device=acc.device)
            out_of_time = bool(acc.reduce(flag, reduction="sum") > 0)
        return out_of_time


def train(cfg: TrainConfig) -> Path:
    """Run training (see :class:`Trainer`); returns ``cfg.out``. Ends with accelerate's ``end_training``: a torchrun
    job's gloo/NCCL process group is destroyed before the process exits (a live one aborted a rank at exit now and
    then: "terminate called without an active exception"); a no-op in one process."""
    trainer = Trainer(cfg)
    out = trainer.train()
    trainer.acc.end_training()
    return out
