"""Per-request sampling parameters, in the style of vLLM's ``SamplingParams`` (DESIGN.md sections 4 and 10)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

from .limits import (CACHE_MODES, MAX_SEED, MAX_SPECULATIVE_BLOCK, MAX_STOP, REMASKING_STRATEGIES, ParamError,
                     check, check_number)

__all__ = ["SamplingParams", "ParamError", "MAX_SEED", "CACHE_MODES", "REMASKING_STRATEGIES"]

SPECULATIVE_ONLY_FIELDS = ("speculative_branches", "speculative_epsilon", "speculative_ratio",
                           "speculative_no_repeat_ngram")  # need speculative


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
            as possible, remainder to the earliest blocks, at least one per block. ``None`` = one token per step:
            ``max_tokens`` rounded up to whole blocks (the canvas's masked positions; a request stops as soon as its
            first ``max_tokens`` are revealed), unless the checkpoint's default threshold applies (see
            :meth:`with_defaults`).
        block_size: block length in tokens; ``None`` = the checkpoint's ``dllm.block_size``.
        sub_block_size: decoding window inside a block (Fast-dLLM v2's sub-blocks): positions are revealed window
            by window, left to right, while attention and caching stay per block; the step budget is split over
            the windows. ``None`` = the checkpoint's ``dllm.sub_block_size``, else the whole block.
        remasking: which masked positions are revealed first: ``low_confidence`` | ``margin`` | ``entropy`` |
            ``random`` (LLaDA / Dream names).
        threshold: when set, threshold decoding (Fast-dLLM): reveal every position whose candidate probability
            is >= threshold, and always at least the best one; ``steps`` is then ignored. ``None`` = the
            checkpoint's ``dllm.default_sampling.threshold`` when the request sets no ``steps`` and keeps the
            default ``remasking``, else quota decoding.
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
        cache: ``auto`` | ``none`` | ``prefix`` | ``dual`` (KV-cache policy; see ``unmask.engine.kv_cache``).
        logprobs: record the log-probability each token had at the step it was revealed.
        speculative: self-speculative decoding (``unmask.engine.speculative``): mask-block drafts verified by the
            model's causal path; greedy: the output is token for token the model's ``block_size=1`` greedy decoding;
            temperature > 0: speculative sampling, every token distributed as ``block_size=1`` sampling from the
            verifying model (the causal path, or the checkpoint's verifier) would draw it. ``prefix_causal`` models with the logit shift only (``temperature`` ``None`` resolves to the
            checkpoint's, else 0); ``steps``, ``threshold`` and ``remasking`` do not apply; ``block_size`` is the draft block. ``None`` =
            the checkpoint's ``dllm.default_sampling.speculative`` where the request allows it (see
            :meth:`with_defaults`), else off.
        speculative_branches: fallback mask groups per step (drafts for when draft i is the first rejected),
            ``0..block_size - 1``; ``None`` = ``min(3, block_size - 1)``. More rows per forward, fewer wasted steps.
        speculative_epsilon: Medusa's typical acceptance (Cai et al. 2024, section 2.3.1) instead of exact
            verification: a draft is also accepted when its causal probability is > ``min(eps, sqrt(eps) *
            exp(-H))`` (H = entropy of the causal distribution). In (0, 1]; ``None`` = exact (output = greedy).
            Greedy requests only.
        speculative_ratio: relaxed verification by the probability gap to the top token instead of exact
            verification: a draft is also accepted when its causal probability is at least ``ratio`` times the
            causal argmax's (the tolerance of SpecDec's relaxed top-beta verification, Xia et al. 2023, with
            ``tau = -log(ratio)``; ``top_k``/``top_p`` act as the top-beta cap, since drafts outside the filter are
            always rejected). Unlike typical acceptance it only keeps near-ties of the causal path (the parent's, for
            a checkpoint with a verifier), whatever its entropy. In (0, 1] (1 = exact up to exact ties); ``None`` = exact.
            Greedy requests only; not together with ``speculative_epsilon``.
        speculative_no_repeat_ngram: the loop guard of the relaxed rules: a draft they would keep although it is not
            the causal argmax is rejected (the argmax is taken instead) when it completes an n-gram of this many
            tokens that the generated text already contains. Lossy acceptance otherwise drifts into repetition
            loops the exact path would not have entered (``benchmarks/results/loop-guard/``); the causal argmax itself
            is never blocked, so exact-path repetition stays as it is. ``None`` = 3 when ``speculative_epsilon`` or
            ``speculative_ratio`` is set; 0 = off; at most 64. A value > 0 needs a relaxed rule.

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
    remasking: str = "low_confidence"
    threshold: float | None = None
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
    speculative: bool | None = None
    speculative_branches: int | None = None
    speculative_epsilon: float | None = None
    speculative_ratio: float | None = None
    speculative_no_repeat_ngram: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
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
        if self.remasking not in REMASKING_STRATEGIES:
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

    def with_defaults(self, default_sampling: dict | None = None, model_block_size: int | None = None
                      ) -> "SamplingParams":
        """A copy with ``temperature``, ``threshold`` and ``seed`` resolved from the checkpoint's
        ``dllm.default_sampling`` (validated by :class:`~unmask.engine.config.DllmConfig`) and a random seed.

        ``temperature``: the request's, else the checkpoint's, else 1.0. ``threshold``: the checkpoint's only when
        the request sets neither ``threshold`` nor ``steps`` and keeps ``remasking="low_confidence"`` (a step
        count or another remasking order asks for quota decoding). ``speculative``: the request's, else the
        checkpoint's when the request is one self-speculative decoding can serve as asked (no ``steps`` or
        ``threshold``, ``remasking="low_confidence"``, no CFG, no penalties, a draft block - the request's, else
        ``model_block_size`` - of at most 32), else off; greedy and sampling requests alike (sampling ones are
        verified by speculative sampling). A speculative request whose temperature neither it nor the checkpoint
        sets decodes greedily (0 instead of 1.0) and takes no default threshold (it does not use one).

        Raises:
            ParamError: ``speculative_branches`` / ``speculative_epsilon`` / ``speculative_ratio`` /
                ``speculative_no_repeat_ngram`` on a request that is not speculative.
        """
        defaults = default_sampling or {}
        speculative = self.speculative
        if speculative is None:
            speculative = bool(defaults.get("speculative", False)) and self._fits_speculative(model_block_size)
        for name in SPECULATIVE_ONLY_FIELDS:
            if getattr(self, name) is not None and not speculative:
                if not defaults.get("speculative", False):
                    why = "this checkpoint does not decode speculatively by default: set speculative=true"
                else:
                    conflicts = self._speculative_conflicts(model_block_size)
                    why = (f"the request also sets {', '.join(conflicts)}, which self-speculative decoding does not "
                           f"do, so it keeps the ordinary decoding: drop {name}, or drop {' and '.join(conflicts)} "
                           "to get the speculative default")
                raise ParamError(name, f"only applies with self-speculative decoding; {why}")
        temperature = self.temperature
        if temperature is None:
            temperature = float(defaults.get("temperature", 0.0 if speculative else 1.0))
        threshold = self.threshold
        if (threshold is None and self.steps is None and self.remasking == "low_confidence" and not speculative
                and defaults.get("threshold") is not None):
            threshold = float(defaults["threshold"])
        seed = self.seed if self.seed is not None else int.from_bytes(os.urandom(7), "little")
        return replace(self, temperature=temperature, threshold=threshold, seed=seed, speculative=speculative)

    def _speculative_conflicts(self, model_block_size: int | None) -> list[str]:
        """The fields of this request that self-speculative decoding ignores or refuses (empty: a checkpoint's
        speculative default may apply), e.g. ``["steps", "cfg_scale"]``."""
        block = self.block_size or model_block_size
        checks = [("steps", self.steps is not None), ("threshold", self.threshold is not None),
                  ("remasking", self.remasking != "low_confidence"), ("cfg_scale", self.cfg_scale != 0),
                  ("presence_penalty", self.presence_penalty != 0), ("frequency_penalty", self.frequency_penalty != 0),
                  ("repetition_penalty", self.repetition_penalty != 1.0),
                  (f"block_size over {MAX_SPECULATIVE_BLOCK}", block is not None and block > MAX_SPECULATIVE_BLOCK)]
        return [name for name, bad in checks if bad]

    def _fits_speculative(self, model_block_size: int | None) -> bool:
        """Whether a checkpoint's speculative default may apply: the request asks for nothing that self-speculative
        decoding ignores or refuses (a request outside it silently keeps the ordinary decoding)."""
        return not self._speculative_conflicts(model_block_size)
