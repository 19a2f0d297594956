"""Per-request sampling parameters, in the style of vLLM's ``SamplingParams`` (docs/design.md#decoding and
#decisions)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from .limits import (CACHE_MODES, MAX_SEED, MAX_SPECULATIVE_BLOCK, MAX_STOP, REMASKING_STRATEGIES, ParamError,
                     check, check_number)

__all__ = ["SamplingParams", "SpeculativeOptions", "Constraint", "ParamError", "MAX_SEED", "MAX_SPECULATIVE_BLOCK",
           "CACHE_MODES", "REMASKING_STRATEGIES", "CONSTRAINT_KINDS"]

CONSTRAINT_KINDS = ("json_object", "json_schema", "lark", "regex")
#: the uniform-canvas sampler's fields (DiffusionGemma; ``unmask.engine.uniform_options``), transformers' names
UNIFORM_FIELDS = ("max_denoising_steps", "t_min", "t_max", "entropy_bound", "stability_threshold",
                  "confidence_threshold")

SPECULATIVE_ONLY_FIELDS = ("speculative_branches", "speculative_epsilon", "speculative_ratio",
                           "speculative_no_repeat_ngram")  # need speculative


@dataclass(frozen=True)
class SpeculativeOptions:
    """Options of self-speculative decoding (``SamplingParams(speculative=True, speculative_options=...)``); each
    ``None`` = the default, and every set one needs ``speculative`` (HTTP: the flat ``speculative_*`` fields, which
    :meth:`SamplingParams.from_flat` maps here; errors name those flat fields).

    Attributes:
        branches: fallback mask groups per step (drafts for when draft i is the first rejected),
            ``0..block_size - 1``; ``None`` = ``min(3, block_size - 1)``. More rows per forward, fewer wasted steps.
        epsilon: Medusa's typical acceptance (Cai et al. 2024, section 2.3.1) instead of exact verification: a
            draft is also accepted when its causal probability is > ``min(eps, sqrt(eps) * exp(-H))`` (H = entropy
            of the causal distribution). In (0, 1]; ``None`` = exact (output = greedy). Greedy requests only.
        ratio: relaxed verification by the probability gap to the top token: a draft is also accepted when its
            causal probability is at least ``ratio`` times the causal argmax's (SpecDec's relaxed top-beta
            verification, Xia et al. 2023, ``tau = -log(ratio)``; ``top_k``/``top_p`` act as the top-beta cap).
            Only keeps near-ties of the causal path, whatever its entropy. In (0, 1]; ``None`` = exact. Greedy
            requests only; not together with ``epsilon``.
        no_repeat_ngram: the loop guard of the relaxed rules: a draft they would keep although it is not the causal
            argmax is rejected (the argmax is taken instead) when it completes an n-gram of this many tokens that
            the generated text already contains (``benchmarks/results/loop-guard/``); the causal argmax itself is
            never blocked. ``None`` = 3 when ``epsilon`` or ``ratio`` is set; 0 = off; at most 64. A value > 0
            needs a relaxed rule.
    """

    FIELDS = ("branches", "epsilon", "ratio", "no_repeat_ngram")

    branches: int | None = None
    epsilon: float | None = None
    ratio: float | None = None
    no_repeat_ngram: int | None = None


@dataclass(frozen=True, eq=False)
class Constraint:
    """A grammar the generated text must follow (structured outputs, enforced tool calls;
    docs/design.md#constrained-decoding, ``docs/structured-output.md``). Compiled once per tokenizer and spec by
    ``unmask.engine.constraints`` (llguidance) when the request is built, never on the decoding step.

    Attributes:
        kind: ``json_object`` (any JSON object; ``spec`` ignored, may be ``None``), ``json_schema`` (``spec``: the
            JSON schema, a dict or its JSON text), ``lark`` (``spec``: an llguidance Lark grammar, which may embed
            ``%json{...}`` schemas) or ``regex`` (``spec``: a regular expression the whole output matches).
        spec: see ``kind``.
        field: the request field errors name (``response_format``; ``tool_choice`` for enforced tool calls).

    Equality and hashing go by :meth:`key` (``kind`` and the canonical spec), so equal specs share one compiled
    grammar. Raises :class:`ParamError` (naming ``field``) for an unknown kind or a spec of the wrong type; an
    invalid grammar or schema is found when it is compiled (also a :class:`ParamError` naming ``field``).
    """

    kind: str
    spec: str | dict | None = None
    field: str = "response_format"

    def __post_init__(self) -> None:
        if self.kind not in CONSTRAINT_KINDS:
            raise ParamError(self.field, f"constraint kind must be one of {list(CONSTRAINT_KINDS)}, got {self.kind!r}")
        if self.kind == "json_schema":
            if isinstance(self.spec, str):
                try:
                    parsed = json.loads(self.spec)
                except ValueError as e:
                    raise ParamError(self.field, f"the JSON schema is not valid JSON: {e}") from None
                except RecursionError:
                    raise ParamError(self.field, "the JSON schema is nested deeper than the JSON parser's "
                                                 "recursion limit") from None
            else:
                parsed = self.spec
            if not isinstance(parsed, (dict, bool)):
                raise ParamError(self.field, f"a JSON schema must be an object, got {type(parsed).__name__}")
        elif self.kind in ("lark", "regex") and (not isinstance(self.spec, str) or not self.spec):
            raise ParamError(self.field, f"a {self.kind} constraint needs its grammar as a non-empty string")

    def key(self) -> tuple[str, str]:
        """``(kind, canonical spec text)``: the cache key of the compiled grammar."""
        if self.kind == "json_object":
            return (self.kind, "")
        if self.kind == "json_schema":
            spec = json.loads(self.spec) if isinstance(self.spec, str) else self.spec
            return (self.kind, json.dumps(spec, sort_keys=True, separators=(",", ":")))
        return (self.kind, str(self.spec))

    def __eq__(self, other) -> bool:
        return isinstance(other, Constraint) and self.key() == other.key() and self.field == other.field

    def __hash__(self) -> int:
        return hash((self.key(), self.field))


def _flat_option(name: str) -> property:
    """Read-only ``SamplingParams.speculative_<name>``: ``speculative_options.<name>``, ``None`` without options."""
    return property(lambda self: getattr(self.speculative_options, name) if self.speculative_options else None,
                    doc=f"``speculative_options.{name}`` (``None`` without options; the HTTP field's name).")


@dataclass
class SamplingParams:
    """How one request is decoded.

    Attributes:
        max_tokens: most tokens returned (the generation region is rounded up to whole blocks; the extra
            positions are decoded but never returned). Default 256.
        temperature: 0 = argmax; > 0 = Gumbel-max sampling with float64 noise. ``None`` = checkpoint default
            (``dllm.default_sampling.temperature``), else 1.0.
        top_k: keep the k most likely tokens (0 = off). top_p: nucleus filter (1.0 = off).
        steps: total denoising steps for the whole generation (LLaDA's ``steps``), split over the blocks as evenly
            as possible, remainder to the earliest blocks, at least one per block, at most the masked positions
            (a ParamError beyond: docs/design.md#admission-and-limits). ``None`` = one token per step:
            ``max_tokens`` rounded up to whole blocks (the canvas's masked positions; a request stops as soon as its
            first ``max_tokens`` are revealed), unless the checkpoint's default threshold applies (see
            ``unmask.engine.plan``).
        block_size: block length in tokens; ``None`` = the checkpoint's ``dllm.block_size``. At most 512, the
            context, and max(the checkpoint's block, ``max_tokens`` rounded up to a power of two)
            (docs/design.md#admission-and-limits).
        sub_block_size: decoding window inside a block (Fast-dLLM v2's sub-blocks): positions are revealed window
            by window, left to right, while attention and caching stay per block; the step budget is split over
            the windows. ``None`` = the checkpoint's ``dllm.sub_block_size``, else the whole block; at most
            ``block_size``.
        remasking: which masked positions are revealed first: ``low_confidence`` | ``margin`` | ``entropy`` |
            ``left_to_right`` | ``random`` (LLaDA / Dream names). ``None`` = the checkpoint's
            ``dllm.default_sampling.remasking`` for a plain-diffusion request, else ``low_confidence``
            (:func:`unmask.engine.plan.resolve_params`).
        threshold: when set, threshold decoding (Fast-dLLM): reveal every position whose candidate probability
            is >= threshold, and always at least the best one; ``steps`` is then ignored. ``None`` = the
            checkpoint's ``dllm.default_sampling.threshold`` when the request sets no ``steps``, keeps the
            default ``remasking`` and ``default_threshold``, else quota decoding.
        default_threshold: False = never the checkpoint's default threshold (the HTTP API's explicit
            ``"threshold": null``); every other default (a speculative one included) still applies.
        cfg_scale: classifier-free guidance scale s (LLaDA): ``l = l_u + (1 + s)(l_c - l_u)``; 0 = off.
        seed: seed of the request's own ``torch.Generator`` in [0, 2**63 - 1]; ``None`` = random. Choice i of an
            ``n > 1`` request uses ``(seed + i) mod 2**63``.
        stop: stop strings (at most 4, non-empty). stop_token_ids: extra ids that end generation like EOS.
        presence_penalty, frequency_penalty: OpenAI penalties over prompt + revealed tokens, in [-2, 2].
        repetition_penalty: vLLM/CTRL penalty (> 0; 1 = off) over prompt + revealed tokens.
        min_tokens: EOS and stop ids are forbidden at the first ``min_tokens`` generated positions.
        ignore_eos: EOS does not end generation (vLLM); finish_reason is then ``length``.
        suffix: text after the generated region (infilling; bidirectional models only).
        constraints: fixed tokens ``{generated position: token id}`` (infilling; bidirectional models only).
        constraint: a :class:`Constraint` (JSON object / JSON schema / Lark grammar / regex) the output follows:
            constrained positions are revealed left to right, each token sampled under the grammar's mask
            (docs/design.md#constrained-decoding); ``None`` = unconstrained.
        logit_bias: ``{token id: bias}`` added to the logits before sampling, bias in [-100, 100] (OpenAI's
            ``logit_bias``: -100 in effect bans a token, +100 in effect forces it); ids are checked against the
            model's vocabulary when the request is built. ``None`` = none.
        cache: ``auto`` | ``none`` | ``prefix`` | ``dual`` (KV-cache policy; see ``unmask.engine.kv_cache``).
        logprobs: record the log-probability each token had at the step it was revealed.
        top_logprobs: with ``logprobs``, also record this many most likely tokens (0 to 20) at that position and
            step, under the same distribution (the step's final logits at temperature 1, after penalties and
            top-k/top-p; tokens those filters removed are left out, so a list may be shorter).
        speculative: self-speculative decoding (``unmask.engine.speculative``): mask-block drafts verified by the
            model's causal path; greedy: the output is token for token the model's ``block_size=1`` greedy decoding;
            temperature > 0: speculative sampling, every token distributed as ``block_size=1`` sampling from the
            verifying model (the causal path, or the checkpoint's verifier) would draw it. ``prefix_causal`` models
            with the logit shift only (``temperature`` ``None`` resolves to the checkpoint's, else 0); ``steps``,
            ``threshold``, a ``remasking`` other than ``low_confidence`` and ``sub_block_size`` set with it are a
            ``ParamError`` naming the field (it decides its own reveals: they would have no effect;
            ``unmask.engine.plan.NOT_SPECULATIVE_FIELDS``); ``block_size`` is the draft block. ``None`` =
            the checkpoint's ``dllm.default_sampling.speculative`` where the request allows it (see
            ``unmask.engine.plan``), else off.
        speculative_options: :class:`SpeculativeOptions` (branches, epsilon, ratio, no_repeat_ngram), ``None`` =
            every default; read flat as ``speculative_branches`` etc. (the HTTP names).
        multi_block: multi-block decoding (``unmask.engine.multi_block``, docs/design.md#the-seeds-methods): the next
            block joins the active ones once the last active block has revealed this fraction of its positions,
            in (0, 1]; 1.0 = single-block decoding exactly; ``None`` = off. ``prefix_causal`` / ``block_causal``
            models, whole-block windows, not speculative.
        editing_threshold: token editing (LLaDA2.1, ``unmask.engine.refinement``): in a block-refinement family
            (``llada2``), a generated position of the active block that holds a token takes the model's candidate
            when that differs and its confidence is above this, in (0, 1]; ``None`` or 0 = off. Tokens of the
            active block are then provisional until the block ends.
        max_post_steps: with ``editing_threshold``, the most editing steps after a block's last mask beyond the
            first (``LLaDA2Pipeline``'s ``max_post_steps``); ``None`` = 16.
        max_denoising_steps, t_min, t_max, entropy_bound, stability_threshold, confidence_threshold: the
            uniform-canvas sampler's options (DiffusionGemma, transformers' names: ``unmask.engine.uniform_options``);
            ``None`` = the checkpoint's, else transformers' default; another family refuses them.

    Raises:
        ParamError: from :meth:`validate`, naming the field.
    """

    max_tokens: int = 256
    temperature: float | None = None
    top_k: int = 0
    top_p: float = 1.0
    steps: int | None = None
    block_size: int | None = None
    sub_block_size: int | None = None
    remasking: str | None = None
    threshold: float | None = None
    default_threshold: bool = True
    cfg_scale: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    suffix: str | list[int] | None = None
    constraints: dict[int, int] = field(default_factory=dict)
    cache: str = "auto"
    logprobs: bool = False
    top_logprobs: int = 0
    speculative: bool | None = None
    speculative_options: SpeculativeOptions | None = None
    constraint: Constraint | None = None
    logit_bias: dict[int, float] | None = None
    multi_block: float | None = None
    editing_threshold: float | None = None
    max_post_steps: int | None = None
    max_denoising_steps: int | None = None
    t_min: float | None = None
    t_max: float | None = None
    entropy_bound: float | None = None
    stability_threshold: int | None = None
    confidence_threshold: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        opts = self.speculative_options
        if opts is not None and not isinstance(opts, SpeculativeOptions):
            raise ParamError("speculative_options", f"must be a SpeculativeOptions, got {type(opts).__name__}")
        if opts is not None and all(getattr(opts, f) is None for f in SpeculativeOptions.FIELDS):
            self.speculative_options = None  # all defaults: the same request as none
        self.validate()

    def validate(self) -> None:
        """Check every field; raise :class:`ParamError` naming the first bad one."""
        check("max_tokens", self.max_tokens)
        check("temperature", self.temperature)
        check("top_k", self.top_k)
        check("top_p", self.top_p)
        check("steps", self.steps)
        check("block_size", self.block_size)
        check("sub_block_size", self.sub_block_size)
        check("threshold", self.threshold)
        check("cfg_scale", self.cfg_scale)
        check("seed", self.seed)
        check("presence_penalty", self.presence_penalty)
        check("frequency_penalty", self.frequency_penalty)
        check("repetition_penalty", self.repetition_penalty)
        check("min_tokens", self.min_tokens)
        check("multi_block", self.multi_block)
        check("editing_threshold", self.editing_threshold)
        check("max_post_steps", self.max_post_steps)
        for name in UNIFORM_FIELDS:
            check(name, getattr(self, name))
        if self.max_post_steps is not None and not self.editing_threshold:
            raise ParamError("max_post_steps", "applies with token editing only: set editing_threshold > 0")
        check("top_logprobs", self.top_logprobs)
        if self.top_logprobs and not self.logprobs:
            raise ParamError("top_logprobs", "requires logprobs")
        if self.remasking is not None and self.remasking not in REMASKING_STRATEGIES:
            raise ParamError("remasking", f"must be one of {list(REMASKING_STRATEGIES)}, got {self.remasking!r}")
        if self.cache not in CACHE_MODES:
            raise ParamError("cache", f"must be one of {list(CACHE_MODES)}, got {self.cache!r}")
        if not isinstance(self.stop, list) or len(self.stop) > MAX_STOP:
            raise ParamError("stop", f"must be a string or a list of at most {MAX_STOP} strings")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ParamError("stop", "stop strings must be non-empty strings")
        for t in self.stop_token_ids:
            check("stop_token_ids", t)
        if self.speculative is not None and not isinstance(self.speculative, bool):
            raise ParamError("speculative", f"must be a boolean, got {self.speculative!r}")
        check("speculative_branches", self.speculative_branches)
        check("speculative_epsilon", self.speculative_epsilon)
        check("speculative_ratio", self.speculative_ratio)
        check("speculative_no_repeat_ngram", self.speculative_no_repeat_ngram)
        if self.speculative_epsilon is not None and self.speculative_ratio is not None:
            raise ParamError("speculative_ratio", "choose one relaxed acceptance rule: speculative_epsilon (typical "
                                                  "acceptance) or speculative_ratio, not both")
        for name in SPECULATIVE_ONLY_FIELDS:
            if getattr(self, name) is not None and self.speculative is False:
                raise ParamError(name, "only applies with speculative decoding (speculative=true)")
        if self.min_tokens and self.min_tokens > self.max_tokens:
            raise ParamError("min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if not isinstance(self.constraints, dict):
            raise ParamError("constraints", "must be a mapping {generated position: token id}")
        for pos, tok in self.constraints.items():
            check_number("constraints", pos, lo=0, hi=self.max_tokens - 1, integer=True)
            check_number("constraints", tok, lo=0, integer=True)
        if self.suffix is not None and not isinstance(self.suffix, (str, list)):
            raise ParamError("suffix", "must be a string or a list of token ids")
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            raise ParamError("constraint", f"must be a Constraint, got {type(self.constraint).__name__}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ParamError("logit_bias", "must be a mapping {token id: bias}")
            for tok, bias in self.logit_bias.items():
                if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
                    raise ParamError("logit_bias", f"keys must be token ids (integers >= 0), got {tok!r}")
                check("logit_bias", bias)

    # ------------------------------------------------------------------ speculative options, flat (HTTP) names
    speculative_branches = _flat_option("branches")
    speculative_epsilon = _flat_option("epsilon")
    speculative_ratio = _flat_option("ratio")
    speculative_no_repeat_ngram = _flat_option("no_repeat_ngram")

    @classmethod
    def from_flat(cls, **fields) -> "SamplingParams":
        """Build from flat fields as the HTTP API and the CLI name them: every :class:`SamplingParams` field plus
        ``speculative_branches``, ``speculative_epsilon``, ``speculative_ratio`` and
        ``speculative_no_repeat_ngram``, which go into :attr:`speculative_options` (``None`` values are unset).

        Example: ``SamplingParams.from_flat(max_tokens=32, speculative=True, speculative_epsilon=0.03)``.

        Raises:
            ParamError: as the constructor (the flat name in ``field``, e.g. ``speculative_epsilon``).
        """
        flat = {name: fields.pop(f"speculative_{name}", None) for name in SpeculativeOptions.FIELDS}
        if any(v is not None for v in flat.values()):
            if fields.get("speculative_options") is not None:
                raise ParamError("speculative_options", "give either speculative_options or the flat speculative_* "
                                                        "fields, not both")
            fields["speculative_options"] = SpeculativeOptions(**flat)
        return cls(**fields)
