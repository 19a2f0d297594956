"""Prompt log-probabilities (docs/design.md#http-contract: completions ``echo`` + ``logprobs``, ``prompt_logprobs``).

Two methods, chosen by the checkpoint (:func:`scoring_method`):

* ``causal`` (exact): a model with a causal path - ``prefix_causal`` attention, or ``block_causal`` with blocks
  aligned to the generation (a prompt's committed rows are then strictly causal), and the logit shift. One forward
  of the prompt with the committed rows' causal mask is the AR parent's forward; token ``i``'s log-probability is
  read from output ``i - 1``. The first token has none (``None``, as OpenAI's ``echo``).
* ``monte_carlo`` (an estimate, bidirectional families: LLaDA, Dream): the masked-diffusion bound of the prompt's
  log-likelihood, estimated as in LLaDA's evaluation: each of ``samples`` draws picks a masking ratio ``t`` (the
  draws stratified over (0, 1]), masks ``m = ceil(t * L)`` of the ``L`` scored positions (every token but the
  first, which stays as the condition) at random, runs one bidirectional forward and adds the log-probabilities of
  the masked tokens weighted by ``L / m`` (LLaDA's ``1 / t``). Token ``i``'s value is its mean contribution over
  the draws, so the values add up to the estimate of ``log p(tokens[1:] | tokens[0])`` (a lower bound on it in
  expectation, as LLaDA's); ``stderr`` is the standard error of that sum over the draws. A fixed ``seed`` makes
  it reproducible. ``top`` lists only the token itself (alternatives have no per-token estimate).

Other checkpoints (block-causal without a causal path: SDAR, Fast-dLLM v2) raise :class:`ParamError`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .limits import ParamError
from .loaded import LoadedModel
from .text_ids import check_token_ids

DEFAULT_MC_SAMPLES = 64  # LLaDA's evaluation uses 128; 64 keeps a request's cost near one generation step per draw
MAX_MC_SAMPLES = 1024
MC_BATCH = 8             # draws per forward


@dataclass
class PromptScores:
    """The log-probabilities of a prompt's tokens.

    Attributes:
        token_ids: the prompt's tokens.
        logprobs: per token, its log-probability (None for the first); a Monte-Carlo contribution for
            ``monte_carlo``.
        top: per token, ``{token_id: logprob}`` of its ``top_k`` likeliest alternatives (``causal``; the token
            itself for ``monte_carlo``), None for the first.
        ranks: per token, its rank among the vocabulary (1 = likeliest; ``causal`` only, else None).
        method: ``causal`` (exact) or ``monte_carlo`` (an estimate). samples: draws (0 for ``causal``).
        total: the sum of ``logprobs``; stderr: its standard error (0.0 for ``causal``).
    """

    token_ids: list[int]
    logprobs: list[float | None]
    top: list[dict[int, float] | None]
    ranks: list[int | None]
    method: str
    samples: int = 0
    total: float = 0.0
    stderr: float = 0.0
    seed: int | None = field(default=None)

    @property
    def estimate(self) -> bool:
        return self.method == "monte_carlo"


def scoring_method(model: LoadedModel) -> str | None:
    """``causal``, ``monte_carlo`` or None (this checkpoint's prompts cannot be scored)."""
    d = model.dllm
    if d.logit_shift and (d.attention == "prefix_causal"
                          or (d.attention == "block_causal" and d.block_alignment == "generation")):
        return "causal"
    if d.attention == "bidirectional":
        return "monte_carlo"
    return None


def check_scoring(model: LoadedModel, prompt_ids: list[int], samples: int | None = None) -> str:
    """The method for ``prompt_ids``; raises :class:`ParamError` when they cannot be scored."""
    method = scoring_method(model)
    if method is None:
        d = model.dllm
        raise ParamError("logprobs", f"prompt log-probabilities need a causal path (prefix_causal, or block_causal "
                                     f"aligned to the generation, with the logit shift) or a bidirectional model; this "
                                     f"{d.family} model is {d.attention} (alignment {d.block_alignment}, logit_shift="
                                     f"{d.logit_shift})")
    if not prompt_ids:
        raise ParamError("prompt", "is empty")
    check_token_ids("prompt", prompt_ids, model.vocab_size)  # an id past the vocabulary fails an index, a 500
    if len(prompt_ids) > model.max_context:
        raise ParamError("prompt", f"{len(prompt_ids)} tokens exceed the model's context of {model.max_context}")
    if samples is not None and not 1 <= samples <= MAX_MC_SAMPLES:
        raise ParamError("logprobs_samples", f"must be in [1, {MAX_MC_SAMPLES}], got {samples}")
    return method


@torch.inference_mode()
def score_prompt(model: LoadedModel, prompt_ids: list[int], top_k: int = 0, samples: int | None = None,
                 seed: int = 0) -> PromptScores:
    """Log-probabilities of ``prompt_ids`` (module docstring): exact on a causal path, else a Monte-Carlo
    estimate from ``samples`` draws (default :data:`DEFAULT_MC_SAMPLES`) seeded with ``seed``.

    Raises:
        ParamError: the checkpoint has no way to score prompts, the prompt is empty or too long, ``samples`` out of
            range.
    """
    method = check_scoring(model, prompt_ids, samples)
    if method == "causal":
        return _causal(model, prompt_ids, top_k)
    return _monte_carlo(model, prompt_ids, samples or DEFAULT_MC_SAMPLES, seed)


def _forward(model: LoadedModel, ids: torch.Tensor, causal: bool) -> torch.Tensor:
    """Hidden states ``[B, L, H]`` of ``ids`` ``[B, L]`` under a causal or a full (bidirectional) mask."""
    B, L = ids.shape
    pos = torch.arange(L, device=model.device).expand(B, L)
    mask = torch.ones(L, L, dtype=torch.bool, device=model.device)
    if causal:
        mask = torch.tril(mask)
    return model.hidden_states(ids, pos, mask.expand(B, 1, L, L))


def _causal(model: LoadedModel, prompt_ids: list[int], top_k: int) -> PromptScores:
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=model.device)
    hidden = _forward(model, ids, causal=True)[0, :-1]  # output i-1 predicts token i
    logprobs: list[float | None] = [None]
    top: list[dict[int, float] | None] = [None]
    ranks: list[int | None] = [None]
    target = ids[0, 1:]
    for lo in range(0, hidden.shape[0], 256):  # the logits a chunk at a time: [256, V] float32
        lp = torch.log_softmax(model.logits(hidden[lo:lo + 256]), dim=-1)
        tgt = target[lo:lo + 256]
        own = lp.gather(1, tgt[:, None])[:, 0]
        rank = (lp > own[:, None]).sum(dim=1) + 1
        logprobs.extend(own.tolist())
        ranks.extend(rank.tolist())
        if top_k:
            vals, idx = lp.topk(top_k, dim=-1)
            top.extend({int(i): float(v) for i, v in zip(ii, vv)} for ii, vv in zip(idx.tolist(), vals.tolist()))
        else:
            top.extend({} for _ in range(len(tgt)))
    total = math.fsum(v for v in logprobs if v is not None)
    return PromptScores(list(prompt_ids), logprobs, top, ranks, "causal", total=total)


