"""Self-speculative decoding: diffusion drafts verified by the model's own causal path.

A ``prefix_causal`` A2D model with the logit shift (docs/design.md#words and #decoding) is two models in one: its
committed context is strictly causal, so the output at a committed position ``j`` is an autoregressive prediction of
token ``j + 1`` (``block_size=1`` decoding *is* that AR model), while a block of mask tokens after the context is a
diffusion drafter that predicts several later tokens at once. One forward can therefore *verify* draft tokens
placed as causal context and *draft* the next ones from mask blocks - the idea of speculative decoding (Leviathan
et al. 2023, "Fast Inference from Transformers via Speculative Decoding") and Jacobi/lookahead decoding, with the
dLLM's mask blocks as the drafter (as in self-speculative decoding for dLLMs, e.g. arXiv:2510.04147).

One step forwards, for a request whose canvas is final up to position ``f`` (exclusive):

* the not-yet-cached final tokens (the prompt at the first step, else the token revealed last), causal;
* drafts ``d_f, d_{f+1}, ...`` as causal context (each its own attention group, like committed tokens);
* mask group A: ``block_size`` masks right after the drafts, seeing all of the above;
* fallback groups (``branches`` of them): for draft i, ``block_size`` masks at the draft's own position that see
  only the context before it - the drafts to use when draft i is the first one rejected.

Verification (greedy): draft ``d_q`` is accepted while it equals the argmax of the causal output at ``q - 1``;
the first rejected position gets that argmax instead (the "correction", always exact), so every step reveals
``accepted + 1`` tokens and the output is *token for token* the model's ``block_size=1`` greedy decoding (for the
untrained conversion: the AR parent's).

Verification (sampling, temperature > 0): speculative sampling (Leviathan et al. 2023, Algorithm 1; Chen et al.
2023, "Accelerating LLM decoding with speculative sampling"). Drafts are *sampled* from the mask rows' distribution
``q`` (the request's temperature, top-k and top-p) and ``q`` is kept; draft ``d_q`` is accepted with probability
``min(1, p(d_q) / q(d_q))`` under the causal distribution ``p`` of its position; the first rejected position gets a
token sampled from ``norm(max(0, p - q))``, and a step that accepts every draft samples the next token from ``p``.
Every revealed token is then distributed exactly as ``block_size=1`` sampling from the causal path would give it
(not token for token: the random draws differ). The next drafts come from group A when every draft was accepted, from the
fallback group of the first rejected draft otherwise, and none when that group was not forwarded. Only the causal
tokens before the correction are committed to the KV cache; rejected drafts' keys/values are never stored (the
rollback is free).

A request with a grammar constraint (docs/design.md#constrained-decoding) keeps it here: the causal rows are masked by
the grammar state after the final tokens and the drafts before them (a draft the grammar forbids has probability 0 and
is rejected; the correction is drawn under the mask, so greedy output is constrained ``block_size=1`` decoding token
for token), and the next drafts are drawn under the grammar's mask too (forced tokens are drafted for certain).
"""
from __future__ import annotations

import torch

from .constraints import forced_run
from .grammar_sampling import grammar_drafts
from .limits import MAX_SPECULATIVE_BLOCK as MAX_DRAFT_BLOCK
from .noise import ACCEPT, RESIDUAL, Draws
from .outputs import StepEvent
from .request import LaneInput, Request
from .reveals import HostRows
from .speculative_batch import VerifyRows, speculative_rows, verify_batch

__all__ = ["SpeculativeSequence", "speculative_accept", "MAX_DRAFT_BLOCK"]

MASK_GROUP_BASE = 1 << 40  # attention-group ids of mask groups: above every position (committed tokens use pos)


