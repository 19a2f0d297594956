"""Request models of the OpenAI-compatible API (docs/design.md#http-contract and #decisions; responses:
:mod:`.responses`).

Requests follow the OpenAI API (``/v1/completions``, ``/v1/chat/completions``) with our diffusion knobs as extra
top-level fields, the way vLLM adds its extras. Validation is strict so that the published OpenAPI schema says
exactly what is accepted: no type coercion (``"0.5"`` is not a number, ``1`` is not a boolean), NaN/inf rejected,
ranges (:data:`unmask.engine.limits.RANGES`, the one declaration the CLI and the Python API check too) and
enums in the schema, unknown fields rejected (``additionalProperties: false``). Fields of the OpenAI API
that this server does not implement (the deprecated ``functions``, audio, ...) are rejected with a 400 that names
the field rather than ignored; ``metadata``, ``service_tier``, ``store``, ``prediction``, ``prompt_cache_*`` are
accepted and have no effect (nothing is stored). The whole field policy, field by field: docs/api-fields.md. Tools and ``response_format`` are :mod:`unmask.server.tool_protocol`
(docs/design.md#tools-and-the-responses-api).

``logprobs``: a diffusion model reveals tokens in any order; the log-probability reported for a token is the one it
had (under the final logits of that step, after penalties and top-k/top-p, at temperature 1) at the step it was
revealed, and its alternatives are the most likely tokens of that position under the same distribution: chat's
``top_logprobs`` up to 20 and completions' ``logprobs`` up to 5, OpenAI's limits (vLLM allows 20 for both).
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from unmask.engine import SamplingParams
from unmask.engine.limits import (CACHE_MODES, MAX_CONTENT_PARTS, MAX_COMPLETION_LOGPROBS, MAX_MESSAGES, MAX_TOP_LOGPROBS,
                                  MAX_NAME_CHARS, MAX_PROMPTS, MAX_STOP, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS,
                                  MAX_TOKEN_ID, RANGES, REMASKING_STRATEGIES)

# the request-size caps (MAX_PROMPTS, MAX_STOP_CHARS, ...; MAX_N is RANGES['n']) are declared with the decoding ranges in unmask.engine.limits

from .structured import (LOGIT_BIAS_KEY, MAX_LOGIT_BIAS, bad_bias_key, logit_bias_ids, response_format_constraint, tool_choice_constraint,
                         with_extras)
from .field_text import CACHE_DESCRIPTION, UNSUPPORTED_FIELDS
from .messages import ChatMessage, TextPart
from .tool_protocol import MAX_TOOLS, RequestBody, integral_fields, ResponseFormat, Strict, Text, Tool, ToolChoice, check_tool_messages

TOP_K_OFF = -1             # vLLM's "off" (like 0): accepted on the wire, below the engine's range

RemaskingName = Literal[tuple(REMASKING_STRATEGIES)]  # type: ignore[valid-type]
CacheName = Literal[tuple(CACHE_MODES)]  # type: ignore[valid-type]


# the integer fields (and lists of ids) of the request models: 7.0 is the integer 7 there, as in the schema
_INTEGER_FIELDS = frozenset({"max_tokens", "max_completion_tokens", "n", "best_of", "seed", "steps", "block_size",
                             "sub_block_size", "top_k", "min_tokens", "speculative_branches",
                             "speculative_no_repeat_ngram", "top_logprobs", "stop_token_ids", "prompt_logprobs",
                             "prompt_logprobs_samples", "max_post_steps", "max_denoising_steps",
                             "stability_threshold"})


TokenId = Annotated[int, Field(ge=RANGES["stop_token_ids"].lo, le=MAX_TOKEN_ID)]
StopString = Annotated[Text, Field(min_length=1, max_length=MAX_STOP_CHARS)]


MAX_MC_SAMPLES = 1024  # prompt_logprobs_samples' bound (the engine's scoring.MAX_MC_SAMPLES, which checks it again)


def ranged(name: str, default: Any, *, lo: float | None = None, **kw) -> Any:
    """A ``Field`` whose bounds are ``RANGES[name]`` (``lo`` overrides the lower bound)."""
    r = RANGES[name]
    lo = r.lo if lo is None else lo
    if lo is not None:
        kw["gt" if r.lo_open else "ge"] = lo
    if r.hi is not None:
        kw["le"] = r.hi
    return Field(default, **kw)


def _is(field: str, schema: dict) -> dict:
    return {"properties": {field: schema}, "required": [field]}


# stream_options only with stream: true (chat, completions and /v1/responses)
STREAM_OPTIONS_RULE = {"if": _is("stream_options", {"type": "object"}), "then": _is("stream", {"const": True})}

# cross-field rules that validation enforces, written into the published schema too
# (docs/design.md#admission-and-limits): request model name -> JSON Schema subschemas the body must also
# satisfy ("allOf")
_SCHEMA_RULES: dict[str, list[dict]] = {
    "_common": [
        # speculative_epsilon and speculative_ratio are two relaxed rules: one of the two, not both (null = unset)
        {"not": {"allOf": [_is("speculative_epsilon", {"type": "number"}),
                           _is("speculative_ratio", {"type": "number"})]}},
        STREAM_OPTIONS_RULE,
    ],
    "ChatCompletionRequest": [
        # top_logprobs >= 1 needs logprobs: true
        {"if": _is("top_logprobs", {"type": "integer", "minimum": 1}), "then": _is("logprobs", {"const": True})},
        # prompt log-probabilities are not streamed
        {"if": _is("prompt_logprobs", {"type": "integer"}), "then": {"not": _is("stream", {"const": True})}},
    ],
    "CompletionRequest": [
        # prompt log-probabilities (prompt_logprobs, or echo with logprobs) are not streamed
        {"if": _is("prompt_logprobs", {"type": "integer"}), "then": {"not": _is("stream", {"const": True})}},
        {"if": {"allOf": [_is("echo", {"const": True}), _is("logprobs", {"type": "integer"})]},
         "then": {"not": _is("stream", {"const": True})}},
        # max_tokens 0 only scores the prompt
        {"if": _is("max_tokens", {"const": 0}),
         "then": {"anyOf": [_is("prompt_logprobs", {"type": "integer"}),
                            {"allOf": [_is("echo", {"const": True}), _is("logprobs", {"type": "integer"})]}]}},
    ],
}


def _schema_extra(schema: dict, cls) -> None:
    """The cross-field rules, and ``null`` allowed where validation takes it as the default (an optional field whose
    default is not ``None``: ``"top_p": null`` means 1.0)."""
    props = schema.get("properties", {})
    for name, f in cls.model_fields.items():
        if name in props and not f.is_required() and f.default is not None:
            keep = {k: props[name].pop(k) for k in ("default", "description", "title") if k in props[name]}
            props[name] = {"anyOf": [props[name], {"type": "null"}], **keep}
    rules = _SCHEMA_RULES["_common"] + _SCHEMA_RULES.get(cls.__name__, [])
    if "speculative_ratio" in props:
        schema.setdefault("allOf", []).extend(rules)


_Strict = Strict


class _Rules(RequestBody):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, json_schema_extra=_schema_extra)


class StreamOptions(_Strict):
    """``stream_options``: ``include_usage`` (OpenAI) adds a final chunk with ``choices: []`` and the usage;
    ``continuous_usage_stats`` (vLLM's; with ``include_usage``) puts the usage so far in every chunk;
    ``include_obfuscation`` (OpenAI) adds random ``obfuscation`` padding to every chunk with choices;
    ``include_denoising`` (ours) streams every denoising step (docs/design.md#decisions). docs/api-fields.md."""

    include_usage: bool = False
    include_denoising: bool = False
    continuous_usage_stats: bool = Field(False, description="vLLM's: with include_usage, every chunk carries the "
                                                            "request's usage so far")
    include_obfuscation: bool = Field(False, description="OpenAI's: true adds an `obfuscation` field of random "
                                                         "padding to every chunk with choices; default off")


class PredictionContent(_Strict):
    """OpenAI's ``prediction`` (predicted outputs): accepted and unused; it changes only speed at OpenAI, never
    the answer."""

    type: Literal["content"]
    content: Text | Annotated[list[TextPart], Field(min_length=1, max_length=MAX_CONTENT_PARTS)]


class PromptCacheOptions(_Strict):
    """OpenAI's ``prompt_cache_options``: accepted, no effect (the prefix cache needs no hints)."""

    mode: Literal["implicit", "explicit"] | None = None
    ttl: Literal["30m"] | None = None


class _Common(_Rules):
    """Fields shared by completions and chat completions (OpenAI + our diffusion extras)."""

    model: str = Field(min_length=1, max_length=MAX_NAME_CHARS, description="a model id from GET /v1/models")
    max_tokens: int | None = ranged("max_tokens", None, description="most tokens to generate; default: the "
                                    "server's --default-max-tokens, lowered to the remaining context")
    temperature: float | None = ranged("temperature", None, description="0 = argmax; default from the checkpoint")
    top_p: float = ranged("top_p", 1.0)
    n: int = ranged("n", 1, description="choices; choice i uses seed + i")
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = Field(
        None, description=f"a string or at most {MAX_STOP} non-empty strings; text is cut before the first one")
    seed: int | None = ranged("seed", None)
    stream: bool = False
    stream_options: StreamOptions | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description=(
        "vLLM's: the log-probability of each prompt token and this many likeliest alternatives (not streamed); "
        "exact on a model with a causal path, else a Monte-Carlo estimate (docs/api-fields.md)"))
    prompt_logprobs_samples: int | None = Field(None, ge=1, le=MAX_MC_SAMPLES, description=(
        "ours: Monte-Carlo draws of a bidirectional model's prompt log-probabilities (default 64; seeded by seed, "
        "default 0); no effect on a causal path"))
    user: str | None = Field(None, max_length=MAX_NAME_CHARS,
                             description="accepted, recorded nowhere (OpenAI end-user id)")
    safety_identifier: str | None = Field(None, max_length=MAX_NAME_CHARS, description="accepted like user; no effect")
    prompt_cache_key: str | None = Field(None, max_length=MAX_NAME_CHARS,
                                         description="accepted; the KV cache is per request")
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_NAME_CHARS, description=(
        "vLLM's: the prefix cache shares stored KV only among requests of the same tenant (API key) with the same "
        "salt; without one, among the tenant's requests without one"))
    presence_penalty: float = ranged("presence_penalty", 0.0)
    frequency_penalty: float = ranged("frequency_penalty", 0.0)
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-100, le=100)]], Field(max_length=MAX_LOGIT_BIAS)] | None = Field(
        None, description="token id (a decimal string) -> bias in [-100, 100] added to its logit before sampling "
                          "(OpenAI's); a key outside the vocabulary or one the model never samples (its mask "
                          "token, padding) is a 400",
        json_schema_extra={"propertyNames": {"pattern": LOGIT_BIAS_KEY}})
    metadata: Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
                        Field(max_length=16)] | None = Field(None, description="accepted, stored nowhere (OpenAI's "
                                                                                "stored-completion tags)")
    service_tier: Literal["auto", "default", "flex", "scale", "priority", "fast"] | None = Field(
        None, description="accepted; one tier here (answered as default)")
    store: bool | None = Field(None, description="accepted; nothing is stored")
    prompt_cache_retention: Literal["in_memory", "in-memory", "24h"] | None = Field(
        None, description="accepted, no effect: the prefix cache keeps what fits its budget")
    prompt_cache_options: PromptCacheOptions | None = Field(None, description="accepted, no effect")
    prediction: PredictionContent | None = Field(None, description="predicted outputs: accepted, unused (they "
                                                                   "change only speed, never the answer)")
    modalities: Annotated[list[Literal["text"]], Field(max_length=1)] | None = Field(
        None, description='["text"] (the only output here); "audio" is a 400')
    # --- diffusion extras (docs/design.md#http-contract) ---
    steps: int | None = ranged("steps", None,
                               description="total denoising steps (LLaDA), split over the blocks; default max_tokens "
                                           "(one token per step) unless the checkpoint sets a default threshold; "
                                           "not with speculative: true")
    block_size: int | None = ranged("block_size", None, description="block length; default from the checkpoint")
    sub_block_size: int | None = ranged("sub_block_size", None,
                                        description="decoding window inside a block (Fast-dLLM v2 sub-blocks); "
                                                    "default from the checkpoint, else the whole block; not with "
                                                    "speculative: true")
    remasking: RemaskingName | None = Field(None, description="order in which masked positions are revealed; "
                                                              "absent or null: the checkpoint's default for plain "
                                                              "diffusion, else low_confidence; with speculative: "
                                                              "true only low_confidence")
    threshold: float | None = ranged("threshold", None,
                                     description="confidence-threshold parallel decoding (steps is then ignored); "
                                                "absent: the checkpoint's default threshold when it has one, "
                                                "steps is absent and remasking is absent, low_confidence or the checkpoint's; null: not the "
                                                "checkpoint's default threshold (quota decoding, or the "
                                                "checkpoint's speculative default); a number not with "
                                                "speculative: true")
    cfg_scale: float = ranged("cfg_scale", 0.0, description="classifier-free guidance scale; 0 = off")
    multi_block: float | None = ranged("multi_block", None,
                                       description="multi-block decoding: the next block joins once the last "
                                                   "active one has revealed this fraction, in (0, 1]; 1 = single-"
                                                   "block decoding; absent = off (docs/design.md#the-seeds-methods)")
    editing_threshold: float | None = ranged("editing_threshold", None,
                                             description="token editing (LLaDA2.1, llada2 models): a token of the "
                                                         "active block is replaced by the model's candidate when "
                                                         "that differs with confidence above this; 0 or absent = "
                                                         "off; the block's tokens stay provisional until it ends "
                                                         "(docs/design.md#decoding)")
    max_post_steps: int | None = ranged("max_post_steps", None,
                                        description="with editing_threshold: editing steps after a block's last "
                                                    "mask beyond the first; absent = 16")
    # the uniform-canvas sampler (diffusion_gemma models; transformers' DiffusionGemmaGenerationConfig names)
    max_denoising_steps: int | None = ranged("max_denoising_steps", None,
                                             description="uniform canvas (diffusion_gemma): denoising steps per "
                                                         "canvas at most; absent = the checkpoint's, else 48")
    t_min: float | None = ranged("t_min", None, description="uniform canvas: the temperature at the last step "
                                                            "(linear schedule); absent = the checkpoint's, else 0.4")
    t_max: float | None = ranged("t_max", None, description="uniform canvas: the temperature at the first step; "
                                                            "> t_min; absent = the checkpoint's, else 0.8")
    entropy_bound: float | None = ranged("entropy_bound", None,
                                         description="uniform canvas: a step accepts the lowest-entropy tokens whose "
                                                     "summed entropy less the largest is within this; absent = 0.1")
    stability_threshold: int | None = ranged("stability_threshold", None,
                                             description="uniform canvas: adaptive stopping once the argmax canvas "
                                                         "is unchanged for this many steps (and confident); absent = 1")
    confidence_threshold: float | None = ranged("confidence_threshold", None,
                                                description="uniform canvas: adaptive stopping needs the mean token "
                                                            "entropy below this; absent = 0.005")
    top_k: int = ranged("top_k", 0, lo=TOP_K_OFF, description="0 or -1 = off")
    repetition_penalty: float = ranged("repetition_penalty", 1.0, description="vLLM's repetition penalty; 1 = off")
    min_tokens: int = ranged("min_tokens", 0, description="EOS/stop tokens forbidden before this many tokens")
    ignore_eos: bool = False
    cache: CacheName = Field("auto", description=CACHE_DESCRIPTION)
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = Field(
        None, description="token ids that end a choice, as EOS does (vLLM's); an id outside the vocabulary or one "
                          "the model never samples (its mask token, padding) is a 400")
    speculative: bool | None = Field(None, description="self-speculative decoding: mask-block drafts verified by "
                                                        "the model's causal path (prefix_causal models); greedy: "
                                                        "output identical to block_size=1 greedy decoding; "
                                                        "temperature > 0: speculative sampling, distributed as "
                                                        "block_size=1 sampling of the verifying model; "
                                                        "absent: the checkpoint's default; false: off; "
                                                        "true with steps, threshold, sub_block_size or a remasking "
                                                        "other than low_confidence: a 400 naming the field "
                                                        "(speculative decoding decides its own reveals: they "
                                                        "would have no effect)")
    speculative_branches: int | None = ranged(
        "speculative_branches", None, description="fallback draft groups per step; default min(3, block_size - 1)")
    speculative_epsilon: float | None = ranged("speculative_epsilon", None,
                                               description="typical acceptance of drafts (Medusa; greedy requests); "
                                                          "absent: exact")
    speculative_ratio: float | None = ranged("speculative_ratio", None,
                                             description="relaxed verification of drafts (greedy requests): keep a "
                                                        "draft whose causal probability is >= ratio x the top "
                                                        "token's; absent: exact")
    speculative_no_repeat_ngram: int | None = ranged("speculative_no_repeat_ngram", None,
                                                     description="loop guard of the relaxed rules: a draft kept "
                                                                "only by speculative_epsilon/ratio must not complete "
                                                                "an n-gram of this many tokens already generated; "
                                                                "absent: 3 (with a relaxed rule); 0: off")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        # OpenAI documents most optional fields as "or null" and its SDK sends null for an explicit None:
        # null then means "use the default" (a field whose default is itself None keeps its own validation)
        if isinstance(data, dict):
            data = {k: v for k, v in data.items()
                    if not (v is None and k in cls.model_fields and cls.model_fields[k].default is not None)}
        return data

    @model_validator(mode="before")
    @classmethod
    def _integers(cls, data: Any) -> Any:
        return integral_fields(data, _INTEGER_FIELDS | ({"prompt", "logprobs"} if cls.__name__ == "CompletionRequest"
                                                        else set()))

    @model_validator(mode="before")
    @classmethod
    def _reject_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, why in UNSUPPORTED_FIELDS.items():
                if name in data and data[name] not in (None, False, [], {}):
                    raise PydanticCustomError("unsupported_field", "{field}: {why}", {"field": name, "why": why})
                data = {k: v for k, v in data.items() if k != name} if name in data else data
        return data

    @field_validator("modalities", mode="before")
    @classmethod
    def _text_only(cls, v):
        if isinstance(v, list) and "audio" in v:
            raise PydanticCustomError("unsupported_field", "{field}: {why}", {
                "field": "modalities", "why": 'only text output is supported by this server (send ["text"])'})
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias_keys(cls, v):
        for key in v or {}:
            if not key.isdigit() or len(key) > 10:
                raise PydanticCustomError("invalid_field", "{field}: {why}", {
                    "field": "logit_bias", "why": bad_bias_key(key)})
        return v

    @model_validator(mode="after")
    def _cross_field(self):
        if self.stream_options is not None and not self.stream:
            raise PydanticCustomError("invalid_field", "{field}: {why}",
                                      {"field": "stream_options", "why": "only allowed when stream is true"})
        return self

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def sampling_params(self, max_tokens: int, logprobs: bool, default_cache: str = "auto") -> SamplingParams:
        """The engine's :class:`SamplingParams` (raises ``ParamError`` naming the field). An explicit
        ``"threshold": null`` turns the checkpoint's default threshold off (``default_threshold=False``: quota
        decoding, ``steps`` or one token per step) and nothing else: a checkpoint's speculative default still
        applies, as when the field is absent. ``default_cache``: the server's KV-cache policy for a request that
        sends no ``cache``."""
        null_threshold = self.threshold is None and "threshold" in self.model_fields_set
        # the flat HTTP speculative_* fields: SamplingParams.from_flat groups them into SpeculativeOptions
        params = SamplingParams.from_flat(
            max_tokens=max_tokens, temperature=self.temperature, top_k=max(self.top_k, 0), top_p=self.top_p,
            steps=self.steps, block_size=self.block_size, sub_block_size=self.sub_block_size,
            remasking=self.remasking, threshold=self.threshold, default_threshold=not null_threshold,
            cfg_scale=self.cfg_scale, seed=self.seed, stop=self.stop_list(),
            stop_token_ids=list(self.stop_token_ids or []), presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
            min_tokens=self.min_tokens, ignore_eos=self.ignore_eos,
            cache=self.cache if "cache" in self.model_fields_set else default_cache, logprobs=logprobs,
            suffix=getattr(self, "suffix", None), speculative=self.speculative,
            speculative_branches=self.speculative_branches, speculative_epsilon=self.speculative_epsilon,
            speculative_ratio=self.speculative_ratio,
            speculative_no_repeat_ngram=self.speculative_no_repeat_ngram, multi_block=self.multi_block,
            editing_threshold=self.editing_threshold, max_post_steps=self.max_post_steps,
            max_denoising_steps=self.max_denoising_steps, t_min=self.t_min, t_max=self.t_max,
            entropy_bound=self.entropy_bound, stability_threshold=self.stability_threshold,
            confidence_threshold=self.confidence_threshold,
            top_logprobs=self.alternatives() if logprobs else 0)
        return with_extras(params, self.constraint(), logit_bias_ids(self.logit_bias))

    def constraint(self):
        """The engine ``Constraint`` this request asks for (chat: ``response_format`` / ``tool_choice``)."""
        return None

    def alternatives(self) -> int:
        """Alternatives to record per token (chat: ``top_logprobs``; completions: ``logprobs``)."""
        return 0

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's ``continuous_usage_stats``, which counts only with ``include_usage`` (as in vLLM)."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)

    @property
    def include_obfuscation(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_obfuscation)

    @property
    def include_denoising(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_denoising)