def _monte_carlo(model: LoadedModel, prompt_ids: list[int], samples: int, seed: int) -> PromptScores:
    d = model.dllm
    dev = model.device
    L = len(prompt_ids) - 1  # scored positions 1..L; token 0 is the condition
    contrib = torch.zeros(samples, len(prompt_ids), dtype=torch.float64)
    if L > 0:
        gen = torch.Generator().manual_seed(seed)
        u = torch.rand((), generator=gen).item()
        ratios = [((u + j) / samples) % 1.0 or 1.0 for j in range(samples)]  # stratified over (0, 1]
        seq = torch.tensor(prompt_ids, dtype=torch.long)
        for lo in range(0, samples, MC_BATCH):
            batch = ratios[lo:lo + MC_BATCH]
            masked = torch.zeros(len(batch), len(prompt_ids), dtype=torch.bool)
            weight = torch.zeros(len(batch), dtype=torch.float64)
            for b, t in enumerate(batch):
                m = max(1, math.ceil(t * L))
                masked[b, 1 + torch.randperm(L, generator=gen)[:m]] = True
                weight[b] = L / m
            noisy = torch.where(masked, torch.full_like(seq, d.mask_token_id), seq)
            hidden = _forward(model, noisy.to(dev), causal=False)
            rows = masked.nonzero()
            b_idx, p_idx = rows[:, 0], rows[:, 1]
            out_idx = p_idx - 1 if d.logit_shift else p_idx  # Dream reads position i from output i-1
            for r in range(0, len(rows), 512):  # the logits of 512 masked rows at a time
                bi, pi, oi = b_idx[r:r + 512], p_idx[r:r + 512], out_idx[r:r + 512]
                lp = torch.log_softmax(model.logits(hidden[bi.to(dev), oi.to(dev)]), dim=-1)
                own = lp.gather(1, seq[pi].to(dev)[:, None])[:, 0].double().cpu()
                contrib[lo + bi, pi] = own * weight[bi]
    per_token = contrib.mean(dim=0)
    totals = contrib.sum(dim=1)
    stderr = float(totals.std(unbiased=True) / math.sqrt(samples)) if samples > 1 else float("inf")
    logprobs: list[float | None] = [None] + per_token[1:].tolist()
    top: list[dict[int, float] | None] = [None] + [{t: v} for t, v in zip(prompt_ids[1:], logprobs[1:])]
    return PromptScores(list(prompt_ids), logprobs, top, [None] * len(prompt_ids), "monte_carlo", samples=samples,
                        total=float(totals.mean()), stderr=stderr, seed=seed)
