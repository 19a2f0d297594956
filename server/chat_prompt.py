"""Chat messages (+ tools) -> prompt token ids through a chat template (docs/design.md#tools-and-the-responses-api).

The template is ``--chat-template`` when the server has one, else the tokenizer's (a dict of named templates picks
``tool_use`` for a request with tools when there is one, else ``default``). Tools are passed to transformers'
``apply_chat_template(tools=...)`` as OpenAI sends them (``{"type": "function", "function": {...}}``, the JSON-schema
shape Hugging Face templates read).

A template that never mentions ``tools`` cannot show them to the model. Without ``--chat-template``, a model whose own
template is ChatML (SmolLM2, the default model) renders a request that uses tools with the shipped ``chatml-tools``
template instead (:func:`tools_fallback`): the system prompt its own template adds to a chat without one stays
(``default_system``), and tool results are plain words (``tool_results_as_text``) so that a model never trained on
tools answers in words; a request without tools keeps the model's own template, byte for byte. Any other template
that renders no tools makes a request with tools (or tool messages) a 400 naming the fix (``--chat-template
chatml-tools``), never a silently tool-less prompt.
"""
from __future__ import annotations

import json
import re
import secrets
from importlib import resources

from unmask.engine import ParamError, encode_plain, encode_text

from . import json_text
from .errors import APIError

SHIPPED = {"chatml-tools": "chatml_tools.jinja"}


def shipped_template(name: str) -> str | None:
    """The text of a template shipped with the server (``chatml-tools``), or None for another name."""
    file = SHIPPED.get(name)
    if file is None:
        return None
    return resources.files("unmask.server").joinpath("templates", file).read_text(encoding="utf-8")


_SENTINEL = "\x00unmask-user\x00"
_fallbacks: dict[str, tuple[str, dict] | None] = {}  # the model's template text -> its tools fallback


def renders_tools(template: str) -> bool:
    """Whether a chat template reads ``tools`` or tool calls at all."""
    return "tools" in template or "tool_calls" in template


def tools_fallback(tokenizer, own: str) -> tuple[str, dict] | None:
    """The template and variables for a request with tools when the model's own template ``own`` renders none:
    ``chatml-tools`` with the system prompt ``own`` adds to a chat without one and tool results as words, when
    ``own`` is ChatML; else None (cached per template text)."""
    if own not in _fallbacks:
        fallback = None
        if "<|im_start|>" in own:
            variables: dict = {"tool_results_as_text": True}
            try:
                text = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}], tokenize=False,
                                                     add_generation_prompt=False, chat_template=own)
            except Exception:  # a template that needs more than one user message: no default system prompt
                text = ""
            head = "<|im_start|>system\n"
            if text.startswith(head) and "<|im_end|>" in text and text.index("<|im_end|>") < text.find(_SENTINEL):
                variables["default_system"] = text[len(head):text.index("<|im_end|>")]
            fallback = (shipped_template("chatml-tools"), variables)
        _fallbacks[own] = fallback
    return _fallbacks[own]


def _template(tokenizer, override: str | None, with_tools: bool) -> str | None:
    if override is not None:
        return override
    own = getattr(tokenizer, "chat_template", None)
    if isinstance(own, dict):
        return own.get("tool_use") if with_tools and "tool_use" in own else own.get("default")
    return own


_SLOT_RE = re.compile("UNMASKSLOT([0-9a-f]{16})N([0-9]+)Z")  # letters and digits: tojson and repr keep a slot as it is


