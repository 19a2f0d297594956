"""``POST /tokenize``, ``POST /detokenize`` and ``GET /version`` in vLLM's request and response shapes
(docs/design.md#http-contract); behind the API key like ``/v1/*`` (:mod:`unmask.server.guard`).

* ``/tokenize``: ``{"prompt", "add_special_tokens": true}`` (the ids ``/v1/completions`` would use for that prompt)
  or ``{"messages", "tools"?, "add_generation_prompt": true}`` (the ids ``/v1/chat/completions`` would use); both
  take ``model`` (optional; another name is a 404) and ``return_token_strs`` -> ``{"count", "max_model_len",
  "tokens", "token_strs"}`` (``token_strs``: the tokenizer's token strings, or null).
* ``/detokenize``: ``{"tokens"}`` -> ``{"prompt"}`` (special tokens kept, as vLLM's).
* ``/version``: ``{"version"}``, the installed unmask's.
"""
from __future__ import annotations

from typing import Annotated

import anyio
from fastapi import APIRouter, Request
from pydantic import BaseModel, Discriminator, Field, Tag, model_validator

from unmask.engine import encode_text
from unmask.engine.limits import MAX_MESSAGES, MAX_NAME_CHARS

from .errors import APIError, check_model
from .messages import ChatMessage
from .prompt_input import chat_ids, check_chars
from .tool_protocol import MAX_TOOLS, RequestBody, Text, Tool, check_tool_messages, integral_fields

router = APIRouter()


class _Tokenize(RequestBody):
    model: str | None = Field(None, max_length=MAX_NAME_CHARS, description="the served id (optional)")
    return_token_strs: bool | None = Field(False, description="also return the tokenizer's token strings")


class TokenizeCompletionRequest(_Tokenize):
    """``/tokenize`` of a completions prompt."""

    prompt: Text
    add_special_tokens: bool = Field(True, description="the tokenizer's special tokens (e.g. BOS), as "
                                                       "/v1/completions adds them")


class TokenizeChatRequest(_Tokenize):
    """``/tokenize`` of chat messages, rendered by the chat template as ``/v1/chat/completions`` renders them."""

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _tool_messages(self):
        check_tool_messages(self.messages)  # every tool message answers an earlier call, as chat's rule
        return self


def _form(v) -> str:
    """The member of a ``/tokenize`` body: chat when it has ``messages``, else a completions prompt."""
    return "Chat" if isinstance(v, dict) and "messages" in v or isinstance(v, TokenizeChatRequest) else "Prompt"


TokenizeRequest = Annotated[Annotated[TokenizeChatRequest, Tag("Chat")]
                            | Annotated[TokenizeCompletionRequest, Tag("Prompt")], Discriminator(_form)]


class TokenizeResponse(BaseModel):
    """vLLM's tokenize response."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestBody):
    """``/detokenize``: token ids -> text."""

    model: str | None = Field(None, max_length=MAX_NAME_CHARS)
    tokens: list[Annotated[int, Field(ge=0)]]

    @model_validator(mode="before")
    @classmethod
    def _integers(cls, data):
        return integral_fields(data, {"tokens"})  # 7.0 is the integer 7, as in the schema


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


def _state(request: Request):
    return request.app.state.unmask


def _model(state, name: str | None) -> None:
    check_model(name, state.model_name)


@router.post("/tokenize", response_model=TokenizeResponse)
async def tokenize(body: TokenizeRequest, request: Request):
    """Token ids of a completions prompt or of chat messages (vLLM's ``/tokenize``)."""
    state = _state(request)
    _model(state, body.model)
    tok, mask_id = state.tokenizer, state.engine.dllm.mask_token_id
    if isinstance(body, TokenizeChatRequest):
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        ids = await chat_ids(state, [m.as_template_dict() for m in body.messages], tools,
                             add_generation_prompt=body.add_generation_prompt)
    else:
        check_chars(state, "prompt", len(body.prompt))
        ids = await anyio.to_thread.run_sync(lambda: encode_text(tok, body.prompt, mask_id, body.add_special_tokens))
    strs = tok.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=state.max_context, tokens=ids, token_strs=strs)


@router.post("/detokenize", response_model=DetokenizeResponse)
async def detokenize(body: DetokenizeRequest, request: Request):
    """The text of token ids (vLLM's ``/detokenize``; an id outside the vocabulary is a 400 naming ``tokens``)."""
    state = _state(request)
    _model(state, body.model)
    vocab = len(state.tokenizer)
    bad = next((i for i, t in enumerate(body.tokens) if t >= vocab), None)
    if bad is not None:
        raise APIError(400, f"tokens.{bad}: token id {body.tokens[bad]} is outside the vocabulary [0, {vocab})",
                       param=f"tokens.{bad}", code="invalid_value")
    text = await anyio.to_thread.run_sync(lambda: state.tokenizer.decode(body.tokens))
    return DetokenizeResponse(prompt=text)


@router.get("/version", response_model=VersionResponse)
async def version():
    """The installed unmask's version (vLLM's ``/version``)."""
    from importlib.metadata import PackageNotFoundError, version as installed

    try:
        return VersionResponse(version=installed("unmask"))
    except PackageNotFoundError:  # pragma: no cover - run from a source tree that was never installed
        return VersionResponse(version="unknown")
