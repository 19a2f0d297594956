"""Parameters resolved once: (request parameters x checkpoint config x engine options) -> a frozen decoding plan.

Every default and every eligibility rule of a request lives here and nowhere else (docs/design.md#decoding
and #decisions):

* the engine's defaults (:func:`engine_defaults`, decided once per engine from the checkpoint's settings and the
  engine options of :class:`~unmask.engine.options.EngineConfig`): the default block (``block_size``, else the
  checkpoint's ``block_size`` and, for plain diffusion, its ``diffusion_block_size``), the context
  (``max_model_len``, else the checkpoint's), the draft policy; the loaded model's settings are never changed
  (they are frozen at load, ``DllmConfig.freeze``); :meth:`EngineDefaults.describe` is the start-up log's line;
* request-level defaults (:func:`resolve_params`): ``temperature`` (the request's, else the checkpoint's
  ``dllm.default_sampling``, else 1.0; 0 for a speculative request), ``threshold`` (the checkpoint's only for a
  request that sets neither ``threshold`` nor ``steps`` and sends no ``remasking``, ``low_confidence`` or the
  checkpoint's own), ``remasking`` (the request's, else the checkpoint's for a request decoded by plain
  diffusion, else ``low_confidence``), ``seed`` (random when unset), ``speculative`` (the request's, else the
  checkpoint's where the request allows it);
* the engine's draft policy (:func:`drafts_by_default`, engine option ``default_drafts``): a request that gets
  speculative decoding only from the checkpoint's default drafts (block ``block_size``) only where the policy
  says so, else it decodes one token per forward (draft block 1) through the same verifying path (``auto``: drafts
  on a GPU in every dtype, none on a CPU; what its answers then are: :func:`drafts_by_default`);
* the model's rules (:func:`resolve`): a fixed block size, infilling on bidirectional models only, self-speculative
  decoding on ``prefix_causal`` models with the logit shift only, the cache mode;
* what a speculative request may not set (:data:`NOT_SPECULATIVE_FIELDS`, :func:`check_speculative`): the fields
  self-speculative decoding has no use for (``steps``, ``threshold``, ``remasking``, ``sub_block_size``).

Errors: :class:`~unmask.engine.limits.ParamError` naming the field (HTTP 400); ``ValueError`` naming the engine
option (:func:`engine_defaults`).
"""
from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from .config import DllmConfig
from .limits import MAX_SEED, MAX_SPECULATIVE_BLOCK, MIN_SAMPLING_TEMPERATURE, ParamError
from .options import DRAFT_POLICIES
from .params import SPECULATIVE_ONLY_FIELDS, UNIFORM_FIELDS, SamplingParams
from .uniform_options import UNIFORM_CANVAS_FAMILIES, UniformCanvasOptions, uniform_canvas_options

DEFAULT_BRANCHES = 3         # fallback groups when the request does not say (block 4: every draft has one)
DEFAULT_NO_REPEAT_NGRAM = 3  # loop guard of the relaxed rules when the request does not say


@dataclass(frozen=True)
class EngineDefaults:
    """What a request that sets nothing gets on one engine: the checkpoint's settings x the engine's options,
    decided once by :func:`engine_defaults` (read-only).

    Attributes:
        block_size: the default block, the draft block of speculative requests: the engine's ``block_size`` option,
            else the checkpoint's ``dllm.block_size``.
        diffusion_block_size: the default block of plain-diffusion requests: the checkpoint's
            ``dllm.diffusion_block_size`` unless the engine's ``block_size`` option replaces both; None =
            ``block_size``.
        default_sampling: the checkpoint's request defaults (``dllm.default_sampling``).
        default_drafts: the engine's draft policy. device_type: the model's (``cpu``, ``cuda``...).
        drafts: whether checkpoint-default speculative requests draft (:func:`drafts_by_default`).
        max_context: the context in tokens (the engine's ``max_model_len``, else the checkpoint's); None = unknown.
    """

    block_size: int
    diffusion_block_size: int | None
    default_sampling: Mapping[str, Any]
    default_drafts: str
    device_type: str
    drafts: bool
    max_context: int | None = None

    @property
    def plain_block_size(self) -> int:
        """The default block of a plain-diffusion request."""
        return self.diffusion_block_size or self.block_size

    def describe(self, verifier: str = "the model's causal path", drafter: str = "the model's mask rows") -> str:
        """One line of what a request that sets nothing gets (the start-up log's ``default decoding``);
        ``verifier`` / ``drafter``: what runs the causal rows and the drafts of a speculative request."""
        d = self.default_sampling
        thr = d.get("threshold")
        decoding = (f"threshold {thr:g} (confidence-threshold parallel decoding)" if thr is not None
                    else "one token per step")
        decoding += (f", block {self.plain_block_size} and remasking {d.get('remasking', 'low_confidence')} "
                     f"unless sent")
        if not d.get("speculative"):
            return decoding
        plain = (f"requests without steps/threshold: speculative decoding, drafts from {drafter} verified by "
                 f"{verifier}" if self.drafts else
                 f"requests without steps/threshold: {verifier}, one token per forward (no drafts: on a CPU "
                 f"drafting costs more than it saves, and the answers are the same; --default-drafts on to draft)")
        return f"{plain}; other requests: {decoding}"


