"""Self-speculative verification of many sequences in one pass (docs/design.md#decoding, "Self-speculative decoding").

Every speculative sequence of a step contributes its rows (the causal rows from ``f - 1``, then its mask groups'
rows: ``SpeculativeSequence.lane_inputs``). On the model's device, for all of them at once: the forbidden ids,
``min_tokens`` and ``logit_bias`` (``unmask.engine.sampler.prepare_groups``), a grammar's masks on a constrained
sequence's causal rows, top-k/top-p (``filter_groups``); then per row the argmax and its log-probability, the
log-probability of the draft the row verifies and the relaxed rules' verdict on it, and under speculative sampling the
acceptance test, the residual draw (:func:`speculative_rows`) and the draw of a next draft, for every row whatever
the host will decide (each is a function of its own row and counter-based keys, so computing the unused ones changes
nothing). One device-to-host copy carries them (:class:`VerifyRows`); each sequence then accepts, reveals and picks
its next drafts on the host (``SpeculativeSequence.advance``). A grammar-constrained sequence's own host reads (its
masks, its drafts under the grammar) come on top and are its own.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .grammar_sampling import mask_verifier_rows
from .noise import ACCEPT, DRAFT, RESIDUAL, Draws, row_keys, uniform
from .outputs import StepEvent
from .sampler import RowGroup, filter_groups, gumbel_argmax, log_normalizer, prepare_groups
from .sequence import guided_rows
from .transfer import to_device

__all__ = ["VerifyRows", "relaxed_accept", "speculative_rows", "verify_batch"]

#: columns of the packed host copy, before the ``top_logprobs`` ids and log-probabilities
COLUMNS = ("best", "best_prob", "best_lp", "draft_prob", "draft_lp", "relaxed", "accept", "sample", "sample_prob",
           "sample_lp", "draft_sample")


@dataclass
class VerifyRows:
    """One sequence's rows of a verification pass, on the host (a list per column, one entry per row).

    Attributes:
        best / best_prob / best_lp: the row's argmax, its probability (float64) and log-probability (float32
            widened), under the filtered logits at temperature 1.
        draft_prob / draft_lp: the same for the draft the row verifies (rows ``0 .. D - 1``; 0 elsewhere).
        relaxed: the relaxed rule (``speculative_ratio`` / ``speculative_epsilon``) keeps the row's draft.
        accept: speculative sampling accepts the row's draft (``u * q(d) < p(d)``).
        sample / sample_prob / sample_lp: speculative sampling's token for the row's position: the residual draw
            from ``norm(max(0, p - q))`` at a draft row, the draw from ``p`` at the row after the last draft.
        draft_sample: speculative sampling's draft drawn from a mask row's distribution.
        top: per row its ``top_logprobs`` alternatives ``((id, logprob), ...)`` (causal rows), or ``None``.
    """

    best: list
    best_prob: list
    best_lp: list
    draft_prob: list
    draft_lp: list
    relaxed: list
    accept: list
    sample: list
    sample_prob: list
    sample_lp: list
    draft_sample: list
    top: list | None


def speculative_rows(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, u: torch.Tensor, keys: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling's per-row verdicts (Leviathan et al. 2023, Algorithm 1), for rows of many requests.

    Args:
        p: ``[N, V]`` float64 target (causal) distributions.
        q: ``[N, V]`` float64 distributions the rows' drafts were drawn from (``p`` itself on a row without a draft).
        drafts: ``[N]`` int64 draft ids (any id on a row without a draft).
        u: ``[N]`` float64 acceptance uniforms. keys: ``[N]`` int64 counter-based keys of the residual draws.

    Returns:
        ``accept`` ``[N]`` bool (``u * q(d) < p(d)``, i.e. ``u < p / q`` without dividing by q) and ``token`` ``[N]``
        int64 drawn from ``norm(max(0, p - q))``, or from ``p`` where that residual is empty (``q == p``: no draft,
        or p == q up to rounding).
    """
    d = drafts[:, None]
    accept = u * q.gather(-1, d)[:, 0] < p.gather(-1, d)[:, 0]
    residual = (p - q).clamp_min(0.0)
    total = residual.sum(-1, keepdim=True)
    dist = torch.where(total > 1e-12, residual / total, p)
    return accept, gumbel_argmax(torch.log(dist), keys)


