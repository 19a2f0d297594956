"""``unmask options``: every option of ``unmask serve`` and ``unmask train`` with its flag, variable, default and
config field, generated from the configuration objects (issue 39): the table and the parsers agree, option for
option, and each default is declared once."""
from __future__ import annotations

import argparse
import json

import pytest

from unmask.cli.flags import env_name
from unmask.cli.main import build_parser, main
from unmask.cli.options import COMMANDS, table


@pytest.fixture(autouse=True)
def no_unmask_variables(monkeypatch):
    import os

    for var in [v for v in os.environ if v.startswith("UNMASK_")]:
        monkeypatch.delenv(var)


def _subparser(command: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser = sub.choices[command]
    return parser.load_options() if hasattr(parser, "load_options") else parser  # train's are added when used


def _parser_rows(command: str) -> dict[str, tuple[str, str, str]]:
    """flag -> (variable, default, source field) as the parser has them."""
    rows = {}
    for a in _subparser(command)._actions:
        if isinstance(a, argparse._HelpAction):
            continue
        flag = a.option_strings[0] if a.option_strings else "MODEL"
        var = env_name(a) if getattr(a, "env", False) else "-"
        default = "(required)" if a.required else repr(a.default)
        rows[flag] = (var, default, getattr(a, "source", None))
    return rows


@pytest.mark.parametrize("command", COMMANDS)
def test_the_table_is_the_parser(command):
    """Every parser option appears in the table with the parser's variable, default and source field; no extra."""
    listed = {flag: (var, default, field) for flag, var, default, field in table(command)}
    assert listed == _parser_rows(command)
    assert all(field is not None for _, _, field in listed.values())


def test_serve_options_come_from_the_engine_and_server_configs():
    fields = {field.split(".")[0] for _, _, _, field in table("serve")}
    assert fields == {"EngineConfig", "ServerConfig", "RayServeConfig"}
    assert {field.split(".")[0] for _, _, _, field in table("train")} == {"TrainConfig"}


def test_the_command_prints_every_row(capsys):
    assert main(["options"]) == 0
    out = capsys.readouterr().out
    for command in COMMANDS:
        assert f"unmask {command}" in out
        for flag, var, default, field in table(command):
            assert any(flag in line and var in line and field in line for line in out.splitlines()), flag
    assert main(["options", "serve", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert list(data) == ["serve"] and data["serve"][0] == {"flag": "MODEL", "variable": "UNMASK_MODEL",
                                                            "default": "None", "field": "EngineConfig.model"}
    assert main(["options", "nope"]) == 2
    assert "COMMAND: 'nope' is not one of serve, train" in capsys.readouterr().err


def test_the_command_line_builds_without_torch():
    """train's options (TrainConfig's module imports torch) join its parser when it runs: `unmask --help`, `unmask
    chat` and the other commands stay free of torch."""
    import subprocess
    import sys

    probe = ("import sys; from unmask.cli.main import build_parser; p = build_parser(); "
             "assert 'torch' not in sys.modules, 'torch imported'; "
             "p.parse_args(['train', '--model', 'm', '--data', 'd', '--out', 'o', '--seed', '3']); "
             "assert 'torch' in sys.modules")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_a_train_value_its_option_cannot_parse_names_the_option(capsys):
    assert main(["train", "--model", "m", "--data", "d", "--out", "o", "--draft-block-sizes", "2,x"]) == 2
    assert ("--draft-block-sizes: expected comma-separated integers such as 2,4, got '2,x'"
            in capsys.readouterr().err)


def test_each_engine_default_is_declared_once():
    """The queue, batch and prefill defaults of serve, the Python API (LLM, Engine, AsyncEngine) and the scheduler
    are EngineConfig's (max_queue had three: 256, 1<<30 and 1024)."""
    import inspect

    import tiny
    from unmask.engine import EngineConfig
    from unmask.engine.async_engine import AsyncEngine
    from unmask.engine.engine import Engine
    from unmask.engine.scheduler import Scheduler

    cfg = EngineConfig()
    rows = {flag: default for flag, _, default, _ in table("serve")}
    assert rows["--max-queue"] == repr(cfg.max_queue) and rows["--max-batch-size"] == repr(cfg.max_batch_size)
    sig = inspect.signature(Scheduler)
    assert (sig.parameters["max_queue"].default, sig.parameters["max_batch_size"].default) == (
        cfg.max_queue, cfg.max_batch_size)
    model = tiny.loaded()
    engine = Engine(model)
    assert engine.scheduler.max_queue == cfg.max_queue and engine.config == cfg
    a = AsyncEngine(model)
    try:
        assert a.max_queue == cfg.max_queue and a.max_batch_size == cfg.max_batch_size
    finally:
        a.shutdown()