def engine_defaults(dllm: DllmConfig, max_context: int | None = None, device_type: str = "cpu",
                    default_drafts: str = "auto", block_size: int | None = None,
                    max_model_len: int | None = None) -> EngineDefaults:
    """The :class:`EngineDefaults` of a model (its ``dllm``, context and device type) under the engine options
    ``default_drafts``, ``block_size`` and ``max_model_len`` (:class:`~unmask.engine.options.EngineConfig`).

    Raises:
        ValueError: (names the option) ``default_drafts`` not a policy; ``block_size`` on a family that decodes
            with its trained block size only; ``max_model_len`` above the model's context.
    """
    drafts = drafts_by_default(default_drafts, device_type)
    if block_size is not None and dllm.fixed_block_size and block_size != dllm.block_size:
        raise ValueError(f"block_size: this {dllm.family} model decodes with its trained block size "
                         f"{dllm.block_size} only")
    if max_model_len is not None:
        if max_context is not None and max_model_len > max_context:
            raise ValueError(f"max_model_len: {max_model_len} exceeds the model's context of {max_context} tokens")
        max_context = max_model_len
    return EngineDefaults(block_size=block_size or dllm.block_size,
                          diffusion_block_size=None if block_size else dllm.diffusion_block_size,
                          default_sampling=dllm.default_sampling, default_drafts=default_drafts,
                          device_type=device_type, drafts=drafts, max_context=max_context)


@dataclass(frozen=True)
class DecodingPlan:
    """How one choice is decoded, every default resolved (read-only).

    Attributes:
        params: the request's :class:`SamplingParams` with every default applied (``temperature``, ``threshold``,
            ``seed``, ``speculative``, ``block_size`` set); the sampler and the stop rules read it.
        speculative: self-speculative decoding. block_size: block length (speculative: the draft block).
        draft_block: the draft block when speculative, else ``None``. window_size: decoding window in a block.
        temperature: resolved (0 = argmax). sampling: temperature above :data:`MIN_SAMPLING_TEMPERATURE`.
        threshold: threshold decoding's threshold, ``None`` = quota decoding. seed: the choice's seed.
        cache: ``none`` | ``exact`` | ``prefix`` | ``dual`` (resolved from ``params.cache``).
        lanes: canvas variants forwarded per step (2 under CFG, else 1).
        branches / epsilon / ratio / no_repeat_ngram: speculative decoding's options, resolved (0/None otherwise).
        multi_block: multi-block decoding's fraction (``unmask.engine.multi_block``), ``None`` = off.
        model_block_size: the engine's default block (:attr:`EngineDefaults.block_size`), the bound of a request's
            own ``block_size`` (``unmask.engine.limits.check_block_use``).
        refinement: decoded by block refinement (``unmask.engine.refinement``: the families of
            :data:`REFINEMENT_FAMILIES`). editing_threshold: its token editing (``None`` = off);
            max_post_steps: editing steps after a block's last mask beyond the first.
        uniform: the uniform-canvas sampler's options (DiffusionGemma, ``unmask.engine.uniform_canvas``), None
            on the other families.
    """

    params: SamplingParams
    speculative: bool
    block_size: int
    draft_block: int | None
    window_size: int
    # sampling
    temperature: float
    sampling: bool
    threshold: float | None
    seed: int
    # forwards
    cache: str
    lanes: int
    # self-speculative decoding
    branches: int = 0
    epsilon: float | None = None
    ratio: float | None = None
    no_repeat_ngram: int = 0
    top_k: int = 0
    top_p: float = 1.0
    steps: int | None = None
    remasking: str = "low_confidence"
    cfg_scale: float = 0.0
    multi_block: float | None = None
    model_block_size: int = 1
    refinement: bool = False
    editing_threshold: float | None = None
    max_post_steps: int = 0
    uniform: UniformCanvasOptions | None = None

    def with_new_seed(self) -> "DecodingPlan":
        """The plan :func:`resolve` gives another request with the same (unchanged) parameters when their ``seed``
        is unset: this one with a new random seed (:func:`random_seed`) in ``seed`` and ``params.seed``. ``params``
        is copied, not validated again: it differs from this plan's validated parameters in the seed alone, drawn
        in range (``LLM.generate``'s prompts share one ``SamplingParams``, resolved once)."""
        seed = random_seed()
        params = copy.copy(self.params)
        params.seed = seed
        return replace(self, seed=seed, params=params)

    def for_choice(self, index: int) -> "DecodingPlan":
        """The plan of choice ``index`` of an ``n > 1`` request: seed ``(seed + index) mod 2**63``."""
        seed = (self.seed + index) % (MAX_SEED + 1)
        return replace(self, seed=seed, params=replace(self.params, seed=seed))