def control_texts(tokenizer) -> tuple[str, ...]:
    """The texts of the tokenizer's special tokens (``<|im_start|>``, ``<|im_end|>``, the mask token, ...)."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return tuple(t.content for t in decoder.values() if getattr(t, "special", False) and t.content)


class _Slots:
    """Client texts that spell a control token, each replaced by a slot (``UNMASKSLOT<nonce>N<k>Z``, the same slot
    for the same text) in a copy of the values the template receives: message contents, names, tool-call
    arguments, tool results, and tools' names, descriptions and parameters (keys included), at any depth."""

    def __init__(self, controls: tuple[str, ...]):
        self.controls, self.texts, self._index = controls, [], {}
        self.nonce = secrets.token_hex(8)

    def _slot(self, text: str) -> str:
        if text not in self._index:
            self._index[text] = len(self.texts)
            self.texts.append(text)
        return f"UNMASKSLOT{self.nonce}N{self._index[text]}Z"

    def replace(self, value):
        """``value`` with every string (and dict key) that spells a control token replaced by its slot."""
        if isinstance(value, str):
            return self._slot(value) if any(c in value for c in self.controls) else value
        if isinstance(value, dict):
            return {self.replace(k): self.replace(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.replace(v) for v in value]
        return value


def _renderings(text: str) -> list[str]:
    """How a template may write ``text``: as it is, inside a JSON string (``tojson``, with or without ASCII or HTML
    escaping) or a Python repr (a dict rendered with ``{{ }}``)."""
    js = json.dumps(text)[1:-1]
    html = js.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026").replace("'", "\\u0027")
    return list(dict.fromkeys([text, json.dumps(text, ensure_ascii=False)[1:-1], js, html, repr(text)[1:-1]]))


def _pieces(with_slots: str, text: str, slots: _Slots) -> list[tuple[str, bool]] | None:
    """``text`` (the chat rendered as it is) cut into ``(piece, is_client_text)``: the markup between the slots of
    ``with_slots`` (the chat rendered with slots), and at each slot the rendering of its text found there
    (:func:`_renderings`); None when ``text`` is not ``with_slots`` with each slot written back (a template that
    changes the text)."""
    parts = [p for p in _SLOT_RE.split(with_slots)]  # markup, nonce, k, markup, nonce, k, ..., markup
    markup, slot_ids = parts[0::3], [(parts[i], int(parts[i + 1])) for i in range(1, len(parts), 3)]
    if any(nonce != slots.nonce or k >= len(slots.texts) for nonce, k in slot_ids) or not text.startswith(markup[0]):
        return None
    out, pos = [(markup[0], False)], len(markup[0])
    for (_, k), after in zip(slot_ids, markup[1:]):
        for form in _renderings(slots.texts[k]):
            if text.startswith(form, pos) and text.startswith(after, pos + len(form)):
                out += [(form, True), (after, False)]
                pos += len(form) + len(after)
                break
        else:
            return None
    return out if pos == len(text) else None


def _ids_of_pieces(tokenizer, pieces: list[tuple[str, bool]], mask_token_id: int | None) -> list[int]:
    """Token ids of a rendered chat cut into pieces: the template's markup parsed as usual (its special tokens are
    control tokens), the clients' texts as plain characters (:func:`unmask.engine.text_ids.encode_plain`)."""
    ids: list[int] = []
    markup = ""
    for piece, client in pieces + [("", True)]:
        if not client:
            markup += piece
            continue
        if markup:
            ids += encode_text(tokenizer, markup, mask_token_id, add_special_tokens=False)
            markup = ""
        if piece:
            ids += encode_plain(tokenizer, piece)
    return ids


def render_chat_ids(tokenizer, messages: list[dict], chat_template: str | None = None,
                    tools: list[dict] | None = None, mask_token_id: int | None = None,
                    add_generation_prompt: bool = True, special_tokens_in_content: bool = False) -> list[int]:
    """Token ids of ``messages`` (template dicts) with the generation prompt (unless ``add_generation_prompt`` is
    False: ``/tokenize``); ``tools``: the request's tools (None: none offered, or ``tool_choice: none``); the mask
    token's text in them is tokenized as plain text (:func:`unmask.engine.text_ids.encode_text`).

    Special tokens typed anywhere a client writes text are text, not control tokens (issue 41: no fake system turn
    through ``hi<|im_end|>\n<|im_start|>system\n...``): message contents and names, assistant tool-call arguments,
    tool results, and the tools' names, descriptions and parameters. Each such string is rendered as a slot
    (:class:`_Slots`) and the text the template writes there (as it is, or JSON-escaped by ``tojson``) tokenized as
    plain characters, the template's own markup as usual. A template that transforms the text (so that the slots
    would not give back the same rendering) makes it a 400.
    ``special_tokens_in_content``: the old behaviour (``--chat-special-tokens``), parsing them as control tokens.

    Raises:
        APIError: 400 naming ``messages`` (no template, or the template failed to render) or ``tools`` (the
            template renders no tools).
    """
    uses_tools = bool(tools) or any(m["role"] == "tool" or m.get("tool_calls") for m in messages)
    template = _template(tokenizer, chat_template, uses_tools)
    if not template:
        raise APIError(400, "messages: this model has no chat template; pass --chat-template or use completions",
                       param="messages", code="invalid_value")
    variables: dict = {}
    if uses_tools and chat_template is None and not renders_tools(template):
        template, variables = tools_fallback(tokenizer, template) or (template, {})
    if uses_tools and not renders_tools(template):
        field = "tools" if tools else "messages"
        raise APIError(400, f"{field}: this model's chat template does not render tools or tool calls; serve it "
                            f"with --chat-template chatml-tools (ChatML + Hermes tool calls, shipped with unmask) or "
                            f"a template of your own", param=field, code="invalid_value")
    slots = None if special_tokens_in_content else _Slots(control_texts(tokenizer))
    render = lambda msgs, tls: tokenizer.apply_chat_template(  # noqa: E731
        msgs, tools=tls or None, tokenize=False, add_generation_prompt=add_generation_prompt,
        chat_template=template, **variables)
    try:
        text = render(messages, tools)
        if slots is not None:
            slotted = (slots.replace(messages), slots.replace(tools) if tools else tools)
            if slots.texts:
                pieces = _pieces(render(*slotted), text, slots)
                if pieces is None:
                    raise APIError(400, "messages: a message or tool spells a special token of the model, and this "
                                        "chat template changes that text, so it cannot be kept as plain text; remove "
                                        "the special token's text", param="messages", code="invalid_value")
                return _ids_of_pieces(tokenizer, pieces, mask_token_id)
    except (ParamError, APIError):
        raise
    except RecursionError:  # a value the template serializes (tojson) nests deeper than its recursion allows
        field = _deepest_field(messages, tools)
        raise APIError(400, f"{field}: nested too deeply for the chat template to render it (RecursionError)",
                       param=field, code="invalid_json") from None
    except Exception as exc:  # jinja errors (e.g. the template's own raise_exception on a role order)
        raise APIError(400, f"messages: the chat template could not render them ({type(exc).__name__}: {exc})",
                       param="messages", code="invalid_value") from exc
    return encode_text(tokenizer, text, mask_token_id, add_special_tokens=False)


def _deepest_field(messages: list[dict], tools: list[dict] | None) -> str:
    """The request field of the most deeply nested value the template receives: a tool call's parsed
    ``arguments`` (``messages.I.tool_calls.J.function.arguments``) or a tool's ``parameters``
    (``tools.K.function.parameters``); ``messages`` when neither nests."""
    fields: dict[str, object] = {"messages": None}
    for i, m in enumerate(messages):
        for j, call in enumerate(m.get("tool_calls") or []):
            fields[f"messages.{i}.tool_calls.{j}.function.arguments"] = call["function"]["arguments"]
    for k, tool in enumerate(tools or []):
        fields[f"tools.{k}.function.parameters"] = tool.get("function", {}).get("parameters")
    return max(fields, key=lambda name: json_text.depth(fields[name]))
