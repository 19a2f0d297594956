"""``unmask distill-data --teacher MODEL --prompts FILE --out FILE``: the AR parent answers a prompt file
(greedy, batched, resumable), optionally with its top-k next-token distributions for ``unmask train --teacher-kl``."""
from __future__ import annotations

import argparse
import json


def register(sub, name):
    """Add the ``unmask distill-data`` sub-parser (named ``name``) and its options; returns it."""
    p = sub.add_parser(name, help="self-distillation data: the AR parent answers a prompt file",
                       description="Generate training targets with the AR parent (appends; reruns resume).")
    for flag, text in (("--teacher", "AR model: Hugging Face directory or GGUF file/directory"),
                       ("--prompts", "JSONL (`prompt` or `messages`) or text (one prompt per line)"),
                       ("--out", "output JSONL (appended)")):
        p.add_argument(flag, required=True, help=text)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--top-k-dist", type=int, default=0, help="store the parent's top-K distribution per token")
    p.add_argument("--engine", action="store_true",
                   help="answer with unmask's engine from an a2d checkpoint (--teacher: e.g. the output of `unmask "
                        "convert`) at block_size=1: the served checkpoint's own greedy tokens, continuous batching, "
                        "faster on a CPU; no --top-k-dist")
    p.add_argument("--device", default="cpu")
    p.add_argument("--no-progress", action="store_true")
    return p


def run(args: argparse.Namespace) -> int:
    """Have the teacher answer the prompt file (appending to ``--out``) and print the counts as JSON; returns 0.

    Raises:
        UsageError: a ``DataError`` or ``ValueError`` from :func:`unmask.training.distill.distill`.
    """
    from unmask.cli.main import UsageError
    from unmask.training.data import DataError
    from unmask.training.distill import distill

    try:
        stats = distill(args.teacher, args.prompts, args.out, max_new_tokens=args.max_new_tokens,
                        batch_size=args.batch_size, top_k_dist=args.top_k_dist, device=args.device,
                        progress=not args.no_progress, engine=args.engine)
    except (DataError, ValueError) as exc:
        raise UsageError(str(exc)) from exc
    print(json.dumps(stats))
    return 0