# The request fields self-speculative decoding has no use for (``unmask.engine.speculative``): it decides its own
# reveals, the drafts the causal path verifies, left to right, whatever these say. name -> (whether the request set
# it, why it has no effect there). Only the request's own values count: a checkpoint's ``default_sampling`` holds
# none of them but ``threshold``, which a speculative request never gets (:func:`resolve_params`), and
# ``dllm.sub_block_size`` is not ``params.sub_block_size``. Set on a request that asks for ``speculative=true``:
# a ParamError naming the field (:func:`check_speculative`); set on one that leaves ``speculative`` unset: the
# checkpoint's speculative default does not apply (:func:`speculative_conflicts`).
NOT_SPECULATIVE_FIELDS = {
    "steps": (lambda p: p.steps is not None, "a step keeps the drafts the causal path verifies, as many as it "
                                             "verifies: there is no step budget to spend"),
    "threshold": (lambda p: p.threshold is not None, "a draft is kept when the causal path verifies it, not by its "
                                                     "confidence"),
    "remasking": (lambda p: p.remasking not in (None, "low_confidence"),
                  "a step reveals the drafts the causal path verified, in their order: it chooses no reveal order"),
    "sub_block_size": (lambda p: p.sub_block_size is not None, "the draft block (block_size) is revealed left to "
                                                               "right, with no decoding windows inside it"),
}


def not_speculative_fields(params: SamplingParams) -> list[str]:
    """The fields of :data:`NOT_SPECULATIVE_FIELDS` this request sets, in that order (e.g. ``["steps"]``)."""
    return [name for name, (is_set, _) in NOT_SPECULATIVE_FIELDS.items() if is_set(params)]


def check_no_unused_fields(params: SamplingParams) -> None:
    """Raise :class:`ParamError` naming the first field of :data:`NOT_SPECULATIVE_FIELDS` a speculative request
    sets. Needs no model, so callers may check a request that sets ``speculative`` itself before loading one."""
    unused = not_speculative_fields(params)
    if unused:
        name = unused[0]
        raise ParamError(name, f"has no effect with speculative decoding, which decides its own reveals "
                               f"({NOT_SPECULATIVE_FIELDS[name][1]}): drop it, or set speculative=false to decode "
                               f"in parallel with it")


def speculative_conflicts(params: SamplingParams, model_block_size: int | None) -> list[str]:
    """The fields of a request that self-speculative decoding ignores or refuses (empty: a checkpoint's
    speculative default may apply), e.g. ``["steps", "cfg_scale"]``."""
    block = params.block_size or model_block_size
    checks = [(name, True) for name in not_speculative_fields(params)] + [
              ("cfg_scale", params.cfg_scale != 0),
              ("presence_penalty", params.presence_penalty != 0), ("frequency_penalty", params.frequency_penalty != 0),
              ("repetition_penalty", params.repetition_penalty != 1.0),
              (f"block_size over {MAX_SPECULATIVE_BLOCK}", block is not None and block > MAX_SPECULATIVE_BLOCK),
              ("multi_block", params.multi_block is not None)]
    return [name for name, bad in checks if bad]


