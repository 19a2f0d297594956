"""Command-line options generated from the configuration objects (``unmask.engine.options.option`` metadata on
``EngineConfig``, ``ServerConfig``, ``TrainConfig``): the ``argparse`` options, their ``UNMASK_*`` variables, the
configs built back from the parsed namespace, and the table ``unmask options`` prints (docs/design.md#layout-and-layers).

Environment: every option whose :class:`~unmask.engine.options.Option` has ``env`` (serve's) defaults to
``UNMASK_<NAME>`` (``--max-batch-size`` is ``UNMASK_MAX_BATCH_SIZE``; the positional MODEL is ``UNMASK_MODEL``); the
value is typed once parsing shows the command line did not set it (:func:`resolve_env`), so an error about it names
the variable (:func:`option_name`); ``UNMASK_*`` variables that name no option are listed by :func:`unknown_env`.
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from unmask.engine.options import Option, options_of

ENV_PREFIX = "UNMASK_"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
_TYPES = {"int": int, "float": float, "str": None, "bool": None}

# UNMASK_* variables that are not serve options: read elsewhere (the cache root, the default model's adapter switch,
# `unmask chat`'s server, `unmask eval`'s checkout) or by the compose files' interpolation (docs/deploy.md).
OTHER_VARIABLES = frozenset({"UNMASK_HOME", "UNMASK_DEFAULT_ADAPTER", "UNMASK_BASE_URL", "UNMASK_REPO",
                             "UNMASK_DOCKERFILE", "UNMASK_IMAGE", "UNMASK_PUBLISH", "UNMASK_REPLICAS"})


def flag_of(f: dataclasses.Field, opt: Option) -> str:
    """The option's flag (``--max-batch-size``), or a positional's name (``model``)."""
    if opt.positional:
        return f.name
    return opt.flag or "--" + f.name.replace("_", "-")


def value_type(f: dataclasses.Field):
    """The converter of a field's flag text from its annotation (``int | None`` -> int; str, bool, lists -> None)."""
    kind = str(f.type).split("|")[0].strip()
    return _TYPES.get(kind)


