"""Sampling under a grammar (docs/design.md#constrained-decoding): the masked rows, plain diffusion's left-to-right
chain of constrained reveals, and speculative decoding's grammar-checked drafts and verifier rows. The grammar
itself (compilation, the per-choice :class:`~unmask.engine.constraints.GrammarState`, forced runs) is
:mod:`unmask.engine.constraints`."""
from __future__ import annotations

import torch

from .constraints import GrammarState
from .noise import Draws

__all__ = ["mask_rows", "sample_chain", "mask_verifier_rows", "grammar_drafts"]


def mask_rows(logits: torch.Tensor, allowed: torch.Tensor, fallback: torch.Tensor | None = None) -> torch.Tensor:
    """``logits`` (``[V]`` float) with tokens outside ``allowed`` (``[V]`` bool) at -inf. When that leaves no
    finite logit (the grammar allows only ids another rule forbids, e.g. EOS under ``min_tokens``), the grammar
    wins: ``fallback`` (the same row before the other rules; zeros when ``None``) masked by ``allowed``."""
    allowed = allowed.to(logits.device)
    out = logits.masked_fill(~allowed, float("-inf"))
    if not bool(torch.isfinite(out).any()):
        base = fallback if fallback is not None else torch.zeros_like(logits)
        out = base.masked_fill(~allowed, float("-inf"))
        out = torch.where(torch.isfinite(out) | ~allowed, out, torch.zeros_like(out))
    return out


def sample_chain(logits: torch.Tensor, grammar: GrammarState, params, draws: Draws,
                 quota: int | None, threshold: float | None):
    """The constrained reveal rule of plain denoising (docs/design.md#constrained-decoding): candidates for the window's
    masked positions, left to right, each under the grammar's mask after the candidates before it.

    Row 0 is the leftmost undecided position (every generated position before it is revealed), so its mask is the
    exact grammar state of the prefix. Row i is drawn from its logits masked by the state after rows 0..i-1's
    candidates (tried, not kept), then filtered (top-k/top-p) and drawn as unconstrained rows are. A row whose
    mask allows one token only (the grammar forces it: JSON keys, braces, the closing EOS) is kept whatever the
    model says and does not count against the step's quota. The chain stops before the first unforced row past
    ``quota`` unforced rows (quota mode), at the first unforced row after row 0 whose candidate probability is
    below ``threshold`` (threshold mode; that row is not kept), or after an EOS. The kept rows are consumed by the
    grammar: they are revealed this step.

    Args:
        logits: ``[N, V]`` float32 prepared logits (forbidden ids, logit_bias and penalties applied) of the N
            masked positions of the active window, in position order.
        grammar: the request's state (its pushed stack empty). params: the request's parameters.
        draws: the step's counter-based draws, one row per masked position (``unmask.engine.noise``).
        quota / threshold: as :func:`~unmask.engine.reveal_rule.select_reveals` (one of them is set).

    Returns:
        :class:`~unmask.engine.sampler.Candidates` of the kept rows 0..k-1 (k >= 1 when N >= 1).
    """
    from .sampler import Candidates, draw, filter_top_k_top_p, score_candidates

    n = int(logits.shape[0])
    limit = n if quota is None else max(1, int(quota))
    kept, counted = [], 0
    for i in range(n):
        allowed = grammar.allowed()
        forced = grammar.n_allowed == 1
        if counted >= limit and not forced:
            break
        row = filter_top_k_top_p(mask_rows(logits[i], allowed)[None], params.top_k, params.top_p)
        token = draw(row, params, draws.at([i]))
        cand = score_candidates(row, token, params, draws.at([i]))
        if i > 0 and not forced and threshold is not None and float(cand.probability[0]) < threshold:
            break
        if not grammar.push(int(token[0])):  # pragma: no cover - the mask allowed it
            break
        kept.append(cand)
        counted += 0 if forced else 1
        if grammar.is_eos(int(token[0])):
            break
    grammar.commit()
    if not kept:  # pragma: no cover - row 0 is always kept
        empty = torch.empty(0)
        return Candidates(empty.long(), empty.double(), empty.double(), empty.float())
    return Candidates.cat(kept)


def mask_verifier_rows(logits: torch.Tensor, grammar: GrammarState, drafts: list[int]) -> None:
    """Mask the causal (verifier) rows of a constrained speculative step, in place
    (docs/design.md#constrained-decoding): row ``i`` of ``logits`` (``[N, V]`` float32; rows ``0..D`` predict the
    positions of ``drafts[0..D-1]`` and the one after them) gets the grammar's mask after the final tokens and
    ``drafts[:i]``. Masking stops at the first draft the grammar rejects: that draft has probability 0 under its masked
    row, so verification rejects it there (greedy, relaxed and speculative sampling alike) and the rows after it are
    never read. The grammar is left as it was (the drafts are pushed and popped)."""
    for i in range(len(drafts) + 1):
        logits[i] = mask_rows(logits[i], grammar.allowed())
        if i == len(drafts) or not grammar.push(drafts[i]):
            break
    grammar.pop()


def grammar_drafts(logits: torch.Tensor, rows: list[int], grammar: GrammarState, draws: Draws,
                   temperature: float | None) -> tuple[list[int], torch.Tensor | None]:
    """The next drafts of a constrained speculative request from the mask rows ``rows`` of filtered ``[N, V]``
    ``logits``: each drawn under the grammar's mask after the final tokens and the drafts before it - the argmax
    when ``temperature`` is ``None`` (greedy), else a draw from the masked distribution ``q`` at that temperature
    (speculative sampling is exact for any ``q`` the drafts are really drawn from). Tokens the grammar forces are
    drafted with certainty, and the masked verifier accepts them. The grammar is left as it was. ``draws``: one
    row per draft (keyed by the drafted positions).

    Returns:
        ``(drafts, q)``: ``q`` ``[D, V]`` float64 when sampling (``None`` when greedy or no draft).
    """
    from .noise import DRAFT
    from .sampler import sample_from_probs

    drafts, qs = [], []
    for j, r in enumerate(rows):
        row = mask_rows(logits[r], grammar.allowed())
        if temperature is not None:
            q = torch.softmax(row.to(torch.float64) / temperature, dim=-1)
            token = int(sample_from_probs(q[None], draws.at([j]), DRAFT)[0])
            qs.append(q)
        else:
            token = int(torch.argmax(row))
        if not grammar.push(token):  # pragma: no cover - the mask allowed it
            break
        drafts.append(token)
    grammar.pop()
    qs = qs[: len(drafts)]
    return drafts, (torch.stack(qs) if qs else None)