def resolve_params(params: SamplingParams, default_sampling: dict | None = None,
                   model_block_size: int | None = None) -> SamplingParams:
    """A copy of ``params`` with ``temperature``, ``threshold``, ``remasking``, ``seed`` and ``speculative``
    resolved from the checkpoint's ``dllm.default_sampling`` (validated by
    :class:`~unmask.engine.config.DllmConfig`) and a random seed (see the module docstring for the rules).

    Raises:
        ParamError: ``speculative_branches`` / ``speculative_epsilon`` / ``speculative_ratio`` /
            ``speculative_no_repeat_ngram`` on a request that is not speculative.
    """
    defaults = default_sampling or {}
    speculative = params.speculative
    if speculative is None:
        speculative = (bool(defaults.get("speculative", False))
                       and not speculative_conflicts(params, model_block_size))
    for name in SPECULATIVE_ONLY_FIELDS:
        if getattr(params, name) is not None and not speculative:
            if not defaults.get("speculative", False):
                why = "this checkpoint does not decode speculatively by default: set speculative=true"
            else:
                conflicts = speculative_conflicts(params, model_block_size)
                why = (f"the request also sets {', '.join(conflicts)}, which self-speculative decoding does not "
                       f"do, so it keeps the ordinary decoding: drop {name}, or drop {' and '.join(conflicts)} "
                       "to get the speculative default")
            raise ParamError(name, f"only applies with self-speculative decoding; {why}")
    temperature = params.temperature
    if temperature is None:
        temperature = float(defaults.get("temperature", 0.0 if speculative else 1.0))
    threshold = params.threshold
    if (threshold is None and params.default_threshold and params.steps is None
            and params.remasking in (None, "low_confidence", defaults.get("remasking")) and not speculative
            and defaults.get("threshold") is not None):
        threshold = float(defaults["threshold"])
    remasking = params.remasking
    if remasking is None:  # the checkpoint's order applies to plain diffusion only: speculative steps reveal in order
        remasking = "low_confidence" if speculative else defaults.get("remasking", "low_confidence")
    seed = params.seed if params.seed is not None else random_seed()
    return replace(params, temperature=temperature, threshold=threshold, seed=seed, speculative=speculative,
                   remasking=remasking)


def random_seed() -> int:
    """The seed of a request that sets none: 56 random bits (``os.urandom``), within ``[0, MAX_SEED]``."""
    return int.from_bytes(os.urandom(7), "little")


def drafts_by_default(default_drafts: str, device_type: str) -> bool:
    """Whether checkpoint-default speculative requests draft. ``auto``: not on a CPU, where a forward's cost grows
    with its rows so that mask-group drafts cost more than they save (``benchmarks/results/``); on a GPU rows are
    ~free, so drafting stays the default there in every dtype, bf16 included. Its answers are then the parent's
    greedy answers in the serving dtype: every token is the argmax of the parent's causal logits for its prefix,
    computed in the verifying forward; they equal block 1's token for token until the first near-tie (top-2 logits
    within the dtype's rounding, which a verifying forward's other shape moves), as block 1's own answers do
    alone and in a batch. Declining drafts would not make a bf16 answer exact
    (docs/design.md#exactness-contracts-by-device-and-dtype); ``off`` serves block 1.

    Raises:
        ValueError: (names ``default_drafts``) not one of auto, on, off.
    """
    if default_drafts not in DRAFT_POLICIES:  # the one list: EngineConfig's choices
        raise ValueError(f"default_drafts: {default_drafts!r} is not one of auto, on, off")
    if default_drafts == "auto":
        return device_type != "cpu"
    return default_drafts == "on"


