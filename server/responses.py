"""Response bodies and stream chunks of the OpenAI-compatible API: one pydantic model per shape
(docs/design.md#http-contract and #decisions).

The non-streamed bodies (and the model list, the error body) feed the OpenAPI schema and are what the routes send:
``model.model_dump()``, every field present (``"refusal": null``, ``"logprobs": null``). The stream chunks are
serialised with ``model_dump(exclude_unset=True)``: a field given (even as ``None``) is sent, one not given is
absent. That is how a chunk says "no usage field" (``stream_options.include_usage`` off) apart from
``"usage": null`` (on), and how a denoising chunk carries no ``logprobs``; so every field of a chunk model is
given explicitly when it is built (:mod:`unmask.server.render`).
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, model_serializer

FinishReason = Literal["stop", "length", "tool_calls"]


class PromptTokensDetails(BaseModel):
    """``cached_tokens``: prompt tokens whose KV came from the prefix cache (docs/design.md#prefix-reuse)."""

    cached_tokens: int = 0


class Usage(BaseModel):
    """Token counts (``prompt_tokens + completion_tokens == total_tokens``); completion tokens count up to and
    including the first EOS; ``prompt_tokens_details.cached_tokens`` as OpenAI's. Extras: ``nfe`` (model forwards
    of all choices, CFG counts twice) and ``denoising_steps``."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()
    nfe: int = 0
    denoising_steps: int = 0


class CompletionLogprobs(BaseModel):
    """Legacy completions ``logprobs``: per rendered token its text, log-probability (natural log, at the step it
    was revealed), the one recorded alternative (itself) and its character offset (sum of the previous tokens' text
    lengths)."""

    tokens: list[str]
    token_logprobs: list[float | None]  # echo + prompt scoring: the prompt's first token is null
    top_logprobs: list[dict[str, float] | None] | None = None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    """One ``text_completion`` choice (index = prompt index * n + i)."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None


class _Envelope(BaseModel):
    """What every body and chunk of one response starts with (the same ``id`` and ``created`` in all chunks)."""

    id: str
    object: str
    created: int
    model: str


class _Answer(_Envelope):
    """A body with choices and usage (a non-streamed response; the last chunk of ``include_usage``)."""

    choices: list
    usage: Usage


class CompletionResponse(_Answer):
    """``POST /v1/completions`` response body (``created``: unix seconds)."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class TopLogprob(BaseModel):
    """A token, its log-probability (natural log) and its UTF-8 bytes (None when its text has U+FFFD)."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    """A chat content token with its alternatives (empty, or the token itself when ``top_logprobs`` is 1)."""

    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    """Chat ``logprobs``: one entry per rendered token (EOS excluded); ``refusal`` is always None."""

    content: list[TokenLogprob] | None = None
    refusal: list[TokenLogprob] | None = None


class FunctionCallOut(BaseModel):
    """``{"name", "arguments"}`` of a generated tool call (``arguments``: JSON text of an object)."""

    name: str
    arguments: str


class ToolCallOut(BaseModel):
    """A generated tool call (docs/design.md#tools-and-the-responses-api)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    """The generated chat message: ``content`` (None when the choice only called tools), ``tool_calls`` (absent
    when none), ``refusal`` always None, ``annotations`` always ``[]`` (OpenAI's url citations)."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: str | None = None
    annotations: list = []
    tool_calls: list[ToolCallOut] | None = None

    @model_serializer(mode="wrap")
    def _omit_no_calls(self, handler):
        data = handler(self)
        if data.get("tool_calls") is None:
            data.pop("tool_calls", None)
        return data


class ChatChoice(BaseModel):
    """One ``chat.completion`` choice (index = prompt index * n + i)."""

    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None


class ChatCompletionResponse(_Answer):
    """``POST /v1/chat/completions`` response body (``created``: unix seconds)."""

    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class ModelCard(BaseModel):
    """``GET /v1/models/{id}``: the served model (``created``: unix seconds of server start; ``max_model_len``:
    context length in tokens)."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "unmask"
    max_model_len: int | None = None


class ModelList(BaseModel):
    """``GET /v1/models``: the one served model."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    """The ``error`` object of an OpenAI error body (see :mod:`unmask.server.errors` for statuses and types)."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI error body."""

    error: ErrorDetail


# ---------------------------------------------------------------------------------------------- stream chunks
class FunctionDelta(BaseModel):
    """A piece of a streamed tool call's function: the name (first chunk), then the arguments text."""

    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    """A streamed tool call (OpenAI's chunk shape): ``index`` (the call's place in the message), ``id`` and
    ``type`` on its first chunk, ``function.name`` then ``function.arguments``."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDelta


class Delta(BaseModel):
    """A chat chunk's ``delta``: ``{}`` (a denoising chunk), ``{"role": "assistant", "content": ""}`` (the first
    chunk of a choice), ``{"content": ...}`` or ``{"tool_calls": [...]}``."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    """One choice of a ``chat.completion.chunk`` (``logprobs`` absent from denoising chunks)."""

    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None


class RevealedToken(BaseModel):
    """A token revealed in one denoising step: position in the generation region, id, text and confidence."""

    position: int
    token_id: int
    text: str
    confidence: float


class Denoising(BaseModel):
    """One denoising step of one choice (``stream_options.include_denoising``; docs/design.md#decisions): the
    tokens it revealed and the whole canvas (token text, ``None`` where still masked)."""

    index: int
    block: int
    step: int
    nfe: int
    revealed: list[RevealedToken]
    canvas: list[str | None]
    # revisable canvases (token editing): canvas positions >= final may still change in a later step; absent:
    # every shown token is final (docs/design.md#http-contract)
    final: int | None = None


class _Chunk(_Envelope):
    """A streamed chunk with one choice: ``usage`` is given (``None``) only with ``include_usage``, ``denoising``
    only on a denoising chunk."""

    usage: Usage | None = None
    choices: list
    denoising: Denoising | None = None


class CompletionChunk(_Chunk):
    """A streamed ``text_completion`` chunk."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ChatCompletionChunk(_Chunk):
    """A streamed ``chat.completion.chunk``."""

    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


class UsageChunk(_Answer):
    """The last chunk of a stream with ``include_usage``: no choices, the usage of the whole request."""

    object: Literal["text_completion", "chat.completion.chunk"]
    choices: list[CompletionChoice] = []
