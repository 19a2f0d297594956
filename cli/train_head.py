"""``unmask train-head``: train a diffusion draft head for a frozen verifier (``unmask.training.head_trainer``)."""
from __future__ import annotations

import argparse
import dataclasses


def register(sub, name):
    """Add the ``unmask train-head`` sub-parser (named ``name``) and its options; returns it."""
    from unmask.training.head_config import HeadTrainConfig

    d = HeadTrainConfig(verifier="", data="", out="")
    p = sub.add_parser(name, help="train a diffusion draft head that drafts for a verifier (speculative decoding)",
                       description="Train a one-layer diffusion draft head on the verifier's hidden states. OUT "
                                   "becomes a servable checkpoint: the verifier plus OUT/draft_head; speculative "
                                   "requests to it answer with the verifier's own tokens in fewer forwards. Rerun the "
                                   "same command to resume.")
    p.add_argument("--verifier", required=True, help="a2d checkpoint (prefix_causal, logit shift), e.g. the "
                                                     "untrained conversion of the AR parent")
    p.add_argument("--data", required=True, help="JSONL chats; `unmask distill-data` output of the same parent "
                                                 "recommended")
    p.add_argument("--out", required=True, help="output checkpoint directory (resumed when it exists)")
    p.add_argument("--minutes", type=float, default=d.minutes, help="training wall-clock budget (feature extraction "
                                                                    "not counted)")
    for f in dataclasses.fields(HeadTrainConfig):
        if f.name in ("verifier", "data", "out", "minutes"):
            continue
        p.add_argument(f"--{f.name.replace('_', '-')}", type=type(getattr(d, f.name)), default=getattr(d, f.name))
    return p


def run(args: argparse.Namespace) -> int:
    """Train; returns 0. Raises :class:`UsageError` for bad options, data or checkpoints."""
    from unmask.cli.main import UsageError
    from unmask.engine.config import CheckpointError
    from unmask.training.data import DataError
    from unmask.training.head_config import HeadTrainConfig
    from unmask.training.head_trainer import train_head
    from unmask.training.trainer import TrainError

    kw = {f.name: getattr(args, f.name) for f in dataclasses.fields(HeadTrainConfig)}
    try:
        train_head(HeadTrainConfig(**kw))
    except (TrainError, DataError, CheckpointError) as exc:
        raise UsageError(str(exc)) from exc
    return 0