def check_speculative(params: SamplingParams, dllm: DllmConfig, model_block_size: int | None = None) -> None:
    """Raise :class:`ParamError` when this (resolved) request cannot be decoded self-speculatively: it needs a
    ``prefix_causal`` model with the logit shift (the causal path is then an AR model), none of the fields it has no
    use for (:data:`NOT_SPECULATIVE_FIELDS`: ``steps``, ``threshold``, a ``remasking`` other than
    ``low_confidence``, ``sub_block_size``; the request's own: a speculative request never gets the checkpoint's
    default threshold, and one that gets speculative decoding only from the checkpoint's default sets none of
    them), no CFG and no penalties (they would make the verifier differ from ``block_size=1`` decoding), a draft
    block of at most :data:`MAX_SPECULATIVE_BLOCK`; the relaxed acceptance rules are greedy only, the loop guard
    needs one. ``model_block_size``: the engine's default block (default: the checkpoint's)."""
    if dllm.attention != "prefix_causal" or not dllm.logit_shift:
        raise ParamError("speculative", f"needs a prefix_causal model with the logit shift; this {dllm.family} model "
                                        f"has attention {dllm.attention} and logit_shift={dllm.logit_shift}")
    check_no_unused_fields(params)
    for name in ("speculative_epsilon", "speculative_ratio"):
        if getattr(params, name) is not None and float(params.temperature or 0.0) >= MIN_SAMPLING_TEMPERATURE:
            raise ParamError(name, f"relaxed acceptance applies to greedy verification only: needs temperature 0, "
                                   f"got {params.temperature} (sampling requests are verified by speculative sampling, "
                                   f"which is exact)")
    if (params.speculative_no_repeat_ngram and params.speculative_epsilon is None
            and params.speculative_ratio is None):  # 0 (off) is fine anywhere: there is nothing to guard
        raise ParamError("speculative_no_repeat_ngram", "guards relaxed acceptance only: set speculative_epsilon or "
                                                        "speculative_ratio (greedy requests), or leave it out "
                                                        "(exact verification and speculative sampling keep the "
                                                        "causal path's tokens, which the guard never blocks)")
    if params.cfg_scale > 0:
        raise ParamError("speculative", "cannot be combined with cfg_scale > 0")
    if params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0:
        raise ParamError("speculative", "cannot be combined with presence/frequency/repetition penalties")
    block = params.block_size or model_block_size or dllm.block_size
    if block > MAX_SPECULATIVE_BLOCK:
        raise ParamError("block_size", f"self-speculative decoding drafts at most {MAX_SPECULATIVE_BLOCK} tokens per "
                                       f"step (a step forwards up to block_size^2 rows), got {block}")


def check_multi_block(params: SamplingParams, dllm: DllmConfig, window_size: int, block_size: int) -> None:
    """Raise :class:`ParamError` (``multi_block``) when multi-block decoding cannot serve this (resolved) request:
    it needs block order (``prefix_causal`` / ``block_causal`` attention), whole-block windows and no
    self-speculative decoding or grammar constraint (docs/design.md#constrained-decoding and #the-seeds-methods)."""
    if dllm.attention == "bidirectional":
        raise ParamError("multi_block", f"needs a prefix_causal or block_causal model (blocks in order); this "
                                        f"{dllm.family} model's attention is bidirectional")
    if window_size < block_size:
        raise ParamError("multi_block", f"needs whole-block decoding windows; sub_block_size is {window_size} < "
                                        f"block_size {block_size}")
    if params.speculative:
        raise ParamError("multi_block", "cannot be combined with self-speculative decoding (speculative=true)")
    if params.constraint is not None:
        raise ParamError("multi_block", f"cannot be combined with a grammar constraint ({params.constraint.field}): "
                                        "a grammar reveals one left-to-right prefix "
                                        "(docs/design.md#constrained-decoding)")


#: families decoded by block refinement (LLaDA2.x: ``unmask.engine.refinement``), the rule their reference
#: pipeline (diffusers' LLaDA2Pipeline) applies
REFINEMENT_FAMILIES = ("llada2",)
DEFAULT_POST_STEPS = 16  # LLaDA2Pipeline(max_post_steps=16)


