"""Logits -> candidate tokens and confidences for the masked positions of one request (docs/design.md#decoding).

Everything here works on one request at a time (``[N, V]`` logits of its N masked positions in the active block),
with the request's own ``torch.Generator``: a row's result never depends on the other rows of the batch. The one
Gumbel-max draw (:func:`gumbel_argmax`: float64 uniforms drawn on the CPU, so a draw does not depend on the
device) and the one forbidden-token mask (:func:`forbid`) of the engine live here; plain denoising and
self-speculative decoding both use them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .limits import MIN_SAMPLING_TEMPERATURE
from .params import SamplingParams

NEG_INF = float("-inf")


def gumbel_argmax(scores: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """``argmax(scores + g)`` per row of ``[N, V]`` float64 ``scores``, ``g`` standard Gumbel from ``generator``
    (float64 uniforms drawn on the CPU, moved to ``scores``' device). With ``scores = l / T`` this equals LLaDA's
    ``argmax(exp(l) / (-log u)^T)``; with ``scores = log p`` it samples from ``p``. Returns ``[N]`` int64."""
    u = torch.rand(scores.shape, dtype=torch.float64, generator=generator, device="cpu").to(scores.device)
    gumbel = -torch.log(-torch.log(u.clamp_min(1e-300)))
    return torch.argmax(scores + gumbel, dim=-1)


def sample_from_probs(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per row of ``probs`` (``[N, V]`` float64, rows summing to 1; zero-probability tokens are never
    drawn) by :func:`gumbel_argmax` over ``log p``. Returns ``[N]`` int64 on ``probs``' device."""
    return gumbel_argmax(torch.log(probs), generator)


def forbid(logits: torch.Tensor, ids: torch.Tensor | None = None, rows: torch.Tensor | None = None,
           row_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Set forbidden tokens' logits to -inf, in place, and return ``logits`` (``[N, V]`` float).

    Args:
        ids: ``[F]`` int64 ids never generated (the model's ``never_generate_ids``: mask, pad), in every row.
        rows: ``[N]`` bool rows where ``row_ids`` are also forbidden (EOS/stop ids under ``min_tokens``).
        row_ids: ``[E]`` int64.
    """
    if ids is not None and ids.numel():
        logits[:, ids.to(logits.device)] = NEG_INF
    if rows is not None and row_ids is not None:
        idx = rows.nonzero(as_tuple=True)[0]
        if idx.numel():
            logits[idx.to(logits.device)[:, None], row_ids.to(logits.device)[None, :]] = NEG_INF
    return logits


def add_bias(logits: torch.Tensor, bias: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """OpenAI's ``logit_bias``: ``bias = ([K] int64 ids, [K] float biases)`` added to those columns of every row
    of ``[N, V]`` float ``logits``, in place (-inf stays -inf); returns ``logits``. ``None``: unchanged."""
    if bias is not None:
        ids, values = bias
        logits[:, ids.to(logits.device)] += values.to(device=logits.device, dtype=logits.dtype)
    return logits


@dataclass
class Candidates:
    """Sampler output for N masked positions.

    Attributes:
        tokens: ``[N]`` int64 candidate token per position.
        probability: ``[N]`` float64 probability of the candidate under the softmax of the final logits at
            temperature 1 (the quantity compared with the threshold, docs/design.md#decisions).
        score: ``[N]`` float64 ordering score of the remasking strategy (higher = revealed first).
        logprob: ``[N]`` float32 log-probability of the candidate (reported as ``logprobs``).
        top_ids / top_logprobs: ``[N, k]`` int64 / float32, the k most likely tokens of each row and their
            log-probabilities under the same distribution (``SamplingParams.top_logprobs`` = k), or None.
    """

    tokens: torch.Tensor
    probability: torch.Tensor
    score: torch.Tensor
    logprob: torch.Tensor
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None

    def take(self, rows: torch.Tensor) -> "Candidates":
        """The candidates of ``rows`` (an index or mask tensor)."""
        top = (None, None) if self.top_ids is None else (self.top_ids[rows], self.top_logprobs[rows])
        return Candidates(self.tokens[rows], self.probability[rows], self.score[rows], self.logprob[rows], *top)

    @staticmethod
    def cat(parts: list["Candidates"]) -> "Candidates":
        """The rows of ``parts`` one after another (their ``top_*`` all given or all None)."""
        fields = ["tokens", "probability", "score", "logprob"] + (["top_ids", "top_logprobs"]
                                                                  if parts[0].top_ids is not None else [])
        return Candidates(*(torch.cat([getattr(c, f) for c in parts]) for f in fields))

    def top(self, rows: list[int]) -> list[tuple[tuple[int, float], ...]]:
        """Per row of ``rows`` its alternatives as ``((token id, logprob), ...)`` without the ones the filters
        removed (-inf) or padding (id -1); empty tuples without ``top_ids``."""
        if self.top_ids is None:
            return [()] * len(rows)
        ids, lps = self.top_ids[rows].tolist(), self.top_logprobs[rows].tolist()
        return [tuple((i, lp) for i, lp in zip(ri, rl) if i >= 0 and lp > float("-inf")) for ri, rl in zip(ids, lps)]


def classifier_free_guidance(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """LLaDA's CFG: ``uncond + (1 + scale) * (cond - uncond)``; shapes ``[N, V]``, any float dtype."""
    return uncond + (1.0 + scale) * (cond - uncond)


def apply_penalties(logits: torch.Tensor, context_ids: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Presence/frequency (OpenAI) and repetition (CTRL, as vLLM) penalties, in place.

    Args:
        logits: ``[N, V]`` float logits.
        context_ids: ``[T]`` int64 prompt + revealed token ids (the tokens the penalties count).
    """
    if params.presence_penalty == 0 and params.frequency_penalty == 0 and params.repetition_penalty == 1.0:
        return logits
    V = logits.shape[-1]
    ids = context_ids[(context_ids >= 0) & (context_ids < V)]
    counts = torch.bincount(ids, minlength=V).to(logits.dtype)
    present = counts > 0
    if params.repetition_penalty != 1.0:
        rp = params.repetition_penalty
        penalised = torch.where(logits > 0, logits / rp, logits * rp)
        logits = torch.where(present[None, :], penalised, logits)
    if params.frequency_penalty:
        logits = logits - params.frequency_penalty * counts[None, :]
    if params.presence_penalty:
        logits = logits - params.presence_penalty * present.to(logits.dtype)[None, :]
    return logits


def filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k and outside the top-p nucleus to -inf. ``[N, V]`` -> ``[N, V]``.

    top-p keeps the smallest set of most likely tokens whose probability sums to >= top_p (Holtzman et al. 2020),
    always at least one token.
    """
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, NEG_INF)
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits.float(), dim=-1)
        cum_before = probs.cumsum(dim=-1) - probs
        drop_sorted = cum_before >= top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, NEG_INF)
    return logits


def sample_candidates(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator,
    forbidden_ids: torch.Tensor | None = None,
    forbidden_rows: torch.Tensor | None = None,
    row_forbidden_ids: torch.Tensor | None = None,
    context_ids: torch.Tensor | None = None,
    bias: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> Candidates:
    """Choose a candidate token per masked position and score it.

    Args:
        logits: ``[N, V]`` logits (after logit shift and CFG) of the N masked positions of the active block.
        params: the request's parameters (``temperature`` already resolved, not None).
        generator: the request's generator; Gumbel noise is float64 uniform from it (LLaDA ``add_gumbel_noise``).
        forbidden_ids: ``[F]`` ids that are never generated (mask, pad): logit -inf everywhere.
        forbidden_rows: ``[N]`` bool, rows where ``row_forbidden_ids`` (EOS/stop ids under ``min_tokens``) are
            also forbidden.
        context_ids: ``[T]`` prompt + revealed ids for the penalties.
        bias: ``logit_bias`` as ``(ids, biases)`` (:func:`add_bias`), added after the forbidden ids.

    Returns:
        :class:`Candidates`. Candidate: temperature 0 -> argmax; else ``argmax(l / T + g)`` with g standard
        Gumbel (equal to LLaDA's ``argmax(exp(l) / (-log u)^T)``). Scores by ``params.remasking``:
        ``low_confidence`` = p(candidate); ``margin`` = p1 - p2 (Dream); ``entropy`` = -H(p) (Dream);
        ``random`` = uniform from the generator (LLaDA); ``left_to_right`` = -(row index): the leftmost masked
        position first (rows are the masked positions in ascending order), as semi-autoregressive decoding.
    """
    logits = prepare_logits(logits, params, forbidden_ids, forbidden_rows, row_forbidden_ids, context_ids, bias)
    logits = filter_top_k_top_p(logits, params.top_k, params.top_p)
    tokens = draw(logits, params, generator)
    return score_candidates(logits, tokens, params, generator)


def prepare_logits(logits: torch.Tensor, params: SamplingParams, forbidden_ids: torch.Tensor | None = None,
                   forbidden_rows: torch.Tensor | None = None, row_forbidden_ids: torch.Tensor | None = None,
                   context_ids: torch.Tensor | None = None,
                   bias: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Steps 3 of docs/design.md#decoding before the filters: a float32 copy of ``[N, V]`` ``logits`` with the
    forbidden ids at -inf, ``logit_bias`` added and the penalties applied (arguments as
    :func:`sample_candidates`)."""
    logits = forbid(logits.float(), forbidden_ids, forbidden_rows, row_forbidden_ids)
    logits = add_bias(logits, bias)
    if context_ids is not None:
        logits = apply_penalties(logits, context_ids, params)
    return logits


def draw(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> torch.Tensor:
    """The candidate of each row of filtered ``[N, V]`` logits: argmax at temperature 0, else Gumbel-max
    ``argmax(l / T + g)``. Returns ``[N]`` int64."""
    temperature = float(params.temperature or 0.0)
    if temperature < MIN_SAMPLING_TEMPERATURE:
        # 0 = argmax; a positive temperature this small is argmax too (the noise cannot change the order), and
        # l / T would overflow float64 to -inf for every token (then argmax picked index 0, a filtered token)
        return torch.argmax(logits, dim=-1)
    return gumbel_argmax(logits.to(torch.float64) / temperature, generator)


def score_candidates(logits: torch.Tensor, tokens: torch.Tensor, params: SamplingParams,
                     generator: torch.Generator) -> Candidates:
    """Probability, ordering score (``params.remasking``) and log-probability of ``tokens`` (``[N]``) under the
    filtered ``[N, V]`` ``logits`` at temperature 1."""
    lse = log_normalizer(logits)
    cand_logp = logits.gather(-1, tokens[:, None])[:, 0].to(torch.float64) - lse
    probability = cand_logp.exp()
    strategy = params.remasking or "low_confidence"  # None: unresolved (plan.resolve_params), the default order
    if strategy == "low_confidence":
        score = probability
    elif strategy == "margin":
        top2 = (torch.topk(logits, 2, dim=-1).values.to(torch.float64) - lse[:, None]).exp()
        score = top2[:, 0] - top2[:, 1]
    elif strategy == "entropy":
        log_probs = torch.log_softmax(logits.to(torch.float64), dim=-1)
        p = log_probs.exp()
        score = torch.where(p > 0, p * log_probs, torch.zeros_like(p)).sum(dim=-1)
    elif strategy == "random":
        score = torch.rand(tokens.shape, dtype=torch.float64, generator=generator, device="cpu").to(tokens.device)
    elif strategy == "left_to_right":  # with a threshold: the leftmost masked position plus every confident one
        score = -torch.arange(tokens.shape[0], dtype=torch.float64, device=tokens.device)
    else:  # pragma: no cover - validated in SamplingParams
        raise ValueError(f"remasking: unknown strategy {strategy!r}")
    top_ids = top_lp = None
    if params.top_logprobs:  # the k most likely tokens under the same distribution
        values, top_ids = torch.topk(logits, min(params.top_logprobs, logits.shape[-1]), dim=-1)
        top_lp = (values.to(torch.float64) - lse[:, None]).float()
    return Candidates(tokens=tokens, probability=probability, score=score, logprob=cand_logp.float(),
                      top_ids=top_ids, top_logprobs=top_lp)


def forced_candidates(tokens: list[int], like: Candidates) -> Candidates:
    """Tokens a grammar forces (probability 1, log-probability 0; the only alternative is the token itself), on
    ``like``'s devices and dtypes, with ``top_*`` when ``like`` has them."""
    def t(value, have):
        return torch.tensor(value, dtype=have.dtype, device=have.device)

    n = len(tokens)
    top = (None, None)
    if like.top_ids is not None:
        k = like.top_ids.shape[-1]
        ids = [[tok] + [-1] * (k - 1) for tok in tokens]
        top = (t(ids, like.top_ids).reshape(n, k), t([[0.0] + [float("-inf")] * (k - 1)] * n,
                                                     like.top_logprobs).reshape(n, k))
    return Candidates(t(tokens, like.tokens), t([1.0] * n, like.probability), t([1.0] * n, like.score),
                      t([0.0] * n, like.logprob), *top)


def log_normalizer(logits: torch.Tensor) -> torch.Tensor:
    """``log sum_v exp(l_v)`` per row of ``[N, V]`` float32 logits, as ``[N]`` float64.

    The hot path of every step: a float64 ``log_softmax`` over ``[N, V]`` (N up to the block size, V ~ 50k) costs
    several times more than this. The row max is subtracted in float32 (exact for the max itself), the
    exponentials are taken in float32 (relative error ~6e-8 per term) and summed in float64, so the candidate
    probabilities differ from a float64 softmax by a relative ~1e-7 - far below the 1e-4 near-tie bound of
    docs/design.md#decisions. A row whose logits are all -inf gives -inf (never happens: top-k/top-p keep one token).
    """
    row_max = logits.amax(dim=-1, keepdim=True)
    safe_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    sums = torch.exp(logits - safe_max).sum(dim=-1, dtype=torch.float64)
    return sums.log() + safe_max[:, 0].to(torch.float64)


def reveal_count(masked_left: int, steps_left: int) -> int:
    """Quota-mode reveal count ``k = ceil(m / r)``, recomputed every step (LLaDA ``get_num_transfer_tokens``
    gives the same counts when the block's masks divide evenly). ``steps_left <= 0`` reveals everything."""
    if masked_left <= 0:
        return 0
    if steps_left <= 1:
        return masked_left
    return -(-masked_left // steps_left)  # integer ceil: exact for any size (a float quotient can underflow)


def select_reveals(cands: Candidates, quota: int | None, threshold: float | None) -> torch.Tensor:
    """Indices (into the N candidates) to reveal this step.

    Quota mode: the ``quota`` highest scores. Threshold mode: every candidate whose probability is >= threshold,
    plus the highest score (at least one per step, Fast-dLLM). Returns a ``[k]`` int64 tensor, k >= 1 when N >= 1.
    """
    n = cands.tokens.shape[0]
    if n == 0:
        return torch.empty(0, dtype=torch.long)
    best = torch.argmax(cands.score)
    if threshold is not None:
        chosen = cands.probability >= threshold
        chosen[best] = True
        return chosen.nonzero(as_tuple=True)[0]
    k = max(1, min(int(quota or 1), n))
    return torch.topk(cands.score, k).indices