Prompt = (Annotated[Text, Field(min_length=1)]
          | Annotated[list[Annotated[Text, Field(min_length=1)]], Field(min_length=1, max_length=MAX_PROMPTS)]
          | Annotated[list[TokenId], Field(min_length=1)]
          | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=MAX_PROMPTS)])


class CompletionRequest(_Common):
    """``POST /v1/completions`` (OpenAI legacy completions)."""

    prompt: Prompt = Field(description="a string, a list of strings, a list of token ids, or a list of those")
    suffix: Text | None = Field(None, description="text after the generated region (infilling; bidirectional "
                                                 "models only)")
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS,
                                 description="log-probability of each token at the step it was revealed, and this "
                                             "many most likely alternatives there (at most 5, OpenAI's limit)")
    best_of: int | None = ranged("n", None, description="only best_of == n is supported")
    echo: bool = Field(False, description="prepend the prompt's text to each choice's text (streamed: its first "
                                          "chunk); with logprobs also the prompt's log-probabilities (not streamed; "
                                          "exact on a causal path, else a Monte-Carlo estimate: docs/api-fields.md)")
    max_tokens: int | None = ranged("max_tokens", None, lo=0, description=(
        "most tokens to generate; default: the server's --default-max-tokens, lowered to the remaining context; 0 "
        "only scores the prompt (with echo and logprobs, or prompt_logprobs)"))

    @model_validator(mode="after")
    def _scoring(self):
        scores = self.prompt_logprobs is not None or (self.echo and self.logprobs is not None)
        if self.max_tokens == 0 and not scores:
            raise PydanticCustomError("invalid_field", "{field}: {why}", {
                "field": "max_tokens", "why": "0 only scores the prompt: send echo with logprobs, or "
                                              "prompt_logprobs (else at least 1)"})
        if scores and self.stream:
            field = "prompt_logprobs" if self.prompt_logprobs is not None else "echo"
            raise PydanticCustomError("invalid_field", "{field}: {why}", {
                "field": field, "why": "prompt log-probabilities are not streamed: send stream false"})
        return self

    def alternatives(self) -> int:
        return self.logprobs or 0

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list (one entry per prompt)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p[0], int):
            return [list(p)]
        return list(p)

    @model_validator(mode="after")
    def _best_of(self):
        if self.best_of is not None and self.best_of != self.n:
            raise PydanticCustomError("invalid_field", "{field}: {why}",
                                      {"field": "best_of", "why": f"only best_of == n is supported, got best_of="
                                                                  f"{self.best_of} and n={self.n}"})
        return self


