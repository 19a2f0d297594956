"""``unmask recipe``: one command from the SmolLM2-135M-Instruct GGUF to a trained, quantized diffusion model that
``unmask serve`` serves by default (convert -> prompts -> teacher self-distillation -> block-diffusion training
with a time budget -> opt-in drafter training against the parent (its verifier) -> nf4 export). Resumable: rerun the same
command after an interruption."""
from __future__ import annotations

import argparse
import shlex
import sys


def register(sub, name):
    """Add the ``unmask recipe`` sub-parser (named ``name``) and its options; returns it."""
    from unmask.training.recipes.smollm2 import add_arguments

    p = sub.add_parser(name, help="SmolLM2 -> trained nf4 diffusion model in one resumable command",
                       description=__doc__)
    add_arguments(p)
    return p


def run(args: argparse.Namespace) -> int:
    """Run the recipe stages (up to ``--until``); returns 0.

    Raises:
        UsageError: a :class:`~unmask.training.recipes.smollm2.RecipeError` (bad option, failed stage).
    """
    from unmask.cli.main import UsageError
    from unmask.training.recipes.smollm2 import Recipe, RecipeError, config_from_args

    try:
        command = "unmask " + shlex.join(sys.argv[1:]) if sys.argv[1:2] == ["recipe"] else None
        recipe = Recipe(config_from_args(args), log=lambda m: print(m, flush=True), command=command)
        recipe.run(until=args.until)
    except RecipeError as exc:
        raise UsageError(str(exc)) from exc
    return 0