def field_default(f: dataclasses.Field) -> Any:
    """The field's default (its factory's value), or None for a required field."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def add_options(parser: argparse.ArgumentParser, *classes, environ=None) -> None:
    """Add every command-line field of the config ``classes`` to ``parser`` (in field order); with ``environ``, the
    options whose metadata has ``env`` default to their variables (:func:`env_defaults`). Each action records its
    source field (``action.source = "EngineConfig.max_queue"``) and its parse function."""
    for cls in classes:
        for f, opt in options_of(cls):
            if not opt.cli:
                continue
            kw: dict[str, Any] = {"help": opt.help or None}
            if opt.positional:
                action = parser.add_argument(f.name, nargs="?", default=field_default(f), **kw)
            else:
                kw.update(dest=f.name)
                if opt.action == "negatable":
                    kw.update(action=argparse.BooleanOptionalAction, default=field_default(f))
                elif opt.action in ("store_true", "store_false"):
                    kw.update(action=opt.action)
                else:
                    kw.update(default=field_default(f), type=None if opt.parse else value_type(f),
                              required=opt.required)
                    if opt.choices is not None:  # a callable: names known once the command runs (a registry)
                        kw["choices"] = list(opt.choices() if callable(opt.choices) else opt.choices)
                    for name in ("metavar", "nargs"):
                        if getattr(opt, name) is not None:
                            kw[name] = getattr(opt, name)
                action = parser.add_argument(flag_of(f, opt), **kw)
            action.source, action.parse, action.env = f"{cls.__name__}.{f.name}", opt.parse, opt.env
    if environ is not None:
        env_defaults(parser, environ)


class _LazyOptionsParser(argparse.ArgumentParser):
    """A sub-parser whose options are added when it is first used (parsing, help): a command whose config module
    imports torch keeps ``unmask --help`` and the other commands instant (:func:`add_options_lazily`)."""

    def load_options(self) -> argparse.ArgumentParser:
        load, self._load_options = getattr(self, "_load_options", None), None
        if load is not None:
            add_options(self, *load())
        return self

    def _parse_known_args(self, *args, **kwargs):
        self.load_options()
        return super()._parse_known_args(*args, **kwargs)

    def format_usage(self):
        return self.load_options() and super().format_usage()

    def format_help(self):
        return self.load_options() and super().format_help()


def add_options_lazily(parser: argparse.ArgumentParser, load) -> argparse.ArgumentParser:
    """Add the options of the config classes ``load()`` returns to ``parser`` when it is first used (its class
    becomes :class:`_LazyOptionsParser`; ``parser.load_options()`` adds them at once). Returns ``parser``."""
    parser.__class__ = _LazyOptionsParser
    parser._load_options = load
    return parser


def config_from_args(cls, args: argparse.Namespace, **overrides):
    """An instance of config ``cls`` from the parsed ``args`` (its command-line fields; ``overrides`` for the
    others), each ``parse`` function applied.

    Raises:
        UsageError: a ``parse`` function refused the text (names the flag, or the variable it came from).
    """
    from unmask.cli import UsageError

    values = {}
    for f, opt in options_of(cls):
        if not opt.cli or not hasattr(args, f.name):
            continue
        value = getattr(args, f.name)
        if opt.parse is not None and isinstance(value, str):
            try:
                value = opt.parse(value)
            except ValueError as exc:
                raise UsageError(f"{option_name(args, f.name, flag_of(f, opt))}: {exc}") from None
        values[f.name] = value
    return cls(**{**values, **overrides})


def option_rows(command: str, *classes) -> list[tuple[str, str, str, str]]:
    """``(flag, variable, default, source field)`` of every command-line option of ``classes``: the table of
    ``unmask options`` (the variable ``-`` where the option has none)."""
    rows = []
    for cls in classes:
        for f, opt in options_of(cls):
            if not opt.cli:
                continue
            flag = flag_of(f, opt)
            var = env_var(f.name if opt.positional else flag) if opt.env else "-"
            default = "(required)" if opt.required else repr(field_default(f))
            rows.append(("MODEL" if opt.positional and f.name == "model" else flag, var, default,
                         f"{cls.__name__}.{f.name}"))
    return rows


# ------------------------------------------------------------------ environment variables
def env_var(flag_or_name: str) -> str:
    """``--max-batch-size`` -> ``UNMASK_MAX_BATCH_SIZE``; ``model`` -> ``UNMASK_MODEL``."""
    return ENV_PREFIX + flag_or_name.lstrip("-").upper().replace("-", "_")


def env_name(action: argparse.Action) -> str:
    """The environment variable of an option (``--max-batch-size`` -> ``UNMASK_MAX_BATCH_SIZE``) or of the
    positional ``model`` (``UNMASK_MODEL``)."""
    longs = [o for o in action.option_strings if o.startswith("--")]
    return env_var(longs[0] if longs else action.dest)


class EnvValue:
    """An option's default taken from the environment, converted by :func:`resolve_env` once parsing shows the
    command line did not set it (so a bad variable fails only the command that reads it)."""

    def __init__(self, var: str, raw: str, action: argparse.Action):
        self.var, self.raw, self.action = var, raw, action

    def __repr__(self) -> str:
        return f"${self.var}={self.raw!r}"


def _env_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The actions of ``parser`` that read a variable: not ``--help``, not an option declared without ``env``."""
    return [a for a in parser._actions if not isinstance(a, argparse._HelpAction) and a.dest != argparse.SUPPRESS
            and getattr(a, "env", True)]


def env_defaults(parser: argparse.ArgumentParser, environ) -> None:
    """Make every option of ``parser`` that reads a variable default to it when that is set (:func:`env_name`);
    the values are typed by :func:`resolve_env`."""
    for action in _env_actions(parser):
        var = env_name(action)
        if var in environ:
            action.default = EnvValue(var, environ[var], action)


