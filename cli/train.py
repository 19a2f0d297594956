"""``unmask train --model DIR --data FILE --out DIR``: masked-diffusion fine-tuning of an a2d checkpoint.

Runs in one CPU process by default; ``accelerate launch`` / ``torchrun`` run the same command with DDP. See
``unmask.training.trainer`` for the output layout (checkpoints, ``latest``, metrics CSV, loss PNG).
"""
from __future__ import annotations

import argparse


def register(sub, name):
    """Add the ``unmask train`` sub-parser (named ``name``) and its options; returns it."""
    p = sub.add_parser(name, help="fine-tune an a2d checkpoint with a masked-diffusion objective",
                       description="Masked-diffusion fine-tuning (MDLM / block diffusion) of an a2d checkpoint.")
    p.add_argument("--model", required=True, help="a2d checkpoint directory (`unmask convert` output)")
    p.add_argument("--data", required=True, help="JSONL: `messages` chats or `prompt`/`completion` (distill-data)")
    p.add_argument("--out", required=True, help="output directory (checkpoint-<step>/, latest, metrics.csv, loss.png)")
    p.add_argument("--objective", default="block", choices=["mdlm", "block", "draft", "trajectory", "vfm"],
                   help="mdlm: one t per sequence (bidirectional); block: every block in one forward (default); "
                        "draft: train the model as the drafter of verifier-routed speculative decoding (needs "
                        "--verifier); trajectory: d3LLM's pseudo-trajectory distillation (masks follow recorded "
                        "reveal orders); vfm: the VFM trial (a prompt-conditioned noise adapter for one-step decoding; "
                        "--trainable mask_lora, an experiment: docs/methods.md)")
    p.add_argument("--trajectories", default=None, metavar="JSONL",
                   help="--objective trajectory: the trajectory file (default DATA.trajectory.jsonl; recorded "
                        "there first where missing, resumable)")
    p.add_argument("--trajectory-mode", default="engine", choices=["engine", "entropy"],
                   help="engine: the model's own threshold decoding (default); entropy: ground truth revealed "
                        "lowest-entropy-first in --trajectory-steps steps")
    p.add_argument("--trajectory-threshold", type=float, default=0.9, help="engine mode's threshold")
    p.add_argument("--trajectory-steps", type=int, default=8, help="entropy mode's steps per answer")
    p.add_argument("--trajectory-model", default=None, help="the recording model (default --model)")
    p.add_argument("--max-block-size", type=int, default=None,
                   help="--objective trajectory: the training block size doubles up to this (default 2x; "
                        "at most --seq-len)")
    p.add_argument("--init-adapter", default=None, metavar="DIR",
                   help="--trainable mask_lora: start the mask-row adapter from this adapter checkpoint (same rank, "
                        "alpha, targets, parent); --objective vfm keeps it frozen")
    p.add_argument("--vfm-gen-len", type=int, default=32, help="--objective vfm: answer positions G")
    p.add_argument("--vfm-beta", type=float, default=1e-3, help="--objective vfm: final KL weight beta")
    p.add_argument("--vfm-beta-warmup", type=float, default=0.5,
                   help="--objective vfm: beta rises linearly from 0 over this fraction of the run")
    p.add_argument("--vfm-width", type=int, default=256, help="--objective vfm: the noise adapter's inner width")
    p.add_argument("--vfm-full", type=float, default=0.5,
                   help="--objective vfm: share of rows with every answer position masked (the one-step case)")
    p.add_argument("--verifier", default=None,
                   help="--objective draft: the a2d checkpoint whose causal path verifies the drafts (the untrained "
                        "conversion of the AR parent); the saved checkpoints name it as their verifier")
    p.add_argument("--draft-groups", type=int, default=32,
                   help="--objective draft: draft groups (of --block-size masks) per example per step")
    p.add_argument("--draft-block-sizes", default=None, metavar="K,K,...",
                   help="--objective draft: block sizes the draft groups cycle through, one per step (e.g. 2,4: "
                        "drafting at block 4 and plain diffusion at block 2 from one adapter; each in 2..--seq-len; "
                        "default --block-size). Given alone on a block-1 checkpoint it implies --block-size: the "
                        "saved checkpoints draft at the largest of them by default")
    p.add_argument("--trainable", default="full", choices=["full", "freeze_ffn", "qk_only", "lora", "qlora", "mask_lora"],
                   help="mask_lora: the mask-row adapter (LoRA only mask rows see; --lora-r/--lora-alpha/--lora-targets)")
    p.add_argument("--block-size", type=int, default=None,
                   help="training block size, 1..--seq-len (default: the checkpoint's; --objective draft: >= 2, the "
                        "block its checkpoints draft at, default the largest --draft-block-sizes on a block-1 "
                        "checkpoint)")
    p.add_argument("--complementary", action="store_true", help="also train the complementary mask of each block")
    p.add_argument("--batch-size", type=int, default=8, help="examples per micro-batch per process")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=256, help="maximum tokens per example (longer ones truncated)")
    p.add_argument("--max-steps", type=int, default=100)
    p.add_argument("--max-minutes", type=float, default=0.0, help="stop (and save) after this many minutes")
    p.add_argument("--eval-every", type=int, default=0)
    p.add_argument("--eval-data", default=None, help="held-out JSONL for evaluation")
    p.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (always at the end)")
    p.add_argument("--keep-last", type=int, default=0,
                   help="keep only the N newest checkpoints (0 = all; each holds the model and optimizer state)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue from OUT/latest")
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--lr-schedule", default="cosine", choices=["cosine", "linear", "constant", "cosine_time"],
                   help="cosine/linear decay over --max-steps, constant after warmup, or cosine_time: a cosine "
                        "over the --max-minutes wall-clock budget")
    p.add_argument("--warmup", type=int, default=0, help="warmup steps")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="0 = no clipping")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--fsdp", action="store_true",
                   help="shard weights, gradients and optimizer state across the processes of a torchrun / "
                        "accelerate launch job (FSDP2; --trainable full; docs/scale.md)")
    p.add_argument("--teacher", default=None, help="AR parent (HF dir or GGUF) for --teacher-kl, run in-process")
    p.add_argument("--teacher-kl", type=float, default=0.0, help="weight W of KL(parent || model) at masked tokens")
    p.add_argument("--no-ce", action="store_true", help="KL term only (needs --teacher-kl)")
    p.add_argument("--certainty", type=float, default=0.0,
                   help="weight C of the certainty-forcing term (dParallel): entropy of correctly predicted masked "
                        "tokens, so confidence-threshold decoding reveals more tokens per step (0 = off)")
    p.add_argument("--certainty-temperature", type=float, default=0.5, help="softmax temperature of that entropy")
    p.add_argument("--align-weight", type=float, default=0.0, metavar="W",
                   help="Repr-Align (Open-dLLM): + W * (1 - cos(student, AR teacher hidden states)) at masked "
                        "tokens; 0 = off; Open-dLLM uses 10")
    p.add_argument("--align-layers", default="all", help="all | comma-separated 1-based decoder layers")
    p.add_argument("--align-exp", type=float, default=0.0, metavar="G",
                   help="layer weights proportional to exp(G * layer / n_layers) (0 = uniform)")
    p.add_argument("--align-confidence", action="store_true",
                   help="confidence-weighted CE per token: exp(-CE).detach() * CE (Open-dLLM's path term)")
    p.add_argument("--align-teacher", default=None,
                   help="the frozen AR teacher (default: --teacher, else --model run causally)")
    p.add_argument("--align-anchors", default=None, metavar="DIR",
                   help="read the teacher's states from this anchor cache (built there first when absent) instead "
                        "of running the teacher live (the default)")
    p.add_argument("--align-anchor-budget-mb", type=float, default=2048.0,
                   help="refuse to build an anchor cache larger than this")
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--lora-alpha", type=float, default=32.0)
    p.add_argument("--lora-targets", default=None,
                   help="comma-separated module names (default: q_proj,k_proj,v_proj,o_proj; mask_lora: every projection)")
    p.add_argument("--mixed-precision", default="auto", choices=["auto", "no", "bf16", "fp16"])
    p.add_argument("--no-progress", action="store_true")
    return p