def speculative_accept(p: torch.Tensor, q: torch.Tensor, drafts: list[int], draws: Draws
                       ) -> tuple[int, int]:
    """Speculative sampling's verification of one request's drafts (Leviathan et al. 2023, Algorithm 1).

    Args:
        p: ``[D + 1, V]`` float64 target (causal) distributions: row ``i`` for the position of draft ``i``, row
            ``D`` for the position after the last draft.
        q: ``[D, V]`` float64 distributions the drafts were sampled from.
        drafts: the ``D`` draft token ids.
        draws: the step's counter-based draws, row ``i`` for the position of ``p``'s row ``i`` (``D`` acceptance
            uniforms, then one Gumbel-max draw over ``V``, each its own stream: ``unmask.engine.noise``).

    Returns:
        ``(accepted, token)``: the number of leading drafts accepted (draft ``i`` with probability
        ``min(1, p_i(d_i) / q_i(d_i))``) and the token for the next position: drawn from ``norm(max(0, p_i - q_i))``
        at the first rejection ``i`` (from ``p_i`` when that residual is empty, i.e. ``p_i == q_i``), from ``p_D``
        when every draft was accepted. The revealed tokens are then distributed as sampling from ``p`` alone.
    """
    D = len(drafts)
    q_all = p.clone()  # the row after the last draft: q = p, so its draw is from p
    q_all[:D] = q
    u = torch.ones(D + 1, dtype=torch.float64, device=p.device)
    u[:D] = draws.uniform(ACCEPT, D, 1, p.device)[:, 0]
    d = torch.tensor(list(drafts) + [0], dtype=torch.long, device=p.device)
    accept, token = speculative_rows(p, q_all, d, u, draws.keys(RESIDUAL, D + 1))
    ok = accept[:D].tolist()
    i = next((j for j in range(D) if not ok[j]), D)
    return i, int(token[i])


