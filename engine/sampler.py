"""Logits -> candidate tokens and confidences for the masked positions of one step (docs/design.md#decoding).

One call samples the rows of many requests at once (:func:`sample_groups`: each request's rows a
:class:`RowGroup` with its own parameters), on the logits' device, with no host read: the per-row values
(temperatures, filters, keys) travel host-to-device and the result stays on the device until the step's one
summary copy (``unmask.engine.batch_step``). A row's result depends only on its own logits, its request's
parameters and its keys, never on the other rows (batch invariance). Randomness is counter-based
(``unmask.engine.noise``): a Gumbel draw is a function of (seed, step, position, column). The one Gumbel-max draw
(:func:`gumbel_argmax`) and the one forbidden-token mask (:func:`forbid`) of the engine live here; plain denoising,
self-speculative decoding and grammar sampling all use them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .limits import MIN_SAMPLING_TEMPERATURE
from .noise import GUMBEL, REMASK, Draws, uniform
from .params import SamplingParams
from .transfer import to_device

NEG_INF = float("-inf")


def gumbel_argmax(scores: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``argmax(scores + g)`` per row of ``[N, V]`` float64 ``scores``, ``g`` standard Gumbel from the
    counter-based uniforms of the rows' ``[N]`` int64 ``keys`` (``unmask.engine.noise``), drawn on ``scores``'
    device. With ``scores = l / T`` this equals LLaDA's ``argmax(exp(l) / (-log u)^T)``; with ``scores = log p`` it
    samples from ``p``. Returns ``[N]`` int64."""
    u = uniform(keys, scores.shape[-1], scores.device)
    return torch.argmax(scores - torch.log(-torch.log(u)), dim=-1)


def sample_from_probs(probs: torch.Tensor, draws: Draws, stream: int = GUMBEL) -> torch.Tensor:
    """One token per row of ``probs`` (``[N, V]`` float64, rows summing to 1; zero-probability tokens are never
    drawn) by :func:`gumbel_argmax` over ``log p`` with ``draws``' keys of ``stream``. Returns ``[N]`` int64 on
    ``probs``' device."""
    return gumbel_argmax(torch.log(probs), draws.keys(stream, probs.shape[0]))


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
    counts = to_device(torch.bincount(ids, minlength=V).to(logits.dtype), logits.device)  # no blocking copy
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


def filter_rows(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                k_width: int | None = None) -> torch.Tensor:
    """:func:`filter_top_k_top_p` with a setting per row, equal to it row by row (tested): ``top_k`` ``[N]``
    int64 (0, or >= V: no top-k), ``top_p`` ``[N]`` float32 (>= 1: no nucleus); ``None``: no row has one;
    ``k_width``: a bound >= every active row's k (one ``topk`` of that width finds each row's k-th value; None:
    a full sort). ``[N, V]`` -> ``[N, V]``, no host read (the static post-forward step,
    ``unmask.engine.step_graphs``)."""
    V = logits.shape[-1]
    if top_k is not None:
        width = V if k_width is None else min(int(k_width), V)
        on = (top_k > 0) & (top_k < V)
        at = (top_k.clamp(1, width) - 1)[:, None]
        kth = torch.topk(logits, width, dim=-1).values.gather(-1, at)
        kth = torch.where(on[:, None], kth, torch.full_like(kth, NEG_INF))
        logits = logits.masked_fill(logits < kth, NEG_INF)
    if top_p is not None:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits.float(), dim=-1)
        cum_before = probs.cumsum(dim=-1) - probs
        drop_sorted = (cum_before >= top_p[:, None]) & (top_p < 1.0)[:, None]
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, NEG_INF)
    return logits