def unknown_env(parser: argparse.ArgumentParser, environ) -> list[tuple[str, str | None]]:
    """``UNMASK_*`` variables in ``environ`` that neither name an option of ``parser`` nor one of
    :data:`OTHER_VARIABLES`, each with the closest known name (``difflib``) or None: a misspelt variable would
    otherwise be ignored without a word (``UNMASK_PROT=8005`` serving on 8000)."""
    import difflib

    known = {env_name(a) for a in _env_actions(parser)} | OTHER_VARIABLES
    out = []
    for var in sorted(v for v in environ if v.startswith(ENV_PREFIX) and v not in known):
        close = difflib.get_close_matches(var, sorted(known), n=1, cutoff=0.75)
        out.append((var, close[0] if close else None))
    return out


def _convert(value: EnvValue):
    """The typed value of one environment default.

    Raises:
        UsageError: naming the variable: not of the option's type, not one of its choices, not a switch value.
    """
    from unmask.cli import UsageError

    a, raw = value.action, value.raw.strip()
    if a.nargs == 0:  # store_true / store_false
        if raw.lower() not in _TRUE + _FALSE:
            raise UsageError(f"${value.var}: expected one of 1/0/true/false/yes/no/on/off, got {value.raw!r}")
        on = raw.lower() in _TRUE
        if isinstance(a, argparse.BooleanOptionalAction):  # --x / --no-x: the value is the switch itself
            return on
        return on if a.const is True else (not on if a.const is False else (a.const if on else None))
    items = [x.strip() for x in raw.split(",") if x.strip()] if a.nargs in ("*", "+") else [raw]
    out = []
    for item in items:
        try:
            v = a.type(item) if a.type is not None else item
        except (TypeError, ValueError):
            kind = getattr(a.type, "__name__", "value")
            raise UsageError(f"${value.var}: expected {'an' if kind[0] in 'aeiou' else 'a'} {kind}, got "
                             f"{value.raw!r}") from None
        if a.choices is not None and v not in a.choices:
            raise UsageError(f"${value.var}: must be one of {', '.join(map(str, a.choices))}; got {item!r}")
        out.append(v)
    return out if a.nargs in ("*", "+") else out[0]


def resolve_env(args: argparse.Namespace) -> argparse.Namespace:
    """Replace every :class:`EnvValue` left in ``args`` (options the command line did not set) by its typed value,
    and record where each came from in ``args.env_origins`` (dest -> variable; :func:`option_name` reads it).

    Raises:
        UsageError: a variable's value does not fit its option (the message names the variable).
    """
    origins = dict(getattr(args, "env_origins", None) or {})
    for key, value in vars(args).items():
        if isinstance(value, EnvValue):
            setattr(args, key, _convert(value))
            origins[key] = value.var
    args.env_origins = origins
    return args


def option_name(args: argparse.Namespace, dest: str, flag: str | None = None) -> str:
    """What an error about option ``dest`` names: ``$UNMASK_<OPTION>`` when its value came from the environment
    (:func:`resolve_env`), else the flag (``--prefill-chunk``, or ``flag`` where it is not the field's name;
    ``MODEL`` for the positional), so that a bad ``UNMASK_PREFILL_CHUNK=-3`` is not blamed on a flag nobody
    typed."""
    var = (getattr(args, "env_origins", None) or {}).get(dest)
    if var is not None:
        return f"${var}"
    if flag is not None and flag.startswith("--"):
        return flag
    return "MODEL" if dest == "model" else "--" + dest.replace("_", "-")


def name_option(args: argparse.Namespace, message: str, names) -> str:
    """``message`` (a config or load error such as ``max_queue: must be >= 1, got 0``) with its leading field name
    replaced by what the user set (:func:`option_name`: the flag, or the variable) when it is one of ``names``."""
    head, sep, rest = message.partition(": ")
    if sep and head in names and hasattr(args, head):
        return f"{option_name(args, head)}: {rest}"
    return message