def relaxed_accept(logits: torch.Tensor, drafts: torch.Tensor, log_ratio: torch.Tensor, eps: torch.Tensor,
             is_ratio: torch.Tensor) -> torch.Tensor:
    """``[n]`` bool verdicts of the relaxed rules on rows ``[n, V]`` float32 (forbidden ids at -inf) for their
    ``[n]`` drafts: ``speculative_ratio`` where ``is_ratio`` (``log p(d) >= log max p + log ratio``: SpecDec's
    relaxed verification, Xia et al. 2023), else Medusa's typical acceptance (Cai et al. 2024, section 2.3.1:
    ``p(d) > min(eps, sqrt(eps) * exp(-H(p)))``)."""
    logp = torch.log_softmax(logits.to(torch.float64), dim=-1)
    logp_draft = logp.gather(-1, drafts[:, None])[:, 0]
    by_ratio = logp_draft >= logp.max(-1).values + log_ratio
    p = logp.exp()
    entropy = -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(-1)
    typical = logp_draft.exp() > torch.minimum(eps.sqrt() * torch.exp(-entropy), eps)
    return torch.where(is_ratio, by_ratio, typical)


class _Plan:
    """The host-side index lists of one pass: which rows are drafts, relaxed, sampled, and their keys."""

    def __init__(self, seqs: list, sizes: list[int]):
        self.draft = []  # [R] draft id verified by each row (-1: none)
        self.rel_rows, self.rel_ratio, self.rel_eps, self.rel_is_ratio = [], [], [], []
        self.samp_rows, self.samp_temp, self.ver_rows, self.q_at, self.mask_rows = [], [], [], [], []
        self.accept_keys, self.residual_keys, self.draft_keys, self.q = [], [], [], []
        self.groups, self.offsets = [], []
        n = 0
        for seq, k in zip(seqs, sizes):
            self._add(seq, n, k)
            n += k
        self.n = n

    def _add(self, seq, n: int, k: int) -> None:
        lay = seq._layout
        drafts, f = lay["drafts"], lay["f"]
        D = len(drafts)
        pred = lay["pred_pos"]
        self.offsets.append(n)
        p = seq.params
        early = (torch.tensor(pred) - seq.prompt_len < p.min_tokens) if p.min_tokens else None
        self.groups.append(RowGroup(n, n + k, p, Draws(seq.plan.seed, seq.step), early, seq.min_tokens_ids, None,
                                    seq.logit_bias))
        self.draft += list(drafts) + [-1] * (k - D)
        if D and (seq.ratio is not None or seq.epsilon is not None) and not seq.sampling:
            self.rel_rows += range(n, n + D)
            self.rel_ratio += [math.log(float(seq.ratio)) if seq.ratio is not None else 0.0] * D
            self.rel_eps += [float(seq.epsilon) if seq.epsilon is not None else 1.0] * D
            self.rel_is_ratio += [seq.ratio is not None] * D
        if not seq.sampling:
            return
        base = len(self.samp_rows)  # index of the sequence's first row among the sampled rows
        self.samp_rows += range(n, n + k)
        self.samp_temp += [float(seq.temperature)] * k
        self.q_at += range(len(self.ver_rows), len(self.ver_rows) + D)  # its draft rows among the causal ones
        self.ver_rows += range(base, base + D + 1)
        if D:
            self.q.append(seq.draft_probs[:D])
        self.accept_keys.append(row_keys(seq.plan.seed, seq.step, ACCEPT, range(f, f + D)))
        self.residual_keys.append(row_keys(seq.plan.seed, seq.step, RESIDUAL, range(f, f + D + 1)))
        if seq.grammar is None:  # a constrained sequence draws its drafts under the grammar (on the host)
            self.mask_rows += range(base + D + 1, base + k)
            self.draft_keys.append(row_keys(seq.plan.seed, seq.step, DRAFT, pred[D + 1:]))


