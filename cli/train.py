"""``unmask train --model DIR --data FILE --out DIR``: masked-diffusion fine-tuning of an a2d checkpoint.

Runs in one CPU process by default; ``accelerate launch`` / ``torchrun`` run the same command with DDP. See
``unmask.training.trainer`` for the output layout (checkpoints, ``latest``, metrics CSV, loss PNG).
"""
from __future__ import annotations

import argparse

from unmask.cli.flags import add_options_lazily, config_from_args


def register(sub, name):
    """Add the ``unmask train`` sub-parser (named ``name``): every command-line field of
    :class:`~unmask.training.config.TrainConfig` (:mod:`unmask.cli.flags`), added when the command runs (the config
    module imports torch); returns it."""
    p = sub.add_parser(name, help="fine-tune an a2d checkpoint with a masked-diffusion objective",
                       description="Masked-diffusion fine-tuning (MDLM / block diffusion) of an a2d checkpoint.",
                       epilog="`unmask options train` lists every option with its default and config field.")
    return add_options_lazily(p, _config_classes)


def _config_classes() -> tuple:
    from unmask.training.config import TrainConfig

    return (TrainConfig,)


def run(args: argparse.Namespace) -> int:
    """Build a :class:`~unmask.training.config.TrainConfig` from the options and train; returns 0.

    Raises:
        UsageError: a ``TrainError`` (the message names the option or file), or a value its option cannot parse.
    """
    from unmask.cli.main import UsageError
    from unmask.training.config import TrainConfig
    from unmask.training.trainer import TrainError, train

    cfg = config_from_args(TrainConfig, args)
    try:
        out = train(cfg)
    except TrainError as exc:
        raise UsageError(str(exc)) from exc
    print(f"unmask train: done; latest checkpoint in {out}/latest")
    return 0
