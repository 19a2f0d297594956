"""``unmask`` command line: one sub-command per module in this package (``generate``, ``convert``, ``serve``,
``train``, ``export``, ``distill-data``, ``eval``, ``recipe``, ``chat``, ``options``). Heavy imports happen inside
each command, so ``unmask --help`` is instant. Bad values exit with status 2 and a one-line reason; so does a removed command
(:data:`REMOVED`)."""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from unmask.cli import UsageError  # noqa: F401  (re-exported: unmask.cli.main.UsageError)

# sub-command name -> module in unmask.cli exposing register(subparsers) and run(args) -> int
COMMANDS = {
    "generate": "generate",
    "convert": "convert",
    "serve": "serve",
    "train": "train",
    "export": "export",
    "distill-data": "distill",
    "eval": "evaluate",
    "recipe": "recipe",
    "chat": "chat",
    "options": "options",
}

# removed sub-command -> why and what to use instead (exit status 2 with this line, not argparse's "invalid choice")
REMOVED = {
    "train-head": "removed on 2026-12-05 with the draft head: the mask-row adapter replaces it as the drafter of "
                  "speculative decoding (docs/adapter.md); train one with `unmask recipe --trainable mask_lora`",
}


def package_version() -> str:
    """The installed distribution's version (``pyproject.toml``), or ``"unknown"`` when unmask is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("unmask")
    except PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    """The ``unmask`` parser with one sub-command per :data:`COMMANDS` module present (each sets ``_run``)."""
    parser = argparse.ArgumentParser(prog="unmask", description="Diffusion LM inference server and A2D training")
    parser.add_argument("--version", action="version", version=f"unmask {package_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, module in COMMANDS.items():
        try:
            mod = importlib.import_module(f"unmask.cli.{module}")
        except ModuleNotFoundError as exc:
            if exc.name == f"unmask.cli.{module}":
                continue
            raise
        p = mod.register(sub, name)
        p.set_defaults(_run=mod.run)
    return parser


def library_bars_off_terminal(stderr, env) -> None:
    """Off a terminal (stderr redirected to a log file) the libraries' progress bars are hundreds of carriage-return
    frames on one line: transformers' (loading weights, a GGUF's de-quantisation, writing shards) and
    huggingface_hub's. They are turned off through ``TQDM_DISABLE`` and ``HF_HUB_DISABLE_PROGRESS_BARS`` in ``env``,
    which tqdm and huggingface_hub read when first imported (every command imports them later, inside its run).
    unmask's own bars (``distill``, ``train``) pass ``disable`` explicitly and are unaffected; a value the user set
    wins."""
    if not stderr.isatty():
        env.setdefault("TQDM_DISABLE", "1")
        env.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``) and run the command; returns its exit status (130 on Ctrl-C, 2 with a
    one-line message on :class:`UsageError` or a :data:`REMOVED` command; argparse exits 2 on bad syntax)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in REMOVED:
        print(f"unmask {argv[0]}: error: {REMOVED[argv[0]]}", file=sys.stderr)
        return 2
    parser = build_parser()
    args = parser.parse_args(argv)
    library_bars_off_terminal(sys.stderr, os.environ)
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        how = {"recipe": "rerun the same command", "distill-data": "rerun the same command",
               "train": "rerun it with --resume"}.get(args.command)
        print(f"\nunmask {args.command}: interrupted" + (f"; {how} to continue where it stopped" if how else ""),
              file=sys.stderr)
        return 130
    except UsageError as exc:
        print(f"unmask {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