def _int_list(option: str, text: str | None) -> list[int] | None:
    """``"2,4"`` -> ``[2, 4]`` (None stays None).

    Raises:
        UsageError: an item is not an integer (names ``option``).
    """
    if text is None:
        return None
    from unmask.cli.main import UsageError

    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{option}: expected comma-separated integers such as 2,4, got {text!r}") from None


def run(args: argparse.Namespace) -> int:
    """Build a :class:`~unmask.training.trainer.TrainConfig` from the options and train; returns 0.

    Raises:
        UsageError: a ``TrainError`` (the message names the option or file).
    """
    from unmask.cli.main import UsageError
    from unmask.training.trainer import TrainConfig, TrainError, train

    cfg = TrainConfig(
        model=args.model, data=args.data, out=args.out, objective=args.objective, trainable=args.trainable,
        block_size=args.block_size, complementary=args.complementary, batch_size=args.batch_size,
        grad_accum=args.grad_accum, seq_len=args.seq_len, max_steps=args.max_steps, max_minutes=args.max_minutes,
        eval_every=args.eval_every, eval_data=args.eval_data, save_every=args.save_every,
        keep_last=args.keep_last, seed=args.seed,
        resume=args.resume, lr=args.lr, lr_schedule=args.lr_schedule, warmup=args.warmup,
        weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm,
        gradient_checkpointing=args.gradient_checkpointing, teacher=args.teacher, teacher_kl=args.teacher_kl,
        no_ce=args.no_ce, certainty=args.certainty, certainty_temperature=args.certainty_temperature,
        lora_r=args.lora_r, lora_alpha=args.lora_alpha,
        lora_targets=[t.strip() for t in args.lora_targets.split(",") if t.strip()] if args.lora_targets else None,
        mixed_precision=args.mixed_precision, progress=not args.no_progress, verifier=args.verifier,
        draft_groups=args.draft_groups, draft_block_sizes=_int_list("--draft-block-sizes", args.draft_block_sizes),
        fsdp=args.fsdp, align_weight=args.align_weight, align_layers=args.align_layers,
        align_exp=args.align_exp, align_confidence=args.align_confidence, align_teacher=args.align_teacher,
        align_anchors=args.align_anchors, align_anchor_budget_mb=args.align_anchor_budget_mb,
        trajectories=args.trajectories, trajectory_mode=args.trajectory_mode,
        trajectory_threshold=args.trajectory_threshold, trajectory_steps=args.trajectory_steps,
        trajectory_model=args.trajectory_model, max_block_size=args.max_block_size, init_adapter=args.init_adapter,
        vfm_gen_len=args.vfm_gen_len, vfm_beta=args.vfm_beta, vfm_beta_warmup=args.vfm_beta_warmup,
        vfm_width=args.vfm_width, vfm_full=args.vfm_full)
    try:
        out = train(cfg)
    except TrainError as exc:
        raise UsageError(str(exc)) from exc
    print(f"unmask train: done; latest checkpoint in {out}/latest")
    return 0
