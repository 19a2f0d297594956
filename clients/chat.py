"""``unmask chat``: a multi-turn terminal chat that shows the canvas being denoised (rich ``Live``).

On a terminal the generation region is redrawn in place every step: ``·`` for a masked position, each token at its
position when revealed, coloured by the step that revealed it, the current block underlined and block boundaries
marked ``│``; a status line with step, NFE, TPF and tokens/s, then the final usage. When stdout is not a terminal,
or the server sends no denoising events, the answer is plain streamed text. Either way control characters in the
model's text are shown as visible stand-ins (``stream.printable``), never sent to the terminal.

Ctrl-C stops the current answer (the connection is closed, so the server aborts the request and frees its slot)
and returns to the prompt; Ctrl-D or ``/quit`` leaves. Slash commands set the decoding knobs (``/help``).
"""
from __future__ import annotations

import sys
import time

from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from unmask.engine.limits import REMASKING_STRATEGIES

from .stream import Canvas, Client, ClientError, Delta, Finish, Notice, Step, Usage, printable

PALETTE = ["#5fafff", "#5fd7ff", "#5fffd7", "#87ff87", "#d7ff5f", "#ffd75f", "#ffaf5f", "#ff875f", "#ff5f87",
           "#d75fff", "#af87ff", "#8787ff"]
MASK = "·"

# slash command -> (request field, parser, help)
def _bool(v: str) -> bool:
    v = v.lower()
    if v in ("on", "true", "yes", "1"):
        return True
    if v in ("off", "false", "no", "0"):
        return False
    raise ValueError(f"expected on/off, got {v!r}")


def _opt_float(v: str):
    return None if v.lower() in ("off", "none", "null") else float(v)


KNOBS = {
    "steps": ("steps", int, "total denoising steps"),
    "block": ("block_size", int, "block size"),
    "remasking": ("remasking", str, " | ".join(REMASKING_STRATEGIES)),
    "threshold": ("threshold", _opt_float, "reveal every position with confidence >= T (off: none)"),
    "temperature": ("temperature", float, "0 = argmax"),
    "cfg": ("cfg_scale", float, "classifier-free guidance scale"),
    "speculative": ("speculative", _bool, "self-speculative decoding on/off"),
    "max": ("max_tokens", int, "most tokens per answer"),
}

HELP = ("commands: " + ", ".join(f"/{k} V ({h})" for k, (_, _, h) in KNOBS.items())
        + ", /set FIELD JSON (any request field), /unset NAME, /show, /reset (forget the conversation), /quit. "
          "Ctrl-C stops an answer, Ctrl-D leaves.")


_KINDS = {int: "an integer", float: "a number", _opt_float: "a number or off", _bool: "on or off"}


def check_option(field: str, value) -> str | None:
    """Why unmask would refuse ``field = value`` on its own (its range, e.g. ``must be >= 1, got -3``), or None:
    the same check the server makes (``SamplingParams.from_flat``), made before a question is sent, so a bad knob is
    refused once instead of failing every later answer (break-it). Only plain values (numbers, booleans, strings,
    null) are checked: objects and lists (``logit_bias``, ``stop``) take the HTTP layer's conversions first, so the
    server checks them. Fields unmask does not know (other servers' extras) and rules between fields are left to
    the server too: ``max_tokens`` is taken at its largest when another field is checked (``min_tokens`` <=
    ``max_tokens`` is the server's to judge)."""
    import dataclasses

    from unmask.engine import ParamError, SamplingParams, SpeculativeOptions
    from unmask.engine.limits import MAX_POSITIONS

    known = {f.name for f in dataclasses.fields(SamplingParams)} | {
        f"speculative_{name}" for name in SpeculativeOptions.FIELDS}
    if field not in known or isinstance(value, (dict, list)):
        return None
    fields = {field: value} if field == "max_tokens" else {"max_tokens": MAX_POSITIONS, field: value}
    try:
        SamplingParams.from_flat(**fields)
    except ParamError as exc:
        return exc.reason
    except (TypeError, ValueError) as exc:
        return str(exc)
    return None


