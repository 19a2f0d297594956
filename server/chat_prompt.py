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

import re
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


_SLOT = "\x00unmask-content-{}\x00"
_SLOT_RE = re.compile("\x00unmask-content-(\\d+)\x00")
_FIELDS = ("content", "name")  # the message fields a client writes as text


def control_texts(tokenizer) -> tuple[str, ...]:
    """The texts of the tokenizer's special tokens (``<|im_start|>``, ``<|im_end|>``, the mask token, ...)."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return tuple(t.content for t in decoder.values() if getattr(t, "special", False) and t.content)


def _slotted(messages: list[dict], controls: tuple[str, ...]) -> tuple[list[dict], list[str]] | None:
    """``messages`` with every text field that spells a control token replaced by a slot, and those texts (slot
    ``k`` holds ``texts[k]``); None when no text field spells one (the common case: rendered as it is)."""
    texts: list[str] = []
    out = []
    for m in messages:
        m2 = dict(m)
        for field in _FIELDS:
            value = m.get(field)
            if isinstance(value, str) and any(c in value for c in controls):
                m2[field] = _SLOT.format(len(texts))
                texts.append(value)
        out.append(m2)
    return (out, texts) if texts else None


def _ids_with_text_slots(tokenizer, text: str, texts: list[str], mask_token_id: int | None) -> list[int]:
    """Token ids of a rendered chat whose slots hold the clients' texts: the template's markup between the slots
    parsed as usual (its special tokens are control tokens), each slot's text as plain characters
    (:func:`unmask.engine.text_ids.encode_plain`)."""
    ids: list[int] = []
    pos = 0
    for match in _SLOT_RE.finditer(text):
        if match.start() > pos:
            ids += encode_text(tokenizer, text[pos:match.start()], mask_token_id, add_special_tokens=False)
        ids += encode_plain(tokenizer, texts[int(match.group(1))])
        pos = match.end()
    if pos < len(text):
        ids += encode_text(tokenizer, text[pos:], mask_token_id, add_special_tokens=False)
    return ids


def render_chat_ids(tokenizer, messages: list[dict], chat_template: str | None = None,
                    tools: list[dict] | None = None, mask_token_id: int | None = None,
                    add_generation_prompt: bool = True, special_tokens_in_content: bool = False) -> list[int]:
    """Token ids of ``messages`` (template dicts) with the generation prompt (unless ``add_generation_prompt`` is
    False: ``/tokenize``); ``tools``: the request's tools (None: none offered, or ``tool_choice: none``); the mask
    token's text in them is tokenized as plain text (:func:`unmask.engine.text_ids.encode_text`).

    Special tokens typed inside a message's ``content`` or ``name`` are text, not control tokens (issue 41: no fake
    system turn through ``hi<|im_end|>\n<|im_start|>system\n...``): such a message is rendered with a slot in its
    place and the slot's text tokenized as plain characters, the template's own markup as usual. A template that
    transforms the text (so that the slots would not give back the same rendering) makes it a 400.
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
    slotted = None if special_tokens_in_content else _slotted(messages, control_texts(tokenizer))
    render = lambda msgs: tokenizer.apply_chat_template(  # noqa: E731
        msgs, tools=tools or None, tokenize=False, add_generation_prompt=add_generation_prompt,
        chat_template=template, **variables)
    try:
        text = render(messages)
        if slotted is not None:
            with_slots = render(slotted[0])
            if _SLOT_RE.sub(lambda m: slotted[1][int(m.group(1))], with_slots) != text:
                raise APIError(400, "messages: a message spells a special token of the model, and this chat "
                                    "template changes message text, so it cannot be kept as plain text; remove "
                                    "the special token's text", param="messages", code="invalid_value")
            return _ids_with_text_slots(tokenizer, with_slots, slotted[1], mask_token_id)
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
