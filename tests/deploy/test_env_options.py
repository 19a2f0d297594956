"""Every ``unmask serve`` option is settable by environment with one rule (docs/deploy.md): ``--max-batch-size`` ->
``UNMASK_MAX_BATCH_SIZE``, typed as the option, the command line winning, a bad value an error naming the
variable."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from unmask.cli import UsageError
from unmask.cli.main import build_parser, main
from unmask.cli.serve import env_name, resolve_env


def _parse(argv, monkeypatch, env):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return resolve_env(build_parser().parse_args(["serve", *argv]))


def _serve_actions():
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return [a for a in sub.choices["serve"]._actions if not isinstance(a, argparse._HelpAction)]


def test_the_rule_names_each_option():
    names = {a.dest: env_name(a) for a in _serve_actions()}
    assert names["max_batch_size"] == "UNMASK_MAX_BATCH_SIZE"
    assert names["api_key"] == "UNMASK_API_KEY" and names["model"] == "UNMASK_MODEL"
    assert len(set(names.values())) == len(names)  # no two options share a variable


def test_environment_values_are_typed_and_the_command_line_wins(monkeypatch):
    env = {"UNMASK_MAX_BATCH_SIZE": "8", "UNMASK_REQUEST_TIMEOUT": "2.5", "UNMASK_CORS_ORIGINS": "http://a, http://b",
           "UNMASK_CACHE": "prefix", "UNMASK_MODEL": "/models/x", "UNMASK_HOST": "0.0.0.0", "UNMASK_API_KEY": "k"}
    args = _parse([], monkeypatch, env)
    assert args.max_batch_size == 8 and isinstance(args.max_batch_size, int)
    assert args.request_timeout == 2.5 and args.cors_origins == ["http://a", "http://b"]
    assert (args.cache, args.model, args.host, args.api_key) == ("prefix", "/models/x", "0.0.0.0", "k")
    args = _parse(["/cli/model", "--max-batch-size", "4", "--cache", "none"], monkeypatch, env)
    assert (args.max_batch_size, args.cache, args.model) == (4, "none", "/cli/model")
    assert args.port == 8000  # unset variables keep the option's default


def test_every_option_reads_its_variable(monkeypatch):
    """Each option, whoever added it, follows the rule: a sample value of its type round-trips."""
    for a in _serve_actions():
        if a.nargs == 0:  # a switch; --x/--no-x (BooleanOptionalAction) has no const: "1" is True
            raw, want = "1", True if isinstance(a, argparse.BooleanOptionalAction) else a.const
        elif a.choices:
            raw, want = str(list(a.choices)[-1]), list(a.choices)[-1]
        elif a.type in (int, float):
            raw, want = "3", a.type("3")
        else:
            raw, want = "sample", "sample"
        if a.nargs in ("*", "+"):
            want = [want]
        with monkeypatch.context() as m:
            args = _parse([], m, {env_name(a): raw})
            assert getattr(args, a.dest) == want, (a.dest, env_name(a))


@pytest.mark.parametrize("var, value, says", [
    ("UNMASK_MAX_BATCH_SIZE", "eight", "expected an int"),
    ("UNMASK_REQUEST_TIMEOUT", "soon", "expected a float"),
    ("UNMASK_CACHE", "bogus", "must be one of auto, none, prefix, dual"),
    ("UNMASK_LOG_LEVEL", "loud", "must be one of"),
])
def test_a_bad_value_is_an_error_naming_the_variable(monkeypatch, var, value, says):
    with pytest.raises(UsageError) as e:
        _parse([], monkeypatch, {var: value})
    assert f"${var}" in str(e.value) and says in str(e.value)


def test_serve_exits_2_naming_the_variable_before_loading_anything(monkeypatch, capsys):
    monkeypatch.setenv("UNMASK_PORT", "http")
    assert main(["serve", "/nonexistent"]) == 2
    assert "$UNMASK_PORT: expected an int, got 'http'" in capsys.readouterr().err


def test_the_command_line_overrides_a_bad_variable(monkeypatch):
    monkeypatch.setenv("UNMASK_PORT", "http")
    args = build_parser().parse_args(["serve", "--port", "9000"])
    assert resolve_env(args).port == 9000


DEPLOY_MD = Path(__file__).resolve().parents[2] / "docs" / "deploy.md"
IMAGE_DEFAULTS = {"host": "`0.0.0.0` (set by the image)", "model": "the default model"}


def env_table_rows() -> list[str]:
    """docs/deploy.md's table of variables, one row per ``unmask serve`` option: variable, option, type, default
    (the image's where it sets one)."""
    rows = []
    for a in _serve_actions():
        opt = "`" + (" / ".join(o for o in a.option_strings if o.startswith("--")) or "MODEL") + "`"
        if a.dest in IMAGE_DEFAULTS:
            default = IMAGE_DEFAULTS[a.dest]
        elif a.default is None:
            default = "unset"
        elif isinstance(a.default, bool):
            default = "on" if a.default else "off"
        else:
            default = f"`{a.default}`" if a.default != "" else '`""`'
        kind = ("switch" if a.nargs == 0 else "list" if a.nargs in ("*", "+")
                else " \\| ".join(map(str, a.choices)) if a.choices
                else {int: "int", float: "float"}.get(a.type, "string"))
        rows.append(f"| `{env_name(a)}` | {opt} | {kind} | {default} |")
    return rows


def test_docs_deploy_lists_every_variable():
    """The table in docs/deploy.md is the parser's, row for row (an option added later gets its row here)."""
    documented = [line for line in DEPLOY_MD.read_text().splitlines() if line.startswith("| `UNMASK_")]
    expected = env_table_rows()
    assert documented == expected, "docs/deploy.md's table of variables should be:\n" + "\n".join(expected)
