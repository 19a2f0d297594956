"""``unmask eval``: quality/speed evaluation of diffusion checkpoints against their AR parent (issue 5).

A thin front for ``benchmarks/eval_quality.py`` (the harness lives with the other benchmarks; this command finds it
in the source checkout this package is installed from, or under ``$UNMASK_REPO``). Options are the harness's own
(``unmask eval --help``).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

_MODULE = "unmask_benchmarks_eval_quality"


def harness_path() -> Path | None:
    """``benchmarks/eval_quality.py`` of ``$UNMASK_REPO``, of the checkout holding this file, or of the current
    directory -- the first that exists; None when none does."""
    roots = [os.environ.get("UNMASK_REPO"), str(Path(__file__).resolve().parents[1]), os.getcwd()]
    for root in roots:
        if root:
            p = Path(root).expanduser() / "benchmarks" / "eval_quality.py"
            if p.is_file():
                return p
    return None


def load_harness():
    """Import ``benchmarks/eval_quality.py`` as a module (cached). Returns None when it cannot be found."""
    if _MODULE in sys.modules:
        return sys.modules[_MODULE]
    path = harness_path()
    if path is None:
        return None
    spec = importlib.util.spec_from_file_location(_MODULE, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[_MODULE] = mod
    spec.loader.exec_module(mod)
    return mod


def register(sub, name):
    """Add the ``unmask eval`` sub-parser (named ``name``) and its options; returns it."""
    p = sub.add_parser(name, help="evaluate diffusion checkpoints against the AR parent (quality vs speed)",
                       description="Runs the AR parent, the untrained conversion and the given checkpoints over a "
                                   "grid of parallelism settings; writes JSON, Markdown and a PNG plot.")
    harness = load_harness()
    if harness is None:
        p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    else:
        harness.add_arguments(p)
    return p


def run(args: argparse.Namespace) -> int:
    """Run ``benchmarks/eval_quality.py``'s evaluation with the parsed options; returns 0.

    Raises:
        UsageError: the harness is not found, or it raised its ``EvalError``.
    """
    from unmask.cli.main import UsageError

    harness = load_harness()
    if harness is None:
        raise UsageError("benchmarks/eval_quality.py not found: run from a source checkout of unmask "
                         "or set UNMASK_REPO to one")
    args.command_line = "unmask eval " + " ".join(sys.argv[2:]) if len(sys.argv) > 1 else "unmask eval"
    try:
        harness.run_eval(args)
    except harness.EvalError as exc:
        raise UsageError(str(exc)) from exc
    return 0