class SpeculativeSequence(Request):
    """A choice decoded by self-speculative decoding (see the module docstring; the
    :class:`~unmask.engine.request.DecodingStrategy` protocol).

    Same arguments as :class:`~unmask.engine.request.Request` (the plan resolved by ``unmask.engine.plan``); ``params.block_size`` (else the checkpoint's) is the draft block: up to
    ``block_size - 1`` drafts are verified per step and each mask group has ``block_size`` masks.
    ``params.speculative_branches`` (``None`` = ``min(3, block_size - 1)``, at most ``block_size - 1``) fallback
    groups are forwarded per step: ``1 + drafts + block_size * (1 + branches)`` rows at most (20 for block 4 with
    every branch); ``block_size`` is at most :data:`MAX_DRAFT_BLOCK`.
    ``steps``, ``threshold`` and ``remasking`` do not apply. ``nfe`` counts forwards (one per step).
    ``params.speculative_epsilon`` switches exact verification to Medusa's typical acceptance (lossy: the output is
    then no longer the greedy decoding, but every token is still one the causal path found typical in context);
    ``params.speculative_ratio`` to accepting drafts within a probability ratio of the causal argmax (lossy too:
    only near-ties of the causal path are kept); either relaxed rule keeps a non-argmax draft only when it does not
    complete an n-gram the generated text already holds (``params.speculative_no_repeat_ngram``, default
    :data:`unmask.engine.plan.DEFAULT_NO_REPEAT_NGRAM`).

    Raises:
        ParamError: as :class:`~unmask.engine.request.Request`, and from
            :func:`unmask.engine.plan.check_speculative`.
    """

    committed_rows_variant = True  # variant_rows(inp) = inp.committed: a verifier's weights run the causal rows

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        plan = self.plan
        self.draft_block = self.block_size
        self.branches = plan.branches
        self.final_len = self.prompt_len            # canvas positions < final_len hold final tokens
        self.end = self.prompt_len + self.max_tokens  # nothing is drafted at or past max_tokens
        self.drafts: list[int] = []                  # draft tokens for positions final_len, final_len + 1, ...
        self.epsilon, self.ratio, self.no_repeat = plan.epsilon, plan.ratio, plan.no_repeat_ngram
        self._ngrams: set[tuple[int, ...]] = set()  # no_repeat-grams of the final generated text ...
        self._ngrams_end = self.prompt_len          # ... ending before this canvas position
        self.temperature = plan.temperature
        self.sampling = plan.sampling                # speculative sampling instead of argmax checks
        self.draft_probs: torch.Tensor | None = None  # sampling: [len(drafts), V] float64 q the drafts came from
        self._layout: dict | None = None

    # ------------------------------------------------------------------ one step: inputs
    def lane_inputs(self) -> list[LaneInput]:
        """The causal tokens, drafts, mask group A and fallback groups of the next step (one lane: no CFG).

        ``commit`` is ``None``: the committed positions are known only after verification
        (:meth:`verify` returns them).
        """
        lane = self.lanes[0]
        dev = self.device
        lo = lane.cache.length if self.cache_mode != "none" else 0
        f = self.final_len
        drafts = self.drafts[: max(0, min(self.draft_block - 1, self.end - f - 1))]
        fm = f + len(drafts)  # first position of mask group A (its token is the causal prediction from fm - 1)
        mask_id = self.dllm.mask_token_id
        toks = [self.canvas[lo:f], torch.tensor(drafts, dtype=torch.long, device=dev)]
        pos = [torch.arange(lo, fm, device=dev)]
        grp = [torch.arange(lo, fm, device=dev)]
        start = [torch.arange(lo, fm, device=dev)]
        committed = [torch.ones(fm - lo, dtype=torch.bool, device=dev)]
        n = fm - lo
        starts = ([("A", fm)] if fm + 1 < self.end and self.draft_block > 1 else []) + \
                 [(i, f + i) for i in range(min(self.branches, len(drafts)))]
        # needed outputs: the causal rows from f - 1 (verify + correction), every mask row but each group's last
        needed = list(range(f - 1 - lo, fm - lo))
        group_rows: dict = {}  # group kind -> rows of `needed` (in order) that draft positions s + 1, s + 2, ...
        for gi, (kind, s) in enumerate(starts):
            length = min(self.draft_block, self.end - s)
            toks.append(torch.full((length,), mask_id, dtype=torch.long, device=dev))
            pos.append(torch.arange(s, s + length, device=dev))
            grp.append(torch.full((length,), MASK_GROUP_BASE + gi, dtype=torch.long, device=dev))
            start.append(torch.full((length,), s, dtype=torch.long, device=dev))
            committed.append(torch.zeros(length, dtype=torch.bool, device=dev))
            group_rows[kind] = list(range(len(needed), len(needed) + length - 1))
            needed.extend(range(n, n + length - 1))
            n += length
        self._layout = {"lo": lo, "f": f, "drafts": drafts, "group_rows": group_rows,
                        "pred_pos": [lo + i + 1 for i in needed[: fm - f + 1]] + sum(
                            ([s + 1 + j for j in range(len(group_rows[k]))] for k, s in starts), [])}
        return [LaneInput(tokens=torch.cat(toks), chunk=torch.cat(pos), grp=torch.cat(grp), start=torch.cat(start),
                          committed=torch.cat(committed), needed=torch.tensor(needed, dtype=torch.long, device=dev),
                          commit=None)]

    def _repeats(self, f: int, drafts: list[int], q: int) -> bool:
        """Whether ``drafts[q]`` (at canvas position ``f + q``, after the final tokens before ``f`` and
        ``drafts[:q]``) completes an n-gram (``n = self.no_repeat`` tokens, all generated) that the generated text
        before it already contains: the loop guard of the relaxed rules. Grams of the final text are indexed
        incrementally (each once), so a check costs O(n * q), not O(length)."""
        n = self.no_repeat
        first = max(self.prompt_len, f - n + 1)
        if self._ngrams_end < f:  # index the grams that end at the final tokens revealed since the last check
            lo = max(self.prompt_len, self._ngrams_end - n + 1)
            toks = self.canvas[lo:f].tolist()
            for end in range(max(self._ngrams_end, self.prompt_len + n - 1), f):
                self._ngrams.add(tuple(toks[end - n + 1 - lo: end + 1 - lo]))
            self._ngrams_end = f
        seq = self.canvas[first:f].tolist() + list(drafts[: q + 1])
        if len(seq) < n:
            return False
        gram = tuple(seq[-n:])
        if gram in self._ngrams:
            return True
        return any(tuple(seq[j: j + n]) == gram for j in range(len(seq) - n))  # grams ending at drafts[:q]

    # ------------------------------------------------------------------ the strategy protocol
    def variant_rows(self, inp: LaneInput) -> torch.Tensor:
        """The causal (committed-context) rows run the model's row variant (a checkpoint's verifier)."""
        return inp.committed

    def consume(self, logits: list[torch.Tensor], forbidden_ids: torch.Tensor
                ) -> tuple[StepEvent, list[torch.Tensor | None]]:
        """:meth:`verify` the one lane's rows; its commit is the verified causal tokens."""
        event, commit = self.verify(logits[0], forbidden_ids)
        return event, [commit]

    # ------------------------------------------------------------------ one step: verify and reveal
    def verify(self, logits: torch.Tensor, forbidden_ids: torch.Tensor | None = None
               ) -> tuple[StepEvent, torch.Tensor]:
        """Verify the drafts, reveal the accepted ones plus the correction, pick the next drafts: this sequence
        alone through the batched pass (``unmask.engine.speculative_batch.verify_batch``).

        Args:
            logits: ``[N, V]`` float logits of the ``needed`` rows of :meth:`lane_inputs`, in that order.
            forbidden_ids: ``[F]`` int64 ids never generated (the model's ``never_generate_ids``).

        Returns:
            ``(event, commit)``: the step's :class:`StepEvent` and the ``[m]`` int64 chunk indices whose KV is
            committed to the lane cache (the causal tokens before the correction; empty without a cache).
        """
        return verify_batch([self], [(0, int(logits.shape[0]))], logits.float().clone(), forbidden_ids)[0]

    def _accepted(self, v: VerifyRows, f: int, drafts: list[int]) -> tuple[int, int, float, float]:
        """``(accepted, token, its probability, its log-probability)`` from the pass's verdicts: the leading drafts
        accepted (speculative sampling's test; else equal to the causal argmax, or kept by a relaxed rule unless
        the loop guard blocks them) and the token after them (the correction, or the token after the last draft)."""
        if self.sampling:
            a = next((i for i in range(len(drafts)) if v.accept[i] < 0.5), len(drafts))
            return a, v.sample[a], v.sample_prob[a], v.sample_lp[a]
        a = 0
        for q, d in enumerate(drafts):
            if v.best[q] != d and not (v.relaxed[q] > 0.5 and not (self.no_repeat and self._repeats(f, drafts, q))):
                break
            a += 1
        return a, v.best[a], v.best_prob[a], v.best_lp[a]

    def advance(self, v: VerifyRows, logits: torch.Tensor, probs: torch.Tensor | None
                ) -> tuple[StepEvent, torch.Tensor]:
        """Apply a verification pass on the host: accept, reveal, pick the next drafts (as :meth:`verify` returns).

        Args:
            v: this sequence's rows of the pass (:class:`~unmask.engine.speculative_batch.VerifyRows`).
            logits: ``[N, V]`` its filtered logits (device; a grammar's drafts are drawn from them).
            probs: ``[N, V]`` float64 its sampling distributions (speculative sampling), else None.
        """
        lay = self._layout
        lo, f, drafts, group_rows = lay["lo"], lay["f"], lay["drafts"], lay["group_rows"]
        accepted, token, prob, lp = self._accepted(v, f, drafts)
        new_tokens = list(drafts[:accepted])
        probability, logprob = v.draft_prob[:accepted], v.draft_lp[:accepted]
        if f + accepted < self.end:
            new_tokens.append(token)
            probability, logprob = probability + [prob], logprob + [lp]
        top = v.top[: len(new_tokens)] if v.top is not None and self.top_ids is not None else None
        self.proposed_drafts += len(drafts)
        self.accepted_drafts += accepted
        # next drafts: group A when every draft was accepted, else the first rejected draft's fallback group
        key_rows = group_rows.get("A" if accepted == len(drafts) else accepted, [])
        if self.grammar is not None:  # + the tokens the grammar forces next, final at once (probability 1)
            self.grammar.consume(new_tokens)
            forced = forced_run(self.grammar, self.end - f - len(new_tokens))
            new_tokens += forced
            probability, logprob = probability + [1.0] * len(forced), logprob + [0.0] * len(forced)
            top = None if top is None else top + [((t, 0.0),) for t in forced]
            draft_rows = key_rows[len(forced):]
            self.drafts, self.draft_probs = grammar_drafts(logits, draft_rows, self.grammar,
                                                           self.draws([lay["pred_pos"][r] for r in draft_rows]),
                                                           self.temperature if self.sampling else None)
        elif self.sampling:
            self.drafts = [v.draft_sample[r] for r in key_rows]
            self.draft_probs = probs[key_rows[0]: key_rows[-1] + 1].clone() if key_rows else None
        else:
            self.drafts = [v.best[r] for r in key_rows]
        rows = HostRows(new_tokens, probability, logprob, probability, [True] * len(new_tokens), top)
        revealed = self.record(list(range(f, f + len(new_tokens))), rows)
        self.final_len = f + len(new_tokens)
        commit = (torch.arange(0, f + accepted - lo, dtype=torch.long) if self.cache_mode != "none"
                  else torch.empty(0, dtype=torch.long))
        step = self.step
        block = self.block_idx = (f - self.prompt_len) // self.draft_block  # the block of the first revealed token
        self.step += 1
        self._check_finished()
        return self.event(block, step, revealed), commit