def check_refinement(params: SamplingParams, dllm: DllmConfig, window_size: int, block_size: int) -> bool:
    """Whether this (resolved) request is decoded by block refinement, and whether it may be: the families of
    :data:`REFINEMENT_FAMILIES` always are (their rule commits by confidence, whole blocks at a time, in order),
    and token editing (``editing_threshold``) exists only there.

    Raises:
        ParamError: ``editing_threshold`` on another family; on a refinement family ``multi_block``,
            ``sub_block_size`` below the block, a ``remasking`` other than ``low_confidence`` or a grammar
            constraint (names the field).
    """
    if dllm.family not in REFINEMENT_FAMILIES:
        if params.editing_threshold:
            raise ParamError("editing_threshold", f"token editing is LLaDA2.1's block refinement "
                                                  f"(families {', '.join(REFINEMENT_FAMILIES)}); this model is "
                                                  f"{dllm.family}")
        return False
    why = "block refinement commits whole blocks in order by confidence (docs/design.md#decoding)"
    if params.speculative:
        raise ParamError("speculative", f"self-speculative decoding needs a prefix_causal model; {dllm.family} "
                                        f"is decoded by block refinement")
    if params.multi_block is not None:
        raise ParamError("multi_block", f"not with {dllm.family}: {why}")
    if window_size < block_size:
        raise ParamError("sub_block_size", f"not with {dllm.family}: {why}")
    if params.remasking not in (None, "low_confidence"):
        raise ParamError("remasking", f"{dllm.family} commits by confidence (low_confidence) only: {why}")
    if params.constraint is not None:
        raise ParamError(params.constraint.field, f"grammar constraints reveal one left-to-right prefix; not with "
                                                  f"{dllm.family}: {why}")
    return True


def uniform_canvas_plan(params: SamplingParams, dllm: DllmConfig, d: EngineDefaults) -> DecodingPlan:
    """The plan of a request on a uniform-canvas family (DiffusionGemma: ``unmask.engine.uniform_options``): its
    sampler's options, the canvas as the block, a seed; nothing of the masked-diffusion plan applies.

    Raises:
        ParamError: a uniform-canvas field on another family, or what ``uniform_canvas_options`` refuses (names
            the field); a ``block_size`` other than the canvas length.
    """
    if dllm.family not in UNIFORM_CANVAS_FAMILIES:
        name = next(f for f in UNIFORM_FIELDS if getattr(params, f) is not None)
        raise ParamError(name, f"an option of the uniform-canvas sampler (families "
                               f"{', '.join(UNIFORM_CANVAS_FAMILIES)}); this model is {dllm.family}")
    opts = uniform_canvas_options(params, d.default_sampling)
    if params.block_size not in (None, d.block_size):
        raise ParamError("block_size", f"this {dllm.family} model refines canvases of {d.block_size} tokens only "
                                       f"(canvas_length), got {params.block_size}")
    seed = params.seed if params.seed is not None else random_seed()
    p = replace(params, seed=seed, block_size=d.block_size, speculative=False)
    return DecodingPlan(params=p, speculative=False, block_size=d.block_size, draft_block=None,
                        window_size=d.block_size, temperature=opts.t_max, sampling=True, threshold=None, seed=seed,
                        cache="none", lanes=1, model_block_size=d.block_size, uniform=opts)


def resolve_cache(mode: str, dllm: DllmConfig) -> str:
    """The cache mode a request runs: ``auto`` = ``exact`` on a causal model (its committed KV never changes),
    ``none`` on a bidirectional one; ``prefix``/``dual`` on a causal model = ``exact`` (already a prefix cache);
    ``prefix``/``dual`` on a bidirectional model are approximate and opt-in (``unmask.engine.kv_cache``)."""
    causal = dllm.attention != "bidirectional"
    if mode == "none":
        return "none"
    if mode == "auto" or causal:
        return "exact" if causal else "none"
    return mode


