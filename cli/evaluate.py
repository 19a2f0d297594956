"""``unmask eval``: quality/speed evaluation of diffusion checkpoints against their AR parent (issue 5).

A thin front for the harness :mod:`unmask.cli.evaluation.quality`, which ships in the package (with the held-out
prompt sets), so the command works from an installed wheel as well as from a source checkout;
``benchmarks/eval_quality.py`` is the same harness as a script. Options are the harness's own
(``unmask eval --help``).
"""
from __future__ import annotations

import argparse
import sys


def register(sub, name):
    """Add the ``unmask eval`` sub-parser (named ``name``) and its options; returns it."""
    from unmask.cli.evaluation import quality

    p = sub.add_parser(name, help="evaluate diffusion checkpoints against the AR parent (quality vs speed)",
                       description="Runs the AR parent, the untrained conversion and the given checkpoints over a "
                                   "grid of parallelism settings; writes JSON, Markdown and a PNG plot.")
    quality.add_arguments(p)
    return p


def run(args: argparse.Namespace) -> int:
    """Run the harness's evaluation with the parsed options; returns 0.

    Raises:
        UsageError: the harness raised its ``EvalError`` (bad options or data, an ``--out`` holding results).
    """
    from unmask.cli.evaluation import quality
    from unmask.cli.main import UsageError

    args.command_line = "unmask eval " + " ".join(sys.argv[2:]) if len(sys.argv) > 1 else "unmask eval"
    try:
        quality.run_eval(args)
    except quality.EvalError as exc:
        raise UsageError(str(exc)) from exc
    return 0