@dataclass
class RowGroup:
    """One request's rows ``[lo, hi)`` in a :func:`sample_groups` call.

    Attributes:
        params: the request's parameters (``temperature`` resolved, not None).
        draws: its step's counter-based draws, keyed by the positions the rows predict.
        min_tokens_rows: ``[n]`` bool (host), rows where ``min_tokens_ids`` (EOS/stop ids under ``min_tokens``) are
            forbidden too; ``None``: none.
        min_tokens_ids: ``[E]`` int64 (host).
        context_ids: ``[T]`` int64 prompt + revealed ids for the penalties (``None``: no penalty).
        bias: ``logit_bias`` as ``([K] int64 ids, [K] float32 biases)`` (:func:`add_bias`), or ``None``.
        left_to_right_base: the ``left_to_right`` score of the group's first row is ``-base`` (rows are the
            masked positions in ascending order; a request's several windows continue the count).
    """

    lo: int
    hi: int
    params: SamplingParams
    draws: Draws
    min_tokens_rows: torch.Tensor | None = None
    min_tokens_ids: torch.Tensor | None = None
    context_ids: torch.Tensor | None = None
    bias: tuple[torch.Tensor, torch.Tensor] | None = None
    left_to_right_base: int = 0

    @property
    def n(self) -> int:
        return self.hi - self.lo


