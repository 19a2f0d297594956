"""The checkpoint's chat template is checked at load (docs/design.md#checks-at-load): compiled, and rendered once on a
one-message conversation, so a broken ``chat_template.jinja`` is one :class:`CheckpointError` line naming the file
and the Jinja error's line, not a server that starts healthy and answers every chat request with an error.

Where a template comes from (transformers' tokenizer loading): ``chat_template.jinja`` (or
``additional_chat_templates/NAME.jinja`` for a named one), else ``chat_template.json``, else the ``chat_template``
field of ``tokenizer_config.json``.
"""
from __future__ import annotations

from pathlib import Path

from .config import CheckpointError

PROBE = [{"role": "user", "content": "Hello"}]  # the smallest conversation every chat template must render


def template_file(path: Path, name: str | None) -> Path:
    """The file the tokenizer's template ``name`` (None: the default one) was read from."""
    for candidate in ([path / "additional_chat_templates" / f"{name}.jinja"] if name else
                      [path / "chat_template.jinja", path / "chat_template.json"]):
        if candidate.is_file():
            return candidate
    return path / "tokenizer_config.json"


def _jinja_line(exc: BaseException) -> int | None:
    """The template line of a Jinja error: a syntax error's ``lineno``, else the innermost template frame of the
    traceback (Jinja maps its generated code's frames back to template lines, filename ``<template>``)."""
    line = getattr(exc, "lineno", None)
    if isinstance(line, int):
        return line
    tb, found = exc.__traceback__, None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            found = tb.tb_lineno
        tb = tb.tb_next
    return found


def check_chat_template(tokenizer, path: Path) -> None:
    """Compile and render once each of ``tokenizer``'s chat templates (none: nothing to check; chat requests are
    then refused by the server with a 400 naming the fix).

    Raises:
        CheckpointError: ``FILE:LINE: chat template does not compile|render: <Jinja's message>`` in one line.
    """
    templates = getattr(tokenizer, "chat_template", None)
    if not templates:
        return
    named = templates.items() if isinstance(templates, dict) else [(None, templates)]
    for name, text in named:
        where = template_file(Path(path), None if name in (None, "default") else name)
        try:
            from transformers.utils.chat_template_utils import _compile_jinja_template
            stage = "compile"
            _compile_jinja_template(text)
            stage = "render"
            tokenizer.apply_chat_template(PROBE, tokenize=False, add_generation_prompt=True, chat_template=text)
        except ImportError:  # pragma: no cover - jinja2 is a dependency of the package
            return
        except Exception as exc:
            line = _jinja_line(exc)
            label = f" {name!r}" if name not in (None, "default") else ""
            message = " ".join(str(exc).split()) or type(exc).__name__
            raise CheckpointError(f"{where}{f':{line}' if line else ''}: chat template{label} does not {stage} "
                                  f"({type(exc).__name__}: {message})") from None
