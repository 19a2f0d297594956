"""``unmask options [serve|train]``: every option of ``unmask serve`` and ``unmask train`` with its flag, its
environment variable, its default and the config field it sets, generated from the configuration objects
(``EngineConfig``, ``ServerConfig``, ``TrainConfig``; :mod:`unmask.cli.flags`) as their parsers are."""
from __future__ import annotations

import argparse
import json


def config_classes(command: str) -> tuple:
    """The config classes whose fields are ``command``'s options, in the order its parser adds them."""
    if command == "serve":
        from unmask.engine.options import EngineConfig
        from unmask.server.config import ServerConfig
        from unmask.server.ray_config import RayServeConfig

        return (EngineConfig, ServerConfig, RayServeConfig)
    from unmask.training.config import TrainConfig

    return (TrainConfig,)


COMMANDS = ("serve", "train")
HEADER = ("OPTION", "VARIABLE", "DEFAULT", "FIELD")


def register(sub, name):
    """Add the ``unmask options`` sub-parser (named ``name``); returns it."""
    p = sub.add_parser(name, help="list every option of serve and train (flag, variable, default, config field)",
                       description="Every option of `unmask serve` and `unmask train`: its flag, its environment "
                                   "variable (serve's; - where none), its default and the config field it sets.")
    p.add_argument("commands", nargs="*", metavar="COMMAND", help="serve and/or train (default: both)")
    p.add_argument("--json", action="store_true", help="one JSON object: command -> list of rows")
    return p


def table(command: str) -> list[tuple[str, str, str, str]]:
    """The rows of ``command``: ``(flag, variable, default, config field)``."""
    from unmask.cli.flags import option_rows

    return option_rows(command, *config_classes(command))


def run(args: argparse.Namespace) -> int:
    """Print the options of the chosen commands (an aligned table per command, or ``--json``); returns 0.

    Raises:
        UsageError: a command other than serve and train.
    """
    from unmask.cli import UsageError

    bad = [c for c in args.commands if c not in COMMANDS]
    if bad:
        raise UsageError(f"COMMAND: {bad[0]!r} is not one of {', '.join(COMMANDS)}")
    commands = [c for c in COMMANDS if c in args.commands] or list(COMMANDS)
    if args.json:
        print(json.dumps({c: [dict(zip(("flag", "variable", "default", "field"), r)) for r in table(c)]
                          for c in commands}, indent=1))
        return 0
    for i, command in enumerate(commands):
        rows = [HEADER, *table(command)]
        widths = [max(len(r[k]) for r in rows) for k in range(3)]
        print(("\n" if i else "") + f"unmask {command}")
        for r in rows:
            print("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[3])
    return 0