def parse_value(text: str):
    """A ``/set`` value: JSON when it parses, else the string."""
    import json

    try:
        return json.loads(text)
    except ValueError:
        return text


def render_canvas(canvas: Canvas, width_hint: int | None = None) -> Text:
    """The canvas as rich ``Text``: masks as ``·``, tokens coloured by their reveal step, the current block
    underlined, provisional tokens (revisable canvases: they may still change) italic and dim, ``│`` before each
    block after the first."""
    out = Text()
    span = canvas.block_span()
    bounds = canvas.boundaries()
    if span is not None and span[0] > 0:
        bounds = bounds | {span[0]}
    size = canvas.block_size
    if size:
        bounds = bounds | {p for p in range(size, len(canvas.cells), size) if span is None or p <= span[0]}
    for p, cell in enumerate(canvas.cells):
        if p in bounds:
            out.append("│", style="grey50")
        current = span is not None and span[0] <= p < span[1]
        if cell is None:
            out.append(MASK, style="bold white on grey23" if current else "grey42")
        else:
            shown = printable(cell.replace("\n", "↵").replace("\t", "→")) or "∅"
            style = PALETTE[(canvas.step_of[p] or 0) % len(PALETTE)]
            if current:
                style += " underline"
            if canvas.provisional(p):
                style += " italic dim"
            if p in canvas.last_revealed:
                style += " bold reverse"
            out.append(shown, style=style)
    return out


