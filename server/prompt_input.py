"""Prompts to token ids without stalling the event loop (docs/design.md#threading-model and #admission-and-limits).

Lengths that can never fit the context are refused first, from the request alone: a text longer than
``state.max_prompt_chars`` characters (the context x the longest vocabulary entry,
:func:`unmask.engine.limits.prompt_chars_limit`) or a token-id prompt with ``>= max_context`` ids is a 400 naming
the field before anything is tokenized. Templating and tokenizing then run in a worker thread
(``anyio.to_thread``), so that a 2 MB prompt or a slow chat template never holds up other streams or ``/health``.

Errors: :class:`~unmask.server.errors.APIError` 400 naming ``prompt`` / ``prompt.N`` /
``messages.N.content`` / ``messages``; the engine's :class:`~unmask.engine.ParamError` passes through.
"""
from __future__ import annotations

import anyio

from unmask.engine import encode_prompt

from .chat_prompt import render_chat_ids
from .errors import APIError

FALLBACK_TOKEN_CHARS = 1024  # characters per token assumed when the tokenizer lists no vocabulary


def longest_token_chars(tokenizer) -> int:
    """Characters of the longest vocabulary entry (an upper bound on the text one token covers)."""
    try:
        return max(len(t) for t in tokenizer.get_vocab())
    except Exception:  # a tokenizer without a vocabulary listing
        return FALLBACK_TOKEN_CHARS


def check_chars(state, name: str, chars: int) -> None:
    """400 naming ``name`` when ``chars`` characters surely exceed the context (checked before tokenizing)."""
    if chars > state.max_prompt_chars:
        raise APIError(400, f"{name}: {chars} characters cannot fit the model's context of {state.max_context} "
                            f"tokens (no token of this model covers more than "
                            f"{state.max_prompt_chars // state.max_context} characters)", param=name,
                       code="invalid_value")


async def completion_ids(state, prompts: list[str | list[int]]) -> list[list[int]]:
    """The token ids of each completions prompt (strings tokenized in a worker thread; ids are checked against the
    vocabulary by the engine)."""
    for i, prompt in enumerate(prompts):
        name = "prompt" if len(prompts) == 1 else f"prompt.{i}"
        if isinstance(prompt, str):
            check_chars(state, name, len(prompt))
        elif len(prompt) >= state.max_context:
            raise APIError(400, f"{name}: {len(prompt)} token ids leave no room to generate in the model's context "
                                f"of {state.max_context} tokens", param=name, code="invalid_value")
    mask_id = state.engine.dllm.mask_token_id  # its text is tokenized as plain text (unmask.engine.text_ids)
    return await anyio.to_thread.run_sync(lambda: [encode_prompt(state.tokenizer, p, mask_id) for p in prompts])


async def chat_ids(state, messages: list[dict], tools: list[dict] | None = None,
                   add_generation_prompt: bool = True) -> list[int]:
    """The rendered chat's token ids (template and tokenizer in a worker thread, through
    :func:`unmask.server.chat_prompt.render_chat_ids`). ``messages``: the template dicts of
    ``ChatMessage.as_template_dict``; ``tools``: the request's tools for the template (None: none);
    ``add_generation_prompt``: False only for ``/tokenize``."""
    longest = max(range(len(messages)), key=lambda i: len(messages[i]["content"]))  # named in the 400
    check_chars(state, f"messages.{longest}.content", sum(len(m["content"]) for m in messages))
    return await anyio.to_thread.run_sync(render_chat_ids, state.tokenizer, messages, state.chat_template, tools,
                                          state.engine.dllm.mask_token_id, add_generation_prompt,
                                          state.config.chat_special_tokens)