def resolve(params: SamplingParams, dllm: DllmConfig, default_drafts: str = "auto", device_type: str = "cpu",
            defaults: EngineDefaults | None = None) -> DecodingPlan:
    """The frozen plan of choice 0 of a request (:meth:`DecodingPlan.for_choice` gives the others).

    Args:
        params: the request's parameters (validated). dllm: the checkpoint's diffusion settings.
        default_drafts: the engine's draft policy (``auto`` | ``on`` | ``off``; see :func:`drafts_by_default`).
        device_type: the model's device type (``cpu``, ``cuda``...).
        defaults: the engine's :class:`EngineDefaults` (:func:`engine_defaults`); replaces ``default_drafts`` and
            ``device_type``. None = the checkpoint's, under those two.

    Raises:
        ParamError: a parameter this model cannot honour (names the field).
        ValueError: ``default_drafts`` is not a policy.
    """
    d = defaults if defaults is not None else engine_defaults(dllm, None, device_type, default_drafts)
    if dllm.family in UNIFORM_CANVAS_FAMILIES or any(getattr(params, f) is not None for f in UNIFORM_FIELDS):
        return uniform_canvas_plan(params, dllm, d)
    p = resolve_params(params, d.default_sampling, d.block_size)
    if (p.speculative and params.speculative is None and params.block_size is None
            and params.speculative_options is None and not d.drafts):
        p = replace(p, block_size=1)
    default_block = d.block_size  # plain diffusion may have its own (not a request's field: not its limits)
    if not p.speculative and d.diffusion_block_size is not None:
        default_block = d.diffusion_block_size
    if dllm.fixed_block_size and p.block_size not in (None, d.block_size):
        raise ParamError("block_size", f"this {dllm.family} model decodes with its trained block size "
                                       f"{d.block_size} only, got {p.block_size}")
    causal = dllm.attention != "bidirectional"
    if p.suffix is not None and p.suffix != "" and p.suffix != [] and causal:
        raise ParamError("suffix", f"infilling needs a bidirectional model; this model's attention is "
                                   f"{dllm.attention}")
    if p.constraints and causal:
        raise ParamError("constraints", f"fixed-position constraints need a bidirectional model; this model's "
                                        f"attention is {dllm.attention}")
    if p.constraint is not None and (p.constraints or (p.suffix is not None and p.suffix not in ("", []))):
        raise ParamError(p.constraint.field, "a grammar constraint cannot be combined with fixed-position "
                                             "constraints or a suffix (infilling): the grammar is applied to the "
                                             "revealed left-to-right prefix (docs/design.md#constrained-decoding)")
    bs = p.block_size or default_block
    # refused, not clamped (docs/design.md#admission-and-limits)
    if p.sub_block_size is not None and p.sub_block_size > bs:
        raise ParamError("sub_block_size", f"must be <= block_size ({bs}), got {p.sub_block_size}")
    temperature = float(p.temperature or 0.0)
    common = dict(params=p, block_size=bs, window_size=min(p.sub_block_size or dllm.sub_block_size or bs, bs),
                  temperature=temperature, sampling=temperature >= MIN_SAMPLING_TEMPERATURE, seed=int(p.seed),
                  cache=resolve_cache(p.cache, dllm), lanes=2 if p.cfg_scale > 0 else 1, top_k=p.top_k,
                  top_p=p.top_p, steps=p.steps, remasking=p.remasking, cfg_scale=p.cfg_scale,
                  model_block_size=d.block_size)
    if check_refinement(p, dllm, common["window_size"], bs):
        return DecodingPlan(speculative=False, draft_block=None, threshold=p.threshold, refinement=True,
                            editing_threshold=p.editing_threshold or None,
                            max_post_steps=DEFAULT_POST_STEPS if p.max_post_steps is None else p.max_post_steps,
                            **common)
    if p.multi_block is not None:
        check_multi_block(p, dllm, common["window_size"], bs)
    if not p.speculative:
        return DecodingPlan(speculative=False, draft_block=None, threshold=p.threshold, multi_block=p.multi_block,
                            **common)
    check_speculative(p, dllm, d.block_size)
    opts = p.speculative_options
    b = opts.branches if opts is not None else None
    if b is not None and b > bs - 1:  # a fallback group per draft position at most: refused, not clamped
        raise ParamError("speculative_branches", f"must be <= block_size - 1 ({bs - 1}): one fallback group per "
                                                 f"draft position, got {b}")
    branches = min(DEFAULT_BRANCHES if b is None else int(b), bs - 1)
    epsilon, ratio = p.speculative_epsilon, p.speculative_ratio
    guard = p.speculative_no_repeat_ngram
    no_repeat = 0 if epsilon is None and ratio is None else DEFAULT_NO_REPEAT_NGRAM if guard is None else int(guard)
    return DecodingPlan(speculative=True, draft_block=bs, threshold=None, branches=branches, epsilon=epsilon,
                        ratio=ratio, no_repeat_ngram=no_repeat, **common)