def _sampled(logits: torch.Tensor, plan: _Plan, lse: torch.Tensor, cols: dict) -> torch.Tensor | None:
    """Speculative sampling's columns (accept, sample and its probabilities, draft_sample) of the sampled rows;
    returns their ``[n, V]`` float64 distributions (the next step's ``q`` are slices of it)."""
    if not plan.samp_rows:
        return None
    dev = logits.device
    rows = to_device(torch.tensor(plan.samp_rows, dtype=torch.long), dev)
    temps = to_device(torch.tensor(plan.samp_temp, dtype=torch.float64), dev)
    p = torch.softmax(logits[rows].to(torch.float64) / temps[:, None], dim=-1)
    ver = to_device(torch.tensor(plan.ver_rows, dtype=torch.long), dev)
    q = p[ver].clone()  # a row without a draft: q = p (no residual: the draw is from p)
    draft = cols["draft"][rows[ver]]
    u = torch.ones(len(plan.ver_rows), dtype=torch.float64, device=dev)
    if plan.q_at:
        at = to_device(torch.tensor(plan.q_at, dtype=torch.long), dev)
        q[at] = torch.cat(plan.q).to(device=dev, dtype=torch.float64)
        u[at] = uniform(torch.cat(plan.accept_keys), 1, dev)[:, 0]
    accept, token = speculative_rows(p[ver], q, draft.clamp_min(0), u, torch.cat(plan.residual_keys))
    out_rows = rows[ver]
    cols["accept"][out_rows] = accept.to(torch.float64)
    cols["sample"][out_rows] = token.to(torch.float64)
    lp = logits[out_rows].gather(-1, token[:, None])[:, 0].to(torch.float64) - lse[out_rows]
    cols["sample_prob"][out_rows] = lp.exp()
    cols["sample_lp"][out_rows] = lp.float().to(torch.float64)
    if plan.mask_rows:
        m = to_device(torch.tensor(plan.mask_rows, dtype=torch.long), dev)
        cols["draft_sample"][rows[m]] = gumbel_argmax(torch.log(p[m]), torch.cat(plan.draft_keys)).to(torch.float64)
    return p


def _tops(logits: torch.Tensor, lse: torch.Tensor, seqs: list, sizes: list[int], plan: _Plan) -> torch.Tensor | None:
    """``[R, 2 * k]`` float64 ``top_logprobs`` ids then log-probabilities (k: the widest asked; -1 / -inf padding)
    of the causal rows of the sequences that ask for them, one ``topk`` per distinct k."""
    by_k: dict[int, list[int]] = {}
    for seq, k, lo in zip(seqs, sizes, plan.offsets):
        if seq.top_ids is not None:
            by_k.setdefault(int(seq.top_ids.shape[-1]), []).extend(range(lo, lo + len(seq._layout["drafts"]) + 1))
    if not by_k:
        return None
    kmax = max(by_k)
    dev = logits.device
    out = torch.full((plan.n, 2 * kmax), -1.0, dtype=torch.float64, device=dev)
    out[:, kmax:] = float("-inf")
    for k, rows in by_k.items():
        r = to_device(torch.tensor(rows, dtype=torch.long), dev)
        values, ids = torch.topk(logits[r], min(k, logits.shape[-1]), dim=-1)
        w = ids.shape[-1]
        out[r, :w] = ids.to(torch.float64)
        out[r, kmax: kmax + w] = (values.to(torch.float64) - lse[r, None]).float().to(torch.float64)
    return out


def verify_batch(seqs: list, spans: list[tuple[int, int]], logits: torch.Tensor, forbidden_ids: torch.Tensor | None
                 ) -> list[tuple[StepEvent, torch.Tensor]]:
    """Verify the drafts of ``seqs`` (``SpeculativeSequence`` s after ``lane_inputs``) from one step's logits.

    Args:
        spans: ``(start, end)`` of each sequence's rows in ``logits``.
        logits: ``[R', V]`` float logits of the forwards' needed rows (edited in place when float32).
        forbidden_ids: ``[F]`` int64 ids never generated, or None.

    Returns:
        per sequence ``(event, commit)``: its :class:`StepEvent` and the ``[m]`` int64 chunk indices to commit.
    """
    rows, _ = guided_rows(seqs, [[span] for span in spans], logits)  # one lane each: no CFG
    sizes = [b - a for a, b in spans]
    plan = _Plan(seqs, sizes)
    rows = prepare_groups(rows, plan.groups, forbidden_ids)
    for seq, lo, k in zip(seqs, plan.offsets, sizes):
        if seq.grammar is not None:  # masked verifier rows (docs/design.md#constrained-decoding)
            mask_verifier_rows(rows[lo: lo + k], seq.grammar, seq._layout["drafts"])
    rows = filter_groups(rows, plan.groups)
    host = _columns(rows, plan, seqs, sizes)
    out = []
    for seq, lo, k in zip(seqs, plan.offsets, sizes):
        verdicts, p = _slice(host, lo, lo + k)
        out.append(seq.advance(verdicts, rows[lo: lo + k], p))
    return out