def sample_candidates(
    logits: torch.Tensor,
    params: SamplingParams,
    draws: Draws,
    forbidden_ids: torch.Tensor | None = None,
    forbidden_rows: torch.Tensor | None = None,
    row_forbidden_ids: torch.Tensor | None = None,
    context_ids: torch.Tensor | None = None,
    bias: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> Candidates:
    """Choose a candidate token per masked position of one request and score it: :func:`sample_groups` with one
    group (arguments as :class:`RowGroup`; ``forbidden_rows``/``row_forbidden_ids`` = its ``min_tokens_*``)."""
    group = RowGroup(0, logits.shape[0], params, draws, forbidden_rows, row_forbidden_ids, context_ids, bias)
    return sample_groups(logits, [group], forbidden_ids)


def sample_groups(logits: torch.Tensor, groups: list[RowGroup], forbidden_ids: torch.Tensor | None = None
                  ) -> Candidates:
    """Candidates for the rows of many requests at once (docs/design.md#decoding, steps 3-6).

    Args:
        logits: ``[N, V]`` logits (after logit shift and CFG) of the masked positions of every group, edited in
            place when float32.
        groups: the requests' :class:`RowGroup` s, covering ``[0, N)`` in order.
        forbidden_ids: ``[F]`` ids never generated (mask, pad): -inf in every row.

    Returns:
        :class:`Candidates` of all N rows on the logits' device. Candidate: temperature 0 -> argmax; else
        ``argmax(l / T + g)`` with g standard Gumbel (LLaDA's ``argmax(exp(l) / (-log u)^T)``). Scores by the
        group's ``remasking``: ``low_confidence`` = p(candidate); ``margin`` = p1 - p2 (Dream); ``entropy`` = -H(p)
        (Dream); ``random`` = a counter-based uniform; ``left_to_right`` = -(row index in the request). ``top_*``:
        ``[N, k]`` with k the largest ``top_logprobs`` asked (-1 ids / -inf beyond a group's own k), or None.
    """
    logits = prepare_groups(logits, groups, forbidden_ids)
    logits = filter_groups(logits, groups)
    tokens = draw_groups(logits, groups)
    return score_groups(logits, tokens, groups)


def _rows_of(groups: list[RowGroup], device) -> torch.Tensor:
    """``[n]`` int64 on ``device``: the rows of ``groups``."""
    return to_device(torch.cat([torch.arange(g.lo, g.hi, dtype=torch.long) for g in groups]), device)


def _by(groups: list[RowGroup], key) -> dict:
    """``groups`` split by ``key(group)`` (insertion order)."""
    out: dict = {}
    for g in groups:
        out.setdefault(key(g), []).append(g)
    return out


def prepare_groups(logits: torch.Tensor, groups: list[RowGroup], forbidden_ids: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """Step 3 of docs/design.md#decoding before the filters: ``[N, V]`` float32 logits with the forbidden ids at
    -inf, each group's ``min_tokens`` rows, ``logit_bias`` and penalties applied (one indexed write each for the
    whole batch; penalties per penalised group)."""
    logits = forbid(logits.float(), forbidden_ids)
    dev = logits.device
    rows, cols = [], []
    for g in groups:
        if g.min_tokens_rows is not None and g.min_tokens_ids is not None and g.min_tokens_ids.numel():
            r = g.min_tokens_rows.cpu().nonzero(as_tuple=True)[0] + g.lo
            rows.append(r.repeat_interleave(g.min_tokens_ids.numel()))
            cols.append(g.min_tokens_ids.cpu().repeat(r.numel()))
    if rows:
        at = to_device(torch.stack([torch.cat(rows), torch.cat(cols)]), dev)
        logits.index_put_((at[0], at[1]), logits.new_full((), NEG_INF))
    rows, cols, vals = [], [], []
    for g in groups:
        if g.bias is not None and g.n:
            ids, values = g.bias
            rows.append(torch.arange(g.lo, g.hi).repeat_interleave(ids.numel()))
            cols.append(ids.cpu().repeat(g.n))
            vals.append(values.cpu().repeat(g.n))
    if rows:
        at = to_device(torch.stack([torch.cat(rows), torch.cat(cols)]), dev)
        logits.index_put_((at[0], at[1]), to_device(torch.cat(vals), dev).to(logits.dtype), accumulate=True)
    for g in groups:
        if g.context_ids is not None and g.n:
            logits[g.lo:g.hi] = apply_penalties(logits[g.lo:g.hi], g.context_ids, g.params)
    return logits


def filter_groups(logits: torch.Tensor, groups: list[RowGroup]) -> torch.Tensor:
    """Step 4: each group's top-k then top-p (:func:`filter_top_k_top_p`), one call per distinct setting."""
    for (k, p), gs in _by(groups, lambda g: (g.params.top_k, g.params.top_p)).items():
        if not ((k and k < logits.shape[-1]) or p < 1.0):
            continue
        if len(gs) == len(groups) and gs[0].lo == 0 and gs[-1].hi == logits.shape[0]:
            logits = filter_top_k_top_p(logits, k, p)
        else:
            rows = _rows_of(gs, logits.device)
            logits[rows] = filter_top_k_top_p(logits[rows], k, p)
    return logits


def sampling_temperature(params: SamplingParams) -> float:
    """The sampling temperature, 0 for argmax (a positive temperature this small is argmax too: the noise cannot
    change the order, and l / T would overflow float64 to -inf for every token)."""
    t = float(params.temperature or 0.0)
    return t if t >= MIN_SAMPLING_TEMPERATURE else 0.0


def draw_groups(logits: torch.Tensor, groups: list[RowGroup]) -> torch.Tensor:
    """Step 5: the candidate of each row of filtered ``[N, V]`` logits: argmax at temperature 0, else Gumbel-max
    ``argmax(l / T + g)`` over the sampled groups' rows at once. Returns ``[N]`` int64."""
    tokens = torch.argmax(logits, dim=-1)
    sampled = [g for g in groups if sampling_temperature(g.params) and g.n]
    if not sampled:
        return tokens
    dev = logits.device
    rows = _rows_of(sampled, dev)
    temps = to_device(torch.cat([torch.full((g.n,), sampling_temperature(g.params), dtype=torch.float64) for g in sampled]), dev)
    keys = torch.cat([g.draws.keys(GUMBEL, g.n) for g in sampled])
    tokens[rows] = gumbel_argmax(logits[rows].to(torch.float64) / temps[:, None], keys)
    return tokens


def draw(logits: torch.Tensor, params: SamplingParams, draws: Draws) -> torch.Tensor:
    """:func:`draw_groups` for one request's rows. Returns ``[N]`` int64."""
    return draw_groups(logits, [RowGroup(0, logits.shape[0], params, draws)])


def strategy_score(strategy: str, logits: torch.Tensor, lse: torch.Tensor, probability: torch.Tensor,
                   remask_keys: torch.Tensor | None = None, order: torch.Tensor | None = None) -> torch.Tensor:
    """``[n]`` float64 ordering scores of ``n`` rows under the remasking ``strategy``, from their filtered ``[n, V]``
    ``logits``, ``[n]`` float64 log-normalizers ``lse`` and candidate ``probability``; ``remask_keys`` (``[n]``
    int64, ``random``) and ``order`` (``[n]``, ``left_to_right``: the row's index among its request's masked
    positions) where the strategy reads them. Row by row: a row's score depends on that row only."""
    if strategy == "low_confidence":
        return probability
    if strategy == "margin":
        top2 = (torch.topk(logits, 2, dim=-1).values.to(torch.float64) - lse[:, None]).exp()
        return top2[:, 0] - top2[:, 1]
    if strategy == "entropy":
        log_probs = torch.log_softmax(logits.to(torch.float64), dim=-1)
        p = log_probs.exp()
        return torch.where(p > 0, p * log_probs, torch.zeros_like(p)).sum(dim=-1)
    if strategy == "random":
        return uniform(remask_keys, 1, logits.device)[:, 0]
    if strategy == "left_to_right":  # with a threshold: the leftmost masked position plus every confident one
        return -to_device(order, logits.device).to(torch.float64)  # a host-built order: a non-blocking copy
    raise ValueError(f"remasking: unknown strategy {strategy!r}")  # pragma: no cover - validated in SamplingParams


def _strategy_scores(logits: torch.Tensor, lse: torch.Tensor, probability: torch.Tensor, strategy: str,
                     gs: list[RowGroup], rows: torch.Tensor) -> torch.Tensor:
    """``[n]`` float64 ordering scores of the ``rows`` (``[n]`` int64, on the logits' device) of the groups ``gs``,
    which share the remasking ``strategy``: one computation for all of them (:func:`strategy_score`)."""
    keys = torch.cat([g.draws.keys(REMASK, g.n) for g in gs]) if strategy == "random" else None
    order = (torch.cat([torch.arange(g.left_to_right_base, g.left_to_right_base + g.n) for g in gs])
             if strategy == "left_to_right" else None)
    own = logits[rows] if strategy in ("margin", "entropy") else logits
    return strategy_score(strategy, own, lse[rows], probability[rows], keys, order)


def score_groups(logits: torch.Tensor, tokens: torch.Tensor, groups: list[RowGroup]) -> Candidates:
    """Step 6: probability, ordering score and log-probability of ``tokens`` (``[N]``) under the filtered
    ``[N, V]`` ``logits`` at temperature 1, and the ``top_logprobs`` alternatives."""
    lse = log_normalizer(logits)
    cand_logp = logits.gather(-1, tokens[:, None])[:, 0].to(torch.float64) - lse
    probability = cand_logp.exp()
    by_strategy = _by(groups, lambda g: g.params.remasking or "low_confidence")  # None: unresolved, the default
    if list(by_strategy) in ([], ["low_confidence"]):
        score = probability
    else:
        score = torch.empty_like(probability)
        for strategy, gs in by_strategy.items():
            rows = _rows_of(gs, logits.device)
            score[rows] = _strategy_scores(logits, lse, probability, strategy, gs, rows)
    top_ids, top_lp = _top_alternatives(logits, lse, groups)
    return Candidates(tokens=tokens, probability=probability, score=score, logprob=cand_logp.float(),
                      top_ids=top_ids, top_logprobs=top_lp)


def _top_alternatives(logits: torch.Tensor, lse: torch.Tensor, groups: list[RowGroup]):
    """``[N, k]`` int64 ids and float32 log-probabilities of each row's ``top_logprobs`` most likely tokens (k: the
    widest asked; -1 / -inf padding) or ``(None, None)``: one ``topk`` per distinct k (its order among equal logits
    depends on k: a mate's wider ``topk`` gave a request other alternatives than alone)."""
    k = min(max([g.params.top_logprobs for g in groups] + [0]), logits.shape[-1])
    by_k = _by(groups, lambda g: min(g.params.top_logprobs, k)) if k else {}
    ids = torch.full((logits.shape[0], k), -1, dtype=torch.long, device=logits.device) if len(by_k) > 1 else None
    lps = torch.full((logits.shape[0], k), float("-inf"), device=logits.device) if ids is not None else None
    for kk, gs in by_k.items():
        rows = _rows_of(gs, logits.device) if ids is not None else slice(None)  # one k: every row in one call
        values, top = torch.topk(logits[rows], kk, dim=-1)
        lp = (values.to(torch.float64) - lse[rows, None]).float()
        if ids is None:
            return top, lp
        ids[rows, :kk], lps[rows, :kk] = top, lp
    return ids, lps


def score_candidates(logits: torch.Tensor, tokens: torch.Tensor, params: SamplingParams, draws: Draws,
                     left_to_right_base: int = 0) -> Candidates:
    """:func:`score_groups` for one request's rows."""
    group = RowGroup(0, logits.shape[0], params, draws, left_to_right_base=left_to_right_base)
    return score_groups(logits, tokens, [group])


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