class ChatCompletionRequest(_Common):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: int | None = ranged("max_tokens", None,
                                               description="same as max_tokens (takes precedence)")
    logprobs: bool = Field(False, description="log-probability of each token at the step it was revealed")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS,
                                     description="the most likely alternatives of each token at the step that "
                                                 "revealed it (at most 20, OpenAI's limit)")
    response_format: ResponseFormat | None = Field(
        None, description="text | json_object | json_schema: JSON output by constrained decoding")
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = Field(
        None, description="functions the model may call (rendered by the chat template)")
    tool_choice: ToolChoice | None = Field(None, description="none | auto (default with tools) | required | "
                                                             "{type: function, function: {name}}; required and a "
                                                             "named function are enforced by constrained decoding")
    parallel_tool_calls: bool = Field(True, description="false: at most one call per choice (required: exactly one)")

    @model_validator(mode="after")
    def _top_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise PydanticCustomError("invalid_field", "{field}: {why}",
                                      {"field": "top_logprobs", "why": "requires logprobs to be true"})
        if self.prompt_logprobs is not None and self.stream:
            raise PydanticCustomError("invalid_field", "{field}: {why}", {
                "field": "prompt_logprobs", "why": "prompt log-probabilities are not streamed: send stream false"})
        return self

    @model_validator(mode="after")
    def _tools(self):
        def bad(field, why):
            return PydanticCustomError("invalid_field", "{field}: {why}", {"field": field, "why": why})

        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise bad("tools", "function names must be unique")
        choice = self.tool_choice
        if choice not in (None, "none", "auto") and not names:
            raise bad("tool_choice", "requires tools")
        if not isinstance(choice, (str, type(None))) and choice.function.name not in names:
            raise bad("tool_choice", f"the function {choice.function.name!r} is not in tools ({names})")
        if self.tools_active and self.response_format is not None and self.response_format.type != "text" \
                and choice not in (None, "auto"):
            raise bad("response_format", "cannot be combined with tool_choice required or a named function")
        check_tool_messages(self.messages)
        return self

    def alternatives(self) -> int:
        return self.top_logprobs or 0

    @property
    def tools_active(self) -> bool:
        """Tools are rendered and the output parsed for calls (tools given and ``tool_choice`` is not none)."""
        return bool(self.tools) and self.tool_choice != "none"

    def template_tools(self) -> list[dict] | None:
        """The tools as the chat template reads them, or None (none given, or ``tool_choice: none``)."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools_active else None

    def constraint(self):
        if self.tools_active and self.tool_choice not in (None, "auto"):
            return tool_choice_constraint(self.tools, self.tool_choice, self.parallel_tool_calls)
        return response_format_constraint(self.response_format)