def _columns(rows: torch.Tensor, plan: _Plan, seqs: list, sizes: list[int]) -> dict:
    """Every column of the pass on the device, then packed and copied to the host once."""
    dev = rows.device
    n = plan.n
    best = torch.argmax(rows, dim=-1)
    lse = log_normalizer(rows)
    draft = to_device(torch.tensor(plan.draft, dtype=torch.long), dev)
    best_lp = rows.gather(-1, best[:, None])[:, 0].to(torch.float64) - lse
    draft_lp = rows.gather(-1, draft.clamp_min(0)[:, None])[:, 0].to(torch.float64) - lse
    zeros = torch.zeros(n, dtype=torch.float64, device=dev)
    cols = {"draft": draft, "relaxed": zeros.clone(), "accept": zeros.clone(), "sample": zeros.clone(),
            "sample_prob": zeros.clone(), "sample_lp": zeros.clone(), "draft_sample": zeros.clone()}
    if plan.rel_rows:
        r = to_device(torch.tensor(plan.rel_rows, dtype=torch.long), dev)
        vals = to_device(torch.tensor([plan.rel_ratio, plan.rel_eps, plan.rel_is_ratio], dtype=torch.float64), dev)
        cols["relaxed"][r] = relaxed_accept(rows[r], draft[r], vals[0], vals[1], vals[2] > 0.5).to(torch.float64)
    p = _sampled(rows, plan, lse, cols)
    packed = [best.to(torch.float64), best_lp.exp(), best_lp.float().to(torch.float64), draft_lp.exp(),
              draft_lp.float().to(torch.float64), cols["relaxed"], cols["accept"], cols["sample"],
              cols["sample_prob"], cols["sample_lp"], cols["draft_sample"]]
    tops = _tops(rows, lse, seqs, sizes, plan)
    host = torch.cat([torch.stack(packed, 1)] + ([tops] if tops is not None else []), 1).cpu().tolist()
    return {"rows": host, "k": 0 if tops is None else tops.shape[1] // 2, "p": p,
            "samp_base": _sample_bases(plan, seqs, sizes)}


def _sample_bases(plan: _Plan, seqs: list, sizes: list[int]) -> dict[int, int]:
    """Sequence offset -> index of its first row among the sampled rows (its rows of the returned ``p``)."""
    out, base = {}, 0
    for seq, lo, k in zip(seqs, plan.offsets, sizes):
        if seq.sampling:
            out[lo] = base
            base += k
    return out


def _slice(host: dict, lo: int, hi: int) -> tuple[VerifyRows, torch.Tensor | None]:
    """The rows ``[lo, hi)`` of the pass as :class:`VerifyRows`, and the sequence's ``[hi - lo, V]`` sampling
    distributions (None unless it samples)."""
    rows = host["rows"][lo:hi]
    c = list(zip(*rows)) if rows else [()] * (len(COLUMNS) + 2 * host["k"])
    k = host["k"]
    top = None
    if k:
        top = [tuple((int(i), lp) for i, lp in zip(r[len(COLUMNS): len(COLUMNS) + k], r[len(COLUMNS) + k:])
                     if i >= 0 and lp > float("-inf")) for r in rows]
    v = VerifyRows(*(list(c[j]) for j in range(len(COLUMNS))), top)
    v.best = [int(t) for t in v.best]
    v.sample = [int(t) for t in v.sample]
    v.draft_sample = [int(t) for t in v.draft_sample]
    base = host["samp_base"].get(lo)
    return v, (None if base is None else host["p"][base: base + hi - lo])