class Chat:
    """The chat loop. ``options``: request fields sent with every question (the knobs)."""

    def __init__(self, client: Client, model: str, options: dict, console: Console | None = None,
                 live: bool | None = None, out=None):
        self.client = client
        self.model = model
        self.options = dict(options)
        self.console = console or Console(highlight=False)
        self.out = out or sys.stdout
        self.live = self.console.is_terminal if live is None else live
        self.messages: list[dict] = []
        self.failed = 0   # answers that ended in an error: a piped chat then exits 1

    # ------------------------------------------------------------------ commands
    def command(self, line: str) -> bool:
        """Run a slash command; returns False for ``/quit``."""
        name, _, arg = line[1:].strip().partition(" ")
        arg = arg.strip()
        if name in ("quit", "exit", "q"):
            return False
        if name == "help":
            self.say(HELP)
        elif name == "show":
            self.say(f"model {self.model}; options {self.options or '{}'}")
        elif name == "reset":
            self.messages.clear()
            self.say("conversation cleared")
        elif name == "unset":
            field = KNOBS.get(arg, (arg,))[0]
            self.options.pop(field, None)
            self.say(f"{field}: server default")
        elif name == "set":
            field, _, value = arg.partition(" ")
            if not field or not value:
                self.say("usage: /set FIELD VALUE  (VALUE as JSON, e.g. /set top_k 5)")
            else:
                self._set(f"/set {field}", field, parse_value(value.strip()))
        elif name in KNOBS:
            field, conv, helptext = KNOBS[name]
            if not arg:
                self.say(f"{field} = {self.options.get(field, 'server default')!r}  ({helptext})")
            else:
                try:
                    value = conv(arg)
                except ValueError:
                    self.say(f"/{name}: expected {_KINDS.get(conv, 'a value')}, got {arg!r}; not set")
                else:
                    self._set(f"/{name}", field, value)
        else:
            self.say(f"unknown command /{name}; /help lists them")
        return True

    def _set(self, command: str, field: str, value) -> None:
        """Set ``field`` for the next questions unless unmask would refuse the value (then say why)."""
        why = check_option(field, value)
        if why is not None:
            self.say(f"{command}: {why}; not set")
        else:
            self.options[field] = value
            self.say(f"{field} = {value!r}")

    def _status(self) -> int:
        """The exit status: 1 when piped input had an answer fail (a script sees it), else 0."""
        return 1 if self.failed and not self.live else 0

    def say(self, text: str, style: str = "grey62") -> None:
        if self.live:
            self.console.print(printable(text), style=style, markup=False, highlight=False)
        else:
            print(printable(text), file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ one answer
    def ask(self, question: str) -> str | None:
        """Send ``question``; show the answer; returns its text (None when stopped or failed)."""
        self.messages.append({"role": "user", "content": question})
        text, ok = "", False
        try:
            text, ok = (self._ask_live if self.live else self._ask_plain)()
        except KeyboardInterrupt:
            self.say("(stopped)", style="yellow")
        except ClientError as exc:
            self.failed += 1
            self.say(f"error: {exc}", style="bold red")
        if ok:
            self.messages.append({"role": "assistant", "content": text})
            return text
        self.messages.pop()   # a stopped or failed turn is not part of the conversation
        return None

    def _stream(self):
        return self.client.chat(self.model, self.messages, self.options)

    def _ask_plain(self) -> tuple[str, bool]:
        text, usage = "", None
        gen = self._stream()
        try:
            for ev in gen:
                if isinstance(ev, Delta):
                    text += ev.text
                    self.out.write(printable(ev.text))
                    self.out.flush()
                elif isinstance(ev, Notice):
                    self.say(ev.message)
                elif isinstance(ev, Usage):
                    usage = ev.usage
        finally:
            gen.close()
            self.out.write("\n")
            self.out.flush()
        if usage:
            self.say(usage_line(usage, None))
        return text, True

    def _ask_live(self) -> tuple[str, bool]:
        canvas = Canvas(block_size=self.options.get("block_size"))
        text, usage, finish, stepped = "", None, None, False
        started = time.monotonic()

        def view():
            if not stepped:  # no denoising events (yet): plain text
                return Text(printable(text) or "…")
            status = Text(canvas.status(), style="bold cyan")
            return Group(render_canvas(canvas), status)

        gen = self._stream()
        try:
            with Live(view(), console=self.console, refresh_per_second=20, auto_refresh=False,
                      transient=False) as live:
                for ev in gen:
                    if isinstance(ev, Step):
                        if ev.denoising.get("index", 0) == 0:
                            stepped = True
                            canvas.update(ev.denoising)
                    elif isinstance(ev, Delta):
                        text += ev.text
                    elif isinstance(ev, Notice):
                        live.console.print(printable(ev.message), style="grey62", markup=False)
                    elif isinstance(ev, Usage):
                        usage = ev.usage
                    elif isinstance(ev, Finish):
                        finish = ev.reason
                    live.update(view(), refresh=True)
                if stepped:
                    canvas.last_revealed = []
                    if finish is not None:  # finished, not interrupted: nothing fills the rest
                        canvas.drop_unrevealed_tail()
                    live.update(Group(render_canvas(canvas), Text(canvas.status(), style="bold cyan")), refresh=True)
        finally:
            gen.close()
        if stepped:
            self.console.print(Text(printable(text)), style="bold")
        if usage or finish:
            self.console.print(usage_line(usage, time.monotonic() - started, finish), style="green", markup=False)
        return text, True

    # ------------------------------------------------------------------ loop
    def read(self) -> str:
        if self.live:
            return self.console.input("[bold magenta]you>[/] ")
        return input()

    def loop(self) -> int:
        if self.live:
            self.say(f"unmask chat with {self.model} at {self.client.base_url}; /help for commands, Ctrl-D leaves")
        while True:
            try:
                line = self.read()
            except EOFError:
                if self.live:
                    self.console.print()
                return self._status()
            except KeyboardInterrupt:
                self.say("(Ctrl-D or /quit leaves)")
                continue
            line = line.strip()
            if not line:
                continue
            if line.startswith("/"):
                if not self.command(line):
                    return self._status()
                continue
            self.ask(line)


def usage_line(usage: dict | None, seconds: float | None, finish: str | None = None) -> str:
    parts = []
    if usage:
        done = usage.get("completion_tokens", 0)
        parts.append(f"{usage.get('prompt_tokens', 0)} prompt + {done} completion tokens")
        if usage.get("nfe"):
            parts.append(f"NFE {usage['nfe']}, TPF {done / usage['nfe']:.2f}")
        if usage.get("denoising_steps") is not None:
            parts.append(f"{usage['denoising_steps']} steps")
        if seconds:
            parts.append(f"{done / seconds:.1f} tok/s")
    if finish:
        parts.append(f"finish {finish}")
    return "usage: " + "; ".join(parts)
